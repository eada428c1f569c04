"""INT4 weights vs 16-bit (and float32) on the default model, in one run: weight bytes, and decode
tokens/s at batch 1 and batch 16 (`--prompt-len` prompt, `--new-tokens` generated, greedy, EOS
ignored; decode rate = tokens after the first / time after the first token).

Every variant is loaded first; then `--rounds` rounds each measure every variant in turn, so that
load on a shared machine hits all variants alike. Rates are medians over rounds, and each ratio
to bfloat16 is also given per round (measured next to each other).

    python benchmarks/int4_decode.py        # -> benchmarks/results/int4_decode.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from common import log, write_result
from tandem import LLM, SamplingParams
from tandem.kernels.int4 import Int4Linear
from tandem.kernels.int8 import Int8HeadLinear
from tandem.kernels.linear import Bf16Linear, PackedLinear

VARIANTS = {
    "float32": {"dtype": "float32"},  # explicit: "auto" picks by the CPU
    "bfloat16": {"dtype": "bfloat16"},
    "bfloat16_compiled": {"dtype": "bfloat16", "compile_decode": True},  # like for like with int4_compiled
    "int4": {"weight_dtype": "int4"},  # a Q4_1 GGUF as stored: group 32
    "int4_g128": {"weight_dtype": "int4", "int4_group_size": 128},  # requantised: fewer bytes
    "int4_dq": {"weight_dtype": "int4", "int4_double_quant": True},  # Q4_1 codes, int8 group params
    "int4_compiled": {"weight_dtype": "int4", "compile_decode": True},
    "int4_dq_compiled": {"weight_dtype": "int4", "int4_double_quant": True, "compile_decode": True},
    # torch's int4 kernel instead of the native one ("auto" picks native on an AVX2 CPU)
    "int4_torch": {"weight_dtype": "int4", "int4_kernel": "torch"},
    "int4_dq_torch": {"weight_dtype": "int4", "int4_double_quant": True, "int4_kernel": "torch"},
    "int4_dq_torch_compiled": {
        "weight_dtype": "int4",
        "int4_double_quant": True,
        "int4_kernel": "torch",
        "compile_decode": True,
    },
}


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the decoder linears, of the LM head, and of everything (embedding, norms)."""
    linears = head = other = 0
    for name, module in model.named_modules():
        size = 0
        if isinstance(module, Int4Linear):
            size = module.num_weight_bytes
        elif isinstance(module, PackedLinear):
            size = module.in_features * module.out_features * module.packed.element_size()
        elif isinstance(module, Bf16Linear | Int8HeadLinear | nn.Linear):
            size = module.weight.numel() * module.weight.element_size()
        elif isinstance(module, nn.Embedding):
            other += module.weight.numel() * module.weight.element_size()
        if name == "lm_head":
            head += size
        else:
            linears += size
    other += sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)
    return {"decoder_linears": linears, "lm_head": head, "total": linears + head + other}


def decode_rate(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> float:
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(100, 40000, (batch, prompt_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    first = max(o.metrics.ttft or 0.0 for o in outs)
    return batch * (new_tokens - 1) / (wall - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--out", default="benchmarks/results/int4_decode.json")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; rates are medians")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    if "bfloat16" not in args.variants:
        args.variants.insert(0, "bfloat16")  # the baseline of every ratio
    llms: dict[str, LLM] = {}
    results: dict[str, dict] = {}
    for name in args.variants:
        llm = LLM(args.model, kv_cache_memory=128 << 20, enable_prefix_caching=False, **VARIANTS[name])
        decode_rate(llm, 1, 8, 4)  # warm-up
        model = llm.engine.runner.model
        kernels = sorted({m.kernel for m in model.modules() if isinstance(m, Int4Linear)})
        results[name] = {"weight_bytes": weight_bytes(model), "int4_kernel": kernels, "rounds": []}
        llms[name] = llm
        log(f"loaded {name} ({len(llms)}/{len(args.variants)})")
    for round_index in range(args.rounds):
        for name, llm in llms.items():
            rates = {
                f"decode_tokens_per_s_b{b}": decode_rate(llm, b, args.prompt_len, args.new_tokens)
                for b in args.batches
            }
            results[name]["rounds"].append(rates)
            log(f"round {round_index + 1}/{args.rounds} {name}: {rates}")
    for entry in results.values():
        for b in args.batches:
            key = f"decode_tokens_per_s_b{b}"
            entry[key] = statistics.median(r[key] for r in entry["rounds"])
    base = results["bfloat16"]
    for entry in results.values():
        entry["vs_16bit"] = {
            "decoder_linear_bytes": entry["weight_bytes"]["decoder_linears"]
            / base["weight_bytes"]["decoder_linears"],
            "total_bytes": entry["weight_bytes"]["total"] / base["weight_bytes"]["total"],
            **{
                f"decode_b{b}": entry[f"decode_tokens_per_s_b{b}"] / base[f"decode_tokens_per_s_b{b}"]
                for b in args.batches
            },
            **{
                f"decode_b{b}_per_round": [
                    mine[f"decode_tokens_per_s_b{b}"] / theirs[f"decode_tokens_per_s_b{b}"]
                    for mine, theirs in zip(entry["rounds"], base["rounds"], strict=True)
                ]
                for b in args.batches
            },
        }
    summary = {
        "benchmark": "int4_decode",
        "config": vars(args),
        "results": results,
    }
    write_result(args.out, summary)
    print(json.dumps({name: entry["vs_16bit"] for name, entry in results.items()}, indent=2))


if __name__ == "__main__":
    main()
