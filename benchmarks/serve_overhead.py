"""What Ray Serve and HTTP add on top of the engine: the engine called in this process against the
application graph `tandem serve` runs (Serve's proxy -> ingress deployment -> LLM replica), on the
same model, engine options and prompts.

Phases, each run for every `--streams` value (all requests of a wave start together: streaming
completions of the same prompt token ids, greedy, EOS ignored), `--rounds` times:
- `engine_alone`: the engine in this process before Ray starts (the baseline);
- `engine_beside_ray`: the same engine with Ray and the app up and idle (what Ray's own processes
  cost an engine on the same cores: `ray_idle_throughput_cost`);
- `serve`: over HTTP through the app (alternating with the previous phase).
Reported per streams value, as medians over rounds: p50 TTFT and tokens/s of each phase,
`added_ttft_p50_ms` (serve minus engine_alone) and `throughput_vs_engine` (serve / engine_alone).
Only one phase runs at a time (an idle engine sleeps).

    python benchmarks/serve_overhead.py                      # 1 and 16 streams, 3 rounds
    python benchmarks/serve_overhead.py --engine-threads 1   # one core of two kept for Serve
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import time
from typing import Any

import httpx
import torch

from common import log, percentile, write_result
from tandem import AsyncEngine, GenerationRequest, SamplingParams

KEY = "sk-bench"
Wave = tuple[list[float], int, float]  # per-request TTFT (s), tokens generated, wall seconds


async def engine_wave(engine: AsyncEngine, prompts: list[list[int]], new_tokens: int, tag: str) -> Wave:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> tuple[float, int]:
        start, ttft, count = time.perf_counter(), 0.0, 0
        async for out in engine.generate(
            GenerationRequest(f"{tag}-{i}", prompt_token_ids=prompt, sampling_params=params)
        ):
            if not ttft and out.outputs[0].delta_token_ids:
                ttft = time.perf_counter() - start
            count += len(out.outputs[0].delta_token_ids)
        return ttft, count

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return [r[0] for r in results], sum(r[1] for r in results), time.perf_counter() - start


async def http_wave(base_url: str, model: str, prompts: list[list[int]], new_tokens: int) -> Wave:
    async def one(client: httpx.AsyncClient, prompt: list[int]) -> tuple[float, int]:
        body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
        start, ttft, count = time.perf_counter(), 0.0, 0
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    ttft = ttft or time.perf_counter() - start
                if chunk.get("usage"):  # the last chunk: tokens generated
                    count = chunk["usage"]["completion_tokens"]
        return ttft, count

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=headers) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, p) for p in prompts))
        return [r[0] for r in results], sum(r[1] for r in results), time.perf_counter() - start


def summary(wave: Wave) -> dict[str, float]:
    ttfts, tokens, wall = wave
    return {"ttft_p50_ms": 1000 * percentile(ttfts, 0.5), "tokens_per_s": tokens / wall}


def start_serve(engine_options: dict[str, Any], port: int) -> str:
    import ray
    from ray import serve

    from tandem.deployments.app import build_app

    os.environ.setdefault("RAY_worker_niceness", "0")  # noqa: SIM112 - as `tandem serve` starts them
    ray.init(address="local", include_dashboard=False, configure_logging=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app({"engine": engine_options, "api_keys": f"{KEY}=bench", "replica_num_cpus": 0})
    serve.run(app, name="bench", route_prefix="/")
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while httpx.get(f"{base_url}/health", timeout=30).status_code != 200:  # the replica is loading
        assert time.monotonic() < deadline, "the app did not become ready"
        time.sleep(0.5)
    return base_url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine-threads", type=int, default=None, help="default: every core")
    parser.add_argument("--out", default="benchmarks/results/serve_overhead.json")
    args = parser.parse_args()

    engine_options = {"model": args.model, "kv_cache_memory": 256 << 20, "served_model_name": "bench",
                      "enable_prefix_caching": False,  # rounds repeat prompts: no phase may hit a cache
                      "num_threads": args.engine_threads or os.cpu_count()}  # fmt: skip
    engine = AsyncEngine.from_options(**engine_options)
    gen = torch.Generator().manual_seed(0)
    prompts = {
        n: torch.randint(100, 40000, (n, args.prompt_len), generator=gen).tolist() for n in args.streams
    }
    phases = ("engine_alone", "engine_beside_ray", "serve")
    rounds: dict[int, dict[str, list[dict[str, float]]]] = {n: {p: [] for p in phases} for n in args.streams}

    def engine_round(phase: str, round_index: int) -> None:
        for n in args.streams:
            wave = asyncio.run(engine_wave(engine, prompts[n], args.new_tokens, f"{phase}-{round_index}-{n}"))
            rounds[n][phase].append(summary(wave))
            log(f"round {round_index} streams {n} {phase}: {rounds[n][phase][-1]}")

    for round_index in range(args.rounds):  # before Ray starts: the engine with the machine to itself
        engine_round("engine_alone", round_index)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base_url = start_serve(engine_options, port)
    for round_index in range(args.rounds):  # alternating, with Ray and the app up
        engine_round("engine_beside_ray", round_index)
        for n in args.streams:
            rounds[n]["serve"].append(
                summary(asyncio.run(http_wave(base_url, "bench", prompts[n], args.new_tokens)))
            )
            log(f"round {round_index} streams {n} serve: {rounds[n]['serve'][-1]}")
    result: dict[str, Any] = {
        "benchmark": "serve_overhead",
        "config": vars(args),
        "rounds": rounds,
        "summary": {},
    }
    for n, by_phase in rounds.items():
        median = {
            phase: {key: statistics.median(r[key] for r in runs) for key in ("ttft_p50_ms", "tokens_per_s")}
            for phase, runs in by_phase.items()
        }
        result["summary"][str(n)] = {
            **{f"{phase}_ttft_p50_ms": median[phase]["ttft_p50_ms"] for phase in phases},
            **{f"{phase}_tokens_per_s": median[phase]["tokens_per_s"] for phase in phases},
            "added_ttft_p50_ms": median["serve"]["ttft_p50_ms"] - median["engine_alone"]["ttft_p50_ms"],
            "throughput_vs_engine": median["serve"]["tokens_per_s"] / median["engine_alone"]["tokens_per_s"],
            "ray_idle_throughput_cost": 1
            - median["engine_beside_ray"]["tokens_per_s"] / median["engine_alone"]["tokens_per_s"],
        }
    write_result(args.out, result)
    print(json.dumps(result["summary"], indent=2))
    engine.shutdown()


if __name__ == "__main__":
    main()
