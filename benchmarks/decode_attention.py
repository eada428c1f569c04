"""The native decode attention (`attention.native_paged_attention`, `csrc/decoder_cpu.c`) on the
real checkpoints' attention shapes: one decode row per request, a float32 KV cache (or
`--cache-dtype bfloat16`, `float16` or `float8_e4m3fn`, several side by side) in blocks of 16
scattered over the pool as a running engine leaves them, every layer of the model once (each
layer's own cache, so the keys and values stream from memory as in a decode step), in huge pages
as the engine allocates it (`huge_pages`; `--pages both` also in 4 KiB pages, side by side). For
each (model, requests, context): the best of `--repeats` passes over the layers, in milliseconds.

To compare two revisions, run it from each (`PYTHONPATH=<other tree>/src`), alternately:

    python benchmarks/decode_attention.py    # -> benchmarks/results/decode_attention.json
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

from common import cpu, log, write_result
from tandem.kernels import huge_pages
from tandem.kernels.attention import native_paged_attention

BLOCK_SIZE = 16
# name: (layers, query heads, KV heads, head dim)
MODELS = {"smollm2-135m": (30, 9, 3, 64), "gemma-3-270m": (18, 4, 1, 256)}


def time_pass(
    model: str, num_requests: int, context: int, repeats: int, huge: bool, dtype: torch.dtype
) -> float:
    """Best seconds of one decode step's attention over every layer."""
    layers, num_heads, num_kv_heads, head_dim = MODELS[model]
    g = torch.Generator().manual_seed(0)
    blocks_per_request = -(-context // BLOCK_SIZE)
    num_blocks = num_requests * blocks_per_request
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    allocate = huge_pages.empty if huge else lambda shape, dtype: torch.empty(shape, dtype=dtype)
    caches = [
        (
            allocate(shape, dtype).copy_(torch.randn(shape, generator=g)),
            allocate(shape, dtype).copy_(torch.randn(shape, generator=g)),
        )
        for _ in range(layers)
    ]
    # an FP8 cache's per-(token, head) float16 scales (1: the values are what they are)
    row_scales = torch.ones(shape[:3], dtype=torch.float16) if dtype == torch.float8_e4m3fn else None
    tables = torch.randperm(num_blocks, generator=g).view(num_requests, blocks_per_request).contiguous()
    positions = torch.full((num_requests,), context - 1, dtype=torch.int64)
    q = torch.randn(num_requests, num_heads, head_dim, generator=g)
    scale = head_dim**-0.5
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms up
        start = time.perf_counter()
        for k_cache, v_cache in caches:
            native_paged_attention(q, k_cache, v_cache, tables, positions, scale, row_scales, row_scales)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[160, 1024])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--cache-dtype",
        nargs="+",
        choices=["float32", "bfloat16", "float16", "float8_e4m3fn"],
        default=["float32"],
    )
    parser.add_argument(
        "--pages", choices=["huge", "small", "both"], default="huge",
        help="the caches in huge pages (as the engine allocates them), in 4 KiB pages, or both",
    )  # fmt: skip
    parser.add_argument(
        "--output", type=Path, default=Path(__file__).parent / "results" / "decode_attention.json"
    )
    args = parser.parse_args()
    rows = []
    for model in MODELS:
        for num_requests in args.requests:
            for context in args.contexts:
                for cache_dtype, pages in itertools.product(
                    args.cache_dtype, ("huge", "small") if args.pages == "both" else (args.pages,)
                ):
                    dtype = getattr(torch, cache_dtype)
                    seconds = time_pass(model, num_requests, context, args.repeats, pages == "huge", dtype)
                    rows.append(
                        {
                            "model": model,
                            "requests": num_requests,
                            "context": context,
                            "cache_dtype": cache_dtype,
                            "pages": pages,
                            "ms_per_step": 1000 * seconds,
                        }
                    )
                    log(
                        f"{model} requests={num_requests} context={context} {cache_dtype} {pages} pages: "
                        f"{1000 * seconds:.2f} ms"
                    )
    write_result(
        args.output,
        {"benchmark": "decode_attention", "cpu": cpu(), "threads": torch.get_num_threads(), "rows": rows},
    )


if __name__ == "__main__":
    main()
