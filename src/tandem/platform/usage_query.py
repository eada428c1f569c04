"""Usage read back in the shape of OpenAI's `GET /v1/organization/usage/completions`.

Query parameters (as OpenAI's): `start_time` (required, epoch seconds, inclusive), `end_time`
(exclusive, default now), `bucket_width` `1m` | `1h` | `1d` (default `1d`), `group_by` any of
`project_id` (the tenant), `api_key_id`, `model`, `batch`, `user_id` (always null here), `limit`
buckets per page (defaults and maxima per width as OpenAI's: 60/1440, 24/168, 7/31), `page` (the
previous page's `next_page`), and the filters `project_ids`, `api_key_ids`, `models`, `batch`.
List parameters may repeat (`group_by=model&group_by=batch`), use `group_by[]`, or be
comma-separated. A bad value is a 400 naming the parameter.

Buckets are aligned to their width in UTC and each page lists every bucket of its range, empty
ones with `results: []`, as OpenAI does. A record counts in the bucket of its `finished_at`, when
that lies in [start_time, end_time), unless it `failed` (`BILLED_STATUSES`). A real-time
request's `cancelled` records count once per page (`first_cancelled`): the LLM replica records
a stream whose caller died, and a caller that recorded a stream its client left, then died a
moment later, may be taken for one that died before (deployments/orphans.py); the two records
name the same request id (the ingress makes it, unique) and finish seconds apart.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.platform.errors import InvalidRequestError
from tandem.platform.object_store import ObjectStore
from tandem.platform.usage_compaction import partition_keys
from tandem.platform.usage_records import UsageRecord, decode_records, partitions_between

BUCKET_WIDTH_S = {"1m": 60, "1h": 3600, "1d": 86400}
BUCKET_LIMITS = {"1m": (60, 1440), "1h": (24, 168), "1d": (7, 31)}  # width -> (default, max) buckets per page
GROUP_FIELDS = ("project_id", "user_id", "api_key_id", "model", "batch")
# What the usage API counts: requests that answered, and streams their clients left (the tokens
# they were sent). A `failed` request (the engine or the server failed it) is recorded, not billed.
BILLED_STATUSES = frozenset({"completed", "cancelled"})


@dataclass(frozen=True)
class UsageQuery:
    start_time: int
    end_time: int
    bucket_width: str = "1d"
    group_by: tuple[str, ...] = ()
    limit: int = 7
    page: int | None = None  # the first bucket's start on this page
    project_ids: frozenset[str] | None = None
    api_key_ids: frozenset[str] | None = None
    models: frozenset[str] | None = None
    batch: bool | None = None

    @property
    def width_s(self) -> int:
        return BUCKET_WIDTH_S[self.bucket_width]

    def matches(self, record: UsageRecord) -> bool:
        return (
            record.status in BILLED_STATUSES
            and self.start_time <= record.finished_at < self.end_time
            and (self.project_ids is None or record.tenant in self.project_ids)
            and (self.api_key_ids is None or record.api_key_id in self.api_key_ids)
            and (self.models is None or record.model in self.models)
            and (self.batch is None or (record.priority == "batch") == self.batch)
        )


def _values(params: Mapping[str, Sequence[str]], name: str) -> list[str]:
    """Every value of a list parameter: repeated, `name[]`, or comma-separated."""
    raw = [*params.get(name, ()), *params.get(f"{name}[]", ())]
    return [part.strip() for value in raw for part in value.split(",") if part.strip()]


def _one(params: Mapping[str, Sequence[str]], name: str) -> str | None:
    values = params.get(name, ())
    if len(values) > 1:
        raise InvalidRequestError(f"{name} is given {len(values)} times; give it once", param=name)
    return values[0] if values else None


def _int(params: Mapping[str, Sequence[str]], name: str) -> int | None:
    value = _one(params, name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise InvalidRequestError(f"{name} must be an integer, not {value!r}", param=name) from None


def _bool(params: Mapping[str, Sequence[str]], name: str) -> bool | None:
    value = _one(params, name)
    if value is None:
        return None
    if value.lower() not in ("true", "false"):
        raise InvalidRequestError(f"{name} must be true or false, not {value!r}", param=name)
    return value.lower() == "true"


def parse_usage_query(params: Mapping[str, Sequence[str]], now: float | None = None) -> UsageQuery:
    """The query of a request's parameters (name -> its values); 400 naming a bad one."""
    start_time = _int(params, "start_time")
    if start_time is None:
        raise InvalidRequestError("start_time is required (epoch seconds)", param="start_time")
    end_time = _int(params, "end_time")
    if end_time is None:
        end_time = int(now if now is not None else time.time()) + 1
    if end_time <= start_time:
        raise InvalidRequestError("end_time must be after start_time", param="end_time")
    width = _one(params, "bucket_width") or "1d"
    if width not in BUCKET_WIDTH_S:
        raise InvalidRequestError(
            f"bucket_width must be one of {', '.join(BUCKET_WIDTH_S)}, not {width!r}", param="bucket_width"
        )
    group_by = _values(params, "group_by")
    for name in group_by:
        if name not in GROUP_FIELDS:
            raise InvalidRequestError(
                f"group_by {name!r} is not supported; use any of {', '.join(GROUP_FIELDS)}", param="group_by"
            )
    default_limit, max_limit = BUCKET_LIMITS[width]
    limit = _int(params, "limit")
    if limit is not None and not 1 <= limit <= max_limit:
        raise InvalidRequestError(f"limit must be 1 to {max_limit} for bucket_width {width}", param="limit")
    page = _one(params, "page")
    page_start = None
    if page is not None:
        if not page.isdigit() or int(page) % BUCKET_WIDTH_S[width]:
            raise InvalidRequestError("page is not a next_page this query returned", param="page")
        page_start = int(page)

    def ids(name: str) -> frozenset[str] | None:
        values = _values(params, name)
        return frozenset(values) if values else None

    return UsageQuery(
        start_time=start_time,
        end_time=end_time,
        bucket_width=width,
        group_by=tuple(dict.fromkeys(group_by)),
        limit=limit or default_limit,
        page=page_start,
        project_ids=ids("project_ids"),
        api_key_ids=ids("api_key_ids"),
        models=ids("models"),
        batch=_bool(params, "batch"),
    )


