"""Compaction of closed hours of usage records into one object each, counting every record once.

A busy ingress replica writes up to one object per `usage_commit_interval_s`; a query reads every
object of the hours it covers. Once an hour is closed (its end more than `grace_s` ago, so no
flush can still land in it but a late one), its objects are merged into
`usage/v1/<day>/<hour>/compacted.parquet`, written with put-if-absent, whose Parquet metadata
lists the keys it holds (its manifest). Then those keys are deleted.

Exactly once, whatever stops where:
- a reader of a partition with a compacted object reads it and only the keys its manifest does
  not list (`partition_keys`): a crash between the compacted write and the deletes, or a late
  object that landed after the compaction, counts each record once;
- two compactors racing on an hour: one put wins; the loser deletes only what the winner's
  manifest lists (read back), never its own list.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import time

import pyarrow.parquet as pq

from tandem.platform.object_store import ObjectNotFound, ObjectStore, PreconditionFailed
from tandem.platform.usage_records import (
    USAGE_SCHEMA,
    decode_records,
    encode_records,
    hour_of,
    partition_prefix,
)

logger = logging.getLogger("tandem.usage")

COMPACTED = "compacted.parquet"
_MANIFEST_KEY = b"tandem.usage.sources"


def compacted_key(hour: str) -> str:
    return partition_prefix(hour) + COMPACTED


def _manifest(data: bytes) -> set[str]:
    metadata = pq.read_schema(io.BytesIO(data)).metadata or {}
    return set(json.loads(metadata.get(_MANIFEST_KEY, b"[]")))


def partition_keys(store: ObjectStore, hour: str) -> list[str]:
    """The objects to read for an hour: its compacted object (if any) and the keys it does not
    hold."""
    keys = store.list(partition_prefix(hour))
    compacted = compacted_key(hour)
    if compacted not in keys:
        return keys
    try:
        held = _manifest(store.get(compacted).data)
    except ObjectNotFound:  # listed, then gone: nothing deletes a compacted object, but be safe
        return [k for k in keys if k != compacted]
    return [compacted, *(k for k in keys if k != compacted and k not in held)]


def compact_hour(store: ObjectStore, hour: str) -> int:
    """Merge an hour's objects into its compacted object and delete them; returns how many
    objects were removed. Idempotent: run again (or by another process) it finishes the deletes."""
    keys = store.list(partition_prefix(hour))
    compacted = compacted_key(hour)
    if compacted not in keys:
        sources = sorted(keys)
        if len(sources) < 2:
            return 0
        try:
            records = [record for key in sources for record in decode_records(store.get(key).data)]
        except ObjectNotFound:  # another compactor finished meanwhile: its object holds them
            return 0
        table = pq.read_table(io.BytesIO(encode_records(records)), schema=USAGE_SCHEMA)
        table = table.replace_schema_metadata({_MANIFEST_KEY: json.dumps(sources).encode()})
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="zstd")
        with contextlib.suppress(PreconditionFailed):  # another compactor won: its manifest rules
            store.put(compacted, sink.getvalue(), if_none_match=True)
    held = _manifest(store.get(compacted).data)
    removed = 0
    for key in keys:
        if key in held:
            try:
                store.delete(key)
                removed += 1
            except ObjectNotFound:
                pass
    if removed:
        logger.info("usage hour compacted", extra={"hour": hour, "objects_removed": removed})
    return removed


def compact_closed_hours(
    store: ObjectStore, *, now: float | None = None, grace_s: float = 3600.0, lookback_hours: int = 6
) -> int:
    """Compact the hours that closed more than `grace_s` ago, over the last `lookback_hours`
    before that (what a periodic caller has not done yet); returns the objects removed."""
    end = (time.time() if now is None else now) - grace_s
    last_closed = int(end) // 3600 * 3600 - 3600  # the newest hour whose end is before `end`
    removed = 0
    for back in range(lookback_hours):
        removed += compact_hour(store, hour_of(last_closed - back * 3600))
    return removed
