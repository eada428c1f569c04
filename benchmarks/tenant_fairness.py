"""Does one tenant's load starve another's? Through `tandem serve` on its defaults, two tenant keys.

Chat (`--part chat`): tenant B alone (`--b-chats` sequential streamed chats, TTFT = the first
content chunk as the client sees it; then one `--b-long-tokens` stream, its duration); then
tenant A keeps `--flood` streams open (closed loop: each stream of `--flood-tokens` tokens is
followed by another; a 429 is honoured by waiting its Retry-After, with jitter), and after
`--warmup-s` the fleet's real-time tokens/s is read from `/metrics` over `--window-s` (A alone);
then B repeats its chats and long stream during the flood, and tokens/s is read over that time
(A + B). Reported: B's TTFT p50/p99 under the flood against alone, the long stream's duration,
A's 429s, and total tokens/s of the two windows.

Batch (`--part batch`): A submits a `--a-lines`-line batch (`max_tokens` 1); `--b-delay-s`
later B submits an 8-line batch; B's time from submission to `completed` is reported; then (with
`--wait-all`) A's batch is awaited and both output files are checked: every custom_id answered
exactly once.

Weights (`--part weights`): the operator API creates tenants "gold" (weight 2) and "silver"
(weight 1), each allowed `--weight-streams` requests at once, and issues their keys. Real time:
both keep `--weight-streams` streams of `--weight-tokens` tokens open; after `--warmup-s`, the
completion tokens of each tenant's streams that end within `--window-s` are summed (from each
stream's usage chunk). Batch: both submit a `--weight-lines`-line batch at once; after
`--warmup-s`, the lines each completes within `--window-s` are counted (shard commits). Reported:
gold's share over silver's, against the 2.0 the weights ask for.

    python benchmarks/tenant_fairness.py                       # chat and batch -> benchmarks/results/
    python benchmarks/tenant_fairness.py --part batch --a-lines 20000 --wait-all
    python benchmarks/tenant_fairness.py --part weights
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import tempfile
import time
from typing import Any

import httpx

from common import free_port, log, percentile, start_server, stop_server, write_result

KEY_A, KEY_B = "sk-bench-tenant-a", "sk-bench-tenant-b"
OPERATOR_KEY = "sk-op-bench-fairness"
MODEL = "smollm2-135m-instruct"
TOPICS = ["rivers", "old maps", "bread", "the moon", "chess", "bees", "winter", "trains", "jazz", "tea"]


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _chat(i: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": f"Tell me something about {TOPICS[i % len(TOPICS)]} ({i})."}
        ],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "ignore_eos": True,
        "stream": True,
    }


async def _stream(client: httpx.AsyncClient, key: str, body: dict[str, Any]) -> tuple[int, float, float]:
    """One streamed chat: (status, seconds to the first content chunk, seconds to the end);
    a non-200 returns at once with its Retry-After (or 1) as the third value."""
    started = time.perf_counter()
    first = None
    async with client.stream("POST", "/chat/completions", json=body, headers=_headers(key)) as reply:
        if reply.status_code != 200:
            await reply.aread()
            return reply.status_code, 0.0, float(reply.headers.get("retry-after", 1.0))
        async for line in reply.aiter_lines():
            if first is None and line.startswith("data: {") and '"content":"' in line:
                first = time.perf_counter() - started
    return 200, first if first is not None else float("nan"), time.perf_counter() - started


async def _tokens(client: httpx.AsyncClient) -> float:
    """Real-time tokens the engines generated so far (`/metrics`, as the replicas last reported)."""
    reply = await client.get("/metrics", headers=_headers(OPERATOR_KEY))
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in reply.text.splitlines()
        if line.startswith("tandem_engine_output_tokens_interactive_total")
    )


async def _b_session(client: httpx.AsyncClient, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    ttfts = []
    for i in range(args.b_chats):
        status, ttft, _ = await _stream(client, KEY_B, _chat(i, args.b_chat_tokens))
        assert status == 200, f"B's chat got {status}"
        ttfts.append(ttft)
    status, _, long_s = await _stream(client, KEY_B, _chat(99, args.b_long_tokens))
    assert status == 200, f"B's long stream got {status}"
    result = {
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "ttft_s": [round(t, 4) for t in ttfts],
        "long_stream_s": long_s,
    }
    log(f"B {tag}: TTFT p50 {result['ttft_p50_s']:.3f}s p99 {result['ttft_p99_s']:.3f}s, "
        f"{args.b_long_tokens}-token stream {long_s:.1f}s")  # fmt: skip
    return result


async def chat_part(base: str, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.flood + 16, max_keepalive_connections=args.flood + 16)
    async with (
        httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client,
        httpx.AsyncClient(base_url=base.removesuffix("/v1"), timeout=30) as ops,
    ):
        await _b_session(client, argparse.Namespace(**{**vars(args), "b_chats": 3}), "warm-up")
        alone = await _b_session(client, args, "alone")
        stop = asyncio.Event()
        counts = {"ok": 0, "429": 0, "other": 0}

        async def flooder(i: int) -> None:
            while not stop.is_set():
                try:
                    status, _, retry_after = await _stream(client, KEY_A, _chat(i, args.flood_tokens))
                except httpx.HTTPError:
                    counts["other"] += 1
                    continue
                if status == 200:
                    counts["ok"] += 1
                    continue
                counts["429" if status == 429 else "other"] += 1
                await asyncio.sleep(retry_after * random.uniform(0.5, 1.5))

        flood = [asyncio.ensure_future(flooder(i)) for i in range(args.flood)]
        await asyncio.sleep(args.warmup_s)
        before, started = await _tokens(ops), time.perf_counter()
        await asyncio.sleep(args.window_s)
        a_alone_tps = (await _tokens(ops) - before) / (time.perf_counter() - started)
        rejected_before = counts["429"]
        before, started = await _tokens(ops), time.perf_counter()
        under = await _b_session(client, args, "during A's flood")
        both_tps = (await _tokens(ops) - before) / (time.perf_counter() - started)
        stop.set()
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    result = {
        "b_alone": alone,
        "b_under_flood": under,
        "ttft_p50_ratio": under["ttft_p50_s"] / alone["ttft_p50_s"],
        "ttft_p99_ratio_to_alone_p99": under["ttft_p99_s"] / alone["ttft_p99_s"],
        "long_stream_ratio": under["long_stream_s"] / alone["long_stream_s"],
        "tokens_per_s_a_alone": a_alone_tps,
        "tokens_per_s_a_and_b": both_tps,
        "tokens_per_s_ratio": both_tps / a_alone_tps,
        "a_streams": counts,
        "a_429s_during_b": counts["429"] - rejected_before,
    }
    log(f"TTFT p50 x{result['ttft_p50_ratio']:.2f}, p99 x{result['ttft_p99_ratio_to_alone_p99']:.2f}; "
        f"tok/s {a_alone_tps:.1f} (A) -> {both_tps:.1f} (A+B) = x{result['tokens_per_s_ratio']:.3f}; A: {counts}")  # fmt: skip
    return result


def _upload(client: httpx.Client, key: str, name: str, lines: list[dict[str, Any]]) -> str:
    data = io.BytesIO("".join(json.dumps(line) + "\n" for line in lines).encode())
    reply = client.post(
        "/files", headers=_headers(key), data={"purpose": "batch"}, files={"file": (name, data)}
    )
    reply.raise_for_status()
    file_id = reply.json()["id"]
    reply = client.post(
        "/batches", headers=_headers(key),
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )  # fmt: skip
    reply.raise_for_status()
    return str(reply.json()["id"])


def _batch_lines(tenant: str, n: int) -> list[dict[str, Any]]:
    return [
        {"custom_id": f"{tenant}-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": MODEL, "max_tokens": 1,
                  "messages": [{"role": "user", "content": f"Say one word about {TOPICS[i % len(TOPICS)]} {i}."}]}}
        for i in range(n)
    ]  # fmt: skip


def _answered_once(client: httpx.Client, key: str, batch: dict[str, Any], expected: int, tenant: str) -> bool:
    ids: list[str] = []
    for field in ("output_file_id", "error_file_id"):
        if batch.get(field):
            text = client.get(f"/files/{batch[field]}/content", headers=_headers(key)).text
            ids += [json.loads(line)["custom_id"] for line in text.splitlines() if line]
    return sorted(ids) == sorted(f"{tenant}-{i}" for i in range(expected))


def batch_part(base: str, args: argparse.Namespace) -> dict[str, Any]:
    with httpx.Client(base_url=base, timeout=120) as client:

        def status(key: str, batch_id: str) -> dict[str, Any]:
            return dict(client.get(f"/batches/{batch_id}", headers=_headers(key)).json())

        a_id = _upload(client, KEY_A, "a.jsonl", _batch_lines("a", args.a_lines))
        a_started = time.monotonic()
        log(f"A submitted {args.a_lines} lines ({a_id}); B submits 8 in {args.b_delay_s:.0f}s")
        time.sleep(args.b_delay_s)  # the arrival of B's batch, not synchronisation
        b_id = _upload(client, KEY_B, "b.jsonl", _batch_lines("b", 8))
        b_started = time.monotonic()
        while (b := status(KEY_B, b_id))["status"] not in ("completed", "failed", "cancelled", "expired"):
            if time.monotonic() - b_started > 1800:
                raise RuntimeError("B's batch did not complete within 30 minutes")
            time.sleep(0.5)
        b_seconds = time.monotonic() - b_started
        a = status(KEY_A, a_id)
        log(
            f"B's 8-line batch {b['status']} in {b_seconds:.1f}s; A at {a['request_counts']['completed']}/{args.a_lines}"
        )
        result: dict[str, Any] = {
            "b_completed_s": b_seconds,
            "b_status": b["status"],
            "b_answered_once": _answered_once(client, KEY_B, b, 8, "b"),
            "a_lines_done_when_b_completed": a["request_counts"]["completed"] + a["request_counts"]["failed"],
        }
        if args.wait_all:
            last = time.monotonic()
            while (a := status(KEY_A, a_id))["status"] not in ("completed", "failed", "cancelled", "expired"):
                if time.monotonic() - last > 30:
                    last = time.monotonic()
                    log(f"A: {a['request_counts']['completed']}/{args.a_lines} lines")
                time.sleep(2.0)
            result.update(
                a_status=a["status"],
                a_seconds=time.monotonic() - a_started,
                a_answered_once=_answered_once(client, KEY_A, a, args.a_lines, "a"),
            )
            log(
                f"A {a['status']} in {result['a_seconds']:.0f}s; every line answered once: {result['a_answered_once']}"
            )
        else:
            client.post(f"/batches/{a_id}/cancel", headers=_headers(KEY_A))
    return result


def _admin(client: httpx.Client, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    reply = client.request(method, f"/admin{path}", headers=_headers(OPERATOR_KEY), **kwargs)
    reply.raise_for_status()
    return dict(reply.json())


def _weighted_tenants(base: str, streams: int) -> dict[str, str]:
    """Tenants gold (weight 2) and silver (weight 1) through the operator API: name -> key."""
    keys = {}
    with httpx.Client(base_url=base, timeout=60) as client:
        for name, weight in (("gold", 2.0), ("silver", 1.0)):
            _admin(client, "POST", "/tenants", json={"id": name, "weight": weight,
                                                      "limits": {"max_concurrent_requests": streams}})  # fmt: skip
            keys[name] = str(_admin(client, "POST", f"/tenants/{name}/keys", json={"name": "bench"})["key"])
    return keys


async def weights_chat(base: str, keys: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(
        max_connections=4 * args.weight_streams, max_keepalive_connections=4 * args.weight_streams
    )
    window: dict[str, float] = {}
    tokens = {name: 0 for name in keys}
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:

        async def streamer(name: str, i: int) -> None:
            body = {**_chat(i, args.weight_tokens), "stream_options": {"include_usage": True}}
            while not stop.is_set():
                used = 0
                async with client.stream(
                    "POST", "/chat/completions", json=body, headers=_headers(keys[name])
                ) as reply:
                    if reply.status_code != 200:
                        await reply.aread()
                        await asyncio.sleep(float(reply.headers.get("retry-after", 1.0)))
                        continue
                    async for line in reply.aiter_lines():
                        if line.startswith("data: {") and '"usage":{' in line:
                            usage = json.loads(line[6:]).get("usage") or {}
                            used = int(usage.get("completion_tokens") or 0)
                ended = time.monotonic()
                if window and window["start"] <= ended < window["end"]:
                    tokens[name] += used

        tasks = [
            asyncio.ensure_future(streamer(name, i)) for name in keys for i in range(args.weight_streams)
        ]
        await asyncio.sleep(args.warmup_s)
        window.update(start=time.monotonic(), end=time.monotonic() + args.window_s)
        await asyncio.sleep(args.window_s)
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    share = tokens["gold"] / max(1, tokens["silver"])
    log(
        f"real time over {args.window_s:.0f}s: gold {tokens['gold']} tokens, silver {tokens['silver']}: {share:.2f}x"
    )
    return {"tokens": tokens, "gold_over_silver": share, "window_s": args.window_s}


def weights_batch(base: str, keys: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    with httpx.Client(base_url=base, timeout=120) as client:
        ids = {
            name: _upload(client, key, f"{name}.jsonl", _batch_lines(name, args.weight_lines))
            for name, key in keys.items()
        }

        def done() -> dict[str, int]:
            counts = {}
            for name, batch_id in ids.items():
                batch = client.get(f"/batches/{batch_id}", headers=_headers(keys[name])).json()
                counts[name] = batch["request_counts"]["completed"] + batch["request_counts"]["failed"]
            return counts

        time.sleep(args.warmup_s)  # both batches running: the measurement starts after this
        before = done()
        time.sleep(args.window_s)
        after = done()
        for name, batch_id in ids.items():
            client.post(f"/batches/{batch_id}/cancel", headers=_headers(keys[name]))
    lines = {name: after[name] - before[name] for name in keys}
    share = lines["gold"] / max(1, lines["silver"])
    log(
        f"batch over {args.window_s:.0f}s: gold {lines['gold']} lines, silver {lines['silver']}: {share:.2f}x"
    )
    return {"lines": lines, "gold_over_silver": share, "window_s": args.window_s}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=["chat", "batch", "both", "weights"], default="both")
    parser.add_argument("--weight-streams", type=int, default=64, help="weights: each tenant's streams")
    parser.add_argument("--weight-tokens", type=int, default=32, help="weights: tokens per stream")
    parser.add_argument(
        "--weight-lines", type=int, default=4000, help="weights: lines of each tenant's batch"
    )
    parser.add_argument("--flood", type=int, default=150, help="A's concurrent streams")
    parser.add_argument("--flood-tokens", type=int, default=300)
    parser.add_argument("--b-chats", type=int, default=20)
    parser.add_argument("--b-chat-tokens", type=int, default=16)
    parser.add_argument("--b-long-tokens", type=int, default=300)
    parser.add_argument("--warmup-s", type=float, default=20.0)
    parser.add_argument("--window-s", type=float, default=40.0)
    parser.add_argument("--a-lines", type=int, default=20000)
    parser.add_argument("--b-delay-s", type=float, default=15.0)
    parser.add_argument("--wait-all", action="store_true", help="wait for A's batch and check both outputs")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `tandem serve` argument")
    parser.add_argument("--out", default="benchmarks/results/tenant_fairness.json")
    args = parser.parse_args()
    env = {"TANDEM_API_KEYS": f"{KEY_A}=tenant-a,{KEY_B}=tenant-b", "TANDEM_OPERATOR_KEYS": OPERATOR_KEY}
    result: dict[str, Any] = {"args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="tandem-fairness-") as data_dir:
        server, base = start_server(data_dir, free_port(), env, tuple(args.serve_arg))
        try:
            if args.part in ("chat", "both"):
                result["chat"] = asyncio.run(chat_part(base, args))
            if args.part in ("batch", "both"):
                result["batch"] = batch_part(base, args)
            if args.part == "weights":
                keys = _weighted_tenants(base, args.weight_streams)
                result["weights_chat"] = asyncio.run(weights_chat(base, keys, args))
                result["weights_batch"] = weights_batch(base, keys, args)
        finally:
            stop_server(server)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
