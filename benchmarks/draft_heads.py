"""Draft heads side by side: each head's engine (speculative method auto) and plain decoding, one
prompt at a time, alternating per prompt, on the benchmark's chat prompts plus four more.

    python benchmarks/draft_heads.py --head last=/path/to/head --head fused=src/tandem/engine/drafts/smollm2-135m-instruct-eagle
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from common import log, write_result
from speculative import CHAT, chat_token_ids
from tandem import LLM, SamplingParams

MORE = [
    "Tell me about the history of the bicycle.",
    "Give me three tips for learning to cook.",
    "What is a black hole?",
    "Write a short story about a lost key.",
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--head", action="append", required=True, help="NAME=PATH of a draft head folder")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "draft_heads.json")
    args = parser.parse_args()
    heads = dict(item.split("=", 1) for item in args.head)
    engines = {
        name: LLM(
            args.model,
            speculative={"method": "auto", "draft_model": path},
            enable_prefix_caching=False,
            kv_cache_memory=256 << 20,
        )
        for name, path in heads.items()
    }
    first = next(iter(engines.values()))
    prompts = chat_token_ids(first, CHAT + MORE)
    for llm in engines.values():
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    modes: dict[str, tuple[LLM, bool]] = {
        "plain": (first, False),
        **{n: (e, True) for n, e in engines.items()},
    }
    totals = {mode: {"tokens": 0, "wall": 0.0} for mode in modes}
    before = {name: engine.stats() for name, engine in engines.items()}
    for prompt in prompts:
        for mode, (llm, speculative) in modes.items():
            params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, speculative=speculative)
            start = time.perf_counter()
            output = llm.generate([prompt], params)[0]
            totals[mode]["wall"] += time.perf_counter() - start
            totals[mode]["tokens"] += len(output.outputs[0].token_ids)
    plain = totals["plain"]["tokens"] / totals["plain"]["wall"]
    result: dict[str, Any] = {
        "config": {k: str(v) for k, v in vars(args).items()},
        "plain_tokens_per_s": plain,
    }
    for name, engine in engines.items():
        after = engine.stats()
        rate = totals[name]["tokens"] / totals[name]["wall"]
        result[name] = {
            "tokens_per_s": rate,
            "ratio": rate / plain,
            "draft_tokens": after["num_draft_tokens"] - before[name]["num_draft_tokens"],
            "accepted_draft_tokens": after["num_accepted_draft_tokens"]
            - before[name]["num_accepted_draft_tokens"],
        }
        log(f"{name}: {result[name]}")
    write_result(args.out, result)


if __name__ == "__main__":
    main()
