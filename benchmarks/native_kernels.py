"""The native matmuls with and without the AMX paths (`csrc/amx_cpu.c`), in one run: GGUF 4-bit
blocks as stored (`int4_native.int4_mm`, Q4_K-like: int8 codes, float16 super-block scales) and
Q8_0 (`int8.q8_mm`) on the default model's and Gemma 3 270M's shapes, at 1 to 128 rows. For each
(shape, rows): the best of `--repeats` calls with `use_amx(False)` (the vector kernels) and with
`use_amx(True)`, alternating `--rounds` times; the medians and their ratio. On a CPU without AMX
both columns are the vector kernels (the JSON says `amx: false`).

    python benchmarks/native_kernels.py     # -> benchmarks/results/native_kernels.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from common import log, write_result
from tandem.kernels import int4_native
from tandem.kernels.int8 import interleave_outputs, q8_mm, quantize_int8

# (kind, rows of the weight N, columns K): SmolLM2-135M's gate/up and down, Gemma 3 270M's gate/up
# and a quarter of its 262k-token head
SHAPES = (("q4", 3072, 576), ("q4", 576, 1536), ("q8", 4096, 640), ("q8", 65536, 640))


def best_of(call: Callable[[], object], repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def linear_call(kind: str, rows: int, cols: int, x: torch.Tensor, g: torch.Generator) -> Callable[[], object]:
    if kind == "q8":
        codes_il, scales_il = interleave_outputs(quantize_int8(torch.randn(rows, cols, generator=g)))
        return lambda: q8_mm(x, codes_il, scales_il, rows)
    packed = int4_native.pack_rows(torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8))
    codes = torch.randint(-63, 64, (rows, cols // 32, 2), generator=g, dtype=torch.int8)
    scales = (torch.rand(rows, max(1, cols // 256), 2, generator=g) * 0.02).to(torch.float16)
    return lambda: int4_native.int4_mm(x, packed, codes, scales, 32)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 40, 128])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/native_kernels.json")
    args = parser.parse_args()
    amx = int4_native.use_amx(True)
    g = torch.Generator().manual_seed(0)
    results = []
    for kind, rows, cols in SHAPES:
        for num_tokens in args.rows:
            call = linear_call(kind, rows, cols, torch.randn(num_tokens, cols, generator=g), g)
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.rounds):
                for enabled in (False, True):
                    int4_native.use_amx(enabled)
                    times[enabled].append(best_of(call, args.repeats))
            vector, tiled = statistics.median(times[False]), statistics.median(times[True])
            macs = num_tokens * rows * cols
            row = {
                "kind": kind, "shape": [rows, cols], "rows": num_tokens,
                "vector_ms": vector * 1e3, "amx_ms": tiled * 1e3, "vector_over_amx": vector / tiled,
                "vector_gmacs": macs / vector / 1e9, "amx_gmacs": macs / tiled / 1e9,
            }  # fmt: skip
            log(f"{kind} {rows}x{cols} at {num_tokens} rows: vector {row['vector_ms']:.3f} ms, "
                f"AMX {row['amx_ms']:.3f} ms ({row['vector_over_amx']:.2f}x)")  # fmt: skip
            results.append(row)
    int4_native.use_amx(True)
    write_result(
        args.out,
        {"benchmark": "native_kernels", "amx": amx, "threads": torch.get_num_threads(), "results": results},
    )


if __name__ == "__main__":
    main()
