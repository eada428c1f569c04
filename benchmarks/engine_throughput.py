"""Offline engine throughput and TTFT vs HF transformers `generate`, side by side in one run.

For each concurrency N: N requests of `--prompt-len` random tokens, `--new-tokens` generated
(greedy, EOS ignored), submitted at once. Reports generated tokens/s (N * new_tokens / wall
time) and time to first token. HF runs the same prompts as one batch through `generate` on the
same weights (transformers' own GGUF loader) and thread count; its TTFT is the wall time of
the same batch with max_new_tokens=1.

    python benchmarks/engine_throughput.py                 # 1, 8, 32, 64 -> benchmarks/results/
    python benchmarks/engine_throughput.py --concurrency 1 8 --skip-hf
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from common import log, write_result
from tandem import LLM, SamplingParams
from tandem.engine.models.loader import resolve_model_path


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=gen).tolist()


def run_tandem(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    preempt_before = llm.stats()["num_preemptions"]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    ttfts = [o.metrics.ttft or 0.0 for o in outs]
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "wall_s": wall,
        "generated_tokens": generated,
        "tokens_per_s": generated / wall,
        "ttft_mean_s": statistics.mean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_max_s": max(ttfts),
        "preemptions": llm.stats()["num_preemptions"] - preempt_before,
    }


def run_hf(model, prompts: list[list[int]], new_tokens: int) -> dict:  # type: ignore[no-untyped-def]
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    kwargs = {"do_sample": False, "attention_mask": mask, "pad_token_id": 0}
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        wall = time.perf_counter() - start
    generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {
        "wall_s": wall,
        "generated_tokens": generated,
        "tokens_per_s": generated / wall,
        "ttft_mean_s": ttft,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--weight-dtype",
        default="auto",
        choices=["auto", "int4", "hybrid"],
        help="engine weights (int4: the GGUF's Q4_1 as is; hybrid: INT4 for small decode steps, "
        "float32 for prefill and large batches)",
    )
    parser.add_argument(
        "--compile-decode", action="store_true", help="torch.compile the decode steps (compiles at start)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output", type=Path, default=Path(__file__).parent / "results" / "engine_throughput.json"
    )
    args = parser.parse_args()

    threads = torch.get_num_threads()
    log(f"loading tandem engine ({args.model}), torch threads {threads}")
    max_n = max(args.concurrency)
    llm = LLM(
        args.model,
        kv_cache_memory=None,
        max_num_seqs=max(64, max_n),
        weight_dtype=args.weight_dtype,
        compile_decode=args.compile_decode,
        enable_prefix_caching=False,
    )
    log(f"engine ready; decode compiled: {llm.engine.runner.compiles_decode}")
    vocab = llm.engine.model_config.vocab_size
    llm.generate([[100] * 8], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up

    hf_model = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        path = resolve_model_path(args.model)
        log("loading HF transformers reference (its own GGUF loader)")
        if path.suffix == ".gguf":
            hf_model = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32
            )
        else:
            hf_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        hf_model.eval()
        with torch.inference_mode():
            hf_model.generate(torch.tensor([[100] * 8]), max_new_tokens=4, do_sample=False, pad_token_id=0)

    rows = []
    for n in args.concurrency:
        prompts = make_prompts(n, args.prompt_len, vocab, args.seed + n)
        log(f"concurrency {n}: tandem ...")
        ours = run_tandem(llm, prompts, args.new_tokens)
        log(
            f"concurrency {n}: tandem {ours['tokens_per_s']:.1f} tok/s, ttft {ours['ttft_mean_s'] * 1000:.0f} ms"
        )
        row: dict = {"concurrency": n, "tandem": ours}
        if hf_model is not None:
            log(f"concurrency {n}: HF generate ...")
            ref = run_hf(hf_model, prompts, args.new_tokens)
            log(
                f"concurrency {n}: HF {ref['tokens_per_s']:.1f} tok/s, ttft {ref['ttft_mean_s'] * 1000:.0f} ms"
            )
            row["hf"] = ref
            row["tokens_per_s_ratio"] = ours["tokens_per_s"] / ref["tokens_per_s"]
            row["ttft_ratio_hf_over_tandem"] = ref["ttft_mean_s"] / ours["ttft_mean_s"]
            log(f"concurrency {n}: ratio {row['tokens_per_s_ratio']:.2f}x tok/s")
        rows.append(row)

    report = {
        "benchmark": "engine_throughput",
        "model": args.model,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "torch_threads": threads,
        "engine": {
            **{
                k: v
                for k, v in llm.stats().items()
                if k in ("kv_capacity_tokens", "block_size", "max_model_len")
            },
            "weight_dtype": args.weight_dtype,
            "compile_decode": llm.engine.runner.compiles_decode,
        },
        "results": rows,
    }
    write_result(args.output, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
