"""What a batch worker sends and gets back per line, and the window of lines it keeps out.

`Execute` runs one line through the real-time path (`deployments/batch_execution.py`) and returns an
`ExecutedRequest`; it raises `RetryLater` for a failure that is not the line's own (the shard runs
again later) and `Backpressure` when no engine has room (the line waits and is sent again).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tandem.batch.records import ShardCounts
from tandem.batch.shards import BatchResult


@dataclass
class ExecutedRequest:
    """What `execute` returns for one request: a response body or an OpenAI error object."""

    status_code: int
    request_id: str
    body: dict[str, Any] | None
    error: dict[str, Any] | None
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


Execute = Callable[[str, dict[str, Any], str], Awaitable[ExecutedRequest]]  # (endpoint, body, tenant)


class RetryLater(Exception):
    """Raised by `execute` for a request that failed through no fault of its own (its replica
    died, no engine could take it) after the executor's own retries: its answer must not be
    written. The shard is not committed; its lease is released and a later claim runs it again
    (until the batch expires)."""


class Backpressure(Exception):
    """Raised by `execute` when no engine has room for batch work now (each replica takes a
    bounded number of batch requests, so real-time requests always find a seat): not a failure.
    The line waits `retry_after_s` and is sent again, as long as its shard's lease holds."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class LineWindow:
    """How many lines a worker has out at once, sized by the engines' backpressure (AIMD, as TCP
    does): it starts at `limit`, halves on backpressure (at most once per `retry_after_s`, so a
    burst of refusals of lines sent together counts once), and grows by one per answered line, up
    to `limit`. Invariant: 1 <= size <= limit and in_flight <= max(size, in_flight at the last
    shrink) (lines already out are never recalled)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = limit
        self.in_flight = 0
        self.num_backpressured = 0
        self._last_shrink = float("-inf")
        self._changed = asyncio.Condition()

    async def acquire(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.in_flight < self.size)
            self.in_flight += 1

    async def release(self, *, answered: bool) -> None:
        async with self._changed:
            self.in_flight -= 1
            if answered:
                self.size = min(self.limit, self.size + 1)
            self._changed.notify_all()

    def shrink(self, hold_s: float) -> None:
        self.num_backpressured += 1
        now = time.monotonic()
        if now - self._last_shrink >= hold_s:
            self._last_shrink = now
            self.size = max(1, self.size // 2)


def shard_counts(rows: list[BatchResult]) -> ShardCounts:
    return ShardCounts(
        completed=sum(r.ok for r in rows),
        failed=sum(not r.ok for r in rows),
        input_tokens=sum(r.input_tokens for r in rows),
        output_tokens=sum(r.output_tokens for r in rows),
    )


def response_model(body: dict[str, object] | None, request: dict[str, object]) -> str | None:
    """The model a line's response names, else the one its request asked for."""
    model = (body or {}).get("model") or request.get("model")
    return model if isinstance(model, str) else None


def batch_request_id(batch_id: str, line: int) -> str:
    """Stable id of one request of a batch (the `id` of its output line)."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_{line}"
