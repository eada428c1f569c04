"""Usage metering: records stored exactly once (lost answers, a store that is down, batch shards
written twice), read back in OpenAI's usage API shape, and metered by a real server for streamed,
non-streamed, cancelled and failed requests (the official `openai` client over uvicorn); on the
local object store and on a real S3 server (SeaweedFS)."""

from __future__ import annotations

import asyncio
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
from tandem.batch.records import BatchRecord
from tandem.batch.shards import BatchResult, decode_results, encode_results
from tandem.batch.usage import write_shard_usage
from tandem.deployments.engine_clients import LocalEngineClient
from tandem.deployments.ingress import create_app
from tandem.deployments.openai.server import OpenAIServer
from tandem.platform.api_keys import bootstrap_key_id, hash_key, parse_keys, parse_operator_keys
from tandem.platform.errors import InvalidRequestError
from tandem.platform.object_store import FileObjectStore, ObjectStore, S3ObjectStore, StoredObject
from tandem.platform.telemetry import get_telemetry
from tandem.platform.tenancy import TenantRegistry
from tandem.platform.usage_log import UsageLog
from tandem.platform.usage_query import parse_usage_query, read_records, usage_page
from tandem.platform.usage_records import USAGE_PREFIX, UsageRecord, encode_records

from .conftest import S3_BUCKET, serve_app

KEY_A, KEY_B, OPERATOR_KEY = "sk-usage-a", "sk-usage-b", "sk-usage-operator"


def record(request_id: str, finished_at: float, **fields: Any) -> UsageRecord:
    values: dict[str, Any] = dict(
        request_id=request_id, tenant="acme", api_key_id="key_1", model="tiny", adapter=None, input_tokens=10,
        cached_tokens=2, output_tokens=5, accepted_draft_tokens=0, status="completed", finish_reason="stop",
        priority="interactive", batch_id=None, started_at=finished_at - 1, finished_at=finished_at, latency_s=1.0,
    )  # fmt: skip
    values.update(fields)
    return UsageRecord(**values)


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    """The local store, then a fresh prefix of the session's SeaweedFS bucket."""
    if request.param == "file":
        return FileObjectStore(str(tmp_path / "objects"))
    settings = request.getfixturevalue("s3_server")
    return S3ObjectStore(S3_BUCKET, prefix=f"usage-{uuid.uuid4().hex[:8]}", settings=settings)


class FlakyStore(ObjectStore):
    """A store whose puts under `usage/` fail on purpose: the first one is written but its answer
    is lost (raises after the write), the next `num_down` raise before writing."""

    def __init__(self, inner: ObjectStore, num_down: int = 2) -> None:
        self.inner = inner
        self.url = self.inner.url
        self.lost_answer_done = False
        self.num_down = num_down
        self.num_puts = 0

    def get(self, key: str) -> StoredObject:
        return self.inner.get(key)

    def head(self, key: str) -> str | None:
        return self.inner.head(key)

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        self.num_puts += 1
        if key.startswith(USAGE_PREFIX) and not self.lost_answer_done:
            self.lost_answer_done = True
            self.inner.put(key, data, if_none_match=if_none_match, if_match=if_match)
            raise ConnectionError("the answer to this write was lost")
        if key.startswith(USAGE_PREFIX) and self.num_down > 0:
            self.num_down -= 1
            raise ConnectionError("the store is down")
        return self.inner.put(key, data, if_none_match=if_none_match, if_match=if_match)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)


def test_records_are_stored_once_through_lost_answers_and_an_outage(store: ObjectStore) -> None:
    store = FlakyStore(store)
    log = UsageLog(store, commit_interval_s=0.01)
    now = time.time()

    async def commit_all() -> list[bool]:
        return await asyncio.gather(*(log.commit(record(f"r{i}", now)) for i in range(50)))

    assert all(asyncio.run(commit_all()))
    assert log.flush(timeout_s=30)
    stored = list(read_records(store, now - 10, now + 10))
    assert sorted(r.request_id for r in stored) == sorted(f"r{i}" for i in range(50))
    assert store.lost_answer_done and store.num_down == 0  # both failures happened and were retried
    assert log.num_committed == 50
    log.close()


