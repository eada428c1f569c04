"""What usage metering costs a response: `tandem serve` on its defaults, metered and not.

The same workload runs against servers started one after another in this run, alternating
`--rounds` times between one with `--no-usage-metering` and one metered (`--usage-commit-interval`,
default 0.1 s), so that a drift of the shared machine's speed falls on both; medians over rounds. Each server gets
`--requests` non-streamed chat requests of `--max-tokens` tokens at `--concurrency` (closed loop),
then as many streamed ones with `include_usage`. Reported per server: non-streamed latency
p50/p95, the streamed requests' tail (from the last content chunk to the end of the stream:
where the metered server waits for its record), and requests/s; the metered server's usage
objects and records; the ratios metered / not.

    python benchmarks/usage_overhead.py                          # -> benchmarks/results/usage_overhead.json
    python benchmarks/usage_overhead.py --usage-commit-interval 0.02
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from typing import Any

import httpx

from common import free_port, log, percentile, start_server, stop_server, write_result

KEY = "sk-bench-usage"
MODEL = "smollm2-135m-instruct"


async def _one(
    client: httpx.AsyncClient, base: str, i: int, max_tokens: int, stream: bool
) -> tuple[float, float]:
    """(latency, tail) of one request: tail is the time after its last content chunk (0 unstreamed)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Say something about the number {i}."}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    started = time.monotonic()
    if not stream:
        reply = await client.post(f"{base}/chat/completions", json=body)
        reply.raise_for_status()
        return time.monotonic() - started, 0.0
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    last_content = started
    async with client.stream("POST", f"{base}/chat/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                last_content = time.monotonic()
    ended = time.monotonic()
    return ended - started, ended - last_content


async def _workload(base: str, args: argparse.Namespace, stream: bool) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(headers=headers, timeout=300) as client:
        await _one(client, base, -1, args.max_tokens, stream)  # warm
        queue = list(range(args.requests))
        results: list[tuple[float, float]] = []

        async def worker() -> None:
            while queue:
                results.append(await _one(client, base, queue.pop(), args.max_tokens, stream))

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.monotonic() - started
    latencies = [r[0] for r in results]
    tails = [r[1] for r in results]
    out = {
        "latency_p50_s": percentile(latencies, 0.5),
        "latency_p95_s": percentile(latencies, 0.95),
        "requests_per_s": len(results) / wall,
    }
    if stream:
        out |= {"tail_p50_s": percentile(tails, 0.5), "tail_p95_s": percentile(tails, 0.95)}
    return out


def _run_server(args: argparse.Namespace, metered: bool) -> dict[str, Any]:
    data_dir = tempfile.mkdtemp(prefix="tandem-usage-bench-")
    flags: tuple[str, ...] = ("--usage-commit-interval", str(args.usage_commit_interval))
    if not metered:
        flags = ("--no-usage-metering",)
    server, base = start_server(data_dir, free_port(), {"TANDEM_API_KEYS": f"{KEY}=bench"}, flags)
    try:
        log(f"{'metered' if metered else 'not metered'}: non-streamed")
        unstreamed = asyncio.run(_workload(base, args, stream=False))
        log(f"{'metered' if metered else 'not metered'}: streamed")
        streamed = asyncio.run(_workload(base, args, stream=True))
    finally:
        stop_server(server)
    result: dict[str, Any] = {"non_streamed": unstreamed, "streamed": streamed}
    usage_dir = os.path.join(data_dir, "objects", "usage")
    if metered:
        objects = [os.path.join(d, f) for d, _, files in os.walk(usage_dir) for f in files]
        import pyarrow.parquet as pq

        result["usage_objects"] = len(objects)
        result["usage_records"] = sum(pq.read_metadata(path).num_rows for path in objects)
    return result


def _median_run(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds (usage counts summed)."""
    import statistics

    out: dict[str, Any] = {}
    for part in ("non_streamed", "streamed"):
        out[part] = {key: statistics.median(r[part][key] for r in results) for key in results[0][part]}
    for key in ("usage_objects", "usage_records"):
        if key in results[0]:
            out[key] = sum(r[key] for r in results)
    out["rounds"] = results
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--usage-commit-interval", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/usage_overhead.json")
    args = parser.parse_args()
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for round_index in range(args.rounds):
        for metered_run in (False, True) if round_index % 2 == 0 else (True, False):
            runs[metered_run].append(_run_server(args, metered=metered_run))
    plain, metered = _median_run(runs[False]), _median_run(runs[True])
    ratios = {
        "non_streamed_latency_p50": metered["non_streamed"]["latency_p50_s"]
        / plain["non_streamed"]["latency_p50_s"],
        "non_streamed_requests_per_s": metered["non_streamed"]["requests_per_s"]
        / plain["non_streamed"]["requests_per_s"],
        "streamed_latency_p50": metered["streamed"]["latency_p50_s"] / plain["streamed"]["latency_p50_s"],
    }
    result = {
        "args": vars(args),
        "not_metered": plain,
        "metered": metered,
        "ratios_metered_over_not": ratios,
    }
    write_result(args.out, result)
    log(f"metered / not: {ratios}")


if __name__ == "__main__":
    main()
