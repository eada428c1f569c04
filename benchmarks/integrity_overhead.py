"""Cost of the per-step KV-page integrity check at 32 concurrent requests: throughput and p99
end-to-end latency with the check on vs off (alternating runs, `--repeats` each, one process), and
the check's own share of step time measured directly (it is far below run-to-run noise).

    python benchmarks/integrity_overhead.py   # -> benchmarks/results/integrity_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from common import log, percentile, write_result
from tandem import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/integrity_overhead.json")
    args = parser.parse_args()

    llm = LLM(args.model, kv_cache_memory=256 << 20, enable_prefix_caching=False)
    engine = llm.engine
    check_seconds = step_seconds = 0.0
    original_check, original_step = engine._abort_stale, engine.step

    def timed_check(scheduled):  # type: ignore[no-untyped-def]
        nonlocal check_seconds
        start = time.perf_counter()
        try:
            return original_check(scheduled)
        finally:
            check_seconds += time.perf_counter() - start

    def timed_step():  # type: ignore[no-untyped-def]
        nonlocal step_seconds
        start = time.perf_counter()
        try:
            return original_step()
        finally:
            if engine.config.kv_integrity_check:  # the share is of steps that ran the check
                step_seconds += time.perf_counter() - start

    engine._abort_stale = timed_check  # type: ignore[method-assign]
    engine.step = timed_step  # type: ignore[method-assign]
    prompts = torch.randint(
        100, 40000, (args.concurrency, args.prompt_len), generator=torch.Generator().manual_seed(0)
    )
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2].tolist(), SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for _ in range(args.repeats):
        for mode in ("on", "off"):
            engine.config.kv_integrity_check = mode == "on"
            start = time.perf_counter()
            outs = llm.generate(prompts.tolist(), params)
            wall = time.perf_counter() - start
            e2e = [(o.metrics.finished_time or 0.0) - o.metrics.arrival_time for o in outs]
            runs[mode].append(
                {
                    "tokens_per_s": args.concurrency * args.new_tokens / wall,
                    "p99_e2e_s": percentile(e2e, 0.99),
                }
            )
            log(f"check {mode}: {runs[mode][-1]}")
    summary_runs = {
        mode: {k: statistics.mean(r[k] for r in results) for k in ("tokens_per_s", "p99_e2e_s")}
        for mode, results in runs.items()
    }
    result = {
        "benchmark": "integrity_overhead",
        "config": vars(args),
        "runs": runs,
        "mean": summary_runs,
        "throughput_on_over_off": summary_runs["on"]["tokens_per_s"] / summary_runs["off"]["tokens_per_s"],
        "p99_on_over_off": summary_runs["on"]["p99_e2e_s"] / summary_runs["off"]["p99_e2e_s"],
        "check_share_of_step_time": check_seconds / step_seconds,
    }
    write_result(args.out, result)
    print(
        json.dumps(
            {k: result[k] for k in ("throughput_on_over_off", "p99_on_over_off", "check_share_of_step_time")},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
