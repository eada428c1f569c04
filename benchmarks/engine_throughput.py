"""Offline engine throughput and TTFT vs HF transformers `generate` and llama.cpp, side by side in
one run.

For each concurrency N: N requests of `--prompt-len` random tokens, `--new-tokens` generated
(greedy, EOS ignored), submitted at once. Reports generated tokens/s (N * new_tokens / wall
time, prefill included) and time to first token, for the engine with its defaults (dtype and
weight_dtype "auto", speculative decoding on) and with speculation off (random-token prompts make
the model repeat itself, which prompt lookup predicts unusually well). HF runs the same prompts as
one batch through `generate` on the same weights (transformers' own GGUF loader, float32) and
thread count; its TTFT is the wall time of the same batch with max_new_tokens=1. llama.cpp, where
`benchmarks/install_llama_cpp.sh` built it (or `--llama-cpp-bin DIR`), runs `llama-batched-bench`
on the same GGUF with the same threads, prompt and generation lengths: its generated tokens over
total time (the same measure) and its decode-only rate. With `--rounds R` each engine runs each
concurrency R times, the engines alternating (each round starts with the next), and its median
round counts: speculation on / off is then not decided by which engine ran first, and is the
median over rounds of the two engines' ratio within a round (single runs on a shared host move
by 5-10%, now and then 30%: use at least 9 rounds to read on / off to a few percent).

    python benchmarks/engine_throughput.py                 # 1, 8, 32, 64 -> benchmarks/results/
    python benchmarks/engine_throughput.py --concurrency 1 8 32 --rounds 11
    python benchmarks/engine_throughput.py --concurrency 1 8 --skip-hf --skip-llama-cpp
    python benchmarks/engine_throughput.py --device cuda   # benchmarks/cuda_throughput.py: 1, 32, 256
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from common import cpu, log, write_result
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


LLAMA_CPP_DIR = Path(__file__).resolve().parent.parent / ".cache" / "llama-cpp" / "bin"


def run_llama_cpp(
    bin_dir: Path, gguf: Path, concurrency: list[int], prompt_len: int, new_tokens: int, threads: int
) -> dict[int, dict[str, float]]:
    """`llama-batched-bench` rows by batch size: generated tokens / total time and decode rate."""
    context = max(concurrency) * (prompt_len + new_tokens) + 256
    command = [
        str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-c", str(context),
        "-npp", str(prompt_len), "-ntg", str(new_tokens), "-npl", ",".join(map(str, concurrency)),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=3600)
    rows: dict[int, dict[str, float]] = {}
    for line in done.stdout.splitlines() + done.stderr.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"\d+", cells[0]):
            pp, tg, batch = int(cells[0]), int(cells[1]), int(cells[2])
            total_s, decode_rate = float(cells[8]), float(cells[7])
            rows[batch] = {
                "wall_s": total_s,
                "generated_tokens": batch * tg,
                "tokens_per_s": batch * tg / total_s,
                "decode_tokens_per_s": decode_rate,
                "prompt_tokens": batch * pp,
            }
    return rows


def _option_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # a plain string such as float32


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--concurrency", type=int, nargs="+", help="CPU: 1 8 32 64; CUDA: 1 32 256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, help="CPU: 64; CUDA: 128")
    parser.add_argument(
        "--workdir", type=Path, default=Path("/tmp/tandem-cuda-bench"), help="CUDA: model folder"
    )
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--skip-no-spec", action="store_true", help="only the defaults, not speculation off")
    parser.add_argument(
        "--llama-cpp-bin", type=Path, default=LLAMA_CPP_DIR, help="folder with llama-batched-bench"
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine option over the defaults, a JSON value or a plain string, e.g. --option dtype=float32 "
        "--option hybrid_int4_max_batch=4 --option speculative=null (repeatable)",
    )
    parser.add_argument(
        "--baseline-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a third engine with these options (e.g. the earlier defaults: --baseline-option dtype=bfloat16 "
        "--baseline-option weight_dtype=hybrid), run alternately with the others; rows get defaults / baseline",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each engine per concurrency, alternating; the median counts",
    )
    parser.add_argument(
        "--output", type=Path, default=Path(__file__).parent / "results" / "engine_throughput.json"
    )
    args = parser.parse_args()
    if args.device == "cuda":
        from cuda_throughput import main_cuda

        report = main_cuda(
            args.concurrency or [1, 32, 256],
            args.prompt_len,
            args.new_tokens or 128,
            args.output,
            args.workdir,
        )
        print(json.dumps(report, indent=2))
        return
    args.concurrency = args.concurrency or [1, 8, 32, 64]
    args.new_tokens = args.new_tokens or 64

    threads = torch.get_num_threads()
    options: dict[str, Any] = {
        key: _option_value(value) for key, value in (o.split("=", 1) for o in args.option)
    }
    max_n = max(args.concurrency)
    common = {"kv_cache_memory": None, "max_num_seqs": max(64, max_n), "enable_prefix_caching": False}
    engines: dict[str, LLM] = {}
    started = time.perf_counter()
    log(f"loading tandem engine ({args.model}, defaults {options or ''}), torch threads {threads}")
    engines["tandem"] = LLM(args.model, **common, **options)
    log(f"engine ready in {time.perf_counter() - started:.1f} s")
    if not args.skip_no_spec:
        engines["tandem_no_spec"] = LLM(args.model, **common, **{**options, "speculative": None})
    baseline = {key: _option_value(value) for key, value in (o.split("=", 1) for o in args.baseline_option)}
    if baseline:
        engines["baseline"] = LLM(args.model, **common, **baseline)
        log(
            f"baseline: {engines['baseline'].stats()['dtype']} / {engines['baseline'].stats()['weight_dtype']}"
        )
    stats = engines["tandem"].stats()
    log(f"precision: {stats['dtype']} / {stats['weight_dtype']} ({stats['precision_reason']})")
    vocab = engines["tandem"].engine.model_config.vocab_size
    for llm in engines.values():
        llm.generate([[100] * 8], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up

    hf_model = None
    path = resolve_model_path(args.model)
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

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

    llama_rows: dict[int, dict[str, float]] = {}
    llama_note = ""
    if args.skip_llama_cpp:
        llama_note = "skipped (--skip-llama-cpp)"
    elif path.suffix != ".gguf":
        llama_note = "not a GGUF model"
    elif not (args.llama_cpp_bin / "llama-batched-bench").exists():
        llama_note = f"not built: run benchmarks/install_llama_cpp.sh (looked in {args.llama_cpp_bin})"
    else:
        log("llama.cpp: llama-batched-bench ...")
        try:
            llama_rows = run_llama_cpp(
                args.llama_cpp_bin, path, args.concurrency, args.prompt_len, args.new_tokens, threads
            )
        except (subprocess.SubprocessError, OSError) as error:
            llama_note = f"failed: {error}"[:500]
    if llama_note:
        log(f"llama.cpp column: {llama_note}")

    rows = []
    for n in args.concurrency:
        prompts = make_prompts(n, args.prompt_len, vocab, args.seed + n)
        row: dict = {"concurrency": n}
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        names = list(engines)
        for round_index in range(args.rounds):
            # Each round starts with the next engine, so that a slow first run (or a host slowing
            # down) falls on each alike; an engine's figure is its median round.
            for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
                log(f"concurrency {n}: {name} (round {round_index + 1}/{args.rounds}) ...")
                runs[name].append(run_tandem(engines[name], prompts, args.new_tokens))
                last = runs[name][-1]
                log(
                    f"concurrency {n}: {name} {last['tokens_per_s']:.1f} tok/s, ttft {last['ttft_mean_s'] * 1000:.0f} ms"
                )
        for name, results in runs.items():
            median = sorted(results, key=lambda r: r["tokens_per_s"])[(len(results) - 1) // 2]
            row[name] = {**median, "rounds_tokens_per_s": [r["tokens_per_s"] for r in results]}
        if "tandem_no_spec" in row:
            # The figure: the median over rounds of on / off within a round (the two engines ran back
            # to back, so a host slowing down between rounds cancels); also the medians' ratio.
            paired = [
                a["tokens_per_s"] / b["tokens_per_s"]
                for a, b in zip(runs["tandem"], runs["tandem_no_spec"], strict=True)
            ]
            row["spec_on_over_off_rounds"] = paired
            row["spec_on_over_off"] = statistics.median(paired)
            row["spec_on_over_off_of_medians"] = (
                row["tandem"]["tokens_per_s"] / row["tandem_no_spec"]["tokens_per_s"]
            )
            log(
                f"concurrency {n}: speculation on / off {row['spec_on_over_off']:.3f} (median of the rounds' "
                f"ratios; ratio of the medians {row['spec_on_over_off_of_medians']:.3f})"
            )
        if "baseline" in row:
            paired = [
                a["tokens_per_s"] / b["tokens_per_s"]
                for a, b in zip(runs["tandem"], runs["baseline"], strict=True)
            ]
            row["defaults_over_baseline"] = statistics.median(paired)
            log(
                f"concurrency {n}: defaults / baseline {row['defaults_over_baseline']:.3f} (median of the rounds' ratios)"
            )
        if hf_model is not None:
            log(f"concurrency {n}: HF generate ...")
            row["hf"] = run_hf(hf_model, prompts, args.new_tokens)
            log(f"concurrency {n}: HF {row['hf']['tokens_per_s']:.1f} tok/s")
        if n in llama_rows:
            row["llama_cpp"] = llama_rows[n]
        for name in engines:
            for peer in ("hf", "llama_cpp"):
                if peer in row:
                    row[f"{name}_over_{peer}"] = row[name]["tokens_per_s"] / row[peer]["tokens_per_s"]
        log(
            f"concurrency {n}: "
            + ", ".join(
                f"{k} {v:.2f}x" for k, v in row.items() if k.endswith(("_over_hf", "_over_llama_cpp"))
            )
        )
        rows.append(row)

    report = {
        "benchmark": "engine_throughput",
        "model": args.model,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "torch_threads": threads,
        "cpu": cpu(),
        "engine": {
            **{k: v for k, v in stats.items() if k in ("kv_capacity_tokens", "block_size", "max_model_len")},
            "options": options,
            "dtype": stats["dtype"],
            "weight_dtype": stats["weight_dtype"],
            "precision_reason": stats["precision_reason"],
            "native_decoder": stats["native_decoder"],
            "kv_cache_dtype": stats["kv_cache_dtype"],
        },
        "baseline": {
            "options": baseline,
            **{k: engines["baseline"].stats()[k] for k in ("dtype", "weight_dtype")},
        }
        if baseline
        else None,
        "llama_cpp": llama_note or "llama-batched-bench, same GGUF and threads",
        "results": rows,
    }
    write_result(args.output, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
