"""Usage records of a committed batch shard, written once whoever writes them.

A batch line is metered from its shard's committed result rows, never while it runs: a line that
ran twice (its first worker died, or lost its lease) has one committed row, so one record. The
records of shard `s` that finished in hour `h` go to one object whose key names the batch, the
shard and the hour (`usage_records.batch_shard_key`), written with put-if-absent: the worker that
commits the shard writes them, and the finalizer writes them again for every shard, so a
committer that died between its commit and its metering loses nothing, and the second write of
an object that exists is a no-op.
"""

from __future__ import annotations

from tandem.batch.records import BatchRecord
from tandem.batch.shards import BatchResult
from tandem.platform.object_store import ObjectStore, PreconditionFailed
from tandem.platform.usage_records import UsageRecord, batch_shard_key, by_hour, encode_records


def shard_usage_records(record: BatchRecord, rows: list[BatchResult]) -> list[UsageRecord]:
    """One record per result row that ran (rows of shards written before metering, with no
    `finished_at`, are left out)."""
    out = []
    for row in rows:
        if row.finished_at <= 0:
            continue
        model = row.model or record.model or ""
        out.append(
            UsageRecord(
                request_id=row.request_id,
                tenant=record.tenant,
                api_key_id=record.api_key_id,
                model=model,
                adapter=model.partition(":")[2] or None,
                input_tokens=row.input_tokens,
                cached_tokens=row.cached_tokens,
                output_tokens=row.output_tokens,
                accepted_draft_tokens=0,  # not reported per line
                status="completed" if row.ok else "failed",
                finish_reason=_finish_reason(row),
                priority="batch",
                batch_id=record.id,
                started_at=row.started_at,
                finished_at=row.finished_at,
                latency_s=max(0.0, row.finished_at - row.started_at),
            )
        )
    return out


def _finish_reason(row: BatchResult) -> str | None:
    choices = (row.body or {}).get("choices") or []
    reason = choices[0].get("finish_reason") if choices and isinstance(choices[0], dict) else None
    return reason if isinstance(reason, str) else (None if row.ok else "error")


def write_shard_usage(store: ObjectStore, record: BatchRecord, shard: int, rows: list[BatchResult]) -> int:
    """Store the shard's records (idempotent); returns how many objects this call wrote."""
    num_written = 0
    for hour, records in by_hour(shard_usage_records(record, rows)).items():
        try:
            store.put(batch_shard_key(hour, record.id, shard), encode_records(records), if_none_match=True)
            num_written += 1
        except PreconditionFailed:
            pass  # written before, from the same committed rows
    return num_written
