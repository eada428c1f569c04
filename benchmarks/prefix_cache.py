"""Prefix caching on the default model, in one run:

1. TTFT of a request whose 1,024-token system prompt is cached (hit) vs one whose system prompt
   was never seen (miss), same engine, `--questions` requests each, one at a time.
2. A multi-turn chat workload (`--conversations` conversations x `--turns` turns; each turn
   resends the whole conversation so far plus a new user message) with caching on vs off:
   generated tokens/s and mean TTFT.

    python benchmarks/prefix_cache.py        # -> benchmarks/results/prefix_cache.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import log, write_result
from tandem import LLM, SamplingParams


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ttft(llm: LLM, prompt: list[int], new_tokens: int = 1) -> float:
    out = llm.generate([prompt], SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))[0]
    return out.metrics.ttft or 0.0


def multi_turn(llm: LLM, args: argparse.Namespace) -> dict:
    params = SamplingParams(max_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True)
    system = random_tokens(args.system_tokens, seed=7)
    conversations = [
        system + random_tokens(args.turn_tokens, seed=100 + c) for c in range(args.conversations)
    ]
    generated, ttfts = 0, []
    start = time.perf_counter()
    for turn in range(args.turns):
        outs = llm.generate(conversations, params)
        for c, out in enumerate(outs):
            generated += len(out.outputs[0].token_ids)
            ttfts.append(out.metrics.ttft or 0.0)
            conversations[c] = (
                conversations[c]
                + out.outputs[0].token_ids
                + random_tokens(args.turn_tokens, seed=1000 * turn + c)
            )
    wall = time.perf_counter() - start
    return {"tokens_per_s": generated / wall, "wall_s": wall, "mean_ttft_s": statistics.mean(ttfts),
            "prefix_cache_hit_rate": llm.stats()["prefix_cache_hit_rate"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--questions", type=int, default=5)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=48)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results/prefix_cache.json")
    args = parser.parse_args()
    options = {"kv_cache_memory": 512 << 20, "max_model_len": 4096}

    llm = LLM(args.model, **options)
    ttft(llm, random_tokens(64, seed=1))  # warm-up
    system = random_tokens(args.system_tokens, seed=2)
    ttft(llm, system + random_tokens(args.question_tokens, seed=3))  # puts the system prompt in the cache
    hit = [
        ttft(llm, system + random_tokens(args.question_tokens, seed=10 + q)) for q in range(args.questions)
    ]
    miss = [
        ttft(
            llm,
            random_tokens(args.system_tokens, seed=50 + q) + random_tokens(args.question_tokens, seed=10 + q),
        )
        for q in range(args.questions)
    ]
    ttft_result = {
        "hit_mean_s": statistics.mean(hit),
        "miss_mean_s": statistics.mean(miss),
        "miss_over_hit": statistics.mean(miss) / statistics.mean(hit),
    }
    log(f"TTFT: {ttft_result}")
    del llm
    chat = {}
    for name, enabled in (("caching_on", True), ("caching_off", False)):
        engine = LLM(args.model, enable_prefix_caching=enabled, **options)
        chat[name] = multi_turn(engine, args)
        log(f"multi-turn {name}: {chat[name]}")
        del engine
    chat["on_over_off_tokens_per_s"] = (
        chat["caching_on"]["tokens_per_s"] / chat["caching_off"]["tokens_per_s"]
    )
    summary = {
        "benchmark": "prefix_cache",
        "config": vars(args),
        "ttft_shared_system_prompt": ttft_result,
        "multi_turn_chat": chat,
    }
    write_result(args.out, summary)


if __name__ == "__main__":
    main()