def read_records(store: ObjectStore, start_s: float, end_s: float) -> Iterator[UsageRecord]:
    """Every stored record finished in [start_s, end_s), partition by partition."""
    for hour in partitions_between(start_s, end_s):
        for key in partition_keys(store, hour):  # a compacted hour: its object and any late ones
            for record in decode_records(store.get(key).data):
                if start_s <= record.finished_at < end_s:
                    yield record


def first_cancelled(records: Iterator[UsageRecord]) -> Iterator[UsageRecord]:
    """`records` without a real-time `cancelled` record whose request id came before (see the
    module docstring); holds the ids of the cancelled real-time records read, not of every one."""
    seen: set[str] = set()
    for record in records:
        if record.status == "cancelled" and record.priority != "batch":
            if record.request_id in seen:
                continue
            seen.add(record.request_id)
        yield record


def _group_value(record: UsageRecord, name: str) -> str | bool | None:
    if name == "project_id":
        return record.tenant
    if name == "api_key_id":
        return record.api_key_id
    if name == "model":
        return record.model
    if name == "batch":
        return record.priority == "batch"
    return None  # user_id: requests carry no user


def _result(group: dict[str, Any]) -> dict[str, Any]:
    return {
        "object": "organization.usage.completions.result",
        "input_tokens": 0,
        "output_tokens": 0,
        "input_cached_tokens": 0,
        "input_audio_tokens": 0,
        "output_audio_tokens": 0,
        "num_model_requests": 0,
        **{name: group.get(name) for name in GROUP_FIELDS},
    }


def usage_page(store: ObjectStore, query: UsageQuery) -> dict[str, Any]:
    """One page of buckets (OpenAI's `page` object), reading only the partitions it covers."""
    width = query.width_s
    first = query.page if query.page is not None else query.start_time // width * width
    starts: list[int] = []
    bucket = first
    while bucket < query.end_time and len(starts) < query.limit:
        starts.append(bucket)
        bucket += width
    has_more = bucket < query.end_time
    results: dict[int, dict[tuple[Any, ...], dict[str, Any]]] = {start: {} for start in starts}
    if starts:
        lo, hi = max(query.start_time, starts[0]), min(query.end_time, starts[-1] + width)
        for record in first_cancelled(read_records(store, lo, hi)):
            if not query.matches(record):
                continue
            start = int(record.finished_at) // width * width
            values = tuple(_group_value(record, name) for name in query.group_by)
            groups = results[start]
            row = groups.get(values)
            if row is None:
                row = groups[values] = _result(dict(zip(query.group_by, values, strict=True)))
            row["input_tokens"] += record.input_tokens
            row["input_cached_tokens"] += record.cached_tokens
            row["output_tokens"] += record.output_tokens
            row["num_model_requests"] += 1
    data = [
        {
            "object": "bucket",
            "start_time": start,
            "end_time": start + width,
            "results": [groups[key] for key in sorted(groups, key=lambda k: tuple(str(v) for v in k))],
        }
        for start, groups in results.items()
    ]
    return {
        "object": "page",
        "data": data,
        "has_more": has_more,
        "next_page": str(bucket) if has_more else None,
    }
