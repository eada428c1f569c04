"""Grammar-constrained decoding: its cost in throughput, and what it buys in valid answers.

Throughput: N chat requests submitted at once (N = 1 and 32), `--new-tokens` each, with every
request constrained by a JSON schema vs none, on the engine's defaults, side by side in one run
(alternating, `--repeats` times each; the median of the per-pair ratios is reported). So that both
runs generate the same number of tokens per request, the unconstrained requests ignore EOS and the
constrained ones follow a schema that cannot close within the budget (one long string): every
constrained row is masked at every step.

Validity: `--num-prompts` review requests (sampled, one seed each) asking for a JSON review with
given fields, once constrained by that schema and once by the prompt alone; the share of answers
that parse as JSON (after stripping a Markdown code fence) and validate against the schema
(`jsonschema`).

    python benchmarks/structured_output.py                 # -> benchmarks/results/structured_output.json
    python benchmarks/structured_output.py --repeats 1 --num-prompts 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jsonschema

from common import log, write_result
from tandem import LLM, SamplingParams
from tandem.engine.sampling_params import StructuredOutput

REVIEW_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "pros": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 3},
        "recommended": {"type": "boolean"},
    },
    "required": ["title", "rating", "pros", "recommended"],
    "additionalProperties": False,
}
# Never closes within the budget: every constrained row is masked at every step.
LONG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"review": {"type": "string", "minLength": 4000}},
    "required": ["review"],
    "additionalProperties": False,
}
SUBJECTS = [
    "a pizza restaurant",
    "a new laptop",
    "a trip to Japan",
    "a jazz concert",
    "a coffee shop",
    "an electric car",
    "a modern art museum",
    "a cheap smartphone",
    "a hiking trail",
    "a science fiction novel",
    "a yoga class",
    "a hotel in Paris",
    "a pair of running shoes",
    "a video game",
    "a bakery",
    "a train journey",
    "a podcast",
    "a board game",
    "a vegan cafe",
    "a city bike",
    "a winter jacket",
    "a language app",
    "a theatre play",
    "a sushi bar",
    "a camping tent",
    "a wireless headset",
    "a cooking class",
    "a zoo",
    "a bookshop",
    "a gym",
]


def review_prompt(subject: str) -> list[dict[str, str]]:
    fields = "title (text), rating (integer 1 to 5), pros (a list of at most 3 short texts), recommended (true or false)"
    return [
        {"role": "user", "content": f"Review {subject}. Answer with a JSON object with the fields {fields}."}
    ]


def parses_and_validates(text: str) -> tuple[bool, bool]:
    body = text.strip()
    if body.startswith("```"):
        body = body.split("\n", 1)[1] if "\n" in body else ""
        body = body.rsplit("```", 1)[0]
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return False, False
    try:
        jsonschema.validate(value, REVIEW_SCHEMA)
    except jsonschema.ValidationError:
        return True, False
    return True, True


def throughput(llm: LLM, n: int, new_tokens: int, constrained: bool) -> dict[str, Any]:
    prompts = [review_prompt(SUBJECTS[i % len(SUBJECTS)]) for i in range(n)]
    if constrained:
        spec = StructuredOutput("json_schema", json.dumps(LONG_SCHEMA))
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, structured=spec)
    else:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    mask_before = llm.stats()["grammar_mask_s"]
    started = time.perf_counter()
    outs = llm.chat(prompts, params)
    wall = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "wall_s": wall,
        "generated_tokens": generated,
        "tokens_per_s": generated / wall,
        "grammar_mask_s": llm.stats()["grammar_mask_s"] - mask_before,
        "finish_reasons": sorted({o.outputs[0].finish_reason or "" for o in outs}),
    }


def validity(llm: LLM, num_prompts: int, constrained: bool, max_tokens: int) -> dict[str, Any]:
    spec = StructuredOutput("json_schema", json.dumps(REVIEW_SCHEMA)) if constrained else None
    prompts = [review_prompt(f"{SUBJECTS[i % len(SUBJECTS)]} (number {i})") for i in range(num_prompts)]
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=i, structured=spec)
        for i in range(num_prompts)
    ]
    started = time.perf_counter()
    outs = llm.chat(prompts, params)
    wall = time.perf_counter() - started
    checks = [parses_and_validates(o.outputs[0].text) for o in outs]
    failures = [o.outputs[0].text[:200] for o, (_, valid) in zip(outs, checks, strict=True) if not valid]
    return {
        "num_prompts": num_prompts,
        "parses": sum(p for p, _ in checks) / num_prompts,
        "validates": sum(v for _, v in checks) / num_prompts,
        "finished_by_stop": sum(o.outputs[0].finish_reason == "stop" for o in outs) / num_prompts,
        "wall_s": wall,
        "example": outs[0].outputs[0].text[:300],
        "failures": failures[:5],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=100)
    # Room for the schema's longest answer (4 strings of at most 60 characters), so that a
    # constrained answer is never cut short; the unconstrained ones get the same budget.
    parser.add_argument("--validity-max-tokens", type=int, default=400)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "structured_output.json"))
    args = parser.parse_args()

    llm = LLM(max_num_seqs=max(32, *args.concurrency))
    stats = llm.stats()
    log(f"engine: dtype {stats['dtype']}, weight_dtype {stats['weight_dtype']}")
    llm.chat(
        [review_prompt("a warm-up")],
        SamplingParams(max_tokens=8, structured=StructuredOutput("json_schema", json.dumps(LONG_SCHEMA))),
    )

    result: dict[str, Any] = {
        "new_tokens": args.new_tokens,
        "dtype": stats["dtype"],
        "weight_dtype": stats["weight_dtype"],
        "throughput": {},
    }
    for n in args.concurrency:
        runs: dict[str, list[dict[str, Any]]] = {"none": [], "constrained": []}
        for repeat in range(args.repeats):
            for mode in ("none", "constrained"):
                run = throughput(llm, n, args.new_tokens, mode == "constrained")
                runs[mode].append(run)
                log(f"{n} concurrent, {mode}, run {repeat + 1}: {run['tokens_per_s']:.1f} tok/s")
        ratios = [
            c["tokens_per_s"] / u["tokens_per_s"]
            for u, c in zip(runs["none"], runs["constrained"], strict=True)
        ]
        result["throughput"][str(n)] = {
            "none_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs["none"]),
            "constrained_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs["constrained"]),
            "ratio_constrained_over_none": statistics.median(ratios),
            "ratios": ratios,
            "grammar_mask_s_per_run": statistics.median(r["grammar_mask_s"] for r in runs["constrained"]),
            "runs": runs,
        }
        log(f"{n} concurrent: constrained / none = {statistics.median(ratios):.3f}")

    result["validity"] = {}
    for mode in ("none", "constrained"):
        log(f"validity, {mode}: {args.num_prompts} prompts")
        result["validity"][mode] = validity(
            llm, args.num_prompts, mode == "constrained", args.validity_max_tokens
        )
        log(f"validity, {mode}: {result['validity'][mode]['validates']:.0%} validate")
    result["engine_stats"] = {k: v for k, v in llm.stats().items() if "grammar" in k or "draft" in k}
    write_result(args.out, result)
    print(
        json.dumps(
            {k: v for k, v in result.items() if k != "throughput"}
            | {
                "throughput": {
                    n: {k: v for k, v in t.items() if k != "runs"} for n, t in result["throughput"].items()
                }
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
