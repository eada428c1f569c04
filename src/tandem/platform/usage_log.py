"""`UsageLog`: usage records, durable on local disk at once, in the object store soon after.

One writer per process. A record handed over (`submit`, or `commit` to wait) is appended to the
process's local spool (`usage_spool`: JSON lines, fsync'd) by the spool thread, which takes
every record waiting at once (one write and one fsync per group). `commit` returns when its
record is on local disk: a response never waits on the object store. The ship thread sends the
spool to the store as Parquet objects (one per hour partition per range, keys no other write
uses, put-if-absent) when `ship_max_records` wait or the oldest has waited `commit_interval_s`;
an idle process makes no store call. While the store is down the records stay in the spool and
the ship thread retries with backoff; a process that dies leaves its spool to the next writer of
the same store on this machine (`sweep_orphans`, at start and every `sweep_interval_s`).

Exactly once: a record is appended once; a spool range is shipped under keys fixed by its
position, so a range shipped again (a lost answer, a crash mid-ship) finds its keys taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from tandem.platform.local_state import state_path
from tandem.platform.object_store import ObjectStore
from tandem.platform.usage_compaction import compact_closed_hours
from tandem.platform.usage_records import UsageRecord
from tandem.platform.usage_spool import SpoolWriter, sweep_orphans

logger = logging.getLogger("tandem.usage")

Done = Callable[[], None]

RETRY_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0)  # then every 5 s while the store is down


def ship_due(num_unshipped: int, waited_s: float, interval_s: float, max_records: int) -> bool:
    """Whether a spool holding `num_unshipped` records, the oldest spooled `waited_s` ago, ships
    now: by size (`max_records`) or by time (`interval_s`). An empty spool never ships."""
    return num_unshipped > 0 and (num_unshipped >= max_records or waited_s >= interval_s)


def default_spool_dir(store_url: str) -> Path:
    """Where every process of the store at `store_url` on this machine spools (local_state.py)."""
    return state_path("usage-spool", store_url)


class UsageLog:
    def __init__(
        self,
        store: ObjectStore,
        *,
        writer_id: str | None = None,
        commit_interval_s: float = 1.0,
        ship_max_records: int = 2000,
        spool_dir: Path | None = None,
        sweep_interval_s: float = 30.0,
        on_committed: Callable[[list[UsageRecord]], None] | None = None,
        compaction_interval_s: float | None = 600.0,
    ) -> None:
        """`on_committed(records)` runs on the ship thread after records reach the store
        (counters). Every `compaction_interval_s` (None: never) the ship thread also compacts the
        closed hours (`usage_compaction`; any number of writers may, safely)."""
        self.store = store
        self.writer_id = writer_id or uuid.uuid4().hex[:16]
        self.commit_interval_s = commit_interval_s
        self.ship_max_records = ship_max_records
        self.sweep_interval_s = sweep_interval_s
        self.compaction_interval_s = compaction_interval_s
        self.spool_dir = spool_dir or default_spool_dir(store.url)
        self._compacted_at = float("-inf")
        self._compactor: threading.Thread | None = None
        self.on_committed = on_committed
        self.num_committed = 0  # this process's records in the store so far
        self.num_recovered = 0  # records of stopped processes' spools this one shipped
        self.num_spooled = 0  # records on local disk so far
        self._pending: list[tuple[UsageRecord, Done | None]] = []
        self._appending = False  # a group taken off `_pending` is being written
        self._num_appending = 0  # its size
        self._committed_at_compaction = 0
        self._oldest_unshipped: float | None = None  # monotonic time the oldest unshipped was spooled
        self._ship_now = False  # a flush waits: ship without waiting for the interval
        self._closed = False
        self._cond = threading.Condition()
        self._spool: SpoolWriter | None = None
        self._threads: list[threading.Thread] = []

    # -- handing records over ---------------------------------------------------------------
    def submit(self, record: UsageRecord, done: Done | None = None) -> None:
        """Queue `record`; `done()` runs on the spool thread once it is on local disk. Never
        blocks and never raises (it runs in cleanup code, also under cancellation)."""
        with self._cond:
            self._pending.append((record, done))
            self._cond.notify_all()
        self.start()

    def start(self) -> None:
        """Start the spool and ship threads (the first `submit` does too): the ship thread first
        ships what stopped processes of this store left in the spool on this machine."""
        with self._cond:
            if self._threads or self._closed:
                return
            for target, name in ((self._spool_loop, "usage-spool"), (self._ship_loop, "usage-ship")):
                thread = threading.Thread(target=target, name=name, daemon=True)
                self._threads.append(thread)
                thread.start()

    async def commit(self, record: UsageRecord, timeout_s: float = 5.0) -> bool:
        """Queue `record` and wait until it is on local disk: True then. False after `timeout_s`
        (the local disk failed): the record stays queued, and the caller goes on rather than
        failing a request that was served. Cancelling the wait leaves the record queued."""
        loop = asyncio.get_running_loop()
        stored: asyncio.Future[None] = loop.create_future()

        def set_stored() -> None:
            if not stored.done():
                stored.set_result(None)

        def done() -> None:
            loop.call_soon_threadsafe(set_stored)

        self.submit(record, done)
        try:
            await asyncio.wait_for(asyncio.shield(stored), timeout_s)
            return True
        except TimeoutError:
            logger.warning(
                "usage record not spooled in time; it stays queued",
                extra={"request_id": record.request_id, "timeout_s": timeout_s},
            )
            return False

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every record submitted so far is in the object store; False after
        `timeout_s` (they stay spooled and are shipped later)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            target = self.num_spooled + len(self._pending) + (self._num_appending if self._appending else 0)
            while self.num_committed < target:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._ship_now = True
                self._cond.notify_all()
                self._cond.wait(min(remaining, 0.5))
        return True

    def close(self, timeout_s: float = 30.0) -> bool:
        """Ship what is queued (up to `timeout_s`) and stop. What could not be shipped stays in
        the local spool for the next process of this store on this machine."""
        shipped = self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5.0)
        if self._spool is not None:
            self._spool.close()
        if not shipped:
            logger.warning("usage records left in the local spool at close; the next process ships them")
        return shipped

    # -- the spool thread -------------------------------------------------------------------
    def _spool_loop(self) -> None:
        attempt = 0
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:  # closed and drained
                    return
                batch, self._pending = self._pending, []
                self._appending, self._num_appending = True, len(batch)
            try:
                if self._spool is None:
                    self._spool = SpoolWriter(self.spool_dir, self.writer_id)
                self._spool.append([record for record, _ in batch])
            except OSError as exc:  # a full or failing local disk: keep them, retry
                with self._cond:
                    self._pending = batch + self._pending
                    self._appending = False
                pause = RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)]
                attempt += 1
                logger.error("usage spool write failed; retrying", extra={"error": str(exc)[:300]})
                time.sleep(pause)
                continue
            attempt = 0
            with self._cond:
                self._appending = False
                self.num_spooled += len(batch)
                if self._oldest_unshipped is None:
                    self._oldest_unshipped = time.monotonic()
                self._cond.notify_all()
            for _, done in batch:
                if done is not None:
                    with contextlib.suppress(RuntimeError):  # its event loop has closed: nobody waits
                        done()

    # -- the ship thread --------------------------------------------------------------------
    def _ship_due(self) -> bool:
        unshipped = self.num_spooled - self.num_committed
        if unshipped <= 0 or self._oldest_unshipped is None:
            return False
        waited = time.monotonic() - self._oldest_unshipped
        return (
            self._ship_now
            or self._closed
            or unshipped >= self.ship_max_records
            or waited >= self.commit_interval_s
        )

    def _ship_loop(self) -> None:
        attempt = 0
        swept_at = float("-inf")
        while True:
            with self._cond:
                while not self._ship_due():
                    if self._closed and not self._pending and not self._appending:
                        return
                    if time.monotonic() - swept_at >= self.sweep_interval_s:
                        break
                    wait = self.commit_interval_s
                    if self._oldest_unshipped is not None:
                        wait = max(0.0, self._oldest_unshipped + self.commit_interval_s - time.monotonic())
                    self._cond.wait(min(wait, self.sweep_interval_s) if wait > 0 else 0.05)
                self._ship_now = False
                self._oldest_unshipped = None if self.num_spooled == self.num_committed else time.monotonic()
            try:
                if time.monotonic() - swept_at >= self.sweep_interval_s:
                    swept_at = time.monotonic()
                    self.num_recovered += sweep_orphans(
                        self.store, self.spool_dir, exclude=self.writer_id,
                        max_records=self.ship_max_records, on_shipped=self._counted,
                    )  # fmt: skip
                if self._spool is not None:
                    num = self._spool.ship(self.store, self.ship_max_records, self._counted)
                    with self._cond:
                        self.num_committed += num
                        if self.num_committed >= self.num_spooled:
                            self._oldest_unshipped = None
                        self._cond.notify_all()
                attempt = 0
            except Exception as exc:  # noqa: BLE001 - the store is down: the spool keeps them, retry
                with self._cond:
                    if self._oldest_unshipped is None and self.num_spooled > self.num_committed:
                        self._oldest_unshipped = time.monotonic()
                pause = RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)]
                attempt += 1
                logger.warning(
                    "usage shipping failed; the records stay spooled",
                    extra={"attempt": attempt, "error": f"{type(exc).__name__}: {exc}"[:300]},
                )
                with self._cond:
                    if self._closed:
                        return  # what is left stays spooled for the next process
                    self._cond.wait(pause)
                continue
            self._maybe_compact()

    def _counted(self, records: list[UsageRecord]) -> None:
        if self.on_committed is not None:
            try:
                self.on_committed(records)
            except Exception:  # noqa: BLE001 - counters must not stop the log
                logger.exception("usage counters failed")

    def _maybe_compact(self) -> None:
        """Start a compaction of the closed hours on its own thread (reading an hour's objects
        can take long: flushes never wait for it), at most one at a time."""
        if (
            self.compaction_interval_s is None
            or time.monotonic() - self._compacted_at < self.compaction_interval_s
        ):
            return
        if self.num_committed == self._committed_at_compaction:
            return  # an idle process leaves compaction to the busy ones: no store calls
        self._committed_at_compaction = self.num_committed
        if self._compactor is not None and self._compactor.is_alive():
            return
        self._compacted_at = time.monotonic()

        def compact() -> None:
            try:
                compact_closed_hours(self.store)
            except Exception:  # noqa: BLE001 - compaction is an optimisation: the next run retries
                logger.warning("usage compaction failed; retried later", exc_info=True)

        self._compactor = threading.Thread(target=compact, name="usage-compaction", daemon=True)
        self._compactor.start()
