"""Mixture-of-experts throughput against HF transformers, side by side in one run.

A Qwen3-MoE model is built from a config with random weights (no download; `--experts` experts,
top `--top-k`, `--layers` layers of hidden `--hidden`: about 100M parameters, 425 MB in float32,
by default) and saved with a small byte-level tokenizer. For each concurrency N: N requests of
`--prompt-len` random tokens, `--new-tokens` generated (greedy, EOS ignored), submitted at once;
generated tokens/s (prefill included) for the engine (its defaults on this CPU, and with
`--option`s) and for HF `generate` on the same weights (float32, the same threads). Also: the
share of the engine's step time spent in the sparse MoE blocks (forward hooks, eager run), and
the tokens routed to each expert (`stats()`: min, max, imbalance = max / mean).

    python benchmarks/moe.py                                  # 1, 8, 32 -> benchmarks/results/moe.json
    python benchmarks/moe.py --concurrency 1 8 --skip-hf
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from common import log, write_result
from engine_throughput import make_prompts, run_hf, run_tandem
from tandem import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build_model(args: argparse.Namespace, folder: Path) -> Path:
    """A random-weight Qwen3-MoE checkpoint saved by transformers, with a tiny tokenizer."""
    import shutil

    import transformers
    from tests.conftest import make_tiny_model

    tokenizer = make_tiny_model(folder / "_tokenizer", num_layers=1)
    vocab = json.loads((tokenizer / "config.json").read_text())
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab["vocab_size"], hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=2, head_dim=64,
        num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_size,
        norm_topk_prob=True, max_position_embeddings=4096, eos_token_id=vocab["eos_token_id"],
        bos_token_id=vocab["bos_token_id"], pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
            else:
                param.normal_(0.0, 0.05)
    out = folder / "qwen3-moe"
    model.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, out / name)
    num_params = sum(p.numel() for p in model.parameters())
    log(f"built {out}: {num_params / 1e6:.0f}M parameters, {4 * num_params / 1e6:.0f} MB float32")
    return out


def moe_share(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """Wall seconds inside the sparse MoE blocks over the engine's step wall seconds, one run."""
    from tandem.engine.models.moe_layer import SparseMoE

    model = llm.engine.runner.model  # type: ignore[attr-defined]
    spent = [0.0]
    started: dict[int, float] = {}

    def before(module: Any, _: Any) -> None:
        started[id(module)] = time.perf_counter()

    def after(module: Any, _: Any, __: Any) -> None:
        spent[0] += time.perf_counter() - started.pop(id(module))

    handles = []
    for module in model.modules():
        if isinstance(module, SparseMoE):
            handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    step_before = llm.stats()["step_wall_s"]
    llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    step_s = llm.stats()["step_wall_s"] - step_before
    for handle in handles:
        handle.remove()
    return {"moe_s": spent[0], "step_s": step_s, "moe_share": spent[0] / step_s if step_s else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-size", type=int, default=256)
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="an engine option")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/moe.json")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    folder = build_model(args, Path(tempfile.mkdtemp(prefix="tandem-moe-bench-")))
    options: dict[str, Any] = {}
    for pair in args.option:
        key, _, value = pair.partition("=")
        options[key] = json.loads(value) if value[:1] in "[{0123456789tfn-" else value
    llm = LLM(str(folder), kv_cache_memory=256 << 20, max_num_seqs=max(args.concurrency), **options)
    log(
        f"engine: dtype {llm.stats()['dtype']}, weights {llm.stats()['weight_dtype']}; torch threads {threads}"
    )
    hf = None
    if not args.skip_hf:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    vocab = llm.engine.model_config.vocab_size  # type: ignore[attr-defined]
    rows = []
    for n in args.concurrency:
        prompts = make_prompts(n, args.prompt_len, vocab, seed=n)
        run_tandem(llm, make_prompts(n, args.prompt_len, vocab, seed=1000 + n), 4)  # warm this batch size
        row: dict[str, Any] = {"concurrency": n, "tandem": run_tandem(llm, prompts, args.new_tokens)}
        if hf is not None:
            row["hf"] = run_hf(hf, prompts, args.new_tokens)
            row["ratio_tandem_over_hf"] = row["tandem"]["tokens_per_s"] / row["hf"]["tokens_per_s"]
        log(
            f"N={n}: tandem {row['tandem']['tokens_per_s']:.1f} tok/s"
            + (
                f", HF {row['hf']['tokens_per_s']:.1f} tok/s, {row['ratio_tandem_over_hf']:.2f}x"
                if hf
                else ""
            )
        )
        rows.append(row)
    share = moe_share(llm, make_prompts(8, args.prompt_len, vocab, seed=7), args.new_tokens)
    experts = llm.stats()["moe_expert_tokens"]
    balance = {
        "min": min(experts),
        "max": max(experts),
        "imbalance_max_over_mean": llm.stats()["moe_expert_imbalance"],
    }
    log(f"MoE blocks: {share['moe_share']:.0%} of step time; tokens per expert {balance}")
    write_result(
        args.out,
        {"args": vars(args), "threads": threads, "options": options, "rows": rows, "moe_time": share,
         "expert_tokens": experts, "expert_balance": balance},
    )  # fmt: skip


if __name__ == "__main__":
    main()
