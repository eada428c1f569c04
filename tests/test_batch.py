"""Batch API: object stores (file:// and a real S3 server), leases, validation, the whole flow
through the official openai client, cancel, expiry, duplicate commits and a killed worker."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from tandem import AsyncEngine
from tandem.batch.leases import LeaseManager
from tandem.batch.lines import ExecutedRequest
from tandem.batch.records import batch_data_prefix, result_shard_key
from tandem.batch.service import BatchLimits, BatchService
from tandem.batch.validation import validate_batch_file
from tandem.batch.worker import BatchWorker
from tandem.deployments.batch_execution import execute_batch_line
from tandem.deployments.ingress import create_app
from tandem.deployments.local import local_platform
from tandem.deployments.openai.endpoints import ENDPOINTS
from tandem.platform.api_keys import parse_keys
from tandem.platform.object_store import (
    FileObjectStore,
    ObjectNotFound,
    ObjectStore,
    PreconditionFailed,
    S3ObjectStore,
)
from tandem.platform.tenancy import TenantRegistry

from .conftest import S3_BUCKET

KEY_A, KEY_B = "sk-batch-a", "sk-batch-b"
CHAT = "/v1/chat/completions"


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "file":
        return FileObjectStore(str(tmp_path / "objects"))
    settings = request.getfixturevalue("s3_server")
    return S3ObjectStore(S3_BUCKET, prefix=f"test-{uuid.uuid4().hex[:8]}", settings=settings)


# -- object store and leases ----------------------------------------------------------------------
def test_object_store_conditional_writes(store: ObjectStore) -> None:
    first = store.put("a/b.json", b"1", if_none_match=True)
    with pytest.raises(PreconditionFailed):
        store.put("a/b.json", b"2", if_none_match=True)  # put-if-absent: the second writer loses
    assert store.get("a/b.json").data == b"1"
    second = store.put("a/b.json", b"3", if_match=first)  # compare-and-swap on the current etag
    with pytest.raises(PreconditionFailed):
        store.put("a/b.json", b"4", if_match=first)  # a stale etag loses
    assert store.get("a/b.json").data == b"3" and store.head("a/b.json") == second
    store.put("a/c/d", b"x")
    store.put("b/e", b"y")
    assert store.list("a/") == ["a/b.json", "a/c/d"]
    store.delete("a/b.json")
    assert store.head("a/b.json") is None and store.list("a/") == ["a/c/d"]
    with pytest.raises(ObjectNotFound):
        store.get("a/b.json")
    with pytest.raises(ValueError):
        store.put("../escape", b"")


def test_lease_has_one_owner_until_it_expires(store: ObjectStore) -> None:
    one = LeaseManager(store, "worker-1", ttl_s=1.0)
    two = LeaseManager(store, "worker-2", ttl_s=1.0)
    lease = one.try_claim("leases/shard-0")
    assert lease is not None and two.try_claim("leases/shard-0") is None
    assert one.renew(lease) and two.try_claim("leases/shard-0") is None
    deadline = time.monotonic() + 10
    while one.is_live("leases/shard-0"):  # wait for the expiry itself
        assert time.monotonic() < deadline
        time.sleep(0.05)
    taken = two.try_claim("leases/shard-0")
    assert taken is not None and taken.owner == "worker-2"
    assert not one.renew(lease), "the old owner must learn that it lost the lease"
    two.release(taken)
    assert not two.is_live("leases/shard-0") and one.try_claim("leases/shard-0") is not None


# -- validation -----------------------------------------------------------------------------------
def _line(custom_id: str, content: str = "Hello", model: str = "tiny", url: str = CHAT, **body: Any) -> str:
    request = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": request})


def test_validation_reports_every_bad_line_of_the_file_with_its_number() -> None:
    """Problems with the file fail the batch, every one with its line; a body the endpoint would
    refuse is not the file's problem: that line runs (and gets its 400 then)."""
    lines = [
        _line("ok-1"),
        "this is not json",
        "[1, 2]",
        json.dumps({"method": "POST", "url": CHAT, "body": {}}),
        _line("ok-1"),
        _line("ok-2", url="/v1/completions"),
        _line("ok-3", model="other"),
        _line("ok-4", temperature=-1),
        _line("ok-5", logit_bias={"1": 2}),
        _line("ok-6", model="tiny:some-adapter"),
        json.dumps({"custom_id": "no-model", "method": "POST", "url": CHAT, "body": {"messages": []}}),
    ]
    checked = validate_batch_file("\n".join(lines).encode(), CHAT, {"tiny", "other"}, ENDPOINTS)
    by_line = {e.line: e for e in checked.errors}
    assert sorted(by_line) == [2, 3, 4, 5, 6, 7, 11]
    assert by_line[2].code == "invalid_json_line"
    assert by_line[4].param == "custom_id"
    assert by_line[5].code == "duplicate_custom_id" and "line 1" in by_line[5].message
    assert by_line[6].code == "invalid_url"
    assert by_line[7].code == "mismatched_model"
    assert by_line[11].param == "body.model"
    assert [i.custom_id for i in checked.inputs] == ["ok-1", "ok-4", "ok-5", "ok-6"]
    unknown = validate_batch_file(_line("x", model="nope").encode(), CHAT, {"tiny"}, ENDPOINTS)
    assert unknown.errors[0].code == "model_not_found"


