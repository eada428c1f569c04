"""Batch workers: claim a shard, run its requests, commit the results exactly once.

A worker loops over the queue, tenants in fair turn: the batches of the tenant that has claimed
the fewest shards (divided by its weight) come first, each tenant's oldest batch first, so a small
batch starts while another tenant's large one runs (a tenant whose batches were all done starts
level with the others, banking no credit). For a batch `in_progress` it takes the lease of the
first shard that has no committed result and no live lease, runs the shard's requests
concurrently through `execute` (the same code path as the real-time API, at batch priority),
renews the lease while they run, then commits the shard's results with put-if-absent and releases
the lease. Up to `BatchLimits.max_shards_in_flight` shards run at once per worker, each its own
task under its own lease, so one shard's tail (its last long requests) never leaves the replicas
idle; the engine's batch admission (KV occupancy limit, priorities) decides how many of the
requests in flight compute at a time. Exactly-once follows from the commit, not from the lease: if a slow worker's lease
expired and a second worker re-ran the shard, whichever commits first wins and the other's copy
is discarded, so every request appears in the output exactly once. A crashed worker leaves a lease
that expires; the shard is then claimed again and only uncommitted shards ever run twice.

Store faults: a transient store error never throws finished work away. Lease renewals and batch
checks that fail are retried at the next tick (a lease nobody took meanwhile still renews); a
commit that fails is retried with backoff, the lease renewed meanwhile, until it lands or the
batch expires; a shard given up (its lease lost, a line to retry) keeps its finished lines in
the worker (`shard_runner.ShardRunner`), and the worker's next claim of that shard runs only the others. A shard
task that fails cancels its lines and releases its lease at once.

When every shard is committed, a worker finishes the batch (`finalizer.py`). Cancel stops new
claims, in-flight shards commit what finished, and the batch ends `cancelled` with those partial
results; past `expires_at` the same happens (`expired`). What a line is and how many go out at
once: `lines.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from tandem.batch.finalizer import BatchFinalizer
from tandem.batch.leases import Lease, LeaseManager
from tandem.batch.lines import (
    Execute,
    LineWindow,
)
from tandem.batch.records import (
    BatchRecord,
    lease_key,
    queue_key,
)
from tandem.batch.service import BatchService
from tandem.batch.shard_runner import ShardRunner
from tandem.platform.errors import NotFoundError, TandemError

logger = logging.getLogger("tandem.batch")

HINT_TTL_S = 5.0  # a queue length heard longer ago than this is not trusted
IDLE_LIST_S = 30.0  # an idle worker lists the queue itself at least this often


class BatchWorker:
    def __init__(
        self,
        service: BatchService,
        execute: Execute,
        *,
        worker_id: str | None = None,
        poll_interval_s: float = 1.0,
        tenant_weights: dict[str, float] | None = None,
        weight_of: Callable[[str], float | None] | None = None,
    ) -> None:
        """`weight_of(tenant)`: the tenant's current weight where it has one (the live tenant
        directory), else `tenant_weights`, else 1."""
        self.service = service
        # Fair turns between tenants: shards this worker claimed per tenant with queued batches,
        # divided by the tenant's weight at each claim.
        self.tenant_weights = dict(tenant_weights or {})
        self.weight_of = weight_of
        self.claimed: dict[str, float] = {}
        self.store = service.store
        self.execute = execute
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        self.leases = LeaseManager(self.store, self.worker_id, service.limits.lease_ttl_s)
        self.finalizer = BatchFinalizer(service, self.leases)
        self.poll_interval_s = poll_interval_s
        self._wake = asyncio.Event()
        # The queue's length as someone who lists it anyway last saw it (the fleet state), and
        # when: an idle worker that hears "empty" does not list the queue itself, except every
        # `IDLE_LIST_S` in case that reader went quiet.
        self._queue_hint: tuple[float, int] | None = None
        self._listed_at = float("-inf")
        self._shards: set[asyncio.Future[None]] = set()  # shards in flight, each its own task
        self._shard_leases: dict[asyncio.Future[None], Lease] = {}  # their leases
        self.stopping = False  # `stop()` was called: nothing more is claimed
        limits = service.limits
        self.window = LineWindow(limits.max_shards_in_flight * limits.shard_size)
        self.shards = ShardRunner(
            service,
            self.leases,
            execute,
            self.window,
            self.finalizer,
            worker_id=self.worker_id,
            poll_interval_s=poll_interval_s,
        )

    @property
    def num_shards_run(self) -> int:
        return self.shards.num_shards_run

    @property
    def num_duplicate_commits(self) -> int:
        return self.shards.num_duplicate_commits

    @property
    def num_lines_run(self) -> int:
        return self.shards.num_lines_run

    # -- loop ------------------------------------------------------------------------------
    async def run_forever(self) -> None:
        """Work until cancelled (shards in flight are cancelled with it: their leases expire and
        another worker runs them). Idle polls wait `poll_interval_s`, or until `wake()` or a shard
        in flight finishes."""
        try:
            while True:
                try:
                    did_work = await self.run_once()
                except asyncio.CancelledError:
                    raise
                except TandemError as exc:  # the store is down or full: the next poll tries again
                    logger.warning(
                        "batch worker step failed; retrying",
                        extra={"worker": self.worker_id, "error": exc.message},
                    )
                    did_work = False
                except Exception:
                    logger.exception("batch worker step failed; retrying", extra={"worker": self.worker_id})
                    did_work = False
                if not did_work:
                    self._wake.clear()
                    waker: asyncio.Future[Any] = asyncio.ensure_future(self._wake.wait())
                    watched: set[asyncio.Future[Any]] = {waker, *self._shards}
                    try:
                        await asyncio.wait(
                            watched, timeout=self.poll_interval_s, return_when=asyncio.FIRST_COMPLETED
                        )
                    finally:
                        waker.cancel()
        finally:
            await self._end_shards()

    def wake(self) -> None:
        self._wake.set()

    def queue_seen(self, num_queued_batches: int) -> None:
        """The batch queue's length as the fleet state just listed it: work appearing wakes the
        worker; an empty queue spares an idle worker its own listing."""
        previous = self._queue_hint
        self._queue_hint = (time.monotonic(), num_queued_batches)
        if num_queued_batches and (previous is None or previous[1] == 0):
            self.wake()

    def _idle_by_hint(self) -> bool:
        """Whether the queue is known empty (fresh hint, nothing in flight, listed lately)."""
        hint = self._queue_hint
        now = time.monotonic()
        return (
            hint is not None and hint[1] == 0 and now - hint[0] < HINT_TTL_S and not self._shards
            and now - self._listed_at < IDLE_LIST_S
        )  # fmt: skip

    async def stop(self) -> None:
        """Stop for good (a graceful stop of the server): claim nothing more, end the shards in
        flight without committing them and release their leases, so another worker resumes
        them at once instead of after the lease's time (their lines run again there: a shard
        is committed whole or not at all, so none is answered twice)."""
        self.stopping = True
        num_released = await self._end_shards()
        logger.info("batch worker stopped", extra={"worker": self.worker_id, "shards_released": num_released})

    async def _end_shards(self) -> int:
        """Cancel the shards in flight and give their leases back (a task cancelled before it
        started never runs its own cleanup, so the leases are released here); how many."""
        shards = dict(self._shard_leases)
        for task in shards:
            task.cancel()
        await asyncio.gather(*shards, return_exceptions=True)
        for lease in shards.values():  # after a commit the lease is gone already: a no-op then
            await self.shards.release(lease)
        self._shards.clear()
        self._shard_leases.clear()
        return len(shards)

    @property
    def num_shards_in_flight(self) -> int:
        return len(self._shards)

    async def run_once(self) -> bool:
        """One pass over the queue: start shards (each its own task) while fewer than
        `BatchLimits.max_shards_in_flight` run, resume validations, finalize finished batches.
        True when it started, finished or reaped something."""
        did_work = self._reap()
        if self.stopping or self._idle_by_hint():
            return did_work
        self._listed_at = time.monotonic()
        for tenant, batch_id in self._fair_order(await asyncio.to_thread(self.service.queued_batches)):
            if await self._advance(tenant, batch_id):
                did_work = True
                break  # the next pass starts again from the tenant whose turn it is
        return did_work

    def _fair_order(self, queued: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """`queued` (oldest first) by tenant turn: fewest weighted claims first, oldest batch
        first within a tenant. Tenants with nothing queued are forgotten; one that appears starts
        at the lowest count among the others (no credit for time away)."""
        active = {tenant for tenant, _ in queued}
        self.claimed = {t: n for t, n in self.claimed.items() if t in active}
        floor = min(self.claimed.values(), default=0.0)
        for tenant in active - self.claimed.keys():
            self.claimed[tenant] = floor
        return sorted(queued, key=lambda item: self.claimed[item[0]])  # stable: age within a tenant

    def _reap(self) -> bool:
        """Forget finished shard tasks (logging any that raised); True when there were some."""
        done = {task for task in self._shards if task.done()}
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                logger.error(
                    "batch shard failed", exc_info=task.exception(), extra={"worker": self.worker_id}
                )
        self._shards -= done
        for task in done:
            self._shard_leases.pop(task, None)
        return bool(done)

    def queued_shards(self) -> int:
        """Shards not yet committed over every running batch (the autoscaling signal; 0 without
        a store call while the fleet state's listing says the queue is empty)."""
        if self._idle_by_hint():
            return 0
        total = 0
        for tenant, batch_id in self.service.queued_batches():
            with contextlib.suppress(NotFoundError):
                record = self.service.get_batch(tenant, batch_id)
                if record.status == "in_progress":
                    total += record.num_shards - len(record.shard_counts)
        return total

    async def _advance(self, tenant: str, batch_id: str) -> bool:
        try:
            record = await asyncio.to_thread(self.service.get_batch, tenant, batch_id)
        except NotFoundError:
            await asyncio.to_thread(self.store.delete, queue_key(batch_id))
            return False
        if record.is_terminal:
            await asyncio.to_thread(self.store.delete, queue_key(batch_id))
            return False
        if record.status == "validating":
            return await asyncio.to_thread(self._resume_validation, record)
        if record.status == "in_progress" and time.time() < record.expires_at:
            if len(self._shards) >= self.service.limits.max_shards_in_flight:
                return False
            lease_and_shard = await asyncio.to_thread(self.shards.claim, record)
            if lease_and_shard is not None and self.stopping:  # stopped while it claimed
                await asyncio.to_thread(self.leases.release, lease_and_shard[0])
                return False
            if lease_and_shard is not None:
                self.claimed[tenant] = self.claimed.get(tenant, 0.0) + 1.0 / self.weight(tenant)
                task = asyncio.ensure_future(self.shards.run(record, *lease_and_shard))
                self._shards.add(task)
                self._shard_leases[task] = lease_and_shard[0]
                return True
        return await asyncio.to_thread(self.finalizer.try_finalize, record)

    def weight(self, tenant: str) -> float:
        live = self.weight_of(tenant) if self.weight_of is not None else None
        return live if live is not None else self.tenant_weights.get(tenant, 1.0)

    def _resume_validation(self, record: BatchRecord) -> bool:
        """Finish a validation whose API process died (only after a lease period, so the API
        process, which validates right away, is not raced)."""
        if time.time() - record.created_at < self.leases.ttl_s:
            return False
        lease = self.leases.try_claim(lease_key(record.tenant, record.id, "validate"))
        if lease is None:
            return False
        try:
            self.service.validate_batch(record.tenant, record.id)
        finally:
            self.leases.release(lease)
        return True
