"""Two LLM replicas behind two ingress replicas: routing by adapter and prefix, tenant limits
across the fleet, one /metrics for both, and a replica killed mid-batch (Ray started by the test
session)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from .conftest import make_tiny_model
from .test_serve import KEY, OPERATOR_KEY, deploy, scraped_samples, upload_adapter

pytestmark = pytest.mark.ray

APP = "fleet"
PERIOD_S = 0.25  # the replicas' reporting period (routing stats and the stats board)


@pytest.fixture(scope="module")
def fleet_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fleet-objects")


@pytest.fixture(scope="module")
def fleet(ray_serve: str, tmp_path_factory: pytest.TempPathFactory, fleet_store: Path) -> Iterator[str]:
    from ray import serve

    store = fleet_store
    deploy(
        tmp_path_factory,
        APP,
        f"/{APP}",
        num_replicas=2,
        ingress_num_replicas=2,
        object_store=f"file://{store}",
        routing={"stats_period_s": PERIOD_S},
        max_concurrent_requests_per_tenant=2,
        batch={"shard_size": 4, "lease_ttl_s": 2.0},
        batch_poll_interval_s=0.1,
    )
    wait_for(lambda: len(board()) == 2, 60, "both replicas reporting to the fleet state")
    yield f"{ray_serve}/{APP}"
    serve.delete(APP)


def board() -> dict[str, dict[str, Any]]:
    """Replica id -> the engine stats it last reported."""
    from ray import serve

    handle = serve.get_deployment_handle("FleetState", app_name=APP)  # what /metrics reads
    return dict(handle.snapshot.remote().result())


def fresh_board(since: float) -> dict[str, dict[str, Any]]:
    """The board once every replica has reported after `since` (time.time())."""
    snapshot: dict[str, dict[str, Any]] = {}

    def fresh() -> bool:
        nonlocal snapshot
        snapshot = board()
        return len(snapshot) == 2 and all(s["reported_at"] > since for s in snapshot.values())

    wait_for(fresh, 30, "fresh reports from both replicas")
    return snapshot


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # polling state that other processes update on their own schedule


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_an_adapter_is_loaded_by_one_replica(fleet: str, peft_adapters: dict[str, Path]) -> None:
    upload_adapter(fleet, "fleet-bot", peft_adapters["all-r8"])

    async def twenty() -> list[str]:
        api = openai.AsyncOpenAI(base_url=f"{fleet}/v1", api_key=KEY, max_retries=0, timeout=120)
        limit = asyncio.Semaphore(2)  # the tenant's concurrency limit

        async def one(i: int) -> str:
            async with limit:
                done = await api.completions.create(
                    model="tiny:fleet-bot", prompt=f"Request {i}", max_tokens=4, temperature=0
                )
                return done.model

        return await asyncio.gather(*(one(i) for i in range(20)))

    assert set(asyncio.run(twenty())) == {"tiny:fleet-bot"}
    holders = [
        rid for rid, s in fresh_board(time.time()).items() if any("fleet-bot" in n for n in s["loras_loaded"])
    ]
    assert len(holders) == 1, fresh_board(time.time())


def test_requests_sharing_a_prefix_land_together(fleet: str, tmp_path: Path) -> None:
    """20 requests that share a long prefix: their prefix-cache hits across the fleet are at
    least those of one engine serving them all (the prefix is computed once, not once per
    replica)."""
    from tandem.engine.llm import LLM
    from tandem.engine.sampling_params import SamplingParams

    prefix = "The shared preamble of a long system prompt, repeated. " * 12
    prompts = [prefix + f"Question number {i}?" for i in range(20)]
    before = fresh_board(time.time())
    for prompt in prompts:
        client(fleet).completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    after = fresh_board(time.time())
    hits = {rid: after[rid]["prefix_cache_hits"] - before[rid]["prefix_cache_hits"] for rid in after}

    single = LLM(str(make_tiny_model(tmp_path, max_positions=4096)), kv_cache_memory=8 << 20)
    single_before = single.stats()["prefix_cache_hits"]
    for prompt in prompts:
        single.generate([prompt], SamplingParams(max_tokens=2, temperature=0))
    single_hits = single.stats()["prefix_cache_hits"] - single_before
    assert single_hits > 0
    assert sum(hits.values()) >= single_hits, (hits, single_hits)
    assert max(hits.values()) >= single_hits, "the requests landed together on one replica"


def test_tenant_concurrency_limit_holds_across_replicas(fleet: str) -> None:
    """Limit 2 per tenant, two ingress and two LLM replicas with room: of 6 streams at once, 2 run
    and 4 get a 429; when they end, the tenant's slots are free again."""

    async def six() -> list[str]:
        api = openai.AsyncOpenAI(base_url=f"{fleet}/v1", api_key=KEY, max_retries=0, timeout=120)
        decided = asyncio.Event()  # every stream either runs or was refused
        outcomes: list[str] = []

        def note(outcome: str) -> None:
            outcomes.append(outcome)
            if len(outcomes) == 6:
                decided.set()

        async def one() -> None:
            try:
                stream = await api.completions.create(
                    model="tiny", prompt="x", max_tokens=3000, stream=True, extra_body={"ignore_eos": True}
                )
                async for _ in stream:  # the first token: admitted and running; it keeps its
                    note("ok")  # slot until every other stream is decided
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(decided.wait(), 20)
                    break
                await stream.close()
            except openai.RateLimitError as exc:
                assert exc.body.get("code") == "rate_limit_exceeded", exc.body
                note("429")

        await asyncio.wait_for(asyncio.gather(*(one() for _ in range(6))), timeout=120)
        return outcomes

    outcomes = asyncio.run(six())
    assert sorted(outcomes) == ["429"] * 4 + ["ok"] * 2, outcomes
    # The operator's view counts the fleet's refusals, whichever ingress replica refused.
    load = httpx.get(
        f"{fleet}/v1/admin/load", headers={"Authorization": f"Bearer {OPERATOR_KEY}"}, timeout=10
    )
    assert load.json()["tenants"]["acme"]["refused_last_hour"]["rate_limit_exceeded"] >= 4, load.text
    # The closed streams give their slots back (the server learns of a disconnect a moment later).
    api = client(fleet)
    deadline = time.monotonic() + 10
    while True:
        try:
            done = api.completions.create(model="tiny", prompt="x", max_tokens=2)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "closed streams still hold the tenant's slots after 10 s"
    assert done.choices[0].finish_reason in ("length", "stop")


