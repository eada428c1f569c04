"""Colocated against disaggregated serving on the same CPU budget, and the bytes a hand-over moves.

Workload: `--streams` streaming completions of short prompts decode (greedy, EOS ignored); once
all have their first token, `--long-prompts` long prompts arrive (prefill-heavy, a few tokens
each). Reported per mode: the decoding streams' time per output token (gaps between streamed
tokens, p50 and p99) and the long prompts' TTFT. Modes, one after the other on a Ray of its own:
- colocated: one LLM replica with every core;
- disaggregated: one prefill replica and one decode replica (its default INT4 + FP8), each
  with half the cores.
Also: bytes per prompt token of a KV hand-over, 16-bit pages against FP8 pages (engine level).

    python benchmarks/disaggregation.py    # -> benchmarks/results/disaggregation.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import ray
from ray import serve

from common import log, percentile, write_result
from tandem import GenerationRequest, SamplingParams
from tandem.deployments.app import build_app
from tandem.engine.engine import LLMEngine

KEY = "sk-bench"


async def stream_gaps(
    client: httpx.AsyncClient,
    base: str,
    model: str,
    prompt: str,
    max_tokens: int,
    started: asyncio.Event | None,
) -> tuple[float, list[float]]:
    """(TTFT, gaps between streamed tokens) of one streaming completion."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    sent = time.perf_counter()
    times: list[float] = []
    async with client.stream(
        "POST", f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
                if started is not None and len(times) == 1:
                    started.set()
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return (times[0] - sent if times else float("nan")), gaps


async def workload(base: str, model: str, args: argparse.Namespace, round_id: str) -> dict[str, Any]:
    # Each round's prompts start differently: nothing is served from the prefix cache.
    long_prompt = "Paged attention keeps the cache in blocks. " * (args.long_prompt_words // 7)
    async with httpx.AsyncClient(timeout=600) as client:
        events = [asyncio.Event() for _ in range(args.streams)]
        decoders = [
            asyncio.create_task(
                stream_gaps(client, base, model, f"{round_id} story number {i}:", args.new_tokens, events[i])
            )
            for i in range(args.streams)
        ]
        await asyncio.gather(*(e.wait() for e in events))
        longs = await asyncio.gather(
            *(
                stream_gaps(client, base, model, f"{round_id}-{i} {long_prompt}", 2, None)
                for i in range(args.long_prompts)
            )
        )
        decoded = await asyncio.gather(*decoders)
    gaps = [g for _, gs in decoded for g in gs]
    return {
        "tpot_p50_ms": 1000 * percentile(gaps, 0.5),
        "tpot_p99_ms": 1000 * percentile(gaps, 0.99),
        "long_prompt_ttft_p50_ms": 1000 * percentile([t for t, _ in longs], 0.5),
        "num_gaps": len(gaps),
    }


def serve_mode(mode: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    cores = os.cpu_count() or 2
    engine = {"model": args.model, "max_model_len": 2048, "speculative": None}
    app_args: dict[str, Any] = {
        "api_keys": f"{KEY}=bench",
        "replica_num_cpus": 0,
        "engine": {**engine, "num_threads": cores},
    }
    if mode == "disaggregated":
        half = max(1, cores // 2)
        app_args.update(
            mode="disaggregated", engine={**engine, "num_threads": half}, prefill_engine={"num_threads": half}
        )
    serve.run(build_app(app_args), name=mode, route_prefix=f"/{mode}")
    base = f"http://127.0.0.1:{port}/{mode}"
    model = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()[
        "data"
    ][0]["id"]
    asyncio.run(workload(base, model, args, f"warm-up {mode}"))
    result = asyncio.run(workload(base, model, args, f"measured {mode}"))
    serve.delete(mode)
    log(f"{mode}: {result}")
    return result


def handover_bytes(model: str, num_tokens: int) -> dict[str, float]:
    sender = LLMEngine.from_options(
        model, kv_cache_dtype="bfloat16", kv_cache_memory=64 << 20, speculative=None
    )
    prompt = list(range(100, 100 + num_tokens))
    sizes = {}
    for dtype in ("bfloat16", "float8_e4m3fn"):
        request_id = f"bytes-{dtype}"
        sender.add_prefill_request(
            GenerationRequest(request_id, prompt_token_ids=prompt, sampling_params=SamplingParams())
        )
        while sender.has_unfinished_requests():
            sender.step()
        sizes[dtype] = sender.handover.export_kv(request_id, dtype).num_bytes / num_tokens
    return {"bytes_per_token_16bit": sizes["bfloat16"], "bytes_per_token_fp8": sizes["float8_e4m3fn"],
            "fp8_over_16bit": sizes["float8_e4m3fn"] / sizes["bfloat16"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--long-prompts", type=int, default=3)
    parser.add_argument("--long-prompt-words", type=int, default=700)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "disaggregation.json")
    args = parser.parse_args()
    result: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}}
    result["handover"] = handover_bytes(args.model, 256)
    log(f"hand-over: {result['handover']}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for mode in ("colocated", "disaggregated"):
            result[mode] = serve_mode(mode, args, port)
    finally:
        serve.shutdown()
        ray.shutdown()
    result["tpot_p99_colocated_over_disaggregated"] = (
        result["colocated"]["tpot_p99_ms"] / result["disaggregated"]["tpot_p99_ms"]
    )
    write_result(args.out, result)


if __name__ == "__main__":
    main()
