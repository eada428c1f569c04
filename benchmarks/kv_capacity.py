"""16-bit vs FP8 KV cache at one fixed KV memory budget, sized so that the 16-bit cache runs out
at about `--fit` concurrent requests: for concurrency 1, 8, 16, 32, 64 (prompt `--prompt-len`,
`--new-tokens` generated, greedy, EOS ignored, all submitted at once) the tokens/s, preemptions,
mean time queued before first scheduled, and the most requests running at once. One run, default
model, float32 compute.

    python benchmarks/kv_capacity.py        # -> benchmarks/results/kv_capacity.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from common import log, write_result
from tandem import LLM, SamplingParams
from tandem.engine.runner import KVCacheSpec


def run(llm: LLM, concurrency: int, args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(concurrency)
    prompts = torch.randint(100, 40000, (concurrency, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    preempted_before = engine.stats()["num_preemptions"]
    peak_running = 0
    original_step = engine.step

    def step():  # type: ignore[no-untyped-def]
        nonlocal peak_running
        outputs = original_step()
        peak_running = max(peak_running, engine.scheduler.num_running)
        return outputs

    engine.step = step  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
    finally:
        engine.step = original_step  # type: ignore[method-assign]
    queued = [(o.metrics.first_scheduled_time or 0.0) - o.metrics.arrival_time for o in outs]
    return {
        "tokens_per_s": concurrency * args.new_tokens / wall,
        "preemptions": engine.stats()["num_preemptions"] - preempted_before,
        "mean_queue_s": statistics.mean(queued),
        "peak_running": peak_running,
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--fit", type=int, default=32, help="16-bit KV holds about this many requests")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    parser.add_argument("--out", default="benchmarks/results/kv_capacity.json")
    args = parser.parse_args()

    probe = LLM(args.model, kv_cache_memory=16 << 20, kv_cache_dtype="bfloat16")
    cfg = probe.engine.model_config
    spec = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 16, torch.bfloat16)
    blocks_per_request = -(-(args.prompt_len + args.new_tokens) // 16)
    budget = args.fit * blocks_per_request * spec.bytes_per_block
    del probe
    log(
        f"KV budget {budget / 2**20:.1f} MiB: 16-bit fits {args.fit} requests of {args.prompt_len}+{args.new_tokens}"
    )
    results: dict[str, dict] = {}
    for kv_dtype in ("bfloat16", "fp8_e4m3"):
        llm = LLM(
            args.model, kv_cache_memory=budget, kv_cache_dtype=kv_dtype, max_num_seqs=max(args.concurrency),
            max_num_batched_tokens=2048, max_model_len=args.prompt_len + args.new_tokens,
        )  # fmt: skip
        stats = llm.stats()
        entry: dict = {"kv_capacity_tokens": stats["kv_capacity_tokens"], "by_concurrency": {}}
        for concurrency in args.concurrency:
            entry["by_concurrency"][concurrency] = run(llm, concurrency, args)
            log(f"{kv_dtype} c{concurrency}: {entry['by_concurrency'][concurrency]}")
        entry["peak_tokens_per_s"] = max(r["tokens_per_s"] for r in entry["by_concurrency"].values())
        entry["max_running"] = max(r["peak_running"] for r in entry["by_concurrency"].values())
        results[kv_dtype] = entry
        del llm
    b16, fp8 = results["bfloat16"], results["fp8_e4m3"]
    summary = {
        "benchmark": "kv_capacity",
        "config": vars(args) | {"kv_cache_memory": budget},
        "results": results,
        "fp8_vs_16bit": {
            "capacity_tokens": fp8["kv_capacity_tokens"] / b16["kv_capacity_tokens"],
            "max_running": fp8["max_running"] / b16["max_running"],
            "peak_tokens_per_s": fp8["peak_tokens_per_s"] / b16["peak_tokens_per_s"],
        },
    }
    write_result(args.out, summary)
    print(json.dumps(summary["fp8_vs_16bit"], indent=2))


if __name__ == "__main__":
    main()