def test_metrics_cover_both_replicas(fleet: str) -> None:
    replicas = {
        labels.split('replica="')[1].split('"')[0]
        for name, labels, _ in scraped_samples(fleet)
        if name == "tandem_kv_cache_occupancy"
    }
    assert replicas == set(board()), replicas


def test_killing_a_replica_mid_run_loses_no_request_and_meters_each_once(
    fleet: str, fleet_store: Path
) -> None:
    """A batch and a mix of real-time requests (streamed, non-streamed, cancelled, failed) of one
    tenant, one LLM replica killed while they run: the batch loses no line, and the usage records
    match what the responses reported, each request once (batch lines that ran twice included)."""
    import psutil

    from tandem.platform.object_store import FileObjectStore
    from tandem.platform.usage_query import read_records

    started = int(time.time())
    assert (
        _admin(
            fleet, "POST", "/tenants", json={"id": "meter-co", "limits": {"max_concurrent_requests": 8}}
        ).status_code
        == 200
    )
    secret = _admin(fleet, "POST", "/tenants/meter-co/keys").json()["key"]
    wait_for(lambda: _every_ingress_answers(fleet, secret, True), 5, "the new key on every ingress replica")
    api = openai.OpenAI(base_url=f"{fleet}/v1", api_key=secret, max_retries=0, timeout=120)
    lines = [
        json.dumps(
            {
                "custom_id": f"k{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "tiny", "prompt": f"Item {i}", "max_tokens": 48, "ignore_eos": True},
            }
        )
        for i in range(24)
    ]
    file_id = api.files.create(
        file=("in.jsonl", io.BytesIO(("\n".join(lines) + "\n").encode())), purpose="batch"
    ).id
    batch = api.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    replica_pids = [
        proc.pid
        for proc in psutil.Process().children(recursive=True)  # this session's Ray, not others'
        if f"ServeReplica:{APP}:LLMReplica" in " ".join(proc.cmdline())
    ]
    assert len(replica_pids) == 2, replica_pids
    wait_for(lambda: api.batches.retrieve(batch.id).request_counts.completed > 0, 120, "the batch to start")

    reported: dict[str, tuple[int, int]] = {}  # request id -> (prompt, completion tokens) as reported
    cancelled: list[str] = []
    num_errors = 0

    def realtime(i: int) -> None:
        nonlocal num_errors
        kind = i % 4
        try:
            if kind == 0:
                done = api.completions.create(
                    model="tiny", prompt=f"Now {i}", max_tokens=64, extra_body={"ignore_eos": True}
                )
                assert done.usage is not None
                reported[done.id] = (done.usage.prompt_tokens, done.usage.completion_tokens)
            elif kind == 1:
                chunks = list(
                    api.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": f"Now {i}"}], max_tokens=64, stream=True,
                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                    )
                )  # fmt: skip
                usage = chunks[-1].usage
                assert usage is not None
                reported[chunks[0].id] = (usage.prompt_tokens, usage.completion_tokens)
            elif kind == 2:
                stream = api.completions.create(
                    model="tiny",
                    prompt=f"Now {i}",
                    max_tokens=2000,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                first = next(iter(stream))
                next(iter(stream))
                cancelled.append(first.id)
                stream.close()
            else:
                with contextlib.suppress(openai.BadRequestError):  # over the context: refused
                    api.completions.create(model="tiny", prompt=[5] * 5000, max_tokens=16)
        except (openai.APIError, StopIteration):  # its replica was killed under it
            num_errors += 1

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(realtime, i) for i in range(16)]
        wait_for(lambda: any(f.done() for f in futures), 120, "real-time requests under way")
        os.kill(replica_pids[0], signal.SIGKILL)
        for future in futures:
            future.result()
    wait_for(lambda: api.batches.retrieve(batch.id).status == "completed", 240, "the batch to complete")
    batch = api.batches.retrieve(batch.id)
    assert batch.request_counts.completed == 24 and batch.request_counts.failed == 0, batch.request_counts
    output = [json.loads(line) for line in api.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == sorted(f"k{i}" for i in range(24))
    assert all(o["response"]["status_code"] == 200 for o in output), [
        o for o in output if o["response"]["status_code"] != 200
    ]
    done = api.completions.create(model="tiny", prompt="After the loss", max_tokens=4, temperature=0)
    assert done.choices[0].finish_reason in ("length", "stop")
    reported[done.id] = (done.usage.prompt_tokens, done.usage.completion_tokens) if done.usage else (0, 0)
    print(
        f"\nreal-time: {len(reported)} answered, {len(cancelled)} cancelled, {num_errors} lost with the replica"
    )

    # -- metering: every request once, as reported ---------------------------------------------
    store = FileObjectStore(str(fleet_store))

    def records() -> list[Any]:
        return [r for r in read_records(store, started - 1, time.time() + 1) if r.tenant == "meter-co"]

    # records are on the ingress's disk before a response reports them, in the store within a
    # second or so (the spool's ship interval)
    wait_for(
        lambda: {*cancelled, *reported} <= {r.request_id for r in records()}, 15, "every request's record"
    )
    stored = records()
    counts: dict[str, int] = {}
    for r in stored:
        counts[r.request_id] = counts.get(r.request_id, 0) + 1
    assert all(n == 1 for n in counts.values()), {k: n for k, n in counts.items() if n > 1}
    by_id = {r.request_id: r for r in stored}
    for request_id, (prompt, completion) in reported.items():
        assert (by_id[request_id].status, by_id[request_id].input_tokens, by_id[request_id].output_tokens) == (
            "completed", prompt, completion
        ), by_id[request_id]  # fmt: skip
    assert all(by_id[request_id].status == "cancelled" for request_id in cancelled)
    # a replica sends a stream's prompt with its first output only: the ingress's meter still
    # counts it for a stream the client left after two chunks
    assert all(by_id[request_id].input_tokens > 0 for request_id in cancelled)
    lines_usage = {o["response"]["body"]["id"]: o["response"]["body"]["usage"] for o in output}
    batch_records = [r for r in stored if r.batch_id == batch.id]
    assert {r.request_id for r in batch_records} == set(lines_usage)
    for r in batch_records:
        assert (r.input_tokens, r.output_tokens) == (
            lines_usage[r.request_id]["prompt_tokens"], lines_usage[r.request_id]["completion_tokens"]
        )  # fmt: skip
    # the usage API (an operator's view of this tenant) sums the same, batch and real time apart
    query = {"start_time": started - 60, "bucket_width": "1m", "group_by": "batch", "project_ids": "meter-co"}
    page = _usage_api(fleet, OPERATOR_KEY, query)
    sums: dict[bool, list[int]] = {}
    for result in (r for bucket in page["data"] for r in bucket["results"]):
        total = sums.setdefault(result["batch"], [0, 0, 0])
        total[0] += result["input_tokens"]
        total[1] += result["output_tokens"]
        total[2] += result["num_model_requests"]
    gone = [by_id[request_id] for request_id in cancelled]
    assert sums[True] == [
        sum(u["prompt_tokens"] for u in lines_usage.values()), sum(u["completion_tokens"] for u in lines_usage.values()), 24
    ]  # fmt: skip
    assert sums[False] == [
        sum(p for p, _ in reported.values()) + sum(r.input_tokens for r in gone),
        sum(c for _, c in reported.values()) + sum(r.output_tokens for r in gone),
        len(reported) + len(gone),
    ]
    # the tenant's own key sees only its own usage
    own = _usage_api(
        fleet, secret, {"start_time": started - 60, "bucket_width": "1h", "group_by": "project_id"}
    )
    assert {r["project_id"] for bucket in own["data"] for r in bucket["results"]} == {"meter-co"}


def _usage_api(fleet: str, key: str, params: dict[str, Any]) -> dict[str, Any]:
    """Every bucket of `GET /v1/organization/usage/completions`, page after page."""
    import httpx

    data: list[dict[str, Any]] = []
    cursor = None
    while True:
        query = {**params, **({"page": cursor} if cursor else {})}
        reply = httpx.get(
            f"{fleet}/v1/organization/usage/completions",
            params=query,
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
        page = reply.json()
        data += page["data"]
        cursor = page["next_page"]
        if not page["has_more"]:
            return {"data": data}


# -- tenants and keys managed live (the operator API) ----------------------------------------
def _admin(fleet: str, method: str, path: str, key: str = OPERATOR_KEY, **kwargs: Any) -> Any:
    import httpx

    headers = {"Authorization": f"Bearer {key}"}
    return httpx.request(method, f"{fleet}/v1/admin{path}", headers=headers, timeout=30, **kwargs)


def _ray_session_logs(marker: str) -> list[Path]:
    """The log files of the newest local Ray session whose Serve logs mention `marker`."""
    root = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray"
    for session in sorted(root.glob("session_2*"), key=os.path.getmtime, reverse=True)[:5]:
        files = [f for f in (session / "logs").rglob("*") if f.is_file()]
        if any(marker.encode() in f.read_bytes() for f in files if "serve" in f.parts):
            return files
    return []


def _every_ingress_answers(fleet: str, key: str, want_ok: bool) -> bool:
    """20 requests in a row, spread by Serve's proxy over both ingress replicas (all 20 on one
    replica: chance 2 x 2^-20), each authenticated (or each refused) as `want_ok` says."""
    api = openai.OpenAI(base_url=f"{fleet}/v1", api_key=key, max_retries=0, timeout=30)
    for _ in range(20):
        try:
            api.models.list()
            ok = True
        except openai.AuthenticationError:
            ok = False
        if ok != want_ok:
            return False
    return True


def test_a_key_issued_through_the_operator_api_works_everywhere_and_revocation_follows(
    fleet: str, fleet_store: Path
) -> None:
    created = _admin(fleet, "POST", "/tenants", json={"id": "initech", "weight": 2})
    assert created.status_code == 200, created.text
    assert created.json()["weight"] == 2.0
    issued = _admin(fleet, "POST", "/tenants/initech/keys", json={"name": "ci"})
    assert issued.status_code == 200, issued.text
    secret, key_id = issued.json()["key"], issued.json()["id"]
    started = time.monotonic()
    wait_for(lambda: _every_ingress_answers(fleet, secret, True), 5, "the new key on every ingress replica")
    assert time.monotonic() - started < 5
    api = openai.OpenAI(base_url=f"{fleet}/v1", api_key=secret, max_retries=0, timeout=120)
    reply = api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    listed = _admin(fleet, "GET", "/tenants/initech/keys").json()
    assert [k["id"] for k in listed["data"]] == [key_id] and secret not in json.dumps(listed)
    # stored as a digest only, and in no log: this Ray session's (the one whose proxy logged these calls)
    assert not any(secret.encode() in f.read_bytes() for f in fleet_store.rglob("*") if f.is_file())
    marker = "POST /fleet/v1/admin/tenants/{tenant_id}/keys"  # how Serve's proxy logs the call
    wait_for(lambda: bool(_ray_session_logs(marker)), 10, "Serve's proxy to log the admin calls")
    logs = _ray_session_logs(marker)
    assert not any(secret.encode() in f.read_bytes() for f in logs)
    assert _admin(fleet, "DELETE", f"/tenants/initech/keys/{key_id}").status_code == 200
    wait_for(lambda: _every_ingress_answers(fleet, secret, False), 5, "the revoked key refused everywhere")


def test_a_tenants_limits_change_live_and_leave_other_tenants_alone(fleet: str) -> None:
    assert _admin(fleet, "POST", "/tenants", json={"id": "umbrella"}).status_code == 200
    secret = _admin(fleet, "POST", "/tenants/umbrella/keys").json()["key"]
    wait_for(lambda: _every_ingress_answers(fleet, secret, True), 5, "the new key on every ingress replica")
    api = openai.OpenAI(base_url=f"{fleet}/v1", api_key=secret, max_retries=0, timeout=120)
    for _ in range(3):  # no limit yet
        api.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0)
    patched = _admin(fleet, "PATCH", "/tenants/umbrella", json={"limits": {"tokens_per_minute": 1}})
    assert patched.status_code == 200 and patched.json()["limits"]["tokens_per_minute"] == 1

    def limited() -> bool:
        try:
            api.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0)
        except openai.RateLimitError as refused:
            assert refused.response.headers.get("retry-after")
            assert refused.body["code"] == "tokens_per_minute_exceeded"  # type: ignore[index]
            return True
        return False

    wait_for(limited, 5, "the new tokens-per-minute limit in force")
    client(fleet).completions.create(
        model="tiny", prompt="Hello", max_tokens=4, temperature=0
    )  # acme: unaffected


