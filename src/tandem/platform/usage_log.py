"""`UsageLog`: appends usage records to the object store, durably, in group commits.

One writer per process. Records handed to it (`submit`, or `commit` to wait) are written by one
background thread as Parquet objects (`usage_records`), one object per hour partition per flush,
each under a key no other write uses (`rt-<writer id>-<seq>`, the writer id random per process)
with put-if-absent. Flushes run back to back but at most one per `commit_interval_s`, so a busy
replica writes a bounded number of objects, and a record waits at most that interval plus one
object write.

Exactly-once: a record is in exactly one flush, and each flush writes each of its objects until
the store has it. A write whose answer was lost is retried under the same key; finding the key
taken then means the earlier try landed (no one else writes that key), not a duplicate. A server
that awaits `commit` before it sends a response's usage knows the record is stored before the
client sees the count; a process killed before that point never reported the usage either.
Records submitted without waiting (a request cancelled or failed) are stored at the next flush,
and `close` flushes what is left on a graceful stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable

from tandem.platform.object_store import ObjectStore, PreconditionFailed
from tandem.platform.usage_compaction import compact_closed_hours
from tandem.platform.usage_records import UsageRecord, by_hour, encode_records, realtime_key

logger = logging.getLogger("tandem.usage")

Done = Callable[[], None]

RETRY_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0)  # then every 5 s while the store is down


class UsageLog:
    def __init__(
        self,
        store: ObjectStore,
        *,
        writer_id: str | None = None,
        commit_interval_s: float = 0.1,
        on_committed: Callable[[list[UsageRecord]], None] | None = None,
        compaction_interval_s: float | None = 600.0,
    ) -> None:
        """`on_committed(records)` runs on the writer thread after each flush (counters). Every
        `compaction_interval_s` (None: never) the writer thread also compacts the closed hours
        (`usage_compaction`; any number of writers may, safely)."""
        self.store = store
        self.writer_id = writer_id or uuid.uuid4().hex[:16]
        self.commit_interval_s = commit_interval_s
        self.compaction_interval_s = compaction_interval_s
        self._compacted_at = float("-inf")
        self._compactor: threading.Thread | None = None
        self.on_committed = on_committed
        self.num_committed = 0  # records stored so far
        self.num_objects = 0  # objects written so far
        self._seq = 0
        self._pending: list[tuple[UsageRecord, Done | None]] = []
        self._flushing = False  # a flush taken off `_pending` is being written
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    # -- handing records over ---------------------------------------------------------------
    def submit(self, record: UsageRecord, done: Done | None = None) -> None:
        """Queue `record` for the next flush; `done()` runs on the writer thread once it is stored.
        Never blocks and never raises (it runs in cleanup code, also under cancellation)."""
        with self._cond:
            self._pending.append((record, done))
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="usage-log", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    async def commit(self, record: UsageRecord, timeout_s: float = 10.0) -> bool:
        """Queue `record` and wait until it is stored: True then. False after `timeout_s` (the
        store is unreachable): the record stays queued and is stored once the store answers, and
        the caller goes on rather than failing a request that was served. Cancelling the wait
        leaves the record queued."""
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
                "usage record not stored in time; it stays queued",
                extra={"request_id": record.request_id, "timeout_s": timeout_s},
            )
            return False

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every record submitted so far is stored; False after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._flushing:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.notify_all()
                self._cond.wait(remaining)
        return True

    def close(self, timeout_s: float = 30.0) -> bool:
        """Store what is queued (up to `timeout_s`) and stop the writer thread."""
        stored = self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if not stored:
            logger.error("usage records left unstored at close", extra={"num_records": len(self._pending)})
        return stored

    # -- the writer thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:  # closed and drained
                    self._thread = None
                    return
                batch, self._pending = self._pending, []
                self._flushing = True
            started = time.monotonic()
            try:
                self._write(batch)
            finally:
                with self._cond:
                    self._flushing = False
                    self._cond.notify_all()
            for _, done in batch:
                if done is not None:
                    with contextlib.suppress(RuntimeError):  # its event loop has closed: nobody waits
                        done()
            if self.on_committed is not None:
                try:
                    self.on_committed([record for record, _ in batch])
                except Exception:  # noqa: BLE001 - counters must not stop the log
                    logger.exception("usage counters failed")
            self._maybe_compact()
            pause = self.commit_interval_s - (time.monotonic() - started)
            if pause > 0:
                with self._cond:
                    if not self._closed:
                        self._cond.wait(pause)

    def _maybe_compact(self) -> None:
        """Start a compaction of the closed hours on its own thread (reading an hour's objects
        can take long: flushes never wait for it), at most one at a time."""
        if self.compaction_interval_s is None or time.monotonic() - self._compacted_at < self.compaction_interval_s:
            return
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

    def _write(self, batch: list[tuple[UsageRecord, Done | None]]) -> None:
        """Store every record of `batch`: one object per hour, each retried until stored."""
        for hour, records in by_hour(record for record, _ in batch).items():
            key = realtime_key(hour, self.writer_id, self._seq)
            self._seq += 1
            data = encode_records(records)
            for attempt in range(1_000_000):
                try:
                    self.store.put(key, data, if_none_match=True)
                except PreconditionFailed:  # an earlier try landed though its answer was lost
                    pass
                except Exception as exc:  # noqa: BLE001 - the store is down: keep the records, retry
                    pause = RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)]
                    logger.warning(
                        "usage write failed; retrying",
                        extra={
                            "key": key,
                            "attempt": attempt + 1,
                            "error": f"{type(exc).__name__}: {exc}"[:300],
                        },
                    )
                    time.sleep(pause)
                    continue
                break
            self.num_objects += 1
            self.num_committed += len(records)
