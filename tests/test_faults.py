"""The fault suite: the object store stopped, frozen, slowed and full, and processes killed, under
the parts that use it. A real S3 server (SeaweedFS) sits behind a fault-injecting TCP proxy
(`fault_proxy.py`); the servers are the real OpenAI app (`openai_server`, the function the Serve
ingress uses) under uvicorn with the official `openai` client, and the real batch worker.

What must hold: chat and completions never wait on the store, and a process that starts while it
is down serves; store calls answer 503 `store_unavailable` with Retry-After within 5 s, and a full
disk 507 before anything is written; usage records reach the store exactly once, also from a
process killed before it shipped them; a batch survives store errors with every line once and no
line run twice; a lease outlives a store outage without changing hands."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tandem import AsyncEngine
from tandem.batch.leases import LeaseManager
from tandem.batch.lines import ExecutedRequest
from tandem.batch.service import BatchLimits, BatchService
from tandem.batch.worker import BatchWorker
from tandem.deployments.app import openai_server
from tandem.deployments.app_config import AppConfig
from tandem.deployments.engine_clients import LocalEngineClient
from tandem.deployments.ingress import create_app
from tandem.deployments.openai.endpoints import ENDPOINTS
from tandem.platform.errors import InsufficientStorageError, StoreUnavailableError
from tandem.platform.local_state import SavedDocument, state_path
from tandem.platform.object_store import FileObjectStore, ObjectStore, S3ObjectStore, S3Settings, StoredObject
from tandem.platform.store_guard import GuardedStore
from tandem.platform.tenant_directory import TenantDirectory, TenantSpec
from tandem.platform.usage_log import UsageLog, default_spool_dir
from tandem.platform.usage_query import read_records
from tandem.platform.usage_records import UsageRecord

from .conftest import S3_BUCKET, serve_app
from .fault_proxy import FaultProxy

pytestmark = pytest.mark.s3

OPERATOR_KEY = "sk-faults-operator"


@pytest.fixture(scope="module")
def proxy(s3_server: S3Settings) -> Iterator[FaultProxy]:
    assert s3_server.endpoint_url is not None
    host_port = s3_server.endpoint_url.removeprefix("http://")
    host, port = host_port.rsplit(":", 1)
    fault_proxy = FaultProxy(host, int(port))
    yield fault_proxy
    fault_proxy.close()


@pytest.fixture()
def proxied(s3_server: S3Settings, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh prefix of the session's bucket, reached through the proxy: its s3:// URL (the
    environment names the proxy as the endpoint, as an operator's would)."""
    monkeypatch.setenv("TANDEM_S3_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key_id or "")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_access_key or "")
    proxy.set_mode("pass")
    yield f"s3://{S3_BUCKET}/faults-{uuid.uuid4().hex[:8]}"
    proxy.set_mode("pass")


def direct_store(s3_server: S3Settings, url: str) -> S3ObjectStore:
    """The same prefix, not through the proxy (the test's own view of what was stored)."""
    return S3ObjectStore(S3_BUCKET, url.split("/", 3)[3], s3_server)


def wait_until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.05)  # polling a condition, not waiting a fixed time


def record(request_id: str, **fields: Any) -> UsageRecord:
    now = time.time()
    values: dict[str, Any] = dict(
        request_id=request_id, tenant="acme", api_key_id="key_1", model="tiny", adapter=None, input_tokens=10,
        cached_tokens=0, output_tokens=5, accepted_draft_tokens=0, status="completed", finish_reason="stop",
        priority="interactive", batch_id=None, started_at=now - 1, finished_at=now, latency_s=1.0,
    )  # fmt: skip
    values.update(fields)
    return UsageRecord(**values)