def test_operator_api_refuses_bad_input_in_openais_error_shape(fleet: str) -> None:
    assert _admin(fleet, "POST", "/tenants", json={"id": "hooli"}).status_code == 200
    cases = [
        (_admin(fleet, "POST", "/tenants", json={"id": "hooli"}), 409, None),
        (_admin(fleet, "POST", "/tenants", json={"id": "x", "limits": {"tokens_per_minute": -1}}), 400,
         "limits.tokens_per_minute"),
        (_admin(fleet, "POST", "/tenants", json={"id": "bad id"}), 400, "id"),
        (_admin(fleet, "PATCH", "/tenants/nobody", json={"weight": 2}), 404, None),
        (_admin(fleet, "POST", "/tenants/nobody/keys"), 404, None),
        (_admin(fleet, "DELETE", "/tenants/hooli/keys/key_nope"), 404, None),
        (_admin(fleet, "GET", "/tenants", key=KEY), 403, None),
        (_admin(fleet, "GET", "/tenants", key="sk-nobody"), 401, None),
    ]  # fmt: skip
    for reply, status, param in cases:
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert error["message"] and error["type"]
        if param is not None:
            assert error["param"] == param
    tenants = _admin(fleet, "GET", "/tenants").json()["data"]
    assert "x" not in {t["id"] for t in tenants}  # nothing half-written


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_an_ingress_killed_mid_stream_has_its_requests_aborted_and_metered_once(
    fleet: str, fleet_store: Path, endpoint: str
) -> None:
    """Both ingress replicas killed (SIGKILL) under 6 long streams: the LLM replicas abort the
    streams' requests within about 2 s (they would run for minutes), each is metered once,
    `cancelled`, with at least the tokens its client received; the ingress is back afterwards."""
    import signal
    import threading

    from tandem.platform.object_store import FileObjectStore
    from tandem.platform.usage_query import read_records

    started = time.time()
    tenant = f"orphan-{endpoint}"
    assert (
        _admin(
            fleet, "POST", "/tenants", json={"id": tenant, "limits": {"max_concurrent_requests": 16}}
        ).status_code
        == 200
    )
    secret = _admin(fleet, "POST", f"/tenants/{tenant}/keys").json()["key"]
    wait_for(lambda: _every_ingress_answers(fleet, secret, True), 5, "the new key on every ingress replica")
    api = openai.OpenAI(base_url=f"{fleet}/v1", api_key=secret, max_retries=0, timeout=120)
    received: dict[str, int] = {}  # request id -> chunks with a token its client received
    flowing = threading.Barrier(7)

    def stream(i: int) -> None:
        if endpoint == "chat":
            chunks: Any = api.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"Orphan {i}"}], max_tokens=4000, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
        else:
            chunks = api.completions.create(
                model="tiny",
                prompt=f"Orphan {i}",
                max_tokens=4000,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        try:
            for n, chunk in enumerate(chunks):
                has_token = bool(chunk.choices) and bool(
                    chunk.choices[0].delta.content if endpoint == "chat" else chunk.choices[0].text
                )
                received[chunk.id] = received.get(chunk.id, 0) + int(has_token)
                if n == 3:
                    flowing.wait(timeout=60)
        except (openai.APIError, httpx.HTTPError, ValueError):
            pass  # the ingress died under it: the stream is cut

    import httpx

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(6)]
    for thread in threads:
        thread.start()
    flowing.wait(timeout=60)  # every stream has its tokens flowing
    running = sum(s.get("num_running", 0) for s in fresh_board(time.time()).values())
    assert running >= 6, running  # still running in the engines, minutes from their end
    ingress_pids = _ingress_pids()
    assert len(ingress_pids) == 2, ingress_pids
    for pid in ingress_pids:
        os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(lambda: all(s.get("num_running", 0) == 0 for s in fresh_board(time.time()).values()), 10,
             "the engines to stop the orphaned requests")  # fmt: skip
    stopped_s = time.monotonic() - killed_at
    assert stopped_s < 4.0, stopped_s  # 2 s to notice and abort, plus the board's reporting period
    for thread in threads:
        thread.join(timeout=30)
    assert len(received) == 6, received
    store = FileObjectStore(str(fleet_store))

    def mine() -> list[Any]:
        return [r for r in read_records(store, started - 5, time.time() + 5) if r.request_id in received]

    wait_for(lambda: len(mine()) >= 6, 30, "the orphaned streams' usage records")
    records = mine()
    assert Counter(r.request_id for r in records) == Counter(list(received)), records
    for record in records:
        assert record.status == "cancelled" and record.tenant == tenant, record
        assert received[record.request_id] <= record.output_tokens < 4000, (
            record,
            received[record.request_id],
        )
    wait_for(lambda: len(_ingress_pids()) == 2 and _every_ingress_answers(fleet, secret, True), 90,
             "both ingress replicas replaced")  # fmt: skip


