"""What Ray Serve + HTTP add on top of the engine: TTFT and throughput, side by side in one run.

Phase 1 drives an in-process `AsyncEngine` with N concurrent streams; phase 2 drives the same
engine options deployed with `tandem.deployments.app.build_app` on a local Ray, over HTTP with
streaming completions (the same prompt token ids, greedy, EOS ignored). The phases run one after
the other so they do not compete for CPUs. Reports p50/p99 TTFT, tokens/s and the differences.

    python benchmarks/serve_overhead.py                  # 16 streams -> benchmarks/results/
    python benchmarks/serve_overhead.py --streams 4 --new-tokens 32 --model /path/to/model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from common import log, percentile, write_result


def summarise(ttfts: list[float], tokens: int, wall: float) -> dict[str, float]:
    return {
        "ttft_p50_ms": percentile(ttfts, 0.5) * 1000,
        "ttft_p99_ms": percentile(ttfts, 0.99) * 1000,
        "ttft_mean_ms": statistics.mean(ttfts) * 1000,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
    }


async def run_direct(
    engine_options: dict[str, Any], prompts: list[list[int]], new_tokens: int
) -> dict[str, float]:
    from tandem import AsyncEngine, GenerationRequest, SamplingParams

    engine = AsyncEngine.from_options(**engine_options)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int, prompt: list[int], tag: str) -> tuple[float, int]:
        start = time.perf_counter()
        ttft, count = 0.0, 0
        async for out in engine.generate(
            GenerationRequest(f"{tag}{i}", prompt_token_ids=prompt, sampling_params=params)
        ):
            if not count and out.outputs[0].delta_token_ids:
                ttft = time.perf_counter() - start
            count = len(out.outputs[0].token_ids)
        return ttft, count

    try:
        await asyncio.gather(*(one(i, p[:8], "warm") for i, p in enumerate(prompts[:2])))
        start = time.perf_counter()
        results = await asyncio.gather(*(one(i, p, "r") for i, p in enumerate(prompts)))
        wall = time.perf_counter() - start
    finally:
        engine.shutdown()
    return summarise([r[0] for r in results], sum(r[1] for r in results), wall)


async def run_http(base_url: str, model: str, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    import httpx

    headers = {"Authorization": "Bearer sk-bench"}

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> tuple[float, int]:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": new_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        ttft, tokens = 0.0, 0
        async with client.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if not ttft and chunk.get("choices"):
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        return ttft, tokens

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(one(client, p[:8]) for p in prompts[:2]))
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, p) for p in prompts))
        wall = time.perf_counter() - start
    return summarise([r[0] for r in results], sum(r[1] for r in results), wall)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-memory", type=int, default=512 << 20)
    parser.add_argument(
        "--output", type=Path, default=Path(__file__).parent / "results" / "serve_overhead.json"
    )
    args = parser.parse_args()

    engine_options = {
        "model": args.model,
        "kv_cache_memory": args.kv_cache_memory,
        "served_model_name": "bench",
        "enable_prefix_caching": False,  # warm-ups repeat prompts: compare the paths, not cache hits
    }
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (args.streams, args.prompt_len), generator=gen).tolist()

    log(f"phase 1: engine directly, {args.streams} streams x {args.new_tokens} tokens")
    direct = asyncio.run(run_direct(engine_options, prompts, args.new_tokens))
    log(f"direct: ttft p50 {direct['ttft_p50_ms']:.0f} ms, {direct['tokens_per_s']:.1f} tok/s")

    import ray
    from ray import serve

    from tandem.deployments.app import build_app

    log("phase 2: starting local Ray + Serve")
    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(
            build_app({"engine": engine_options, "api_keys": "sk-bench=bench", "replica_num_cpus": 0}),
            name="bench",
            route_prefix="/",
        )
        log(f"phase 2: HTTP through Serve, {args.streams} streams x {args.new_tokens} tokens")
        http = asyncio.run(run_http(f"http://127.0.0.1:{port}", "bench", prompts, args.new_tokens))
        log(f"http: ttft p50 {http['ttft_p50_ms']:.0f} ms, {http['tokens_per_s']:.1f} tok/s")
    finally:
        serve.shutdown()
        ray.shutdown()

    report = {
        "benchmark": "serve_overhead",
        "model": args.model,
        "streams": args.streams,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "torch_threads": torch.get_num_threads(),
        "direct": direct,
        "http": http,
        "added_ttft_p50_ms": http["ttft_p50_ms"] - direct["ttft_p50_ms"],
        "added_ttft_p99_ms": http["ttft_p99_ms"] - direct["ttft_p99_ms"],
        "throughput_ratio_http_over_direct": http["tokens_per_s"] / direct["tokens_per_s"],
    }
    write_result(args.output, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
