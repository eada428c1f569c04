"""What per-request failure isolation costs a step: the non-finite-logits check every sampling
step runs (`ModelRunner.sample`), timed at the step's real logits shape, as a share of the step
time measured in the same run, at each concurrency (greedy decode on the default model).

The other isolation code costs nothing on the happy path: the per-request rerun only runs after a
step raised, and `finite_kv` only in steps that carry LoRA rows.

    python benchmarks/isolation_overhead.py   # -> benchmarks/results/isolation_overhead.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from common import log, write_result
from tandem import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results/isolation_overhead.json")
    args = parser.parse_args()

    llm = LLM(args.model, kv_cache_memory=256 << 20, enable_prefix_caching=False)
    engine, runner = llm.engine, llm.engine.runner
    timings = {"check_s": 0.0, "step_s": 0.0}
    original_sample, original_step = runner.sampler.sample, engine.step

    def timed_sample(logits, items, draft_probs=None):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        torch.isfinite(logits.sum(dim=-1)).tolist()  # the check, once more at this shape
        timings["check_s"] += time.perf_counter() - start
        return original_sample(logits, items, draft_probs)

    def timed_step():  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return original_step()
        finally:
            timings["step_s"] += time.perf_counter() - start

    runner.sampler.sample = timed_sample  # type: ignore[method-assign]
    engine.step = timed_step  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([[100] * 16], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    results = {}
    for concurrency in args.concurrency:
        prompts = torch.randint(
            100, 40000, (concurrency, args.prompt_len), generator=torch.Generator().manual_seed(0)
        ).tolist()
        timings.update(check_s=0.0, step_s=0.0)
        start = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - start
        results[str(concurrency)] = {
            "tokens_per_s": concurrency * args.new_tokens / wall,
            "check_share_of_step_time": timings["check_s"] / timings["step_s"],
            "check_ms_per_step": 1000 * timings["check_s"] / (args.new_tokens + 1),
        }
        log(f"concurrency {concurrency}: {results[str(concurrency)]}")
    result = {"benchmark": "isolation_overhead", "config": vars(args), "by_concurrency": results}
    write_result(args.out, result)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