def test_a_batch_worker_killed_mid_batch_never_stalls_real_time_streams(fleet: str) -> None:
    """A batch runs and a real-time stream flows; the batch worker is killed (SIGKILL): the
    stream's tokens keep coming (no gap over 0.75 s: the engines' stats and routing once stalled
    for 8-10 s, and the end of each of the dead worker's streams stalled the replica's other
    streams for Ray's one-second waits, `orphans.py`), the dead worker's requests are aborted,
    its shards are taken over by its replacement and the batch completes with every line once."""
    import signal
    import threading

    import psutil

    api = client(fleet)
    lines = [
        json.dumps(
            {
                "custom_id": f"w{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "tiny", "prompt": f"Work {i}", "max_tokens": 200, "ignore_eos": True},
            }
        )  # fmt: skip
        for i in range(32)
    ]
    file_id = api.files.create(
        file=("in.jsonl", io.BytesIO(("\n".join(lines) + "\n").encode())), purpose="batch"
    ).id
    batch = api.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    arrivals: list[float] = []
    done = threading.Event()

    def realtime() -> None:
        while not done.is_set():
            for _ in api.completions.create(
                model="tiny", prompt="Steady", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
            ):
                arrivals.append(time.monotonic())
                if done.is_set():
                    break

    reader = threading.Thread(target=realtime, daemon=True)
    reader.start()
    wait_for(lambda: api.batches.retrieve(batch.id).request_counts.completed > 0, 120, "the batch to start")
    workers = [
        proc.pid
        for proc in psutil.Process().children(recursive=True)
        if f"ServeReplica:{APP}:BatchWorker" in " ".join(proc.cmdline())
    ]
    assert workers, "no batch worker process"
    before = len(arrivals)
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    finished = wait_for_batch(api, batch.id, 180)
    finished_at = time.monotonic()
    done.set()
    reader.join(timeout=60)
    after = [(b - a, a - killed_at) for a, b in itertools.pairwise(arrivals[before:]) if a >= killed_at]
    gaps_before = [b - a for a, b in itertools.pairwise(arrivals[:before])]
    assert after and gaps_before
    gap_s, gap_at_s = max(after)
    print(f"inter-token gap p99 before {sorted(gaps_before)[int(0.99 * len(gaps_before))]:.4f} s, "
          f"after the kill {sorted(after)[int(0.99 * len(after))][0]:.4f} s, max after {gap_s:.3f} s "
          f"from {gap_at_s:.3f} s after the kill; the batch ended {finished_at - killed_at:.1f} s after it")  # fmt: skip
    assert gap_s < 0.75, (gap_s, gap_at_s)
    assert finished.status == "completed" and finished.request_counts.completed == 32, finished
    output = api.files.content(finished.output_file_id or "").text.splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in output) == sorted(f"w{i}" for i in range(32))


