"""Usage records: one per request, stored as Parquet objects in hourly partitions.

A record is what one request (a real-time request or one line of a batch) used: its tenant and
key, model and adapter, input / cached / output tokens, accepted speculative tokens, how it ended,
its latency and priority, and when it started and ended (seconds since the epoch, UTC).

Layout in the object store, one partition per hour of `finished_at`:

    usage/v1/<YYYY-MM-DD>/<HH>/rt-<writer id>-<seq>.parquet        real-time records of one flush
    usage/v1/<YYYY-MM-DD>/<HH>/batch-<batch id>-<shard>.parquet    one batch shard's lines in that hour

Every object is written once with put-if-absent and never changed: a record is counted once
because each has exactly one object key, fixed before the write (a writer's own sequence, or
the batch shard it belongs to), so a retried write finds its first copy instead of adding one.
Invariant: a record lies in the partition of its own `finished_at` hour, so a reader of a time
range lists only the hours it covers.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq

USAGE_PREFIX = "usage/v1/"

UsageStatus = Literal["completed", "cancelled", "failed"]


@dataclass(frozen=True)
class UsageRecord:
    """What one request used. Token counts are those the response reported (`usage`), or, for a
    request that did not finish (cancelled, failed), what it had produced when it ended."""

    request_id: str
    tenant: str
    api_key_id: str | None  # the key that sent it (a batch line: the key that created the batch)
    model: str  # as the client named it: the base model, or `base:adapter`
    adapter: str | None
    input_tokens: int  # the prompt, cached tokens included
    cached_tokens: int  # of those, served from the prefix cache
    output_tokens: int  # every choice's
    accepted_draft_tokens: int  # speculative draft tokens the model accepted
    status: UsageStatus
    finish_reason: str | None
    priority: Literal["interactive", "batch"]
    batch_id: str | None
    started_at: float  # epoch seconds
    finished_at: float  # epoch seconds; decides the partition and the usage bucket
    latency_s: float


USAGE_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("tenant", pa.string()),
        ("api_key_id", pa.string()),
        ("model", pa.string()),
        ("adapter", pa.string()),
        ("input_tokens", pa.int64()),
        ("cached_tokens", pa.int64()),
        ("output_tokens", pa.int64()),
        ("accepted_draft_tokens", pa.int64()),
        ("status", pa.string()),
        ("finish_reason", pa.string()),
        ("priority", pa.string()),
        ("batch_id", pa.string()),
        ("started_at", pa.float64()),
        ("finished_at", pa.float64()),
        ("latency_s", pa.float64()),
    ]
)
_FIELD_NAMES = [f.name for f in fields(UsageRecord)]
assert USAGE_SCHEMA.names == _FIELD_NAMES, "the schema names every field, in order"


def encode_records(records: Iterable[UsageRecord]) -> bytes:
    """Records as one zstd Parquet object."""
    rows = [asdict(r) for r in records]
    table = pa.Table.from_pylist(rows, schema=USAGE_SCHEMA)
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def decode_records(data: bytes) -> list[UsageRecord]:
    table = pq.read_table(io.BytesIO(data), schema=USAGE_SCHEMA)
    return [UsageRecord(**row) for row in table.to_pylist()]


def hour_of(epoch_s: float) -> str:
    """The partition of a time: 'YYYY-MM-DD/HH' (UTC)."""
    return time.strftime("%Y-%m-%d/%H", time.gmtime(epoch_s))


def partition_prefix(hour: str) -> str:
    return f"{USAGE_PREFIX}{hour}/"


def partitions_between(start_s: float, end_s: float) -> list[str]:
    """The hourly partitions that hold records finished in [start_s, end_s), oldest first."""
    hours = []
    hour_start = int(start_s) // 3600 * 3600
    while hour_start < end_s:
        hours.append(hour_of(hour_start))
        hour_start += 3600
    return hours


def by_hour(records: Iterable[UsageRecord]) -> dict[str, list[UsageRecord]]:
    """Records grouped by the partition of their `finished_at`."""
    groups: dict[str, list[UsageRecord]] = {}
    for record in records:
        groups.setdefault(hour_of(record.finished_at), []).append(record)
    return groups


def realtime_key(hour: str, writer_id: str, seq: int) -> str:
    return f"{partition_prefix(hour)}rt-{writer_id}-{seq:010d}.parquet"


def batch_shard_key(hour: str, batch_id: str, shard: int) -> str:
    return f"{partition_prefix(hour)}batch-{batch_id}-{shard:05d}.parquet"
