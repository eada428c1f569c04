"""What per-head KV eviction costs in quality, against uniform eviction at the same budgets.

Every task is generated here (no downloads) and scored teacher-forced on a reference
continuation, once with the full cache and once per (compression rate, method):
- `perplexity`: natural text (the Python reference manual's prose, `pydoc_data.topics`, shipped
  with CPython): the first `--context` tokens, then the next `--continuation` tokens.
  Score: full-cache perplexity / compressed perplexity (1.0 = no loss). KL(full || compressed)
  of the next-token distributions and top-1 agreement with the full cache are reported beside it.
- `copy`: a quoted passage (`--continuation` tokens) inside a long document of other text, then
  "Repeat the quoted passage exactly", then the passage again. Score: the fraction of repeated
  tokens whose argmax is the reference token. (The retrieval setting of LongBench: a small part
  of a long context matters; copying a whole context can keep no more than 1/rate of it.)
- `digits`: random digits, then "Repeat the digits". Score as for copy. Every digit must be
  read: at rate r at most about 1/r of them survive, so this task shows the floor.
- `passkey`: a five-digit pass key at several depths in filler text ("needle in a haystack"),
  then the question. Score: 1 when every pass-key token is the argmax, else 0 (the same as greedy
  decoding of that span). Reported only where the full cache finds the key, as the issue asks.

How compression is applied (the engine's semantics): the context is prefilled with the full cache;
then each layer keeps, per KV head, the tokens `tandem.kernels.kv_eviction.select_kept` picks from
the observation-window scores (`observation_scores` of the last `--window` context queries;
pooled over `--pool-kernel` neighbours; the last `--window` and first `--sinks` tokens are always kept); the continuation then attends, in each head, only
the kept context tokens plus the continuation so far. The model runs in HF `transformers` with
an attention function registered here that applies exactly that visibility per head;
`tests/test_head_kv_cache.py` shows attention over the real per-head paged cache equals dense
attention over the kept tokens, which is what this computes.

Serving (`--serve-requests`, 0 to skip): the engine itself (`LLM`, its defaults otherwise) at one
KV budget (`--kv-budget-mb`), `--serve-requests` long prompts (`--context` tokens of natural text
each) generating `--serve-new-tokens` tokens, greedy, EOS ignored: without compression (the shared
cache takes the whole budget) and at each `--serve-rates` (the compression pool takes
`--pool-fraction` of the same budget). Output tokens/s over the wall time, and the most requests
running at once (what the budget admits). `capacity` counts, with the head-block bookkeeping alone,
how many of the quality contexts one budget holds at each rate.

    python benchmarks/kv_compression.py            # -> benchmarks/results/kv_compression.json
    python benchmarks/kv_compression.py --rates 8 --context 256 --samples 1   # quick
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from common import log, write_result
from tandem.engine.kv.head_cache import HeadKVCacheManager
from tandem.engine.models.loader import default_cache_dir, gguf_to_hf_folder, resolve_model_path
from tandem.kernels.kv_eviction import (
    num_kept_for_rate,
    observation_scores,
    pool_scores,
    protected_window_for,
    select_kept,
)

ATTENTION_NAME = "tandem_kv_eviction_eval"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
METHODS = ("per_head", "per_head_global", "uniform")
TASKS = ("perplexity", "copy", "digits", "passkey")


@dataclass
class Sample:
    task: str
    name: str
    context_ids: list[int]  # prefilled, then compressed
    continuation_ids: list[int]  # scored, teacher-forced


class EvictionAttention:
    """HF attention function: causal attention, where continuation rows (positions >= T) see, in
    KV head h of layer l, only the context tokens `keep[l][h]`. With `observe`, it also records
    each layer's observation-window scores."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.num_context = 0
        self.observe = False
        self.scores: dict[int, torch.Tensor] = {}  # layer -> [Hk, T]
        self.keep: dict[int, torch.Tensor] | None = None  # layer -> [Hk, T] bool

    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,  # [1, Hq, S, D]
        key: torch.Tensor,  # [1, Hk, S, D] after RoPE
        value: torch.Tensor,  # [1, Hk, S, D]
        attention_mask: torch.Tensor | None,
        scaling: float,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        layer = int(getattr(module, "layer_idx"))  # noqa: B009 (HF sets it on every attention module)
        _, num_q_heads, num_rows, _ = query.shape
        num_kv_heads = key.shape[1]
        group = num_q_heads // num_kv_heads
        t = self.num_context
        if self.observe:
            q_window = query[0, :, t - self.window : t].transpose(0, 1)  # [W, Hq, D]
            self.scores[layer] = observation_scores(q_window, key[0, :, :t].transpose(0, 1), scaling)
        visible = torch.ones(num_rows, num_rows, dtype=torch.bool).tril()  # [S, S]
        visible = visible.expand(num_kv_heads, num_rows, num_rows).clone()  # [Hk, S, S]
        if self.keep is not None:
            visible[:, t:, :t] &= self.keep[layer].unsqueeze(1)
        visible = visible.repeat_interleave(group, dim=0)  # [Hq, S, S]
        keys = key[0].repeat_interleave(group, dim=0)  # [Hq, S, D]
        values = value[0].repeat_interleave(group, dim=0)
        logits = torch.matmul(query[0], keys.transpose(-1, -2)) * scaling  # [Hq, S, S]
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")).float(), dim=-1)
        out = torch.matmul(probs.to(values.dtype), values)  # [Hq, S, D]
        return out.transpose(0, 1).unsqueeze(0).contiguous(), None  # [1, S, Hq, D]


