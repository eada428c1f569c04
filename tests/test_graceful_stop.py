"""Graceful stop: a draining server refuses new requests with 503 `shutting_down` and
Retry-After, lets streams in flight finish up to the drain's end, then ends the rest with an
error event and `[DONE]`; a stopped batch worker gives its shards' leases back at once."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tandem import AsyncEngine
from tandem.batch.service import BatchLimits, BatchService
from tandem.batch.worker import BatchWorker
from tandem.deployments.batch_execution import execute_batch_line
from tandem.deployments.engine_clients import LocalEngineClient
from tandem.deployments.ingress import create_app
from tandem.deployments.openai.endpoints import ENDPOINTS
from tandem.deployments.openai.server import OpenAIServer
from tandem.platform.api_keys import parse_keys
from tandem.platform.object_store import FileObjectStore
from tandem.platform.tenancy import TenantRegistry

from .conftest import serve_with_worker, sse_lines

KEY = "sk-drain"
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, OpenAIServer]]:
    root = tmp_path_factory.mktemp("drain")
    engine = AsyncEngine.from_options(str(tiny_model_dir), kv_cache_memory=8 << 20, served_model_name="tiny")
    batches = BatchService(
        FileObjectStore(str(root / "objects")), {"tiny"}, BatchLimits(shard_size=4), endpoints=ENDPOINTS
    )
    server = OpenAIServer(
        LocalEngineClient(engine), TenantRegistry(parse_keys(f"{KEY}=acme")), batches=batches
    )
    worker = BatchWorker(batches, lambda *a: execute_batch_line(server, *a), poll_interval_s=0.05)
    try:
        with serve_with_worker(create_app(server), worker) as base_url:
            yield base_url, server
    finally:
        engine.shutdown()


def test_drain_refuses_new_requests_and_ends_streams_with_done(served: tuple[str, OpenAIServer]) -> None:
    """During a drain: a new request is a 503 `shutting_down` with Retry-After, a stream in
    flight that ends within the drain finishes normally, and one still running at the drain's
    end ends with an error event and `[DONE]`."""
    base_url, server = served
    short: list[str] = []
    long: list[str] = []
    events = [threading.Event(), threading.Event()]
    threads = [
        threading.Thread(target=sse_lines, args=(base_url, KEY, 6, short, events[0])),
        threading.Thread(target=sse_lines, args=(base_url, KEY, 480, long, events[1])),
    ]
    for thread in threads:
        thread.start()
    for event in events:
        assert event.wait(30)
    server.begin_drain(120)
    refused = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": "tiny", "prompt": "x", "max_tokens": 2},
        headers=HEADERS,
        timeout=30,
    )
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert int(refused.headers["retry-after"]) >= 1
    threads[0].join(60)  # the short stream finishes within the drain
    assert short[-1] == "data: [DONE]"
    finishes = [
        json.loads(line[6:])["choices"][0]["finish_reason"] for line in short[:-1] if '"choices":[{' in line
    ]
    assert finishes[-1] == "length"
    assert threads[1].is_alive(), "the long stream ended before the drain did: make it longer"
    server.begin_drain(0)  # the drain's end (a second signal brings it closer)
    threads[1].join(60)
    assert long[-1] == "data: [DONE]"
    last_event = json.loads(long[-2][6:])
    assert last_event["error"]["code"] == "shutting_down"  # ended by the drain, in-band
    assert server.num_in_flight == 0


def test_a_stopped_worker_releases_its_leases_at_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Stopping a worker mid-shard gives the shard's lease back: a second worker claims it right
    away (not after the lease's time) and the batch completes with every line once."""

    async def scenario() -> None:
        engine = AsyncEngine.from_options(
            str(tiny_model_dir), kv_cache_memory=8 << 20, served_model_name="tiny"
        )
        try:
            limits = BatchLimits(shard_size=4, lease_ttl_s=600)  # an expiry would take 10 minutes
            batches = BatchService(
                FileObjectStore(str(tmp_path / "objects")), {"tiny"}, limits, endpoints=ENDPOINTS
            )
            server = OpenAIServer(
                LocalEngineClient(engine), TenantRegistry(parse_keys(f"{KEY}=acme")), batches=batches
            )
            lines = [
                json.dumps(
                    {
                        "custom_id": f"line-{i}",
                        "method": "POST",
                        "url": "/v1/completions",
                        "body": {
                            "model": "tiny",
                            "prompt": f"count {i}",
                            "max_tokens": 60,
                            "ignore_eos": True,
                        },
                    }
                )
                for i in range(8)
            ]
            file = batches.create_file("acme", "input.jsonl", "batch", ("\n".join(lines) + "\n").encode())
            batch = batches.create_batch("acme", file.id, "/v1/completions", "24h")
            first = BatchWorker(
                batches, lambda *a: execute_batch_line(server, *a), poll_interval_s=0.05, worker_id="first"
            )
            run = asyncio.ensure_future(first.run_forever())
            while first.num_shards_in_flight == 0:
                await asyncio.sleep(0.01)
            await first.stop()
            assert batches.get_batch("acme", batch.id).status == "in_progress"
            second = BatchWorker(
                batches, lambda *a: execute_batch_line(server, *a), poll_interval_s=0.05, worker_id="second"
            )
            run2 = asyncio.ensure_future(second.run_forever())
            started = time.monotonic()
            while batches.get_batch("acme", batch.id).status != "completed":
                assert time.monotonic() - started < 120
                await asyncio.sleep(0.05)
            record = batches.get_batch("acme", batch.id)
            assert record.output_file_id is not None
            output = batches.file_content("acme", record.output_file_id).decode().splitlines()
            assert sorted(json.loads(line)["custom_id"] for line in output) == sorted(
                f"line-{i}" for i in range(8)
            )
            for task in (run, run2):
                task.cancel()
            await asyncio.gather(run, run2, return_exceptions=True)
        finally:
            engine.shutdown()

    asyncio.run(scenario())