def _ingress_pids() -> list[int]:
    import psutil

    return [
        proc.pid
        for proc in psutil.Process().children(recursive=True)
        if f"ServeReplica:{APP}:OpenAIIngress" in " ".join(proc.cmdline()) and proc.is_running()
    ]


def wait_for_batch(api: openai.OpenAI, batch_id: str, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            batch = api.batches.retrieve(batch_id)
            if batch.status in ("completed", "failed", "expired", "cancelled"):
                return batch
        except openai.APIError:  # the API is being restarted
            pass
        assert time.monotonic() < deadline, "the batch did not finish"
        time.sleep(0.2)


def test_a_killed_tenant_budget_shard_is_replaced_and_limits_hold_after(fleet: str) -> None:
    """The tenant budget shard killed (SIGKILL): Serve replaces it; its counts start from zero and
    the ingress replicas' leases start over, so the tenant's limit of 2 holds again once the
    slots the replicas still held have lingered out (0.5 s, and a reconcile: until then they
    count twice)."""
    import signal

    import psutil

    shard_pids = [
        proc.pid
        for proc in psutil.Process().children(recursive=True)
        if f"ServeReplica:{APP}:TenantBudget-0" in " ".join(proc.cmdline())
    ]
    assert len(shard_pids) == 1, shard_pids
    os.kill(shard_pids[0], signal.SIGKILL)

    async def three() -> list[str]:
        api = openai.AsyncOpenAI(base_url=f"{fleet}/v1", api_key=KEY, max_retries=0, timeout=120)
        decided = asyncio.Event()
        outcomes: list[str] = []

        def note(outcome: str) -> None:
            outcomes.append(outcome)
            if len(outcomes) == 3:
                decided.set()

        async def one() -> None:
            try:
                stream = await api.completions.create(
                    model="tiny", prompt="x", max_tokens=3000, stream=True, extra_body={"ignore_eos": True}
                )
                async for _ in stream:
                    note("ok")
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(decided.wait(), 20)
                    break
                await stream.close()
            except openai.RateLimitError:
                note("429")
            except openai.APIError:
                note("error")  # the shard not yet replaced: a lease that could not be asked

        await asyncio.wait_for(asyncio.gather(*(one() for _ in range(3))), timeout=120)
        return outcomes

    deadline = time.monotonic() + 30
    while True:  # until the replaced shard answers and the old leases have lingered out
        outcomes = asyncio.run(three())
        if sorted(outcomes) == ["429", "ok", "ok"]:
            break
        assert time.monotonic() < deadline, outcomes
