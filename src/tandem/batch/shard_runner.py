"""Running one claimed shard of a batch: its lines through `execute`, its lease renewed, its
results committed exactly once (`ShardRunner`; the worker's docstring tells the whole story).

A shard given up before its commit (its lease lost, a line to retry, a commit that failed until
the batch expired) keeps its finished lines here, and the next claim of that shard by this worker
runs only the others.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

from tandem.batch.finalizer import BatchFinalizer
from tandem.batch.leases import Lease, LeaseManager
from tandem.batch.lines import (
    Backpressure,
    Execute,
    ExecutedRequest,
    LineWindow,
    RetryLater,
    batch_request_id,
    response_model,
    shard_counts,
)
from tandem.batch.records import BatchRecord, input_shard_key, lease_key, result_shard_key
from tandem.batch.service import BatchService
from tandem.batch.shards import BatchInput, BatchResult, decode_inputs, decode_results, encode_results
from tandem.batch.usage import write_shard_usage
from tandem.platform.errors import TandemError
from tandem.platform.object_store import PreconditionFailed

logger = logging.getLogger("tandem.batch")

COMMIT_BACKOFF_S = (0.5, 1.0, 2.0, 4.0)  # then every 4 s until the commit lands or the batch expires
MAX_KEPT_SHARDS = 64  # shards given up whose finished lines a worker keeps for its next claim


class ShardRunner:
    def __init__(
        self,
        service: BatchService,
        leases: LeaseManager,
        execute: Execute,
        window: LineWindow,
        finalizer: BatchFinalizer,
        *,
        worker_id: str,
        poll_interval_s: float,
    ) -> None:
        """`window`: how many lines are out at once (shared by the worker's shards);
        `poll_interval_s`: how often a running shard checks for a cancel."""
        self.service = service
        self.store = service.store
        self.leases = leases
        self.execute = execute
        self.window = window
        self.finalizer = finalizer  # which shards are committed
        self.worker_id = worker_id
        self.poll_interval_s = poll_interval_s
        self.num_shards_run = 0
        self.num_duplicate_commits = 0
        self.num_lines_run = 0  # lines sent to an engine (not kept ones)
        # (tenant, batch id, shard) -> finished lines of a shard given up before its commit
        self._kept: dict[tuple[str, str, int], dict[int, BatchResult]] = {}

    def claim(self, record: BatchRecord) -> tuple[Lease, int] | None:
        committed = self.finalizer.committed_shards(record)
        for shard in range(record.num_shards):
            if shard in committed:
                continue
            lease = self.leases.try_claim(lease_key(record.tenant, record.id, f"shard-{shard:05d}"))
            if lease is None:
                continue
            if self.store.exists(result_shard_key(record.tenant, record.id, shard)):
                self.leases.release(lease)  # committed between our listing and the claim
                continue
            return lease, shard
        return None

    async def release(self, lease: Lease) -> None:
        """Give `lease` back (best effort: with the store down it expires on its own)."""
        try:
            await asyncio.to_thread(self.leases.release, lease)
        except Exception as exc:  # noqa: BLE001
            logger.warning(
                "lease release failed; it expires", extra={"key": lease.key, "error": str(exc)[:200]}
            )

    async def run(self, record: BatchRecord, lease: Lease, shard: int) -> None:
        """Run a claimed shard and commit it. Cancelled (the worker stops), it commits nothing;
        `_end_shards` gives its lease back. Failing otherwise, it cancels its lines, keeps the
        finished ones for this worker's next claim of the shard and releases its lease."""
        tenant, batch_id = record.tenant, record.id
        log = {"tenant": tenant, "batch_id": batch_id, "shard": shard, "worker": self.worker_id}
        kept = self._kept.pop((tenant, batch_id, shard), {})
        tasks: list[asyncio.Task[BatchResult]] = []
        try:
            data = await asyncio.to_thread(self.store.get, input_shard_key(tenant, batch_id, shard))
            inputs = decode_inputs(data.data)
            logger.info("shard claimed", extra={**log, "requests": len(inputs), "kept": len(kept)})
            tasks = [
                asyncio.ensure_future(self._run_one(record, row)) for row in inputs if row.line not in kept
            ]
            stop_reason = await self._supervise(tenant, batch_id, lease, tasks)
        except BaseException as exc:  # cancelled, or a failure: its lines' requests end with it
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._keep(tenant, batch_id, shard, kept, tasks)
            if not isinstance(exc, asyncio.CancelledError):
                await self.release(lease)
            raise
        if stop_reason == "lease_lost":
            self._keep(tenant, batch_id, shard, kept, tasks)
            logger.warning("lease lost; shard left to its new owner", extra=log)
            return
        failed = [
            t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception() is not None
        ]
        if failed:  # RetryLater (or a bug): no line's answer is lost or written as an error
            self._keep(tenant, batch_id, shard, kept, tasks)
            await self.release(lease)
            logger.warning(
                "shard not committed; it runs again",
                extra={
                    **log,
                    "failed": len(failed),
                    "error": f"{type(failed[0]).__name__}: {failed[0]}"[:300],
                },
            )
            return
        rows = list(kept.values()) + [t.result() for t in tasks if t.done() and not t.cancelled()]
        rows.sort(key=lambda r: r.line)
        if not await self._commit_with_retries(record, shard, rows, lease):
            self._keep(tenant, batch_id, shard, {}, [], rows)
            await self.release(lease)
            return
        self.num_shards_run += 1
        logger.info("shard committed", extra={**log, "results": len(rows), "stopped": stop_reason})

    def _keep(
        self,
        tenant: str,
        batch_id: str,
        shard: int,
        kept: dict[int, BatchResult],
        tasks: list[asyncio.Task[BatchResult]],
        rows: list[BatchResult] | None = None,
    ) -> None:
        """Remember a given-up shard's finished lines (`kept`, the tasks that returned, `rows`)."""
        finished = dict(kept)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                finished[task.result().line] = task.result()
        for row in rows or []:
            finished[row.line] = row
        if not finished:
            return
        self._kept[(tenant, batch_id, shard)] = finished
        while len(self._kept) > MAX_KEPT_SHARDS:
            del self._kept[next(iter(self._kept))]

    async def _commit_with_retries(
        self, record: BatchRecord, shard: int, rows: list[BatchResult], lease: Lease
    ) -> bool:
        """Commit, retrying a store failure with backoff (renewing the lease meanwhile) until it
        lands or the batch expires; False then. A commit is put-if-absent: retrying it, or another
        worker committing first, never counts a line twice."""
        attempt = 0
        while True:
            try:
                await asyncio.to_thread(self._commit, record, shard, rows, lease)
                return True
            except TandemError as exc:
                if time.time() >= record.expires_at:
                    logger.error("shard commit failed until the batch expired", extra={"batch_id": record.id})
                    return False
                pause = COMMIT_BACKOFF_S[min(attempt, len(COMMIT_BACKOFF_S) - 1)]
                attempt += 1
                logger.warning(
                    "shard commit failed; retrying",
                    extra={"batch_id": record.id, "shard": shard, "attempt": attempt, "error": exc.message},
                )
                await asyncio.sleep(pause)
                try:
                    await asyncio.to_thread(self.leases.renew, lease)
                except Exception as renew_exc:  # noqa: BLE001 - the commit's retry renews again
                    logger.warning(
                        "lease renewal failed while a commit retries",
                        extra={"batch_id": record.id, "shard": shard, "error": str(renew_exc)[:200]},
                    )

    async def _supervise(
        self, tenant: str, batch_id: str, lease: Lease, tasks: list[asyncio.Task[BatchResult]]
    ) -> str | None:
        """Renew the lease until the tasks finish. Stops early (cancelling the unfinished ones) when
        the lease is lost or the batch is cancelled or expires; returns why, or None."""
        renew_every = self.leases.ttl_s / 3
        check_every = min(renew_every, self.poll_interval_s)  # how fast a cancel takes effect
        renewed_at = time.monotonic()
        pending: set[asyncio.Task[BatchResult]] = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=check_every)
            if not pending:
                break
            reason: str | None = None
            try:
                if time.monotonic() - renewed_at >= renew_every:
                    if not await asyncio.to_thread(self.leases.renew, lease):
                        reason = "lease_lost"
                    renewed_at = time.monotonic()
                if reason is None:
                    record = await asyncio.to_thread(self.service.get_batch, tenant, batch_id)
                    if record.status == "cancelling":
                        reason = "cancelled"
                    elif time.time() >= record.expires_at:
                        reason = "expired"
            except TandemError as exc:  # the store is down: the lines run on; retried next tick
                logger.warning(
                    "shard check failed; retrying", extra={"batch_id": batch_id, "error": exc.message}
                )
            if reason is not None:
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                return reason
        return None

    async def _send(self, record: BatchRecord, row: BatchInput) -> ExecutedRequest:
        """`execute` within the line window; on backpressure, wait and send again (a cancelled
        shard cancels the wait)."""
        while True:
            await self.window.acquire()
            answered = False
            try:
                done = await self.execute(record.endpoint, row.body, record.tenant)
                answered = True
                return done
            except Backpressure as exc:
                self.window.shrink(exc.retry_after_s)
                pause_s = exc.retry_after_s * random.uniform(0.5, 1.5)  # spread the retries out
            finally:
                await self.window.release(answered=answered)
            await asyncio.sleep(pause_s)

    async def _run_one(self, record: BatchRecord, row: BatchInput) -> BatchResult:
        request_id = batch_request_id(record.id, row.line)
        started_at = time.time()
        self.num_lines_run += 1
        try:
            done = await self._send(record, row)
        except (asyncio.CancelledError, RetryLater):
            raise
        except Exception:  # an engine failure must not lose the rest of the shard
            logger.exception(
                "batch request failed",
                extra={"batch_id": record.id, "custom_id": row.custom_id, "request_id": request_id},
            )
            message = (  # the traceback is in the log under the request id; nothing internal here
                f"The server had an error while processing this request (request id {request_id}); "
                "retry it in another batch"
            )
            done = ExecutedRequest(500, request_id, None, {"code": "internal_error", "message": message})
        return BatchResult(
            line=row.line,
            custom_id=row.custom_id,
            request_id=done.request_id,
            status_code=done.status_code,
            body=done.body,
            error=done.error,
            input_tokens=done.input_tokens,
            output_tokens=done.output_tokens,
            model=response_model(done.body, row.body),
            cached_tokens=done.cached_tokens,
            started_at=started_at,
            finished_at=time.time(),
        )

    def _commit(self, record: BatchRecord, shard: int, rows: list[BatchResult], lease: Lease) -> None:
        try:
            self.store.put(
                result_shard_key(record.tenant, record.id, shard), encode_results(rows), if_none_match=True
            )
        except PreconditionFailed:
            # Another worker committed this shard first (our lease had expired): keep theirs.
            self.num_duplicate_commits += 1
            logger.warning(
                "shard already committed; discarding duplicate", extra={"batch_id": record.id, "shard": shard}
            )
            committed = decode_results(self.store.get(result_shard_key(record.tenant, record.id, shard)).data)
            rows = committed
        write_shard_usage(self.store, record, shard, rows)  # the committed rows, whoever committed them
        counts = shard_counts(rows)

        def add(r: BatchRecord) -> bool:
            if shard in r.shard_counts:
                return False
            r.shard_counts[shard] = counts
            return True

        self.service.update_batch(record.tenant, record.id, add)
        self.leases.release(lease)