# -- the API with the openai client, in-process -------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[AsyncEngine]:
    eng = AsyncEngine.from_options(str(tiny_model_dir), kv_cache_memory=8 << 20, served_model_name="tiny")
    yield eng
    eng.shutdown()


class Platform:
    """The app plus one batch worker running in the app's event loop."""

    def __init__(self, http: TestClient, service: BatchService, worker: BatchWorker) -> None:
        self.http, self.service, self.worker = http, service, worker

    def client(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(
            base_url="http://testserver/v1", api_key=key, http_client=self.http, max_retries=0
        )


@pytest.fixture()
def make_platform(engine: AsyncEngine) -> Iterator[Callable[..., Platform]]:
    stack: list[Any] = []

    def make(store: ObjectStore, *, start_worker: bool = True, **limits: Any) -> Platform:
        tenants = TenantRegistry(parse_keys(f"{KEY_A}=acme,{KEY_B}=globex"))
        local = local_platform(
            engine, store, tenants, batch_limits=BatchLimits(**{"shard_size": 4, "lease_ttl_s": 5.0, **limits}),
            worker_id="in-process",
        )  # fmt: skip
        service, worker = local.batches, local.worker
        http = TestClient(create_app(local.server))
        http.__enter__()
        stack.append(http)
        if start_worker:
            stack.append(http.portal.start_task_soon(worker.run_forever))
        return Platform(http, service, worker)

    yield make
    for item in reversed(stack):
        if isinstance(item, TestClient):
            item.__exit__(None, None, None)
        else:
            item.cancel()


def wait_for(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float = 180.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}"
        time.sleep(0.05)


def _output_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def _upload(client: openai.OpenAI, lines: list[str]) -> str:
    data = ("\n".join(lines) + "\n").encode()
    return client.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose="batch").id


PROMPTS = [f"Tell me about item number {i}" for i in range(10)]


