"""Quality cost of quantisation on the default model, each variant against the unquantised model
(float32 weights, float32 KV), in one run:

- perplexity on a held-out text (`benchmarks/data/heldout.txt`, written for this repo), computed
  teacher-forced in chunks of `--chunk` tokens so that attention reads earlier context back from
  the KV cache (which is where FP8 KV acts);
- mean KL(P_base || P_variant) of the next-token distributions over the same positions;
- the decode path: the text's first `--decode-prompt` tokens as one prompt chunk, then each of the
  next `--decode-tokens` as a one-token decode step, through the runner's own paths as a lone
  request takes them (`teacher_forcing.teacher_forced_logits`: the native INT4 stack, a hybrid
  engine's INT4 copy): perplexity ratio, mean KL and top-1 agreement with the base there, and the
  quality probe's verdict on those figures (its bound, engine/host/quality_probe.py);
- greedy agreement on 32 prompts x 64 new tokens: the fraction of positions whose token equals the
  base model's, and the mean length of the identical prefix (`--greedy-batch N`: in waves of N
  requests, e.g. 8 for a hybrid engine's INT4 decode steps, whose LM head is INT8 up to 4 rows and
  the dense model's beyond).

Variants: FP8 KV, INT4 weights, both (and 16-bit KVs: bfloat16, float16), hybrid weights with float32.

    python benchmarks/quant_quality.py      # -> benchmarks/results/quant_quality.json
    python benchmarks/quant_quality.py --model "$(python scripts/real_checkpoints.py gemma3)"
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import torch

from common import log, write_result
from tandem import LLM, SamplingParams
from tandem.engine.host.quality_probe import MAX_MEAN_KL, MIN_TOP1_AGREEMENT, compare
from tandem.engine.runner.teacher_forcing import teacher_forced_logits
from tandem.kernels.attention_metadata import build_attention_metadata

# Every variant is float32 compute (an explicit dtype: `auto` would pick by the CPU), so that each
# differs from the base in one thing.
VARIANTS = {
    "base_fp32": {"dtype": "float32"},
    "kv_bf16": {"dtype": "float32", "kv_cache_dtype": "bfloat16"},
    "kv_fp8": {"dtype": "float32", "kv_cache_dtype": "fp8_e4m3"},
    "kv_fp16": {"dtype": "float32", "kv_cache_dtype": "float16"},
    "int4": {"dtype": "float32", "weight_dtype": "int4"},
    "int4_g128": {"dtype": "float32", "weight_dtype": "int4", "int4_group_size": 128},
    # round-to-nearest against GPTQ (the default method for float weights), per group size; with a
    # group size, a GGUF's Q4_1 codes are not used: the float weights are quantised afresh
    "int4_rtn_g32": {"dtype": "float32", "weight_dtype": "int4", "int4_group_size": 32, "int4_method": "rtn"},
    "int4_rtn_g128": {
        "dtype": "float32",
        "weight_dtype": "int4",
        "int4_group_size": 128,
        "int4_method": "rtn",
    },
    "int4_gptq_g32": {"dtype": "float32", "weight_dtype": "int4", "int4_group_size": 32},
    "int4_gptq_g64": {"dtype": "float32", "weight_dtype": "int4", "int4_group_size": 64},
    "int4_gptq_g128": {"dtype": "float32", "weight_dtype": "int4", "int4_group_size": 128},
    "int8": {
        "dtype": "float32",
        "weight_dtype": "int8",
    },  # Q8_0 linears, the fallback where INT4 loses answers
    "int4_dq": {"dtype": "float32", "weight_dtype": "int4", "int4_double_quant": True},
    # a GGUF's linears as the file stores them (4-bit blocks exact INT4, Q8_0 / Q5_0 exact INT8,
    # Q5_1 / Q5_K / Q6_K rounded once to Q8_0): the default for a quantised GGUF
    "gguf": {"dtype": "float32", "weight_dtype": "gguf"},
    "gguf_kv_fp16": {"dtype": "float32", "weight_dtype": "gguf", "kv_cache_dtype": "float16"},
    "gguf_kv_bf16": {"dtype": "float32", "weight_dtype": "gguf", "kv_cache_dtype": "bfloat16"},
    "int4_kv_fp8": {"dtype": "float32", "weight_dtype": "int4", "kv_cache_dtype": "fp8_e4m3"},
    "bf16": {"dtype": "bfloat16"},
    "hybrid_fp32": {"dtype": "float32", "weight_dtype": "hybrid"},  # INT4 decode steps, float32 rest
    "hybrid_bf16": {"dtype": "bfloat16", "weight_dtype": "hybrid"},  # the defaults before one-precision
    "auto": {},  # what this CPU gets by default (dtype and weight_dtype "auto")
}
TOPICS = [
    "the history of the printing press", "how volcanoes form", "a recipe for tomato soup",
    "the rules of chess", "why the sky is blue", "how to plant a tree", "the life of honey bees",
    "the water cycle", "how a bicycle works", "the first moon landing", "how to write a good email",
    "the causes of the seasons", "what a compiler does", "the Roman aqueducts", "how bread rises",
    "the migration of birds", "how to tie a bowline knot", "what makes music sound sad",
    "how vaccines work", "the invention of the telephone", "how glaciers move", "the game of cricket",
    "how a refrigerator keeps food cold", "the architecture of cathedrals", "how to learn to swim",
    "the structure of an atom", "why cats purr", "how rivers shape valleys", "the basics of saving money",
    "how lighthouses guide ships", "what a database index is", "how tides are caused by the moon",
]  # fmt: skip


@torch.inference_mode()
def teacher_forced_logprobs(llm: LLM, token_ids: list[int], chunk: int) -> torch.Tensor:
    """[N-1, V] log-probs of each next token, computed through the engine's own model, paged KV
    cache and attention (blocks 0.. of the cache, which is otherwise idle)."""
    engine = llm.engine
    runner, block_size = engine.runner, engine.kv_manager.block_size
    num_blocks = -(-len(token_ids) // block_size)
    table = list(range(num_blocks))
    rows = []
    for start in range(0, len(token_ids) - 1, chunk):
        end = min(start + chunk, len(token_ids) - 1)
        ids = torch.tensor(token_ids[start:end])
        metadata = build_attention_metadata(
            [table], [end - start], [end], block_size, runner.kv_spec.num_kv_heads, runner.device
        )
        logits = runner.model(
            ids, torch.arange(start, end), runner.kv_caches, metadata, torch.arange(end - start)
        )
        rows.append(torch.log_softmax(logits.float(), dim=-1))
    return torch.cat(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--text", default=str(Path(__file__).parent / "data" / "heldout.txt"))
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--decode-prompt", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=192)
    parser.add_argument("--out", default="benchmarks/results/quant_quality.json")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument(
        "--greedy-batch", type=int, default=0,
        help="greedy prompts run in waves of this many at once (0: all at once); a hybrid engine's "
        "decode steps of at most hybrid_int4_max_batch requests run its INT4 copy",
    )  # fmt: skip
    args = parser.parse_args()
    variants = ["base_fp32"] + [v for v in args.variants if v != "base_fp32"]  # the reference first

    text = Path(args.text).read_text()
    prompts = [[{"role": "user", "content": f"Explain {topic} in a few sentences."}] for topic in TOPICS]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    base_logprobs: torch.Tensor | None = None
    base_decode = torch.empty(0)
    base_tokens: list[list[int]] = []
    results = {}
    for name in variants:
        options = VARIANTS[name]
        started = time.perf_counter()
        llm = LLM(args.model, kv_cache_memory=256 << 20, **options)
        token_ids = llm.tokenizer.encode(text)[
            : llm.engine.max_positions
        ]  # a tiny model's context may be short
        decode_ids = token_ids[: args.decode_prompt + args.decode_tokens]
        decode_logits = teacher_forced_logits(llm.engine.runner, decode_ids, args.decode_prompt)[
            :-1
        ]  # [D, V]
        decode_targets = torch.tensor(decode_ids[args.decode_prompt :])
        decode_logprobs = torch.log_softmax(decode_logits, dim=-1)
        decode_nll = -decode_logprobs.gather(1, decode_targets[:, None]).squeeze(1)
        logprobs = teacher_forced_logprobs(llm, token_ids, args.chunk)
        targets = torch.tensor(token_ids[1:])
        nll = -logprobs.gather(1, targets[:, None]).squeeze(1)
        wave = args.greedy_batch or len(prompts)
        outs = [o for i in range(0, len(prompts), wave) for o in llm.chat(prompts[i : i + wave], params)]
        tokens = [o.outputs[0].token_ids for o in outs]
        entry: dict[str, Any] = {
            "perplexity": math.exp(nll.mean().item()),
            "num_text_tokens": len(token_ids),
            "decode_perplexity": math.exp(decode_nll.mean().item()),
            "dtype": llm.stats()["dtype"], "weight_dtype": llm.stats()["weight_dtype"],
            "engine_quality_probe": llm.stats()["quality_probe"],
        }  # fmt: skip
        if base_logprobs is None:
            base_logprobs, base_tokens, base_decode = logprobs, tokens, decode_logits
        else:
            kl = (base_logprobs.exp() * (base_logprobs - logprobs)).sum(-1)
            same = [
                sum(a == b for a, b in zip(w, g, strict=True)) / len(w)
                for w, g in zip(base_tokens, tokens, strict=True)
            ]
            prefix = [
                next((i for i, (a, b) in enumerate(zip(w, g, strict=True)) if a != b), len(w))
                for w, g in zip(base_tokens, tokens, strict=True)
            ]
            decode_kl, decode_top1 = compare(base_decode, decode_logits)
            entry.update(
                {
                    "decode_perplexity_vs_base": entry["decode_perplexity"] / results["base_fp32"]["decode_perplexity"],
                    "decode_mean_kl": decode_kl,
                    "decode_top1_agreement": decode_top1,
                    "within_quality_bound": decode_kl <= MAX_MEAN_KL and decode_top1 >= MIN_TOP1_AGREEMENT,
                    "perplexity_vs_base": entry["perplexity"] / results["base_fp32"]["perplexity"],
                    "mean_kl": kl.mean().item(),
                    "greedy_token_agreement": sum(same) / len(same),
                    "greedy_identical_prefix_mean": sum(prefix) / len(prefix),
                    "greedy_fully_identical": sum(p == args.new_tokens for p in prefix) / len(prefix),
                }
            )  # fmt: skip
        entry["seconds"] = time.perf_counter() - started
        results[name] = entry
        log(f"{name}: " + ", ".join(f"{k}={v:.4f}" for k, v in entry.items() if isinstance(v, float)))
        del llm
    summary = {
        "benchmark": "quant_quality",
        "config": vars(args) | {"num_prompts": len(prompts)},
        "results": results,
    }
    write_result(args.out, summary)


if __name__ == "__main__":
    main()
