"""The end of a batch: merge the committed result shards into its output and error files.

When every shard is committed, one worker (holding the `finalize` lease) merges the result shards
into the output and error files (OpenAI's JSONL line format) and marks the batch `completed`. A
batch `cancelling` ends `cancelled`, one past `expires_at` `expired`, once no shard lease is live,
with the results committed so far; an expired batch's lines that never ran get `batch_expired`
lines in the error file. Every step is idempotent: a finalizer that dies is simply run again.
"""

from __future__ import annotations

import json
import logging
import time

from tandem.batch.leases import LeaseManager
from tandem.batch.lines import batch_request_id, shard_counts
from tandem.batch.records import (
    BatchRecord,
    FileRecord,
    ShardCounts,
    batch_data_prefix,
    input_shard_key,
    lease_key,
    queue_key,
    result_shard_key,
)
from tandem.batch.service import BatchService
from tandem.batch.shards import BatchResult, decode_inputs, decode_results
from tandem.batch.usage import write_shard_usage
from tandem.platform.object_store import ObjectNotFound

logger = logging.getLogger("tandem.batch")


class BatchFinalizer:
    """Finishes the batches of `service` under leases of `leases`."""

    def __init__(self, service: BatchService, leases: LeaseManager) -> None:
        self.service = service
        self.store = service.store
        self.leases = leases

    def committed_shards(self, record: BatchRecord) -> set[int]:
        keys = self.store.list(f"{batch_data_prefix(record.tenant, record.id)}results/")
        return {int(k.rsplit("/", 1)[1].removesuffix(".parquet")) for k in keys}

    def try_finalize(self, record: BatchRecord) -> bool:
        """Finish `record` when nothing is left to run: every shard committed, or (cancelling /
        expired) no shard lease still live. Returns True when this call finished it."""
        if record.status in ("in_progress", "finalizing") and time.time() < record.expires_at:
            committed = self.committed_shards(record)
            if len(committed) < record.num_shards:
                return False
            final = "completed"
        elif record.status == "cancelling":
            final = "cancelled"
        elif record.status in ("in_progress", "finalizing"):
            final = "expired"
        else:
            return False
        if final != "completed" and self._any_live_shard_lease(record):
            return False  # in-flight shards will stop at their next renewal and commit
        lease = self.leases.try_claim(lease_key(record.tenant, record.id, "finalize"))
        if lease is None:
            return False
        try:
            self._finalize(record, final)
        finally:
            self.leases.release(lease)
        return True

    def _any_live_shard_lease(self, record: BatchRecord) -> bool:
        prefix = f"{batch_data_prefix(record.tenant, record.id)}leases/shard-"
        return any(self.leases.is_live(key) for key in self.store.list(prefix))

    def _finalize(self, record: BatchRecord, final: str) -> None:
        tenant, batch_id = record.tenant, record.id
        if final == "completed":

            def finalizing(r: BatchRecord) -> bool:
                if r.status != "in_progress":
                    return False
                r.status, r.finalizing_at = "finalizing", int(time.time())
                return True

            record = self.service.update_batch(tenant, batch_id, finalizing)
        committed = sorted(self.committed_shards(record))
        results: list[BatchResult] = []
        counts: dict[int, ShardCounts] = {}
        for shard in committed:
            rows = decode_results(self.store.get(result_shard_key(tenant, batch_id, shard)).data)
            write_shard_usage(self.store, record, shard, rows)  # a committer that died before metering
            counts[shard] = shard_counts(rows)
            results.extend(rows)
        if final == "expired":
            results.extend(self._expired_results(record, {r.line for r in results}))
        results.sort(key=lambda r: r.line)
        ok = [r for r in results if r.ok]
        failed = [r for r in results if not r.ok]
        output_id = self._write_result_file(record, "output", ok)
        error_id = self._write_result_file(record, "error", failed)
        now = int(time.time())

        def finish(r: BatchRecord) -> bool:
            if r.is_terminal:
                return False
            r.status = final  # type: ignore[assignment]
            r.output_file_id, r.error_file_id = output_id, error_id
            r.shard_counts = counts
            if final == "completed":
                r.completed_at = now
            elif final == "cancelled":
                r.cancelled_at = now
            else:
                r.expired_at = now
            return True

        self.service.update_batch(tenant, batch_id, finish)
        self.store.delete(queue_key(batch_id))
        logger.info(
            "batch finished",
            extra={
                "tenant": tenant,
                "batch_id": batch_id,
                "status": final,
                "ok": len(ok),
                "failed": len(failed),
            },
        )

    def _expired_results(self, record: BatchRecord, done_lines: set[int]) -> list[BatchResult]:
        out = []
        for shard in range(record.num_shards):
            try:
                rows = decode_inputs(self.store.get(input_shard_key(record.tenant, record.id, shard)).data)
            except ObjectNotFound:
                continue
            for row in rows:
                if row.line in done_lines:
                    continue
                out.append(
                    BatchResult(
                        line=row.line,
                        custom_id=row.custom_id,
                        request_id="",
                        status_code=0,
                        body=None,
                        error={
                            "code": "batch_expired",
                            "message": "This request could not be executed before the completion window expired.",
                        },
                    )
                )
        return out

    def _write_result_file(self, record: BatchRecord, kind: str, rows: list[BatchResult]) -> str | None:
        """Write the output or error JSONL as a file of the batch's tenant (deterministic id, so a
        finalizer that crashed and is re-run overwrites the same file)."""
        if not rows and kind == "error":
            return None
        lines = [
            json.dumps(r.output_line(batch_request_id(record.id, r.line)), separators=(",", ":"))
            for r in rows
        ]
        data = ("\n".join(lines) + "\n").encode() if lines else b""
        file = FileRecord(
            id=f"file-{kind}-{record.id.removeprefix('batch_')}",
            tenant=record.tenant,
            bytes=len(data),
            created_at=int(time.time()),
            filename=f"{record.id}_{kind}.jsonl",
            purpose="batch_output",
            num_lines=len(lines),
        )
        self.service.write_file(file, data)
        return file.id
