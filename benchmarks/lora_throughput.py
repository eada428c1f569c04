"""Multi-LoRA throughput: 32 concurrent requests spread over 1, 4 and 16 distinct adapters in one
engine (batched in the same forward passes), against the base model alone and against running
each adapter's requests separately (one adapter at a time), all in one run.

Adapters are random rank-`--rank` PEFT LoRA checkpoints on all seven linear modules, written to a
temp folder in PEFT's file format. Greedy, EOS ignored.

    python benchmarks/lora_throughput.py        # default model -> benchmarks/results/lora_throughput.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from common import log, write_result
from tandem import LLM, LoRARequest, SamplingParams

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


def write_adapter(folder: Path, llm: LLM, rank: int, seed: int) -> None:
    """A random PEFT LoRA checkpoint for `llm`'s base model."""
    assert llm.engine.lora is not None
    shape = llm.engine.lora.shape
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape.num_layers):
        for module, parent in MODULES.items():
            fan_in, fan_out = shape.in_out(module)
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}
    (folder / "adapter_config.json").write_text(json.dumps(config))


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, loras: list[LoRARequest | None]) -> dict:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora=loras)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": wall, "generated_tokens": tokens, "tokens_per_s": tokens / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--out", default="benchmarks/results/lora_throughput.json")
    args = parser.parse_args()

    max_adapters = max(args.adapters)
    llm = LLM(
        args.model, enable_lora=True, max_loras=max_adapters, max_lora_rank=args.rank,
        max_num_seqs=args.requests, max_cpu_loras=max_adapters,
        enable_prefix_caching=False,  # the runs repeat prompts: measure compute, not cache hits
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (args.requests, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="tandem-lora-bench-") as tmp:
        adapters = []
        for i in range(max_adapters):
            write_adapter(Path(tmp) / f"a{i}", llm, args.rank, seed=i)
            adapters.append(LoRARequest(f"a{i}", str(Path(tmp) / f"a{i}")))
        run(llm, prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), [None] * 4)  # warm-up
        results["base"] = run(llm, prompts, params, [None] * args.requests)
        log(f"base: {results['base']['tokens_per_s']:.1f} tok/s")
        for k in args.adapters:
            loras = [adapters[i % k] for i in range(args.requests)]
            mixed = run(llm, prompts, params, loras)
            separate_wall, separate_tokens = 0.0, 0
            for a in range(k):  # each adapter's requests on their own, one adapter after another
                idx = [i for i in range(args.requests) if i % k == a]
                one = run(llm, [prompts[i] for i in idx], params, [adapters[a]] * len(idx))
                separate_wall += one["wall_s"]
                separate_tokens += one["generated_tokens"]
            separate = {"wall_s": separate_wall, "tokens_per_s": separate_tokens / separate_wall}
            results[f"{k}_adapters"] = {
                "mixed_batch": mixed,
                "separate_runs": separate,
                "vs_base": mixed["tokens_per_s"] / results["base"]["tokens_per_s"],
                "vs_separate": mixed["tokens_per_s"] / separate["tokens_per_s"],
            }
            log(
                f"{k} adapters: {mixed['tokens_per_s']:.1f} tok/s mixed, {separate['tokens_per_s']:.1f} separate; "
                f"{results[f'{k}_adapters']['vs_base']:.2f}x base, {results[f'{k}_adapters']['vs_separate']:.2f}x separate"
            )
    summary = {
        "benchmark": "lora_throughput",
        "config": vars(args),
        "results": results,
    }
    write_result(args.out, summary)


if __name__ == "__main__":
    main()
