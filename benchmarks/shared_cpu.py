"""How a shared CPU hurts: the engine and HF transformers, quiet and beside busy processes, one run.

For each concurrency N (`--concurrency`, default 1 and 32): N requests of `--prompt-len` random
tokens, `--new-tokens` generated (greedy, EOS ignored), on the engine (its defaults) and on HF
`generate` (float32, the same weights and threads), first on a quiet host, then while `--busy`
other processes spin on the CPU (pure Python loops, as a neighbour's work would), then quiet again
(to see drift). Reported: tokens/s of each, and each one's busy / quiet ratio (quiet: the mean of
the two quiet runs): the engine should lose no larger a fraction than HF does. With `--rounds R`
each phase runs each R times (engine and HF alternating which goes first) and medians count.

    python benchmarks/shared_cpu.py                       # -> benchmarks/results/shared_cpu.json
    python benchmarks/shared_cpu.py --rounds 3
    python benchmarks/shared_cpu.py --busy 2 --concurrency 1 32
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from typing import Any

import torch

from common import log, write_result
from engine_throughput import make_prompts, run_hf, run_tandem
from tandem import LLM, SamplingParams
from tandem.engine.models.loader import resolve_model_path


def _spin(stop_at: float) -> None:
    """A busy neighbour: burns one CPU until `stop_at` (time.time())."""
    x = 0
    while time.time() < stop_at:
        x = (x * 1103515245 + 12345) % 2147483648


def _measure(
    llm: LLM, hf: Any, concurrency: list[int], args: argparse.Namespace, vocab: int
) -> dict[str, Any]:
    """Per N, the median tokens/s of `args.rounds` runs of each, the two alternating which goes
    first (the busy processes' share of the CPU drifts; a fixed order would charge it to one)."""
    out: dict[str, Any] = {}
    for n in concurrency:
        prompts = make_prompts(n, args.prompt_len, vocab, seed=n)
        runs: dict[str, list[float]] = {"tandem": [], "hf": []}
        for round_index in range(args.rounds):
            for who in ("tandem", "hf") if round_index % 2 == 0 else ("hf", "tandem"):
                if who == "tandem":
                    runs[who].append(run_tandem(llm, prompts, args.new_tokens)["tokens_per_s"])
                else:
                    runs[who].append(run_hf(hf, prompts, args.new_tokens)["tokens_per_s"])
        out[str(n)] = {who: statistics.median(values) for who, values in runs.items()}
        out[str(n)]["rounds"] = runs
        log(
            f"  N={n}: tandem {out[str(n)]['tandem']:.1f} tok/s, HF {out[str(n)]['hf']:.1f} tok/s (medians of {runs})"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside the engine")
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of each per phase and N; the median counts"
    )
    parser.add_argument("--out", default="benchmarks/results/shared_cpu.json")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    llm = LLM(
        args.model, kv_cache_memory=None, max_num_seqs=max(64, *args.concurrency), enable_prefix_caching=False
    )
    path = resolve_model_path(args.model)
    if path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    hf.eval()
    vocab = llm.engine.model_config.vocab_size  # type: ignore[attr-defined]
    llm.generate([[100] * 8], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    with torch.inference_mode():
        hf.generate(torch.tensor([[100] * 8]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    log(f"threads {torch.get_num_threads()}; quiet")
    quiet_before = _measure(llm, hf, args.concurrency, args, vocab)
    log(f"beside {args.busy} busy processes")
    spinners = [
        multiprocessing.Process(target=_spin, args=(time.time() + 3600,), daemon=True)
        for _ in range(args.busy)
    ]
    for spinner in spinners:
        spinner.start()
    try:
        busy = _measure(llm, hf, args.concurrency, args, vocab)
    finally:
        for spinner in spinners:
            spinner.terminate()
            spinner.join()
    log("quiet again")
    quiet_after = _measure(llm, hf, args.concurrency, args, vocab)
    ratios: dict[str, dict[str, float]] = {}
    for n in map(str, args.concurrency):
        ratios[n] = {
            who: busy[n][who] / ((quiet_before[n][who] + quiet_after[n][who]) / 2) for who in ("tandem", "hf")
        }
        log(f"N={n}: busy / quiet: tandem {ratios[n]['tandem']:.2f}, HF {ratios[n]['hf']:.2f}")
    write_result(
        args.out,
        {"args": vars(args), "threads": torch.get_num_threads(), "quiet_before": quiet_before, "busy": busy,
         "quiet_after": quiet_after, "busy_over_quiet": ratios, "engine_stats": {
             k: llm.stats()[k] for k in ("dtype", "weight_dtype", "native_decoder")}},
    )  # fmt: skip


if __name__ == "__main__":
    main()
