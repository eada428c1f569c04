"""Parallel sampling on the default model, in one run: one request for n=8 choices against 8
separate requests (seeds seed+i, the same choices), submitted together to one engine.

Per mode: generated tokens/s, wall seconds, time to the first token, tokens the engine computed
(prompt, choices' tails, decodes), and the peak of KV blocks used (the n choices share the
prompt's full blocks).
The two modes' choices are checked equal (same seeds), so the ratio compares the same work.

    python benchmarks/parallel_sampling.py      # -> benchmarks/results/parallel_sampling.json
"""

from __future__ import annotations

import argparse
import time

import torch

from common import log, write_result
from tandem import GenerationRequest, SamplingParams
from tandem.engine.engine import LLMEngine


def prompt_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: LLMEngine, requests: list[GenerationRequest]) -> dict:
    """Run `requests` together to the end; what it cost and the choices' tokens by index."""
    scheduled_tokens = 0
    schedule = engine.scheduler.schedule

    def counting() -> object:  # the tokens each step computes (prompt, choices' tails and decodes)
        nonlocal scheduled_tokens
        output = schedule()
        scheduled_tokens += output.num_scheduled_tokens
        return output

    engine.scheduler.schedule = counting  # type: ignore[method-assign]
    for request in requests:
        engine.add_request(request)
    peak_blocks = 0
    choices: dict[int, list[int]] = {}
    started = time.perf_counter()
    first_token_at = None
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                if output.finished:
                    for completion in output.outputs:
                        index = (
                            completion.index
                            if len(requests) == 1
                            else int(output.request_id.rsplit("-", 1)[1])
                        )
                        choices[index] = completion.token_ids
            peak_blocks = max(peak_blocks, engine.kv_manager.pool.num_used_blocks)
    finally:
        engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    wall = time.perf_counter() - started
    generated = sum(len(t) for t in choices.values())
    return {
        "wall_s": wall,
        "tokens_per_s": generated / wall,
        "generated_tokens": generated,
        "scheduled_tokens": scheduled_tokens,
        "peak_kv_blocks": peak_blocks,
        "ttft_s": (first_token_at or started) - started,
        "choices": [choices[i] for i in sorted(choices)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternating rounds per mode (the best is kept)"
    )
    parser.add_argument("--out", default="benchmarks/results/parallel_sampling.json")
    args = parser.parse_args()
    summary: dict = {"benchmark": "parallel_sampling", "config": vars(args)}
    # With prefix caching (the default), separate requests share a prompt's blocks too once one of
    # them has computed it before the others are admitted (as chunked prefill spreads a long prompt
    # over steps); without it, only the n choices of one request share.
    for caching in (True, False):
        summary["prefix_caching_on" if caching else "prefix_caching_off"] = compare(args, caching)
    write_result(args.out, summary)


def compare(args: argparse.Namespace, caching: bool) -> dict:
    engine = LLMEngine.from_options(
        args.model, kv_cache_memory=512 << 20, max_model_len=4096, enable_prefix_caching=caching
    )
    prompt = prompt_tokens(args.prompt_tokens, seed=1)

    def params(n: int, seed: int) -> SamplingParams:
        return SamplingParams(n=n, max_tokens=args.max_tokens, temperature=0.8, seed=seed, ignore_eos=True)

    run(
        engine,
        [GenerationRequest("warmup", prompt_token_ids=prompt_tokens(64, 2), sampling_params=params(2, 0))],
    )
    results: dict[str, list[dict]] = {"n_choices": [], "separate_requests": []}
    for round_index in range(args.rounds):
        engine.kv_manager.pool.reset_prefix_cache()  # no round reuses the previous one's blocks
        results["n_choices"].append(
            run(
                engine,
                [
                    GenerationRequest(
                        f"fam{round_index}", prompt_token_ids=prompt, sampling_params=params(args.n, 42)
                    )
                ],
            )
        )
        engine.kv_manager.pool.reset_prefix_cache()
        results["separate_requests"].append(
            run(
                engine,
                [
                    GenerationRequest(
                        f"sep{round_index}-{i}", prompt_token_ids=prompt, sampling_params=params(1, 42 + i)
                    )
                    for i in range(args.n)
                ],
            )
        )
        log(
            f"caching {'on' if caching else 'off'}, round {round_index}: "
            + ", ".join(f"{k} {v[-1]['tokens_per_s']:.1f} tok/s" for k, v in results.items())
        )
    best = {mode: max(runs, key=lambda r: r["tokens_per_s"]) for mode, runs in results.items()}
    same = best["n_choices"]["choices"] == best["separate_requests"]["choices"]
    for runs in results.values():
        for result in runs:
            result.pop("choices")
    summary = {
        "same_choices": same,
        "n_choices": best["n_choices"],
        "separate_requests": best["separate_requests"],
        "tokens_per_s_ratio": best["n_choices"]["tokens_per_s"] / best["separate_requests"]["tokens_per_s"],
        "peak_kv_blocks_ratio": best["n_choices"]["peak_kv_blocks"]
        / best["separate_requests"]["peak_kv_blocks"],
        "scheduled_tokens_ratio": best["n_choices"]["scheduled_tokens"]
        / best["separate_requests"]["scheduled_tokens"],
        "all_rounds": results,
    }
    log(
        f"caching {'on' if caching else 'off'}, n={args.n}: {summary['tokens_per_s_ratio']:.2f}x tok/s, "
        f"{summary['peak_kv_blocks_ratio']:.2f}x peak KV blocks, {summary['scheduled_tokens_ratio']:.2f}x computed "
        f"tokens; same choices: {same}"
    )
    return summary


if __name__ == "__main__":
    main()