def natural_texts() -> list[str]:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return [
        topics[name]
        for name in ("compound", "datamodel", "types", "specialnames", "formatstrings", "assignment")
        if name in topics
    ]


def build_samples(tokenizer: Any, args: argparse.Namespace) -> list[Sample]:
    rng = random.Random(args.seed)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    samples: list[Sample] = []
    for i, text in enumerate(natural_texts()[: args.samples]):
        ids = encode(text)
        need = args.context + args.continuation
        if len(ids) >= need:
            samples.append(Sample("perplexity", f"text{i}", ids[: args.context], ids[args.context : need]))
    texts = natural_texts()
    for i in range(args.samples):
        document = encode(texts[i % len(texts)])
        passage = encode(texts[(i + 1) % len(texts)])[200 : 200 + args.continuation]
        head = encode("Read this document. It quotes one passage.\n\n")
        tail = encode('\n\nNow repeat the quoted passage exactly, word for word:\n\n"')
        quoted = encode('\n\n"') + passage + encode('"\n\n')
        body = max(0, args.context - len(head) - len(quoted) - len(tail))
        before = int(body * rng.choice([0.2, 0.5, 0.8]))
        context = head + document[:before] + quoted + document[before:body] + tail
        samples.append(Sample("copy", f"passage{i}", context, passage))
    for i in range(args.samples):
        digits = " ".join(rng.choice("0123456789") for _ in range(args.context // 4))
        prompt = encode(f"Memorise these digits: {digits}\nNow repeat the digits exactly:")
        samples.append(Sample("digits", f"digits{i}", prompt, encode(" " + digits)[: args.continuation]))
    for length in args.passkey_lengths:
        for depth in args.depths:
            key = "".join(rng.choice("123456789") for _ in range(5))
            filler = encode(FILLER * (length // 20 + 2))
            intro = encode("There is a pass key hidden in the text below. Find it and remember it.\n")
            needle = encode(f" The pass key is {key}. Remember it. {key} is the pass key. ")
            question = encode("\nWhat is the pass key? The pass key is")
            body = length - len(intro) - len(needle) - len(question)
            before = int(body * depth)
            context = intro + filler[:before] + needle + filler[: body - before] + question
            samples.append(Sample("passkey", f"len{length}_depth{depth}", context, encode(f" {key}")))
    return samples


def evaluate(
    model: Any, attention: EvictionAttention, sample: Sample, keep: dict[int, torch.Tensor] | None
) -> torch.Tensor:
    """Log-probabilities [m, V] of the continuation positions under `keep` (None: full cache)."""
    ids = torch.tensor([sample.context_ids + sample.continuation_ids])
    attention.num_context = len(sample.context_ids)
    attention.observe = keep is None
    attention.keep = keep
    with torch.inference_mode():
        logits = model(ids).logits[0].float()  # [S, V]
    t, m = len(sample.context_ids), len(sample.continuation_ids)
    return F.log_softmax(logits[t - 1 : t + m - 1], dim=-1)


def keep_masks(
    scores: dict[int, torch.Tensor], rate: float, method: str, args: argparse.Namespace
) -> tuple[dict[int, torch.Tensor], int]:
    """Per layer, [Hk, T] bool: the context tokens each KV head keeps. `per_head`: each layer
    keeps Hk * T / rate vectors, split over its heads by score (Ada-KV); `per_head_global`: the
    model keeps L * Hk * T / rate, split over all layers' heads by score (KV-Compress); `uniform`:
    T / rate in every head."""
    layers = sorted(scores)
    pooled = torch.stack([pool_scores(scores[layer], args.pool_kernel) for layer in layers])  # [L, Hk, T]
    num_layers, num_kv_heads, num_tokens = pooled.shape
    protected = protected_window_for(num_tokens, rate, args.window, args.sinks)  # as the engine
    budget = num_kept_for_rate(num_tokens, num_kv_heads, rate, protected, args.sinks)
    if method == "per_head_global":
        kept = select_kept(pooled.view(-1, num_tokens), num_layers * budget, protected, True, args.sinks)
    else:
        kept = [
            head_kept
            for layer_scores in pooled
            for head_kept in select_kept(layer_scores, budget, protected, method == "per_head", args.sinks)
        ]
    mask = torch.zeros(num_layers * num_kv_heads, num_tokens, dtype=torch.bool)
    for head, indices in enumerate(kept):
        mask[head, indices] = True
    mask = mask.view(num_layers, num_kv_heads, num_tokens)
    return {layer: mask[i] for i, layer in enumerate(layers)}, int(mask.sum())


def score(task: str, sample: Sample, logprobs: torch.Tensor) -> float:
    target = torch.tensor(sample.continuation_ids)
    if task == "perplexity":
        return float(torch.exp(-logprobs.gather(1, target.view(-1, 1)).mean()))
    correct = logprobs.argmax(dim=-1) == target
    if task == "passkey":
        return float(correct.all())
    return float(correct.float().mean())


def capacity(samples: list[Sample], kept_per_rate: dict[str, dict[float, list[list[int]]]], num_layers: int,
             num_kv_heads: int, block_size: int, budget_blocks: int) -> dict[str, Any]:  # fmt: skip
    """How many of the perplexity contexts fit in `budget_blocks` head blocks when each keeps what
    the model's scores chose (the real head-block bookkeeping: allocate, evict, count)."""
    out: dict[str, Any] = {}
    contexts = [s for s in samples if s.task == "perplexity"]
    if not contexts:
        return out
    for label, per_rate in kept_per_rate.items():
        for rate, kept_counts in per_rate.items():
            if not kept_counts:  # quality runs skipped
                continue
            kv = HeadKVCacheManager(budget_blocks, block_size, num_layers, num_kv_heads)
            admitted = 0
            while True:
                sample_kept = kept_counts[admitted % len(kept_counts)]
                num_tokens = len(contexts[admitted % len(contexts)].context_ids)
                request_id = f"r{admitted}"
                if kv.append_slots(request_id, num_tokens) is None:
                    break
                kv.evict(request_id, [list(range(num_tokens - k, num_tokens)) for k in sample_kept])
                admitted += 1
            out[f"{label}@{rate:g}x"] = admitted
    return out


def serve(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """Engine throughput at one KV budget, without compression and at each of `--serve-rates`."""
    from tandem import LLM, SamplingParams
    from tandem.engine.protocol import GenerationRequest

    budget = int(args.kv_budget_mb * (1 << 20))
    runs: dict[str, Any] = {}
    for rate in [None, *args.serve_rates]:
        options: dict[str, Any] = {"kv_cache_memory": budget, "max_num_seqs": args.serve_requests}
        if rate is not None:
            options |= {"kv_compression_rate": rate, "kv_compression_memory_fraction": args.pool_fraction}
        llm = LLM(args.model, **options)
        engine = llm.engine
        params = SamplingParams(max_tokens=args.serve_new_tokens, temperature=0.0, ignore_eos=True)
        llm.generate([prompts[0][:32]], SamplingParams(max_tokens=2))  # warm-up
        for i in range(args.serve_requests):
            engine.add_request(
                GenerationRequest(f"s{i}", prompt_token_ids=prompts[i % len(prompts)], sampling_params=params)
            )
        most_running, num_tokens = 0, 0
        started = time.perf_counter()
        while engine.scheduler.has_unfinished():
            for output in engine.step():
                if output.finished:
                    num_tokens += len(output.outputs[0].token_ids)
            most_running = max(most_running, engine.scheduler.num_running)
        wall = time.perf_counter() - started
        label = "full_cache" if rate is None else f"per_head@{rate:g}x"
        stats = engine.stats()
        runs[label] = {
            "tokens_per_s": num_tokens / wall,
            "wall_s": wall,
            "output_tokens": num_tokens,
            "most_running": most_running,
            "preemptions": stats["num_preemptions"],
            "kv_blocks": stats["kv_blocks_total"],
            "compression_head_blocks": stats.get("kv_compression_head_blocks_total", 0),
            "vectors_evicted": stats.get("kv_compression_vectors_evicted", 0),
        }
        log(f"serve {label}: {num_tokens / wall:.1f} tok/s, {wall:.1f} s, at most {most_running} running")
        del llm, engine
    base = runs["full_cache"]["tokens_per_s"]
    for run in runs.values():
        run["tokens_per_s_ratio_vs_full"] = run["tokens_per_s"] / base
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0, 32.0, 64.0])
    parser.add_argument("--context", type=int, default=1024, help="context tokens (perplexity, copy)")
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument(
        "--window",
        type=int,
        default=16,
        help="observation window; also the protected recent tokens (fewer at high rates)",
    )
    parser.add_argument("--pool-kernel", type=int, default=7, help="score pooling (SnapKV); 1: none")
    parser.add_argument("--sinks", type=int, default=4, help="first tokens always kept (attention sinks)")
    parser.add_argument("--samples", type=int, default=3, help="per task")
    parser.add_argument("--passkey-lengths", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--serve-requests", type=int, default=16, help="0: skip the serving runs")
    parser.add_argument("--serve-new-tokens", type=int, default=64)
    parser.add_argument("--serve-rates", type=float, nargs="+", default=[8.0])
    parser.add_argument("--kv-budget-mb", type=float, default=100.0, help="KV budget of the serving runs")
    parser.add_argument("--pool-fraction", type=float, default=0.9, help="compression pool's share of it")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument(
        "--tasks", nargs="+", default=list(TASKS), choices=list(TASKS), help="quality tasks to run"
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "kv_compression.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(args.model)
    folder = gguf_to_hf_folder(path, default_cache_dir()) if path.suffix == ".gguf" else path
    attention = EvictionAttention(args.window)
    AttentionInterface.register(ATTENTION_NAME, attention)
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation=ATTENTION_NAME
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    samples = [sample for sample in build_samples(tokenizer, args) if sample.task in args.tasks]
    log(
        f"{len(samples)} samples: "
        + ", ".join(f"{s.name} ({len(s.context_ids)}+{len(s.continuation_ids)})" for s in samples)
    )

    rows: list[dict[str, Any]] = []
    kept_counts: dict[str, dict[float, list[list[int]]]] = {m: {r: [] for r in args.rates} for m in METHODS}
    started = time.perf_counter()
    for index, sample in enumerate([] if args.skip_quality else samples):
        full = evaluate(model, attention, sample, None)
        scores = dict(attention.scores)
        row: dict[str, Any] = {"task": sample.task, "sample": sample.name, "context_tokens": len(sample.context_ids),
                               "full": score(sample.task, sample, full)}  # fmt: skip
        full_argmax = full.argmax(dim=-1)
        for method in METHODS:
            for rate in args.rates:
                masks, num_kept = keep_masks(scores, rate, method, args)
                if sample.task == "perplexity":
                    kept_counts[method][rate].append([int(n) for m in masks.values() for n in m.sum(dim=1)])
                compressed = evaluate(model, attention, sample, masks)
                key = f"{method}@{rate:g}x"
                row[key] = score(sample.task, sample, compressed)
                row[f"{key}:achieved_rate"] = sum(m.numel() for m in masks.values()) / num_kept
                if sample.task == "perplexity":
                    row[f"{key}:kl"] = float(
                        F.kl_div(compressed, full, log_target=True, reduction="batchmean")
                    )
                    row[f"{key}:top1_agreement"] = float(
                        (compressed.argmax(dim=-1) == full_argmax).float().mean()
                    )
        rows.append(row)
        elapsed = time.perf_counter() - started
        log(f"[{index + 1}/{len(samples)}] {sample.name}: full {row['full']:.3f}, "
            + ", ".join(f"{m}@{r:g}x {row[f'{m}@{r:g}x']:.3f}" for m in METHODS for r in args.rates)
            + f" ({elapsed:.0f} s, ETA {elapsed / (index + 1) * (len(samples) - index - 1):.0f} s)")  # fmt: skip

    summary: dict[str, Any] = {}
    for task in args.tasks:
        task_rows = [r for r in rows if r["task"] == task and (task != "passkey" or r["full"] == 1.0)]
        if not task_rows:
            summary[task] = {"note": "the full cache scored 0 on every sample: not reported"}
            continue
        entry: dict[str, Any] = {
            "samples": len(task_rows),
            "full": sum(r["full"] for r in task_rows) / len(task_rows),
        }
        for method in METHODS:
            for rate in args.rates:
                key = f"{method}@{rate:g}x"
                if task == "perplexity":  # already a fraction: full ppl / compressed ppl
                    fraction = sum(r["full"] / r[key] for r in task_rows) / len(task_rows)
                else:
                    fraction = sum(r[key] for r in task_rows) / max(1e-9, sum(r["full"] for r in task_rows))
                entry[key] = round(fraction, 4)
                if task == "perplexity":
                    entry[f"{key}:kl"] = round(sum(r[f"{key}:kl"] for r in task_rows) / len(task_rows), 4)
                    entry[f"{key}:top1_agreement"] = round(
                        sum(r[f"{key}:top1_agreement"] for r in task_rows) / len(task_rows), 4
                    )
        summary[task] = entry
    # Two means: over every task, and over perplexity and copy, the tasks the issue leans on (a
    # small part of a long context matters); digit recall and the passkey read tokens that any
    # eviction at rate r must mostly drop, so they show the floor.
    headline: dict[str, float | None] = {}
    headline_ppl_copy: dict[str, float | None] = {}
    for method in METHODS:
        for rate in args.rates:
            key = f"{method}@{rate:g}x"
            for target, tasks in ((headline, TASKS), (headline_ppl_copy, ("perplexity", "copy"))):
                values = [summary[t][key] for t in tasks if key in summary.get(t, {})]
                target[key] = round(sum(values) / len(values), 4) if values else None
    config = model.config
    blocks_per_context = (
        config.num_hidden_layers * config.num_key_value_heads * -(-args.context // args.block_size)
    )
    counts = {m: {r: v for r, v in per.items()} for m, per in kept_counts.items()}
    result = {
        "benchmark": "kv_compression",
        "config": vars(args),
        "score_fraction_of_full_cache_mean_over_tasks": headline,
        "score_fraction_of_full_cache_mean_over_perplexity_and_copy": headline_ppl_copy,
        "tasks": summary,
        "capacity_contexts_admitted": {
            "budget_head_blocks": 8 * blocks_per_context,
            "full_cache": 8,
            **capacity(
                samples,
                counts,
                config.num_hidden_layers,
                config.num_key_value_heads,
                args.block_size,
                8 * blocks_per_context,
            ),  # fmt: skip
        },
        "rows": rows,
    }
    if args.serve_requests:
        # Distinct prompts (no prefix-cache hits for the shared layout): windows of all the texts.
        stream = [t for text in natural_texts() for t in tokenizer.encode(text, add_special_tokens=False)]
        prompts = [
            stream[i * args.context : (i + 1) * args.context] for i in range(len(stream) // args.context)
        ]
        del model
        result["serving"] = serve(args, prompts)
    for key, value in headline.items():
        log(f"{key}: {value} (all tasks), {headline_ppl_copy[key]} (perplexity and copy)")
    write_result(args.out, result)


if __name__ == "__main__":
    main()