def test_batch_flow_through_openai_client(store: ObjectStore, make_platform: Callable[..., Platform]) -> None:
    platform = make_platform(store)
    client = platform.client()
    lines = [_line(f"req-{i}", p, temperature=0, max_tokens=6) for i, p in enumerate(PROMPTS)]
    lines.append(_line("too-long", "word " * 5000))  # fails at run time: the error file gets it
    file_id = _upload(client, lines)
    assert client.files.retrieve(file_id).purpose == "batch"
    assert file_id in [f.id for f in client.files.list().data]
    batch = client.batches.create(
        input_file_id=file_id, endpoint=CHAT, completion_window="24h", metadata={"job": "nightly"}
    )
    assert batch.status in ("in_progress", "completed") and batch.metadata == {"job": "nightly"}
    batch = wait_for(client, batch.id, {"completed", "failed"})
    assert batch.status == "completed", batch.errors
    assert batch.request_counts.total == 11
    assert (batch.request_counts.completed, batch.request_counts.failed) == (10, 1)
    assert batch.usage.output_tokens == 60 and batch.completed_at >= batch.created_at

    output = _output_lines(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(f"req-{i}" for i in range(10))  # each once
    errors = _output_lines(client, batch.error_file_id)
    assert [e["custom_id"] for e in errors] == ["too-long"]
    assert errors[0]["response"]["status_code"] == 400 and errors[0]["error"] is None
    assert errors[0]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    # A batch answer is the same as the real-time answer to the same greedy request.
    by_id = {o["custom_id"]: o for o in output}
    for i in (0, 7):
        realtime = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": PROMPTS[i]}], max_tokens=6, temperature=0
        )
        body = by_id[f"req-{i}"]["response"]["body"]
        assert by_id[f"req-{i}"]["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == realtime.choices[0].message.content
    # Results came from Parquet shards in the store.
    keys = store.list(batch_data_prefix("acme", batch.id))
    assert sum("/input/" in k for k in keys) == 3 and sum("/results/" in k for k in keys) == 3


def test_batch_listing_errors_and_tenant_isolation(
    make_platform: Callable[..., Platform], tmp_path: Path
) -> None:
    platform = make_platform(
        FileObjectStore(str(tmp_path / "objects")), max_file_bytes=20_000, max_file_lines=50
    )
    a, b = platform.client(KEY_A), platform.client(KEY_B)
    file_id = _upload(a, [_line("x", max_tokens=2)])
    ids = [
        a.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id for _ in range(3)
    ]
    page = a.batches.list(limit=2)
    assert [x.id for x in page.data] == ids[::-1][:2] and page.has_more
    rest = a.batches.list(limit=2, after=page.data[-1].id)
    assert [x.id for x in rest.data] == [ids[0]] and not rest.has_more
    # Another tenant sees none of it.
    assert b.batches.list().data == [] and b.files.list().data == []
    with pytest.raises(openai.NotFoundError):
        b.batches.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        b.batches.cancel(ids[0])
    with pytest.raises(openai.NotFoundError):
        b.files.content(file_id)
    with pytest.raises(openai.NotFoundError):
        b.files.delete(file_id)
    with pytest.raises(openai.NotFoundError):
        a.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
    # Finished batches cannot be cancelled.
    done = wait_for(a, ids[0], {"completed"})
    with pytest.raises(openai.ConflictError):
        a.batches.cancel(done.id)
    # Limits: size and line count are 413; a bad endpoint is 400.
    with pytest.raises(openai.APIStatusError) as too_big:
        _upload(a, ["x" * 30_000])
    assert too_big.value.status_code == 413
    with pytest.raises(openai.APIStatusError) as too_many:
        _upload(a, [_line(f"l{i}") for i in range(60)])
    assert too_many.value.status_code == 413
    with pytest.raises(
        openai.BadRequestError
    ) as bad_endpoint:  # not served here (Anthropic's has its own batches)
        a.batches.create(input_file_id=file_id, endpoint="/v1/messages", completion_window="24h")  # type: ignore[arg-type]
    assert bad_endpoint.value.param == "endpoint" and "/v1/embeddings" in bad_endpoint.value.message
    # A file with invalid lines makes a failed batch that lists them.
    bad = _upload(a, [_line("x"), "not json", _line("x")])
    failed = a.batches.create(input_file_id=bad, endpoint=CHAT, completion_window="24h")
    assert failed.status == "failed" and failed.failed_at is not None
    assert [(e.line, e.code) for e in failed.errors.data] == [
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
    ]
    # Deleting a file removes it.
    assert a.files.delete(bad).deleted
    with pytest.raises(openai.NotFoundError):
        a.files.retrieve(bad)


def test_cancel_keeps_partial_results(make_platform: Callable[..., Platform], tmp_path: Path) -> None:
    platform = make_platform(FileObjectStore(str(tmp_path / "objects")), shard_size=2)
    client = platform.client()
    lines = [_line(f"c{i}", f"Count to {i}", max_tokens=24, ignore_eos=True) for i in range(40)]
    batch = client.batches.create(
        input_file_id=_upload(client, lines), endpoint=CHAT, completion_window="24h"
    )
    deadline = time.monotonic() + 120
    while not platform.service.get_batch("acme", batch.id).shard_counts:  # let one shard finish
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert client.batches.cancel(batch.id).status == "cancelling"
    batch = wait_for(client, batch.id, {"cancelled"})
    output = _output_lines(client, batch.output_file_id)
    ids = [o["custom_id"] for o in output]
    assert len(ids) == len(set(ids)) and set(ids) <= {f"c{i}" for i in range(40)}
    assert 2 <= len(ids) < 40, "partial results are kept and the rest never ran"
    assert batch.request_counts.completed == len(ids) and batch.cancelled_at is not None


def test_expired_batch_reports_unrun_requests(make_platform: Callable[..., Platform], tmp_path: Path) -> None:
    platform = make_platform(FileObjectStore(str(tmp_path / "objects")), completion_window_s=0.001)
    client = platform.client()
    lines = [_line(f"e{i}") for i in range(5)]
    batch = client.batches.create(
        input_file_id=_upload(client, lines), endpoint=CHAT, completion_window="24h"
    )
    batch = wait_for(client, batch.id, {"expired"})
    errors = _output_lines(client, batch.error_file_id)
    assert sorted(e["custom_id"] for e in errors) == [f"e{i}" for i in range(5)]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"} and batch.request_counts.failed == 5


def test_second_commit_of_a_shard_is_discarded(
    make_platform: Callable[..., Platform], tmp_path: Path
) -> None:
    """Two workers run the same shard (the first one's lease expired while it was still working):
    the first commit wins, the second copy is dropped, and the output holds each request once."""
    import anyio

    store = FileObjectStore(str(tmp_path / "objects"))
    platform = make_platform(store, start_worker=False, shard_size=8, lease_ttl_s=0.5)
    client = platform.client()
    lines = [_line(f"d{i}", max_tokens=3) for i in range(4)]
    batch = client.batches.create(
        input_file_id=_upload(client, lines), endpoint=CHAT, completion_window="24h"
    )
    record = platform.service.get_batch("acme", batch.id)
    other = BatchWorker(platform.service, platform.worker.execute, worker_id="other")

    async def race() -> None:
        first = platform.worker.shards.claim(record)
        assert first is not None
        while platform.worker.leases.is_live(first[0].key):  # the first worker stalls past its lease
            await anyio.sleep(0.05)
        second = other.shards.claim(record)
        assert second is not None and second[1] == first[1]
        await other.shards.run(record, *second)
        await platform.worker.shards.run(record, *first)  # the stalled worker finishes and commits

    platform.http.portal.call(race)
    assert other.num_duplicate_commits == 0 and platform.worker.num_duplicate_commits == 1
    platform.http.portal.call(platform.worker.run_once)  # finalize
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.request_counts.completed == 4
    assert sorted(o["custom_id"] for o in _output_lines(client, done.output_file_id)) == [
        f"d{i}" for i in range(4)
    ]


def test_killed_worker_process_loses_nothing(
    make_platform: Callable[..., Platform], tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A worker process is SIGKILLed mid-job; another worker finishes it. Every custom_id is
    answered exactly once, and only shards the dead worker had not committed run again."""
    store = FileObjectStore(str(tmp_path / "objects"))
    platform = make_platform(store, start_worker=False, shard_size=3, lease_ttl_s=2.0)
    client = platform.client()
    lines = [_line(f"k{i}", f"Story {i}", max_tokens=12, ignore_eos=True) for i in range(18)]
    batch = client.batches.create(
        input_file_id=_upload(client, lines), endpoint=CHAT, completion_window="24h"
    )
    record = platform.service.get_batch("acme", batch.id)
    cmd = [
        sys.executable, "-m", "tandem.cli", "batch", "worker", "--object-store", store.url,
        "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--lease-ttl", "2",
        "--shard-size", "3", "--kv-cache-memory", str(8 << 20),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))
    results_prefix = f"{batch_data_prefix('acme', batch.id)}results/"
    leases_prefix = f"{batch_data_prefix('acme', batch.id)}leases/shard-"
    deadline = time.monotonic() + 120
    try:
        while True:  # wait until it has committed a shard and holds the lease of another
            committed = {k.rsplit("/", 1)[1] for k in store.list(results_prefix)}
            busy = [
                k for k in store.list(leases_prefix)
                if platform.worker.leases.is_live(k) and k.rsplit("-", 1)[1].replace(".json", ".parquet") not in committed
            ]  # fmt: skip
            if committed and busy:
                break
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "the worker process never got going"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    committed_by_dead = len(store.list(results_prefix))
    assert committed_by_dead < record.num_shards, "the job must still be unfinished when the worker dies"

    future = platform.http.portal.start_task_soon(platform.worker.run_forever)
    try:
        done = wait_for(client, batch.id, {"completed"})
    finally:
        future.cancel()
    output = _output_lines(client, done.output_file_id)
    ids = [o["custom_id"] for o in output]
    assert sorted(ids) == sorted(f"k{i}" for i in range(18)), "every request answered exactly once"
    assert all(len(o["response"]["body"]["choices"][0]["message"]["content"]) > 0 for o in output)
    assert platform.worker.num_shards_run == record.num_shards - committed_by_dead
    assert done.request_counts.completed == 18
    assert all(store.exists(result_shard_key("acme", batch.id, s)) for s in range(record.num_shards))


async def _work_until_completed(worker: BatchWorker, service: BatchService, batch_id: str) -> None:
    """Run `worker` until the batch is `completed` (30 s at most), then stop it."""
    task = asyncio.ensure_future(worker.run_forever())
    deadline = time.monotonic() + 30
    while service.get_batch("acme", batch_id).status != "completed":
        assert time.monotonic() < deadline, "batch did not complete"
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_a_worker_keeps_several_shards_in_flight(tmp_path: Path) -> None:
    """With `max_shards_in_flight` 3, requests of three shards wait in the executor at once (one
    shard's tail never idles the replicas), never more; the batch then completes exactly once."""
    service = BatchService(
        FileObjectStore(str(tmp_path / "objects")),
        {"tiny"},
        BatchLimits(shard_size=2, max_shards_in_flight=3),
        endpoints=ENDPOINTS,
    )
    lines = [_line(f"r-{i}") for i in range(10)]  # 5 shards
    file_id = service.create_file("acme", "in.jsonl", "batch", ("\n".join(lines) + "\n").encode()).id
    batch = service.create_batch("acme", file_id, CHAT, "24h")
    assert batch.num_shards == 5

    async def scenario() -> tuple[int, int]:
        release = asyncio.Event()
        waiting: set[str] = set()
        max_shards_waiting = 0

        async def execute(endpoint: str, body: dict[str, Any], tenant: str) -> ExecutedRequest:
            nonlocal max_shards_waiting
            custom = body["messages"][0]["content"]
            waiting.add(custom)
            worker_shards = worker.num_shards_in_flight
            max_shards_waiting = max(max_shards_waiting, worker_shards)
            if worker_shards == 3:
                release.set()  # three shards in flight: let everything run
            await release.wait()
            return ExecutedRequest(200, "req", {"ok": True}, None, output_tokens=1)

        worker = BatchWorker(service, execute, poll_interval_s=0.01, worker_id="several")
        await _work_until_completed(worker, service, batch.id)
        return max_shards_waiting, worker.num_shards_run

    max_in_flight, num_run = asyncio.run(scenario())
    assert max_in_flight == 3 and num_run == 5
    done = service.get_batch("acme", batch.id)
    totals = done.totals()
    assert (totals.completed, totals.failed, len(done.shard_counts)) == (10, 0, 5)


@pytest.mark.parametrize(
    ("weights", "live", "expected"),
    [({}, {}, "ABABAAAAAAAA"), ({"A": 2.0}, {}, "ABAABAAAAAAA"), ({"A": 1.0}, {"A": 2.0}, "ABAABAAAAAAA")],
    ids=["equal", "configured-2-1", "live-2-1"],
)
def test_tenants_take_turns_at_shards(
    tmp_path: Path, weights: dict[str, float], live: dict[str, float], expected: str
) -> None:
    """A's large batch is older, B's small one newer: one worker claims shards in tenant turns
    (weighted: configured, or live from the tenant directory, which wins), so B's batch runs while
    A's does, not after it; every line answered exactly once."""
    service = BatchService(
        FileObjectStore(str(tmp_path / "objects")),
        {"tiny"},
        BatchLimits(shard_size=2, max_shards_in_flight=1),
        endpoints=ENDPOINTS,
    )
    batches = {}
    for tenant, num_lines in (("A", 20), ("B", 4)):
        lines = [_line(f"{tenant}-{i}", content=f"{tenant}-{i}") for i in range(num_lines)]
        file_id = service.create_file(tenant, "in.jsonl", "batch", ("\n".join(lines) + "\n").encode()).id
        batches[tenant] = service.create_batch(tenant, file_id, CHAT, "24h").id
    calls: list[str] = []

    async def execute(endpoint: str, body: dict[str, Any], tenant: str) -> ExecutedRequest:
        calls.append(body["messages"][0]["content"])
        return ExecutedRequest(200, "req", {"ok": True}, None, output_tokens=1)

    async def scenario() -> None:
        worker = BatchWorker(
            service,
            execute,
            poll_interval_s=0.01,
            worker_id="fair",
            tenant_weights=weights,
            weight_of=live.get,
        )
        task = asyncio.ensure_future(worker.run_forever())
        deadline = time.monotonic() + 30
        while any(service.get_batch(t, b).status != "completed" for t, b in batches.items()):
            assert time.monotonic() < deadline, "batches did not complete"
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert "".join(c[0] for c in calls[::2]) == expected  # one shard (2 lines) at a time
    assert sorted(calls) == sorted([f"A-{i}" for i in range(20)] + [f"B-{i}" for i in range(4)])


def test_failures_not_of_the_requests_making_are_retried_never_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`execute_batch_line` retries a lost replica and a broken engine, answers a request's own
    failure, and raises `RetryLater` when retries run out; the worker then leaves the shard
    uncommitted and a later claim runs it: every line is answered by the model exactly once."""
    import tandem.deployments.batch_execution as batch_execution
    from tandem.batch.lines import RetryLater
    from tandem.platform.errors import ReplicaLostError, RequestFailedError

    monkeypatch.setattr(batch_execution, "RETRY_BACKOFF_S", (0.0, 0.0))
    answer = {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "usage": {"prompt_tokens": 1, "completion_tokens": 2},
    }

    class FlakyServer:
        def __init__(self, failures: list[Exception]) -> None:
            self.failures, self.calls = failures, 0

        async def chat(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            self.calls += 1
            if self.failures:
                raise self.failures.pop(0)
            return answer

    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    lost_twice = FlakyServer([ReplicaLostError(), RequestFailedError("engine broke", code="engine_failed")])
    done = asyncio.run(execute_batch_line(lost_twice, CHAT, body, "acme"))  # type: ignore[arg-type]
    assert (done.status_code, lost_twice.calls) == (200, 3)
    own_fault = FlakyServer([RequestFailedError("non-finite logits", code="request_failed")])
    done = asyncio.run(execute_batch_line(own_fault, CHAT, body, "acme"))  # type: ignore[arg-type]
    assert (done.status_code, own_fault.calls) == (500, 1)
    always = FlakyServer([ReplicaLostError() for _ in range(3)])
    with pytest.raises(RetryLater):
        asyncio.run(execute_batch_line(always, CHAT, body, "acme"))  # type: ignore[arg-type]

    service = BatchService(
        FileObjectStore(str(tmp_path / "objects")), {"tiny"}, BatchLimits(shard_size=2), endpoints=ENDPOINTS
    )
    lines = [_line(f"r-{i}", content=f"hello r-{i}") for i in range(4)]
    file_id = service.create_file("acme", "in.jsonl", "batch", ("\n".join(lines) + "\n").encode()).id
    batch = service.create_batch("acme", file_id, CHAT, "24h")
    attempts: dict[str, int] = {}

    async def execute(endpoint: str, body: dict[str, Any], tenant: str) -> ExecutedRequest:
        text = body["messages"][0]["content"]
        attempts[text] = attempts.get(text, 0) + 1
        if text == "hello r-1" and attempts[text] == 1:
            raise RetryLater("replica_lost")
        return ExecutedRequest(200, f"req-{text}", {"text": text}, None, output_tokens=1)

    async def scenario() -> int:
        worker = BatchWorker(service, execute, poll_interval_s=0.01, worker_id="retrying")
        await _work_until_completed(worker, service, batch.id)
        return worker.num_shards_run

    assert asyncio.run(scenario()) == 2  # two shards committed; the first was claimed twice
    # the line that finished before the retry was kept by the worker: only r-1 ran again
    assert attempts["hello r-1"] == 2 and attempts["hello r-0"] == 1 and attempts["hello r-2"] == 1
    done_record = service.get_batch("acme", batch.id)
    totals = done_record.totals()
    assert (totals.completed, totals.failed) == (4, 0)
    output = [
        json.loads(x)
        for x in service.file_content("acme", done_record.output_file_id or "").decode().splitlines()
    ]
    assert sorted(o["custom_id"] for o in output) == [f"r-{i}" for i in range(4)]


def test_backpressure_waits_and_resends_and_the_window_follows_the_engines_room(tmp_path: Path) -> None:
    """An executor with 3 seats for batch work refuses the rest (`Backpressure`, as a full replica
    does): refused lines are sent again, never answered with the refusal nor counted as failures;
    the worker's line window shrinks below the 16 lines it could send, so most lines wait in the
    worker instead of being refused over and over; every line is answered exactly once.
    `execute_batch_line` turns a replica's `BatchCapacityError` into `Backpressure`."""
    from tandem.batch.lines import Backpressure
    from tandem.platform.errors import BatchCapacityError

    class FullServer:
        async def chat(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            raise BatchCapacityError("no seat", retry_after_s=0.25)

    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(Backpressure) as refused:
        asyncio.run(execute_batch_line(FullServer(), CHAT, body, "acme"))  # type: ignore[arg-type]
    assert refused.value.retry_after_s == 0.25

    service = BatchService(
        FileObjectStore(str(tmp_path / "objects")),
        {"tiny"},
        BatchLimits(shard_size=8, max_shards_in_flight=2),
        endpoints=ENDPOINTS,
    )
    lines = [_line(f"r-{i}", content=f"hello r-{i}") for i in range(24)]  # 3 shards
    file_id = service.create_file("acme", "in.jsonl", "batch", ("\n".join(lines) + "\n").encode()).id
    batch = service.create_batch("acme", file_id, CHAT, "24h")
    seats = 3
    answered: list[str] = []

    async def scenario() -> tuple[int, int, int]:
        num_running = 0
        num_refused = 0

        async def execute(endpoint: str, body: dict[str, Any], tenant: str) -> ExecutedRequest:
            nonlocal num_running, num_refused
            if num_running >= seats:
                num_refused += 1
                raise Backpressure("no seat", retry_after_s=0.01)
            num_running += 1
            try:
                await asyncio.sleep(0.01)  # the engine computing
            finally:
                num_running -= 1
            text = body["messages"][0]["content"]
            answered.append(text)
            return ExecutedRequest(200, f"req-{text}", {"text": text}, None, output_tokens=1)

        worker = BatchWorker(service, execute, poll_interval_s=0.01, worker_id="backpressured")
        assert worker.window.size == 16
        min_size = 16

        async def watch() -> None:
            nonlocal min_size
            while True:
                min_size = min(min_size, worker.window.size)
                await asyncio.sleep(0.001)

        watcher = asyncio.ensure_future(watch())
        await _work_until_completed(worker, service, batch.id)
        watcher.cancel()
        return num_refused, worker.window.num_backpressured, min_size

    num_refused, num_backpressured, min_size = asyncio.run(scenario())
    assert num_refused == num_backpressured > 0
    assert min_size <= 4, "the window shrank toward the executor's seats"
    assert num_refused < 4 * len(lines), "lines waited in the window instead of being refused again and again"
    assert sorted(answered) == sorted(f"hello r-{i}" for i in range(24))
    totals = service.get_batch("acme", batch.id).totals()
    assert (totals.completed, totals.failed) == (24, 0)