def test_a_commit_never_waits_on_a_store_that_is_down_and_the_record_is_stored_later(tmp_path: Path) -> None:
    store = FlakyStore(FileObjectStore(str(tmp_path)), num_down=3)  # then the retries take 0.1 + 0.2 + 0.5 s
    log = UsageLog(store, commit_interval_s=0.0)
    now = time.time()
    started = time.monotonic()
    assert asyncio.run(log.commit(record("late", now), timeout_s=5.0)) is True  # on local disk
    assert time.monotonic() - started < 0.5
    assert log.flush(timeout_s=30)
    assert store.num_down == 0  # the store refused three times before it took the record
    assert [r.request_id for r in read_records(store, now - 1, now + 1)] == ["late"]


def test_records_land_in_the_partition_of_their_finish_hour(store: ObjectStore) -> None:
    log = UsageLog(store, commit_interval_s=0.0)
    hour = 1_800_000_000 // 3600 * 3600
    for i, at in enumerate((hour + 10, hour + 3599.5, hour + 3600, hour + 7300)):
        log.submit(record(f"h{i}", at))
    assert log.flush()
    keys = store.list(USAGE_PREFIX)
    assert len({k.rsplit("/", 1)[0] for k in keys}) == 3, keys
    assert [r.request_id for r in read_records(store, hour, hour + 3600)] in (["h0", "h1"], ["h1", "h0"])
    assert [r.request_id for r in read_records(store, hour + 3600, hour + 3601)] == ["h2"]


def test_usage_page_buckets_groups_and_filters(tmp_path: Path) -> None:
    store = FileObjectStore(str(tmp_path))
    log = UsageLog(store, commit_interval_s=0.0)
    day = 1_700_000_000 // 86400 * 86400
    log.submit(record("a1", day + 60, input_tokens=100, cached_tokens=40, output_tokens=7))
    log.submit(
        record(
            "a2", day + 61, model="tiny:bot", adapter="bot", input_tokens=1, cached_tokens=0, output_tokens=2
        )
    )
    log.submit(
        record("b1", day + 4000, tenant="globex", api_key_id="key_2", priority="batch", batch_id="batch_x")
    )
    log.submit(record("f1", day + 62, status="failed", output_tokens=99))  # recorded, not billed
    log.submit(record("c1", day + 63, status="cancelled", input_tokens=3, cached_tokens=0, output_tokens=1))
    log.submit(record("late", day + 86400 + 5))
    assert log.flush()
    # a stream its ingress recorded `cancelled` and its LLM replica too (the ingress died a
    # moment after: orphans.py): two writers, one request, counted once
    for writer, finished_at in (("ingress", day + 64), ("replica", day + 67)):
        other = UsageLog(store, commit_interval_s=0.0, writer_id=writer)
        other.submit(
            record("c2", finished_at, status="cancelled", input_tokens=50, cached_tokens=0, output_tokens=20)
        )
        assert other.flush()
        other.close()
    assert [r.request_id for r in read_records(store, day, day + 86400)].count("c2") == 2

    def page(**params: Any) -> dict[str, Any]:
        query = parse_usage_query({k: v if isinstance(v, list) else [str(v)] for k, v in params.items()})
        return usage_page(store, query)

    whole = page(start_time=day, end_time=day + 86400)
    assert whole["object"] == "page" and not whole["has_more"] and whole["next_page"] is None
    [bucket] = whole["data"]
    assert (bucket["object"], bucket["start_time"], bucket["end_time"]) == ("bucket", day, day + 86400)
    [total] = bucket["results"]
    assert total["object"] == "organization.usage.completions.result"
    assert (total["input_tokens"], total["input_cached_tokens"], total["output_tokens"]) == (164, 42, 35)
    assert total["num_model_requests"] == 5 and total["model"] is None and total["project_id"] is None

    by_model = page(start_time=day, end_time=day + 86400, group_by=["model", "project_id"])["data"][0][
        "results"
    ]
    assert {(r["model"], r["project_id"]): r["output_tokens"] for r in by_model} == {
        ("tiny", "acme"): 28, ("tiny:bot", "acme"): 2, ("tiny", "globex"): 5
    }  # fmt: skip
    hourly = page(start_time=day, end_time=day + 7200, bucket_width="1h", group_by="batch")["data"]
    assert [[(r["batch"], r["num_model_requests"]) for r in b["results"]] for b in hourly] == [
        [(False, 4)], [(True, 1)]
    ]  # fmt: skip
    only = page(start_time=day, end_time=day + 86400, project_ids="globex", batch="true")["data"][0][
        "results"
    ]
    assert [r["num_model_requests"] for r in only] == [1]
    assert page(start_time=day, end_time=day + 86400, api_key_ids="key_9")["data"][0]["results"] == []
    # pages of minute buckets, empty ones included, then the next page from its cursor
    first = page(start_time=day, end_time=day + 86400, bucket_width="1m", limit=2)
    assert [b["start_time"] for b in first["data"]] == [day, day + 60] and first["has_more"]
    assert first["data"][0]["results"] == [] and first["data"][1]["results"][0]["num_model_requests"] == 4
    second = page(start_time=day, end_time=day + 86400, bucket_width="1m", limit=2, page=first["next_page"])
    assert [b["start_time"] for b in second["data"]] == [day + 120, day + 180]
    for params, param in (
        ({}, "start_time"),
        ({"start_time": day, "bucket_width": "2h"}, "bucket_width"),
        ({"start_time": day, "group_by": "colour"}, "group_by"),
        ({"start_time": day, "end_time": day - 1}, "end_time"),
        ({"start_time": day, "bucket_width": "1h", "limit": 169}, "limit"),
        ({"start_time": "yesterday"}, "start_time"),
        ({"start_time": day, "page": "abc"}, "page"),
        ({"start_time": day, "batch": "maybe"}, "batch"),
    ):
        with pytest.raises(InvalidRequestError) as bad:
            page(**params)
        assert bad.value.param == param