# -- the store itself ---------------------------------------------------------------------------
def test_a_stopped_frozen_or_slow_store_answers_in_bounded_time(
    s3_server: S3Settings, proxy: FaultProxy
) -> None:
    settings = S3Settings(
        endpoint_url=proxy.url, region="us-east-1", access_key_id=s3_server.access_key_id,
        secret_access_key=s3_server.secret_access_key,
    )  # fmt: skip
    store = GuardedStore(S3ObjectStore(S3_BUCKET, f"faults-{uuid.uuid4().hex[:8]}", settings), cooldown_s=1.0)
    store.put("a", b"1")

    def timed_failure() -> tuple[float, StoreUnavailableError]:
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError) as caught:
            store.get("a")
        return time.monotonic() - started, caught.value

    with proxy.fault("stop"):
        took, error = timed_failure()
        assert took < 2.0 and error.retry_after_s >= 1.0 and error.code == "store_unavailable"
        took, error = timed_failure()  # the circuit is open: no call reaches the store
        assert took < 0.05 and "unavailable" in error.message
    wait_until(lambda: _answers(store), 5.0, "the store's recovery (a probe after the cooldown)")
    with proxy.fault("freeze"):
        took, _ = timed_failure()
        assert 1.0 < took < 5.0, took  # its read timeout (3 s), not boto3's minutes
        assert store.is_open
    wait_until(lambda: _answers(store), 5.0, "the store's recovery after a freeze")
    with proxy.fault("pass", delay_s=1.0):  # slow, not down: answered, not refused
        started = time.monotonic()
        assert store.get("a").data == b"1"
        assert time.monotonic() - started >= 1.0


def _answers(store: ObjectStore) -> bool:
    try:
        return store.get("a").data == b"1"
    except StoreUnavailableError:
        return False


def test_a_lease_outlives_a_store_outage_without_changing_hands(tmp_path: Path) -> None:
    """Nobody can renew while the store is down; once it answers again the owner renews before any
    other worker may take the expired lease. An owner that died loses it one ttl later."""
    switch = OutageStore(FileObjectStore(str(tmp_path)))
    store = GuardedStore(switch, cooldown_s=0.1)
    owner, other = LeaseManager(store, "owner", ttl_s=0.6), LeaseManager(store, "other", ttl_s=0.6)
    lease = owner.try_claim("lease")
    assert lease is not None
    switch.down = True
    with pytest.raises(StoreUnavailableError):
        owner.renew(lease)
    wait_until(lambda: time.time() > lease.expires_at, 2.0, "the lease's expiry during the outage")
    switch.down = False
    wait_until(lambda: _answers_head(store), 2.0, "the store's recovery")
    assert other.try_claim("lease") is None  # expired, but its owner gets a renewal period first
    assert owner.renew(lease)
    assert other.try_claim("lease") is None  # renewed: live
    wait_until(lambda: other.try_claim("lease") is not None, 5.0, "the takeover of a dead owner's lease")


def _answers_head(store: ObjectStore) -> bool:
    try:
        store.head("lease")
        return True
    except StoreUnavailableError:
        return False


