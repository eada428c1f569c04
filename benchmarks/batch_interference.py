"""Does a running batch job hurt real-time latency? Interactive TTFT / time per output token with
no batch load, with a batch at `priority=batch` (how batch jobs run), and with the same batch
load at interactive priority (what happens without the priority machinery), in one run.

Interactive traffic: `--interactive` requests arriving every `--interval` seconds (prompt
`--prompt-len`, `--new-tokens` generated). Batch load: `--batch` requests submitted at t=0
(prompt `--batch-prompt-len`, `--batch-new-tokens`). Greedy, EOS ignored, one AsyncEngine.

With `--through-serve`, the same question end to end: `tandem serve` is started as a subprocess
(its own local Ray, the engine's defaults, a free loopback port, a temporary data dir), the
interactive requests are streamed chat completions through the `openai` client (TTFT is the
first content chunk as the client sees it), and the batch load is a batch job of
`--serve-batch-lines` chat lines uploaded through the files API and run by the app's batch
worker. Interactive requests run alone, then while the batch runs (after its first shard has
committed); the batch's completed lines are read before and after that window to show it kept
going. The batch is cancelled and the server stopped (by PID) at the end.

    python benchmarks/batch_interference.py            # default model -> benchmarks/results/
    python benchmarks/batch_interference.py --through-serve
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import tempfile
import threading
import time
from typing import Any

import torch

from common import free_port, log, percentile, start_server, stop_server, write_result
from tandem import AsyncEngine, SamplingParams
from tandem.engine.protocol import GenerationRequest
from tandem.engine.request import Priority


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n, length), generator=gen).tolist()


async def one(engine: AsyncEngine, rid: str, prompt: list[int], new_tokens: int, priority: Priority) -> dict:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    request = GenerationRequest(
        request_id=rid, prompt_token_ids=prompt, sampling_params=params, priority=priority
    )
    start = time.perf_counter()
    first = None
    num_tokens = 0
    async for out in engine.generate(request):
        if first is None and out.outputs[0].token_ids:
            first = time.perf_counter()
        num_tokens = len(out.outputs[0].token_ids) or num_tokens + len(out.outputs[0].delta_token_ids)
    end = time.perf_counter()
    assert first is not None
    return {"ttft_s": first - start, "tpot_s": (end - first) / max(1, new_tokens - 1), "end": end}


async def scenario(
    engine: AsyncEngine, args: argparse.Namespace, batch_priority: Priority | None, tag: str
) -> dict:
    interactive = prompts(args.interactive, args.prompt_len, seed=1)
    batch = prompts(args.batch, args.batch_prompt_len, seed=2)
    start = time.perf_counter()
    batch_tasks = []
    if batch_priority is not None:
        batch_tasks = [
            asyncio.create_task(one(engine, f"{tag}-b{i}", p, args.batch_new_tokens, batch_priority))
            for i, p in enumerate(batch)
        ]
    results = []
    for i, prompt in enumerate(interactive):
        results.append(
            asyncio.create_task(one(engine, f"{tag}-i{i}", prompt, args.new_tokens, Priority.INTERACTIVE))
        )
        await asyncio.sleep(args.interval)  # the arrival process, not synchronisation
    done = await asyncio.gather(*results)
    interactive_end = time.perf_counter()
    batch_done = await asyncio.gather(*batch_tasks)
    ttft = [d["ttft_s"] for d in done]
    tpot = [d["tpot_s"] for d in done]
    out = {
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": statistics.median(tpot),
        "tpot_p99_s": percentile(tpot, 0.99),
    }
    if batch_done:
        # Batch tokens finished while interactive traffic ran, and overall batch throughput.
        wall = max(d["end"] for d in batch_done) - start
        out["batch_tokens_per_s"] = args.batch * args.batch_new_tokens / wall
        out["batch_wall_s"] = wall
        out["interactive_window_s"] = interactive_end - start
    log(f"{tag}: " + ", ".join(f"{k}={v:.3f}" for k, v in out.items()))
    return out


async def run(args: argparse.Namespace) -> dict:
    engine = AsyncEngine.from_options(
        args.model,
        max_num_seqs=args.max_num_seqs,
        batch_tokens_under_load=args.batch_tokens_under_load,
        enable_prefix_caching=False,  # scenarios repeat prompts: measure scheduling, not cache hits
    )
    try:
        await scenario(engine, argparse.Namespace(**{**vars(args), "interactive": 2}), None, "warmup")
        alone = await scenario(engine, args, None, "alone")
        batch = await scenario(engine, args, Priority.BATCH, "batch_priority")
        same = await scenario(engine, args, Priority.INTERACTIVE, "no_priority")
    finally:
        engine.shutdown()

    def ratio(a: dict, key: str) -> float:
        return a[key] / alone[key]

    return {
        "alone": alone,
        "with_batch_at_batch_priority": batch,
        "with_batch_at_interactive_priority": same,
        "ratios_vs_alone": {
            "batch_priority": {
                k: ratio(batch, k) for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
            },
            "no_priority": {
                k: ratio(same, k) for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
            },
        },
    }


SERVE_KEY = "sk-bench-interference"
OPERATOR_KEY = "sk-op-bench-interference"
TOPICS = ["rivers", "old maps", "bread", "the moon", "chess", "bees", "winter", "trains", "jazz", "tea"]


def _batch_tokens(base: str) -> float:
    """Tokens the engines generated for batch requests so far (`/metrics`, as the replicas last
    reported them): batch progress between shard commits."""
    import httpx

    text = httpx.get(
        base.removesuffix("/v1") + "/metrics", headers={"Authorization": f"Bearer {OPERATOR_KEY}"}, timeout=10
    ).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tandem_engine_output_tokens_batch_total")
    )


def _chat_messages(i: int, words: int) -> list[dict[str, str]]:
    filler = " ".join(TOPICS[(i + k) % len(TOPICS)] for k in range(words))
    return [
        {"role": "user", "content": f"Request {i}. Notes: {filler}. Write about {TOPICS[i % len(TOPICS)]}."}
    ]


def _interactive_window(client: Any, model: str, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """`--interactive` streamed chat requests arriving every `--interval` s, each in its own thread;
    client-side TTFT (first content chunk) and time per output token."""
    results: list[dict[str, float]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        started = time.perf_counter()
        first = None
        num_chunks = 0
        stream = client.chat.completions.create(
            model=model,
            messages=_chat_messages(1000 + i, args.prompt_words),
            max_tokens=args.new_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                num_chunks += 1
                if first is None:
                    first = time.perf_counter()
        end = time.perf_counter()
        assert first is not None, "no content streamed"
        with lock:
            results.append({"ttft_s": first - started, "tpot_s": (end - first) / max(1, args.new_tokens - 1)})

    threads = []
    for i in range(args.interactive):
        thread = threading.Thread(target=one, args=(i,))
        thread.start()
        threads.append(thread)
        time.sleep(args.interval)  # the arrival process, not synchronisation
    for thread in threads:
        thread.join()
    assert len(results) == args.interactive, "an interactive request failed"
    ttft = [r["ttft_s"] for r in results]
    tpot = [r["tpot_s"] for r in results]
    out = {
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": statistics.median(tpot),
        "tpot_p99_s": percentile(tpot, 0.99),
    }
    log(f"{tag}: " + ", ".join(f"{k}={v:.3f}" for k, v in out.items()))
    return out


def run_through_serve(args: argparse.Namespace) -> dict[str, Any]:
    import openai

    with tempfile.TemporaryDirectory(prefix="tandem-interference-") as data_dir:
        server, base = start_server(
            data_dir,
            free_port(),
            {"TANDEM_API_KEYS": f"{SERVE_KEY}=bench", "TANDEM_OPERATOR_KEYS": OPERATOR_KEY},
        )
        try:
            client = openai.OpenAI(base_url=base, api_key=SERVE_KEY, max_retries=0, timeout=600)
            model = client.models.list().data[0].id
            warmup = argparse.Namespace(**{**vars(args), "interactive": 2})
            _interactive_window(client, model, warmup, "warmup")
            alone = _interactive_window(client, model, args, "alone")
            lines = [
                {
                    "custom_id": f"b{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": model,
                        "messages": _chat_messages(i, args.batch_prompt_words),
                        "max_tokens": args.batch_new_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                }
                for i in range(args.serve_batch_lines)
            ]
            data = "".join(json.dumps(line) + "\n" for line in lines).encode()
            file_id = client.files.create(file=("load.jsonl", io.BytesIO(data)), purpose="batch").id
            batch = client.batches.create(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            submitted = time.perf_counter()
            deadline = submitted + 600
            while (batch := client.batches.retrieve(batch.id)).request_counts.completed == 0:  # type: ignore[union-attr]
                assert batch.status == "in_progress" or batch.status == "validating", batch.status
                assert time.perf_counter() < deadline, "the batch did not start"
                time.sleep(0.5)
            counts_before, usage_before, window_start = batch.request_counts, batch.usage, time.perf_counter()
            engine_tokens_before = _batch_tokens(base)
            with_batch = _interactive_window(client, model, args, "with_batch")
            batch = client.batches.retrieve(batch.id)
            window_s = time.perf_counter() - window_start
            engine_tokens = _batch_tokens(base) - engine_tokens_before
            assert batch.request_counts is not None and counts_before is not None
            lines_done = batch.request_counts.completed - counts_before.completed
            tokens_done = (batch.usage.output_tokens if batch.usage else 0) - (
                usage_before.output_tokens if usage_before else 0
            )
            log(
                f"batch during the window: {lines_done} lines committed ({tokens_done / window_s:.1f} tok/s), "
                f"engine batch tokens {engine_tokens / window_s:.1f} tok/s"
            )
            if batch.status not in ("completed", "failed", "cancelled", "expired"):
                client.batches.cancel(batch.id)
        finally:
            stop_server(server)
    ratios = {k: with_batch[k] / alone[k] for k in alone}
    log("with batch / alone: " + ", ".join(f"{k}={v:.3f}x" for k, v in ratios.items()))
    return {
        "alone": alone,
        "with_batch": with_batch,
        "ratios_vs_alone": ratios,
        "batch_during_window": {
            "lines_completed": lines_done,
            "committed_output_tokens_per_s": tokens_done / window_s,
            "engine_batch_tokens_per_s": engine_tokens / window_s,
            "window_s": window_s,
            "lines_total": args.serve_batch_lines,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--interactive", type=int, default=8)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--batch-prompt-len", type=int, default=128)
    parser.add_argument("--batch-new-tokens", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--batch-tokens-under-load", type=int, default=4, help="engine option")
    parser.add_argument("--through-serve", action="store_true", help="end to end through `tandem serve`")
    parser.add_argument(
        "--prompt-words", type=int, default=24, help="--through-serve: interactive prompt filler"
    )
    parser.add_argument(
        "--batch-prompt-words", type=int, default=48, help="--through-serve: batch prompt filler"
    )
    parser.add_argument(
        "--serve-batch-lines", type=int, default=512, help="--through-serve: lines in the batch job"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.through_serve:
        result = {
            "benchmark": "batch_interference_through_serve",
            "config": vars(args),
            **run_through_serve(args),
        }
        write_result(args.out or "benchmarks/results/batch_interference_serve.json", result)
        print(json.dumps(result["ratios_vs_alone"], indent=2))
        return
    args.out = args.out or "benchmarks/results/batch_interference.json"
    result = {
        "benchmark": "batch_interference",
        "config": vars(args),
        **asyncio.run(run(args)),
    }
    write_result(args.out, result)
    print(json.dumps(result["ratios_vs_alone"], indent=2))


if __name__ == "__main__":
    main()