def test_a_batch_shard_is_metered_once_however_often_it_is_written(store: ObjectStore) -> None:
    batch = BatchRecord(
        id="batch_abc", tenant="acme", endpoint="/v1/completions", input_file_id="file-1",
        completion_window="24h", status="in_progress", created_at=0, expires_at=10**10, api_key_id="key_7",
    )  # fmt: skip
    now = time.time()
    rows = [
        BatchResult(1, "c1", "cmpl-1", 200, {"model": "tiny", "choices": [{"finish_reason": "length"}]}, None,
                    input_tokens=5, output_tokens=8, model="tiny", cached_tokens=1, started_at=now - 2, finished_at=now),
        BatchResult(2, "c2", "req-2", 400, {"error": {"message": "bad"}}, None, model="tiny",
                    started_at=now - 1, finished_at=now),
        BatchResult(3, "c3", "cmpl-3", 200, {"model": "tiny"}, None, input_tokens=9, output_tokens=9),  # pre-metering row
    ]  # fmt: skip
    rows = decode_results(encode_results(rows))  # as committed
    assert write_shard_usage(store, batch, 0, rows) == 1
    assert write_shard_usage(store, batch, 0, rows) == 0  # the finalizer's second write: a no-op
    stored = {r.request_id: r for r in read_records(store, now - 10, now + 10)}
    assert set(stored) == {"cmpl-1", "req-2"}
    one = stored["cmpl-1"]
    assert (one.priority, one.batch_id, one.api_key_id, one.status, one.finish_reason) == (
        "batch", "batch_abc", "key_7", "completed", "length"
    )  # fmt: skip
    assert (one.input_tokens, one.cached_tokens, one.output_tokens) == (5, 1, 8)
    assert stored["req-2"].status == "failed"


# -- a real server ----------------------------------------------------------------------------
@pytest.fixture()
def metered(engine: AsyncEngine, store: ObjectStore) -> Iterator[tuple[str, ObjectStore]]:
    tenants = TenantRegistry(
        parse_keys(f"{KEY_A}=acme,{KEY_B}=globex"), operator_keys=parse_operator_keys(OPERATOR_KEY)
    )
    usage_log = UsageLog(store, commit_interval_s=0.05, on_committed=get_telemetry().record_usage)
    server = OpenAIServer(LocalEngineClient(engine), tenants, usage_log=usage_log)
    with serve_app(create_app(server)) as base_url:
        yield base_url, store
    usage_log.close()