class OutageStore(ObjectStore):
    """A store with a switch: `down` makes every call fail as an unreachable store does."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner, self.url, self.down = inner, inner.url, False
        self.num_calls = 0

    def _check(self) -> None:
        self.num_calls += 1
        if self.down:
            raise StoreUnavailableError("the object store did not answer (EndpointConnectionError)")

    def get(self, key: str) -> StoredObject:
        self._check()
        return self.inner.get(key)

    def head(self, key: str) -> str | None:
        self._check()
        return self.inner.head(key)

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        self._check()
        return self.inner.put(key, data, if_none_match=if_none_match, if_match=if_match)

    def delete(self, key: str) -> None:
        self._check()
        self.inner.delete(key)

    def list(self, prefix: str) -> list[str]:
        self._check()
        return self.inner.list(prefix)


# -- usage records --------------------------------------------------------------------------------
CRASHING_WRITER = textwrap.dedent(
    """
    import asyncio, os, signal, sys, time
    from pathlib import Path
    from tandem.platform.errors import StoreUnavailableError
    from tandem.platform.object_store import FileObjectStore
    from tandem.platform.usage_log import UsageLog
    from tandem.platform.usage_records import UsageRecord

    class Down(FileObjectStore):
        def put(self, key, data, **conditions):
            raise StoreUnavailableError("down")

    log = UsageLog(Down(sys.argv[1]), commit_interval_s=0.0, spool_dir=Path(sys.argv[2]))
    now = time.time()
    async def main():
        for i in range(int(sys.argv[3])):
            assert await log.commit(UsageRecord(
                request_id=f"crashed-{i}", tenant="acme", api_key_id="k", model="tiny", adapter=None,
                input_tokens=3, cached_tokens=0, output_tokens=i, accepted_draft_tokens=0, status="completed",
                finish_reason="stop", priority="interactive", batch_id=None, started_at=now, finished_at=now,
                latency_s=0.1))
    asyncio.run(main())
    print("spooled", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_usage_a_killed_process_had_shown_its_clients_is_shipped_by_the_next_one(tmp_path: Path) -> None:
    """The records a process committed (its clients saw their usage) while the store was down,
    then the process was killed: the next writer of that store on the machine ships each once."""
    objects, spool = tmp_path / "objects", tmp_path / "spool"
    done = subprocess.run(
        [sys.executable, "-c", CRASHING_WRITER, str(objects), str(spool), "25"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == -signal.SIGKILL and "spooled" in done.stdout, done.stderr
    store = FileObjectStore(str(objects))
    assert not list(read_records(store, time.time() - 60, time.time() + 60))  # nothing reached the store
    log = UsageLog(store, commit_interval_s=0.0, spool_dir=spool, sweep_interval_s=0.2)
    log.start()
    wait_until(lambda: log.num_recovered == 25, 30.0, "the orphaned spool's shipping")
    stored = list(read_records(store, time.time() - 60, time.time() + 60))
    assert Counter(r.request_id for r in stored) == Counter(f"crashed-{i}" for i in range(25))
    assert sum(r.output_tokens for r in stored) == sum(range(25))
    log.close()
    assert not any(spool.iterdir()), list(spool.iterdir())  # shipped spools are removed


# -- the API while the store is down --------------------------------------------------------------
def make_server(engine: AsyncEngine, url: str) -> Any:
    cfg = AppConfig.model_validate(
        {
            "object_store": url,
            "api_keys": "",
            "operator_keys": OPERATOR_KEY,
            "engine": {"model": "unused", "served_model_name": "tiny"},
            "usage_commit_interval_s": 0.05,
        }
    )
    return openai_server(cfg, LocalEngineClient(engine), None)


def stream_usage(base_url: str, key: str) -> tuple[str, int, int]:
    api = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=30)
    chunks = list(
        api.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "faults"}], max_tokens=6, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    usage = chunks[-1].usage
    assert usage is not None
    return chunks[0].id, usage.prompt_tokens, usage.completion_tokens


def test_the_api_serves_without_the_store_and_store_calls_answer_503(
    engine: AsyncEngine, proxied: str, proxy: FaultProxy, s3_server: S3Settings
) -> None:
    """Store frozen, then stopped: streams finish with their usage in their usual time; files and
    batches answer 503 `store_unavailable` with Retry-After within 5 s; an ingress started during
    the outage authenticates the tenant keys it saw before (its saved directory) and serves; once
    the store is back every response's usage is stored exactly once."""
    directory = TenantDirectory(direct_store(s3_server, proxied))
    directory.create_tenant(TenantSpec(id="acme"))
    key = directory.create_key("acme")[1]
    first = make_server(engine, proxied)
    reported: dict[str, tuple[int, int]] = {}
    with serve_app(create_app(first)) as base_url:
        started = time.monotonic()
        request_id, prompt, completion = stream_usage(base_url, key)
        baseline_s = time.monotonic() - started
        reported[request_id] = (prompt, completion)
        for mode in ("freeze", "stop"):
            with proxy.fault(mode):  # type: ignore[arg-type]
                started = time.monotonic()
                request_id, prompt, completion = stream_usage(base_url, key)
                reported[request_id] = (prompt, completion)
                assert time.monotonic() - started < baseline_s + 1.0  # no wait on the store
                for method, path, kwargs in (
                    (
                        "POST",
                        "/v1/files",
                        {"files": {"file": ("in.jsonl", b"{}\n")}, "data": {"purpose": "batch"}},
                    ),
                    ("GET", "/v1/batches", {}),
                    ("GET", "/v1/files", {}),
                ):
                    started = time.monotonic()
                    reply = httpx.request(
                        method,
                        base_url + path,
                        headers={"Authorization": f"Bearer {key}"},
                        timeout=30,
                        **kwargs,
                    )
                    assert time.monotonic() - started < 5.0, (mode, path)
                    assert reply.status_code == 503, (mode, path, reply.text)
                    error = reply.json()["error"]
                    assert error["code"] == "store_unavailable" and error["type"] == "server_error", error
                    assert int(reply.headers["retry-after"]) >= 1
                # an ingress (re)started now: it has the directory this machine saved
                started = time.monotonic()
                second = make_server(engine, proxied)
                assert time.monotonic() - started < 6.0
                with serve_app(create_app(second)) as second_url:
                    request_id, prompt, completion = stream_usage(second_url, key)
                    reported[request_id] = (prompt, completion)
                assert second.usage_log is not None
                second.usage_log.close(timeout_s=0.1)  # it stops before the store is back
                second.tenants.stop_refresh()
    assert first.usage_log is not None
    assert first.usage_log.flush(timeout_s=30)  # the store is back: the spool ships
    first.usage_log.close()
    first.tenants.stop_refresh()
    # the stopped ingresses' records: shipped by the next process of this store on this machine
    third = make_server(engine, proxied)
    store = direct_store(s3_server, proxied)
    wait_until(
        lambda: {r.request_id for r in read_records(store, time.time() - 300, time.time() + 60)} >= set(reported),
        30.0, "every response's usage in the store",
    )  # fmt: skip
    stored = list(read_records(store, time.time() - 300, time.time() + 60))
    assert Counter(r.request_id for r in stored) == Counter(list(reported))
    assert {r.request_id: (r.input_tokens, r.output_tokens) for r in stored} == reported
    third.usage_log.close()
    third.tenants.stop_refresh()


def test_a_full_disk_is_a_507_before_anything_is_written(tmp_path: Path, engine: AsyncEngine) -> None:
    from tandem.deployments.openai.server import OpenAIServer
    from tandem.platform.api_keys import parse_keys
    from tandem.platform.tenancy import TenantRegistry

    store = FileObjectStore(str(tmp_path / "objects"), min_free_bytes=0)
    service = BatchService(store, {"tiny"}, BatchLimits(), endpoints=ENDPOINTS)
    server = OpenAIServer(
        LocalEngineClient(engine), TenantRegistry(parse_keys("sk-full=acme")), batches=service
    )
    with serve_app(create_app(server)) as base_url:
        api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-full", max_retries=0, timeout=30)
        line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}}  # fmt: skip
        uploaded = api.files.create(file=("in.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
        store.min_free_bytes = store_free_bytes(store) + (1 << 30)  # now the disk is "full"
        before = sorted(p.name for p in (tmp_path / "objects").rglob("*"))
        with pytest.raises(openai.APIStatusError) as caught:
            api.files.create(file=("more.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
        assert caught.value.status_code == 507
        assert caught.value.body["code"] == "insufficient_storage"  # type: ignore[index]
        assert "free" in caught.value.body["message"]  # type: ignore[index]
        with pytest.raises(openai.APIStatusError) as caught:
            api.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        assert caught.value.status_code == 507
        assert sorted(p.name for p in (tmp_path / "objects").rglob("*")) == before  # nothing written


def store_free_bytes(store: FileObjectStore) -> int:
    import shutil

    return shutil.disk_usage(store.root).free


def test_an_enospc_write_is_a_507_naming_the_disk(tmp_path: Path) -> None:
    """A real ENOSPC (a write to /dev/full fails with it on any Linux) through the file store's
    mapping of disk errors."""
    store = FileObjectStore(str(tmp_path))
    with (
        pytest.raises(InsufficientStorageError) as caught,
        store._disk_errors("key"),  # noqa: SLF001 - the mapping itself
        open("/dev/full", "wb") as full,
    ):
        full.write(b"x")
        full.flush()
    assert caught.value.status_code == 507 and "full" in caught.value.message


# -- batches --------------------------------------------------------------------------------------
def test_a_batch_survives_store_outages_with_every_line_once_and_none_run_twice(tmp_path: Path) -> None:
    """The store goes down three times while shards run and commit: checks and renewals fail,
    commits are retried, the worker's loop carries on; the batch completes with each line
    answered once and no line sent to an engine twice."""
    switch = OutageStore(FileObjectStore(str(tmp_path / "objects")))
    store = GuardedStore(switch, cooldown_s=0.2)
    service = BatchService(store, {"tiny"}, BatchLimits(shard_size=4, lease_ttl_s=1.5), endpoints=ENDPOINTS)
    lines = [
        json.dumps(
            {
                "custom_id": f"r-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "tiny", "messages": [{"role": "user", "content": f"line {i}"}]},
            }
        )  # fmt: skip
        for i in range(24)
    ]
    file_id = service.create_file("acme", "in.jsonl", "batch", ("\n".join(lines) + "\n").encode()).id
    batch = service.create_batch("acme", file_id, "/v1/chat/completions", "24h")
    runs: Counter[str] = Counter()

    async def execute(endpoint: str, body: dict[str, Any], tenant: str) -> ExecutedRequest:
        text = body["messages"][0]["content"]
        runs[text] += 1
        await asyncio.sleep(0.15)
        return ExecutedRequest(200, f"req-{text}", {"text": text}, None, output_tokens=1)

    async def scenario() -> BatchWorker:
        worker = BatchWorker(service, execute, poll_interval_s=0.05, worker_id="outages")
        task = asyncio.ensure_future(worker.run_forever())
        for _ in range(3):  # three outages of 1 s, each after 0.4 s of work
            await asyncio.sleep(0.4)
            switch.down = True
            await asyncio.sleep(1.0)
            switch.down = False

        def status() -> str | None:
            try:
                return service.get_batch("acme", batch.id).status
            except StoreUnavailableError:  # the test reads through the same (guarded) store
                return None

        deadline = time.monotonic() + 60
        while status() != "completed":
            assert time.monotonic() < deadline, status()
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return worker

    worker = asyncio.run(scenario())
    done = service.get_batch("acme", batch.id)
    assert done.totals().completed == 24
    output = [
        json.loads(x) for x in service.file_content("acme", done.output_file_id or "").decode().splitlines()
    ]
    assert sorted(o["custom_id"] for o in output) == sorted(f"r-{i}" for i in range(24))
    assert set(runs.values()) == {1}, runs  # no line ran twice
    assert worker.num_lines_run == 24
    assert store.num_failures > 0  # the outages did hit the worker


def test_the_local_state_is_keyed_by_store_and_kept_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_STATE_DIR", str(tmp_path))
    store = FileObjectStore(str(tmp_path / "objects"))
    saved = state_path("tenancy", store.url, ".json")
    directory = TenantDirectory(store, saved=SavedDocument(saved))
    directory.create_tenant(TenantSpec(id="acme"))
    assert saved.is_relative_to(tmp_path) and saved.exists()
    assert os.stat(saved).st_mode & 0o077 == 0
    assert state_path("tenancy", "file:///elsewhere", ".json") != saved
    assert state_path("usage-spool", store.url) == default_spool_dir(store.url)


# -- callers that die -----------------------------------------------------------------------------
def test_a_dead_callers_requests_are_aborted_and_metered_with_what_was_streamed(tmp_path: Path) -> None:
    """`OrphanWatch` over a real engine request stream: the caller's lookup fails, the watch
    aborts its requests and records each once, `cancelled`, with the tokens it had streamed; a
    request of a live caller is left alone (its caller meters it)."""
    from tandem.deployments.orphans import CallerRef, OrphanWatch, UsageTag
    from tandem.engine.protocol import CompletionOutput, RequestMetrics, RequestOutput

    store = FileObjectStore(str(tmp_path / "objects"))
    log = UsageLog(store, commit_interval_s=0.0, spool_dir=tmp_path / "spool")
    alive = {"ingress-1": True, "ingress-2": True}
    aborted: list[str] = []
    tag = UsageTag("key_1", "tiny", None)

    def output(request_id: str, new_tokens: int) -> RequestOutput:
        choice = CompletionOutput(0, "", [], None, delta_token_ids=[7] * new_tokens)
        return RequestOutput(request_id, None, [1, 2, 3], [choice], False, RequestMetrics(arrival_time=0.0))

    async def scenario() -> None:
        watch = OrphanWatch(aborted.append, lambda: log, check_s=0.05, is_alive=lambda c: alive[c.actor_name])
        watch.start("a", "acme", CallerRef("ingress-1", "ns", tag))
        watch.start("b", "acme", CallerRef("ingress-1", "ns", None))  # a batch line: not metered here
        watch.start("c", "acme", CallerRef("ingress-2", "ns", tag))
        for request_id in ("a", "c"):
            for _ in range(5):
                watch.streamed(request_id, output(request_id, 1))
        alive["ingress-1"] = False
        deadline = time.monotonic() + 5
        while len(aborted) < 2:
            assert time.monotonic() < deadline, aborted
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # a few more checks: the live caller's request is left alone
        assert sorted(aborted) == ["a", "b"] and watch.num_orphans == 2
        watch.end("c")

    asyncio.run(scenario())
    assert log.flush(timeout_s=10)
    stored = list(read_records(store, time.time() - 60, time.time() + 60))
    assert [(r.request_id, r.status, r.output_tokens, r.input_tokens) for r in stored] == [
        ("a", "cancelled", 5, 3)
    ]
    log.close()


def test_a_stream_cut_by_a_dead_caller_is_metered_once_and_by_a_live_one_not(tmp_path: Path) -> None:
    """`OrphanWatch.cut` (a stream closed from the caller's side before its end, as gRPC does when
    the caller dies): metered here, `cancelled`, with what was streamed, when look-ups from the
    cut on find the caller dead within `confirm_s` (also one still found alive at the cut: Ray's
    control store learns of a death a moment later), once however the watch's own checks run; not
    metered when the caller lives (it meters a stream its client left), nor after the stream's
    end (`settle`)."""
    from tandem.deployments.orphans import CallerRef, OrphanWatch, UsageTag
    from tandem.engine.protocol import CompletionOutput, RequestMetrics, RequestOutput

    store = FileObjectStore(str(tmp_path / "objects"))
    log = UsageLog(store, commit_interval_s=0.0, spool_dir=tmp_path / "spool")
    alive = {"ingress-1": True, "ingress-2": True, "ingress-3": True}
    tag = UsageTag("key_1", "tiny", None)

    def output(request_id: str) -> RequestOutput:
        choice = CompletionOutput(0, "", [], None, delta_token_ids=[7, 7])
        return RequestOutput(request_id, None, [1, 2, 3], [choice], False, RequestMetrics(arrival_time=0.0))

    async def scenario() -> OrphanWatch:
        watch = OrphanWatch(
            lambda _: None, lambda: log, check_s=0.05, confirm_s=0.5, is_alive=lambda c: alive[c.actor_name]
        )
        for request_id, caller in (
            ("dead-cut", "ingress-1"),
            ("dead-later-cut", "ingress-3"),
            ("live-cut", "ingress-2"),
            ("ended", "ingress-2"),
        ):
            watch.start(request_id, "acme", CallerRef(caller, "ns", tag))
            watch.streamed(request_id, output(request_id))
        await watch.settle("ended")  # its caller lives: the stream ends
        alive["ingress-1"] = False  # dies; its side of the stream closes before any check sees it
        for request_id in ("dead-cut", "dead-later-cut", "live-cut", "ended"):
            watch.cut(request_id)
            watch.end(request_id)
        await asyncio.sleep(0.15)  # ingress-3 was still found alive at its cut
        alive["ingress-3"] = False
        deadline = time.monotonic() + 5
        while watch.num_orphans < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.7)  # past `confirm_s`, the watch's own checks run on: nothing more is metered
        return watch

    watch = asyncio.run(scenario())
    assert watch.num_orphans == 2
    assert log.flush(timeout_s=10)
    stored = list(read_records(store, time.time() - 60, time.time() + 60))
    assert sorted((r.request_id, r.status, r.output_tokens) for r in stored) == [
        ("dead-cut", "cancelled", 2),
        ("dead-later-cut", "cancelled", 2),
    ]
    log.close()


def test_an_ended_stream_closes_once_its_caller_is_seen_alive_or_a_hold_after_it_is_found_dead() -> None:
    """`OrphanWatch.settle`: a request's ended stream closes once a look-up of its caller begun
    after it ended finds the caller alive (20 ending together share at most two look-ups); when
    the caller is dead, only `hold_s` later (Ray's sends to a dead caller must fail before the
    stream ends, or the end stalls the replica's other streams: orphans.py). An ended request is
    not aborted or metered."""
    from tandem.deployments.orphans import CallerRef, OrphanWatch

    alive = {"ingress-1": True, "worker-1": True}
    lookups: list[tuple[str, float]] = []
    aborted: list[str] = []

    def is_alive(caller: CallerRef) -> bool:
        lookups.append((caller.actor_name, time.monotonic()))
        return alive[caller.actor_name]

    async def settle(watch: OrphanWatch, request_id: str) -> tuple[float, float]:
        ended = time.monotonic()
        await watch.settle(request_id)
        return ended, time.monotonic()

    async def scenario() -> None:
        watch = OrphanWatch(aborted.append, lambda: None, check_s=0.05, hold_s=0.6, is_alive=is_alive)
        live = [f"live-{i}" for i in range(20)]
        for request_id in live:
            watch.start(request_id, None, CallerRef("ingress-1", "ns"))
        watch.start("dead", None, CallerRef("worker-1", "ns"))
        await asyncio.sleep(0.12)  # a look-up or two before the streams end
        num_before = len(lookups)
        closes = await asyncio.gather(*(settle(watch, request_id) for request_id in live))
        for ended, closed in closes:
            assert any(name == "ingress-1" and ended <= at <= closed for name, at in lookups)
            assert closed - ended < 0.3
        assert sum(name == "ingress-1" for name, _ in lookups[num_before:]) <= 3  # shared (+ the watch's)
        for request_id in live:
            watch.end(request_id)
        alive["worker-1"] = False
        ended, closed = await settle(watch, "dead")
        assert closed - ended >= 0.6
        watch.end("dead")
        assert aborted == [] and watch.num_orphans == 0

    asyncio.run(scenario())


def test_a_spool_range_shipped_twice_is_stored_once(tmp_path: Path) -> None:
    """A process died after writing a range's objects but before recording it shipped: the next
    shipper sends the same range under the same keys, and the store keeps one copy."""
    from tandem.platform.usage_spool import SpoolWriter, sweep_orphans

    store = FileObjectStore(str(tmp_path / "objects"))
    writer = SpoolWriter(tmp_path / "spool", "dead")
    writer.append([record(f"s{i}") for i in range(7)])
    assert writer.ship(store, max_records=3) == 7  # three ranges: 3 + 3 + 1
    for ship_file in (tmp_path / "spool").glob("*.ship"):  # the crash: progress back to the start
        ship_file.write_text(json.dumps({"shipped": 0, "shipping": None}))
    writer.close()  # its lock is free: an orphan now (the spool looks unshipped)
    assert sweep_orphans(store, tmp_path / "spool", exclude="next", max_records=3) == 7  # sent again
    stored = list(read_records(store, time.time() - 60, time.time() + 60))
    assert Counter(r.request_id for r in stored) == Counter(f"s{i}" for i in range(7))


def test_budget_reports_split_by_the_shard_of_each_tenant() -> None:
    from tandem.deployments.tenant_leases import shard_of
    from tandem.platform.tenant_budget import Report

    tenants = [f"tenant-{i}" for i in range(200)]
    shards = Counter(shard_of(t, 4) for t in tenants)
    assert set(shards) == {0, 1, 2, 3} and min(shards.values()) > 30  # spread, and stable:
    assert [shard_of(t, 4) for t in tenants] == [shard_of(t, 4) for t in tenants]
    report = Report(
        returned={t: 1 for t in tenants[:10]}, tokens={t: 5 for t in tenants[5:15]}, known=set(tenants[:3])
    )
    parts = report.split(lambda t: shard_of(t, 4))
    assert sum(sum(p.returned.values()) for p in parts.values()) == 10
    assert sum(sum(p.tokens.values()) for p in parts.values()) == 50
    for index, part in parts.items():
        assert all(shard_of(t, 4) == index for t in [*part.returned, *part.tokens, *part.known])
