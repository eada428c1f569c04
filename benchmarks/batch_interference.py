"""Does a running batch job hurt real-time latency? Interactive TTFT / time per output token with
no batch load, with a batch at `priority=batch` (how batch jobs run), and with the same batch
load at interactive priority (what happens without the priority machinery), in one run.

Interactive traffic: `--interactive` requests arriving every `--interval` seconds (prompt
`--prompt-len`, `--new-tokens` generated). Batch load: `--batch` requests submitted at t=0
(prompt `--batch-prompt-len`, `--batch-new-tokens`). Greedy, EOS ignored, one AsyncEngine.

    python benchmarks/batch_interference.py            # default model -> benchmarks/results/
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from common import log, percentile, write_result
from tandem import AsyncEngine, SamplingParams
from tandem.engine.protocol import GenerationRequest
from tandem.engine.request import Priority


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n, length), generator=gen).tolist()


async def one(engine: AsyncEngine, rid: str, prompt: list[int], new_tokens: int, priority: Priority) -> dict:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    request = GenerationRequest(
        request_id=rid, prompt_token_ids=prompt, sampling_params=params, priority=priority
    )
    start = time.perf_counter()
    first = None
    num_tokens = 0
    async for out in engine.generate(request):
        if first is None and out.outputs[0].token_ids:
            first = time.perf_counter()
        num_tokens = len(out.outputs[0].token_ids) or num_tokens + len(out.outputs[0].delta_token_ids)
    end = time.perf_counter()
    assert first is not None
    return {"ttft_s": first - start, "tpot_s": (end - first) / max(1, new_tokens - 1), "end": end}


async def scenario(
    engine: AsyncEngine, args: argparse.Namespace, batch_priority: Priority | None, tag: str
) -> dict:
    interactive = prompts(args.interactive, args.prompt_len, seed=1)
    batch = prompts(args.batch, args.batch_prompt_len, seed=2)
    start = time.perf_counter()
    batch_tasks = []
    if batch_priority is not None:
        batch_tasks = [
            asyncio.create_task(one(engine, f"{tag}-b{i}", p, args.batch_new_tokens, batch_priority))
            for i, p in enumerate(batch)
        ]
    results = []
    for i, prompt in enumerate(interactive):
        results.append(
            asyncio.create_task(one(engine, f"{tag}-i{i}", prompt, args.new_tokens, Priority.INTERACTIVE))
        )
        await asyncio.sleep(args.interval)  # the arrival process, not synchronisation
    done = await asyncio.gather(*results)
    interactive_end = time.perf_counter()
    batch_done = await asyncio.gather(*batch_tasks)
    ttft = [d["ttft_s"] for d in done]
    tpot = [d["tpot_s"] for d in done]
    out = {
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": statistics.median(tpot),
        "tpot_p99_s": percentile(tpot, 0.99),
    }
    if batch_done:
        # Batch tokens finished while interactive traffic ran, and overall batch throughput.
        wall = max(d["end"] for d in batch_done) - start
        out["batch_tokens_per_s"] = args.batch * args.batch_new_tokens / wall
        out["batch_wall_s"] = wall
        out["interactive_window_s"] = interactive_end - start
    log(f"{tag}: " + ", ".join(f"{k}={v:.3f}" for k, v in out.items()))
    return out


async def run(args: argparse.Namespace) -> dict:
    engine = AsyncEngine.from_options(
        args.model,
        max_num_seqs=args.max_num_seqs,
        batch_tokens_under_load=args.batch_tokens_under_load,
        enable_prefix_caching=False,  # scenarios repeat prompts: measure scheduling, not cache hits
    )
    try:
        await scenario(engine, argparse.Namespace(**{**vars(args), "interactive": 2}), None, "warmup")
        alone = await scenario(engine, args, None, "alone")
        batch = await scenario(engine, args, Priority.BATCH, "batch_priority")
        same = await scenario(engine, args, Priority.INTERACTIVE, "no_priority")
    finally:
        engine.shutdown()

    def ratio(a: dict, key: str) -> float:
        return a[key] / alone[key]

    return {
        "alone": alone,
        "with_batch_at_batch_priority": batch,
        "with_batch_at_interactive_priority": same,
        "ratios_vs_alone": {
            "batch_priority": {
                k: ratio(batch, k) for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
            },
            "no_priority": {
                k: ratio(same, k) for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
            },
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--interactive", type=int, default=8)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--batch-prompt-len", type=int, default=128)
    parser.add_argument("--batch-new-tokens", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--batch-tokens-under-load", type=int, default=4, help="engine option")
    parser.add_argument("--out", default="benchmarks/results/batch_interference.json")
    args = parser.parse_args()
    result = {
        "benchmark": "batch_interference",
        "config": vars(args),
        **asyncio.run(run(args)),
    }
    write_result(args.out, result)
    print(json.dumps(result["ratios_vs_alone"], indent=2))


if __name__ == "__main__":
    main()