def _usage(base_url: str, key: str, **params: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.get(
        f"{base_url}/v1/organization/usage/completions", params=params, headers=headers, timeout=30
    )


def test_a_server_meters_each_request_once_as_its_response_reported(
    metered: tuple[str, ObjectStore], engine: AsyncEngine
) -> None:
    base_url, store = metered
    started = int(time.time())
    api = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY_A, max_retries=0, timeout=60)
    reported: dict[str, tuple[int, int]] = {}  # request id -> (prompt, completion tokens) the client saw
    done = api.completions.create(
        model="tiny", prompt="Usage one", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert done.usage is not None
    reported[done.id] = (done.usage.prompt_tokens, done.usage.completion_tokens)
    # on the server's local disk before the response came back, in the store within the ship
    # interval (0.05 s here)
    deadline = time.monotonic() + 10
    while [r.request_id for r in read_records(store, started - 1, time.time() + 1)] != [done.id]:
        assert time.monotonic() < deadline, "the record did not reach the store within 10 s"
        time.sleep(0.05)
    chat = api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Usage two"}], max_tokens=4, n=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert chat.usage is not None
    reported[chat.id] = (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    chunks = list(
        api.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Usage three"}], max_tokens=6, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    last = chunks[-1].usage
    assert last is not None
    reported[chunks[0].id] = (last.prompt_tokens, last.completion_tokens)
    # a stream the client leaves after two chunks: recorded `cancelled`, with what it was sent
    stream = api.completions.create(
        model="tiny", prompt="Usage four", max_tokens=500, stream=True, extra_body={"ignore_eos": True}
    )
    seen = [next(iter(stream)), next(iter(stream))]
    cancelled_id = seen[0].id
    stream.close()
    # a request the engine refuses: recorded `failed` where the engine had it, never billed
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model="tiny", prompt=[5] * (engine.engine.max_model_len - 2), max_tokens=13)
    other = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY_B, max_retries=0, timeout=60)
    theirs = other.completions.create(model="tiny", prompt="Globex", max_tokens=3)
    assert theirs.usage is not None

    def records() -> list[UsageRecord]:
        return list(read_records(store, started - 1, time.time() + 1))

    deadline = time.monotonic() + 10
    while not {cancelled_id, theirs.id, *reported} <= {r.request_id for r in records()}:
        assert time.monotonic() < deadline, "the records did not reach the store within 10 s"
        time.sleep(0.05)  # the server learns of the disconnect on its own schedule
    stored = records()
    counts = Counter(r.request_id for r in stored)
    assert all(n == 1 for n in counts.values()), counts
    by_id = {r.request_id: r for r in stored}
    for request_id, (prompt, completion) in reported.items():
        mine = by_id[request_id]
        assert (mine.status, mine.input_tokens, mine.output_tokens) == ("completed", prompt, completion)
        assert (mine.tenant, mine.api_key_id, mine.priority) == (
            "acme",
            bootstrap_key_id(hash_key(KEY_A)),
            "interactive",
        )
    gone = by_id[cancelled_id]
    assert gone.status == "cancelled" and 2 <= gone.output_tokens < 500, gone
    assert all(r.status != "failed" or r.output_tokens == 0 for r in stored)

    # the usage API: a tenant sees its own; billed = what the responses reported, plus what the
    # cancelled stream was sent; failures are not billed
    page = _usage(base_url, KEY_A, start_time=started - 60, bucket_width="1h", group_by="project_id")
    assert page.status_code == 200, page.text
    results = [r for bucket in page.json()["data"] for r in bucket["results"]]
    assert {r["project_id"] for r in results} == {"acme"}
    assert sum(r["input_tokens"] for r in results) == sum(p for p, _ in reported.values()) + gone.input_tokens
    assert (
        sum(r["output_tokens"] for r in results) == sum(c for _, c in reported.values()) + gone.output_tokens
    )
    assert sum(r["num_model_requests"] for r in results) == len(reported) + 1
    everyone = _usage(base_url, OPERATOR_KEY, start_time=started - 60, group_by=["project_id"]).json()
    assert {r["project_id"] for b in everyone["data"] for r in b["results"]} == {"acme", "globex"}
    refused = {
        403: _usage(base_url, KEY_A, start_time=started, project_ids="globex"),
        401: _usage(base_url, "sk-nobody", start_time=started),
        400: _usage(base_url, OPERATOR_KEY, start_time=started, bucket_width="1w"),
    }
    for status, reply in refused.items():
        assert reply.status_code == status, reply.text
        assert reply.json()["error"]["message"]
    assert refused[400].json()["error"]["param"] == "bucket_width"


def test_usage_is_404_without_an_object_store(engine: AsyncEngine) -> None:
    tenants = TenantRegistry(parse_keys(f"{KEY_A}=acme"))
    with serve_app(create_app(OpenAIServer(LocalEngineClient(engine), tenants))) as base_url:
        reply = _usage(base_url, KEY_A, start_time=0)
    assert reply.status_code == 404 and reply.json()["error"]["message"]


def test_usage_counters_per_tenant_on_metrics(metered: tuple[str, ObjectStore]) -> None:
    base_url, _ = metered
    api = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY_B, max_retries=0, timeout=60)
    api.completions.create(model="tiny", prompt="Counted", max_tokens=3, extra_body={"ignore_eos": True})
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {OPERATOR_KEY}"}).text
    lines = [
        line
        for line in text.splitlines()
        if line.startswith("tandem_usage_output_tokens") and 'tenant="globex"' in line
    ]
    assert lines and float(lines[0].rsplit(" ", 1)[1]) >= 3, lines


