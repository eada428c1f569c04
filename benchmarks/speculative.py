"""Speculative decoding against no speculation and against HF `generate`'s own prompt lookup,
side by side in one run: prompt lookup alone (`ngram`) and prompt lookup plus the bundled EAGLE
draft head (`auto`, the default). HF's `assistant_model` does not apply: the head is not a model
HF can run on its own (no smaller sibling of the default model exists).

Workloads (chat-templated, greedy, the model's EOS ends a request, at most `--new-tokens`):
- `chat`: open questions, where little of the answer is in the prompt;
- `grounded`: edit, continue or summarise a text or code given in the prompt.
At batch 1 each prompt runs alone; at `--concurrency` N, N requests (the chat prompts, repeated)
run at once (two rounds). Each wave runs in every mode in turn, each wave starting with the next
mode, so that other load on the machine falls on all alike. HF: `generate`
with and without `prompt_lookup_num_tokens`, batch 1 only (its prompt lookup is batch 1 only).
Reported: generated tokens / wall seconds, ratios with / without speculation, acceptance, and
whether our greedy tokens were identical with speculation.

    python benchmarks/speculative.py                 # -> benchmarks/results/speculative.json
    python benchmarks/speculative.py --skip-hf --concurrency 8
    python benchmarks/speculative.py --skip-hf --rounds 2    # every wave twice per mode
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from common import log, write_result
from tandem import LLM, SamplingParams
from tandem.engine.models.loader import resolve_model_path

REPO = Path(__file__).resolve().parent.parent

CHAT = [
    "Write a short poem about the sea.",
    "What are three tips for sleeping better?",
    "Explain what a CPU cache is, in simple words.",
    "Suggest a name and a one-line description for a coffee shop.",
]


def grounded_prompts() -> list[str]:
    code = (REPO / "src/tandem/engine/spec/drafts.py").read_text().split("class NgramIndex")[1][:900]
    prose = (REPO / "README.md").read_text()[:900]
    return [
        f"Rewrite this Python code, renaming the variable `index` to `idx` and changing nothing else:\n\n"
        f"```python\nclass NgramIndex{code}\n```",
        f"Correct any spelling mistakes in the following text and return the whole text:\n\n{prose}",
        f"Continue this code:\n\n```python\nclass NgramIndex{code}",
        f"Summarise the following text in a few sentences:\n\n{prose}",
    ]


def chat_token_ids(llm: LLM, questions: list[str]) -> list[list[int]]:
    tokenizer = llm.engine.tokenizer
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False
        )
        for q in questions
    ]


MODES = ("plain", "ngram", "auto")  # no speculation; prompt lookup alone; prompt lookup + the draft head


def run_ours(
    engines: dict[str, LLM], waves: list[list[list[int]]], new_tokens: int, *, rounds: int = 1
) -> dict[str, dict[str, Any]]:
    """Each wave (a list of prompts run at once) in every mode, alternating, so that whatever
    else the machine does falls on all alike; totals over all waves and rounds. `plain` runs on
    the `auto` engine with speculation off per request."""
    totals = {
        mode: {
            "generated": 0,
            "wall": 0.0,
            "drafts": 0,
            "accepted": 0,
            "steps": 0,
            "draft_wall": 0.0,
            "step_wall": 0.0,
            "token_ids": [],
        }
        for mode in MODES
    }
    turn = 0
    for _ in range(rounds):
        for wave in waves:
            # Each wave starts with the next mode: the first run after a pause (or after another
            # engine ran) is often slower, and a fixed order would charge that to one mode.
            turn += 1
            for mode in MODES[turn % len(MODES) :] + MODES[: turn % len(MODES)]:
                llm = engines["auto" if mode == "plain" else mode]
                params = SamplingParams(max_tokens=new_tokens, temperature=0.0, speculative=mode != "plain")
                before = llm.stats()
                start = time.perf_counter()
                outputs = llm.generate(wave, params)
                wall = time.perf_counter() - start
                after = llm.stats()
                total = totals[mode]
                total["generated"] += sum(len(o.outputs[0].token_ids) for o in outputs)
                total["wall"] += wall
                for key, stat in (
                    ("drafts", "num_draft_tokens"),
                    ("accepted", "num_accepted_draft_tokens"),
                    ("steps", "num_steps"),
                    ("draft_wall", "draft_wall_s"),
                    ("step_wall", "step_wall_s"),
                ):
                    total[key] += after[stat] - before[stat]
                total["token_ids"].extend(o.outputs[0].token_ids for o in outputs)
    return {
        mode: {
            "tokens_per_s": t["generated"] / t["wall"],
            "generated_tokens": t["generated"],
            "wall_s": t["wall"],
            "draft_tokens": t["drafts"],
            "acceptance_rate": t["accepted"] / t["drafts"] if t["drafts"] else None,
            "tokens_per_step": t["generated"] / t["steps"] if t["steps"] else None,
            "draft_time_share": t["draft_wall"] / t["step_wall"] if t["step_wall"] else None,
            "token_ids": t["token_ids"],
        }
        for mode, t in totals.items()
    }


def summary(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    plain = runs["plain"]
    row: dict[str, Any] = {"tandem_plain_tokens_per_s": plain["tokens_per_s"]}
    for mode in MODES[1:]:
        run = runs[mode]
        row[f"tandem_{mode}_tokens_per_s"] = run["tokens_per_s"]
        row[f"{mode}_ratio"] = run["tokens_per_s"] / plain["tokens_per_s"]
        row[f"{mode}_acceptance_rate"] = run["acceptance_rate"]
        row[f"{mode}_tokens_per_step"] = run["tokens_per_step"]
        row[f"{mode}_draft_tokens"] = run["draft_tokens"]
        row[f"{mode}_identical_greedy_tokens"] = run["token_ids"] == plain["token_ids"]
    row["auto_draft_time_share"] = runs["auto"]["draft_time_share"]
    return row


def run_hf(
    model: Any, prompts: list[list[int]], new_tokens: int, eos_ids: list[int], lookup: int | None
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "do_sample": False,
        "max_new_tokens": new_tokens,
        "eos_token_id": eos_ids,
        "pad_token_id": 0,
    }
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = lookup
    generated = 0
    with torch.inference_mode():
        start = time.perf_counter()
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            generated += out.shape[1] - ids.shape[1]
        wall = time.perf_counter() - start
    return {"tokens_per_s": generated / wall, "generated_tokens": generated, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[8, 32])
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--hf-lookup-tokens", type=int, default=10, help="HF's prompt_lookup_num_tokens")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of every batch-1 wave per mode (concurrent: at least 2)"
    )
    parser.add_argument("--kv-cache-mib", type=int, default=512, help="KV cache of each engine")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "speculative.json")
    args = parser.parse_args()

    log(f"loading {args.model} (torch threads {torch.get_num_threads()})")
    engines = {
        method: LLM(
            args.model,
            enable_prefix_caching=False,  # each run computes its prompts alike
            max_num_seqs=max([64, *args.concurrency]),
            kv_cache_memory=args.kv_cache_mib << 20,
            speculative={"method": method, "num_speculative_tokens": args.num_speculative_tokens},
        )
        for method in ("ngram", "auto")
    }
    llm = engines["auto"]
    workloads = {"chat": chat_token_ids(llm, CHAT), "grounded": chat_token_ids(llm, grounded_prompts())}
    # Warm-up: a speculating engine's first few hundred steps run slower (with the draft head,
    # about 0.4 s in all), which a short batch-1 wave would charge to speculation.
    warm_up = [workloads["chat"][0], workloads["grounded"][0]]
    for engine in engines.values():
        for prompt in warm_up:
            engine.generate([prompt], SamplingParams(max_tokens=args.new_tokens, temperature=0.0))
    result: dict[str, Any] = {
        "config": {k: str(v) for k, v in vars(args).items()},
        "batch_1": {},
        "concurrent": {},
    }
    for name, prompts in workloads.items():
        # batch 1: one prompt per wave
        row = summary(run_ours(engines, [[p] for p in prompts], args.new_tokens, rounds=args.rounds))
        log(f"batch 1 {name}: {row}")
        result["batch_1"][name] = row
    for n in args.concurrency:
        wave = [workloads["chat"][i % len(CHAT)] for i in range(n)]
        for engine in engines.values():  # warm-up at this batch size (first steps of a shape are slow)
            engine.generate(wave, SamplingParams(max_tokens=8, temperature=0.0))
        row = summary(run_ours(engines, [wave], args.new_tokens, rounds=max(2, args.rounds)))
        log(f"concurrency {n} chat: {row}")
        result["concurrent"][str(n)] = row
    result["speculation_by_batch"] = {
        method: engine.stats()["speculation_by_batch"] for method, engine in engines.items()
    }
    log(f"the guard's verdicts: {result['speculation_by_batch']}")
    result["step_cost"] = dict(
        zip(
            ("fixed_s", "per_token_s", "per_row_s"),
            llm.engine.scheduler.speculation.step_cost.coefficients(),
            strict=True,
        )
    )
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        path = resolve_model_path(args.model)
        log("loading HF transformers (its own GGUF loader), float32")
        if path.suffix == ".gguf":
            model = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32
            )
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        model.eval()
        eos_ids = sorted(llm.engine.eos_token_ids)
        for name, prompts in workloads.items():
            plain = run_hf(model, prompts, args.new_tokens, eos_ids, None)
            lookup = run_hf(model, prompts, args.new_tokens, eos_ids, args.hf_lookup_tokens)
            hf = {
                "hf_plain_tokens_per_s": plain["tokens_per_s"],
                "hf_prompt_lookup_tokens_per_s": lookup["tokens_per_s"],
                "hf_ratio": lookup["tokens_per_s"] / plain["tokens_per_s"],
            }
            log(f"batch 1 {name} HF: {hf}")
            result["batch_1"][name].update(hf)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
