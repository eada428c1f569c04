"""The evidence behind `dtype="auto"` on a CPU (engine/host/precision.py): float32 against bfloat16
dense GEMMs at the default model's shapes, through the same kernels the engine runs (oneDNN's
prepacked linear, `kernels/linear.PackedLinear`).

For each M (rows: 1-64 are decode steps, 512-4096 prompt chunks) one "model pass": every linear of
SmolLM2-135M's 30 layers (q/k/v 960x576, o 576x576, gate/up 3072x576, down 576x1536) with its own
weights, so that weights stream from memory as they do in a step (the LM head is left out: the
engine runs it on its own kernels). Reports milliseconds per pass and GFLOP/s per dtype, and
bfloat16 / float32 speed. On CPUs with AMX-BF16 bfloat16 is expected to win at large M; with
AVX512-BF16 alone it measured slower than float32.

    python benchmarks/gemm_dtypes.py      # -> benchmarks/results/gemm_dtypes.json
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from common import cpu, log, write_result
from tandem.kernels.linear import onednn_available, pack_linears

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer
NUM_LAYERS = 30


def build(dtype: torch.dtype) -> nn.Sequential:
    layers = nn.Sequential()
    for _ in range(NUM_LAYERS):
        for out_features, in_features in SHAPES:
            layer = nn.Linear(in_features, out_features, bias=False)
            nn.init.normal_(layer.weight, std=0.02)
            layers.append(layer.to(dtype))
    pack_linears(layers)
    return layers


def model_pass(layers: nn.Sequential, inputs: dict[int, torch.Tensor]) -> None:
    for index, layer in enumerate(layers):
        layer(inputs[SHAPES[index % len(SHAPES)][1]])


def time_pass(layers: nn.Sequential, rows: int, dtype: torch.dtype, repeats: int) -> float:
    inputs = {k: torch.randn(rows, k).to(dtype) for _, k in SHAPES}
    model_pass(layers, inputs)  # warm up (oneDNN primitive creation)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        model_pass(layers, inputs)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 512, 4096])
    parser.add_argument("--repeats", type=int, default=3, help="passes per cell; the fastest counts")
    parser.add_argument("--output", default="benchmarks/results/gemm_dtypes.json")
    args = parser.parse_args()
    dtypes = [torch.float32] + (
        [torch.bfloat16] if onednn_available(torch.device("cpu"), torch.bfloat16) else []
    )
    log(f"CPU {cpu()}, torch threads {torch.get_num_threads()}, dtypes {[str(d) for d in dtypes]}")
    flop_per_row = 2 * NUM_LAYERS * sum(o * i for o, i in SHAPES)
    models = {dtype: build(dtype) for dtype in dtypes}  # built once: every row count runs the same weights
    results = []
    for rows in args.rows:
        cell: dict[str, object] = {"rows": rows}
        for dtype, layers in models.items():
            name = str(dtype).removeprefix("torch.")
            seconds = time_pass(layers, rows, dtype, args.repeats)
            cell[name] = {"ms_per_pass": 1e3 * seconds, "gflop_per_s": flop_per_row * rows / seconds / 1e9}
            log(
                f"rows {rows:5d} {name:9s} {1e3 * seconds:8.1f} ms  {flop_per_row * rows / seconds / 1e9:6.0f} GFLOP/s"
            )
        if "bfloat16" in cell:
            f32, b16 = cell["float32"], cell["bfloat16"]
            assert isinstance(f32, dict) and isinstance(b16, dict)
            cell["bfloat16_over_float32"] = f32["ms_per_pass"] / b16["ms_per_pass"]
        results.append(cell)
    write_result(
        args.output,
        {
            "benchmark": "gemm_dtypes",
            "torch_threads": torch.get_num_threads(),
            "shapes": SHAPES,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