def test_compacted_hours_count_every_record_once_whatever_stops_where(store: ObjectStore) -> None:
    """An hour's objects merged into one: a reader counts each record once before, during (a
    compactor stopped between its write and its deletes), after, with an object that landed late,
    and when a second compactor that listed more objects finishes the job; the open hour is left
    alone."""
    from tandem.platform.usage_compaction import compact_closed_hours, compact_hour, compacted_key
    from tandem.platform.usage_records import hour_of, partition_prefix, realtime_key

    hour_start = (int(time.time()) // 3600 - 3) * 3600
    hour = hour_of(hour_start)
    for seq in range(4):  # four flushes of one writer, three records each
        records = [record(f"c{seq}-{i}", hour_start + 60 * seq + i) for i in range(3)]
        store.put(realtime_key(hour, "w1", seq), encode_records(records), if_none_match=True)

    def counted() -> Counter[str]:
        return Counter(r.request_id for r in read_records(store, hour_start, hour_start + 3600))

    want = counted()
    assert len(want) == 12 and set(want.values()) == {1}

    class StopsAtItsDeletes(FlakyStore):
        """The compactor stops at its first delete, after its compacted object is written."""

        def delete(self, key: str) -> None:
            raise ConnectionError("the compactor stopped here")

    stopper = StopsAtItsDeletes(store, num_down=0)
    stopper.lost_answer_done = True  # its put is answered: it stops at the deletes
    with pytest.raises(ConnectionError, match="stopped here"):
        compact_hour(stopper, hour)
    assert compacted_key(hour) in store.list(partition_prefix(hour))
    assert counted() == want  # the compacted object and the not yet deleted sources: once each
    store.put(
        realtime_key(hour, "w2", 0), encode_records([record("late", hour_start + 3000)]), if_none_match=True
    )
    assert compact_hour(store, hour) >= 1  # a second run finishes the deletes, keeps the late one
    keys = store.list(partition_prefix(hour))
    assert sorted(keys) == sorted([compacted_key(hour), realtime_key(hour, "w2", 0)])
    assert counted() == want + Counter({"late": 1})
    assert compact_hour(store, hour) == 0  # nothing left to delete: the late object stays beside it
    open_hour = hour_of(time.time())
    store.put(
        realtime_key(open_hour, "w1", 0), encode_records([record("now-a", time.time())]), if_none_match=True
    )
    store.put(
        realtime_key(open_hour, "w1", 1), encode_records([record("now-b", time.time())]), if_none_match=True
    )
    compact_closed_hours(store)
    assert compacted_key(open_hour) not in store.list(partition_prefix(open_hour))
