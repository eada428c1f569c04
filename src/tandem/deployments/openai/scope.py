"""`RequestScope`: what one request holds from admission to its end, each released exactly once.

A request holds its tenant's slot (interactive requests: batch work has its own flow control),
a place in the server's in-flight count (what a drain waits for), its usage meter and the engine's
output stream. Whatever ends it (a response, an error before or after the first token, a client
that went away, a drain) calls `close` (or leaves `async with`), which gives them all back once:
the slot first (it never waits, so it is released even under cancellation), the meter's record
of a request that did not report usage, then the engine stream (closing it aborts the request).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Iterator
from types import TracebackType

from tandem.deployments.openai.limiter import TenantLimiter
from tandem.deployments.openai.mapping import num_tokens
from tandem.deployments.usage_metering import RequestMeter
from tandem.engine.protocol import RequestOutput
from tandem.platform.errors import ShuttingDownError
from tandem.platform.usage_log import UsageLog
from tandem.platform.usage_records import UsageStatus


class InFlight:
    """Requests running on one server now (a drain waits for them)."""

    def __init__(self) -> None:
        self.count = 0

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """One request running while the block runs."""
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1


class RequestScope:
    def __init__(
        self,
        in_flight: InFlight,
        limiter: TenantLimiter,
        tenant: str,
        *,
        accounted: bool,
        meter: RequestMeter | None = None,
        usage_log: UsageLog | None = None,
    ) -> None:
        """`accounted`: the request takes a tenant slot (`acquire`); `meter` with `usage_log`:
        its usage is metered."""
        self.in_flight = in_flight
        self.limiter = limiter
        self.tenant = tenant
        self.accounted = accounted
        self.meter = meter if usage_log is not None else None
        self.usage_log = usage_log
        self.outputs: AsyncGenerator[RequestOutput, None] | None = None
        self.last: RequestOutput | None = None  # the latest output counted against the tenant
        # Tokens to count against the tenant instead of `last`'s (a call that ran several engine
        # requests: an embeddings call's inputs)
        self.num_tokens_used: int | None = None
        self._holds_slot = False
        self._closed = False

    async def acquire(self) -> None:
        """The tenant's slot (a 429 `RateLimitError` when its limits refuse)."""
        if self.accounted:
            await self.limiter.acquire(self.tenant)
            self._holds_slot = True

    def start(self, outputs: AsyncGenerator[RequestOutput, None]) -> None:
        """The engine took the request: `outputs` is its stream, closed by `close`."""
        self.outputs = outputs
        self.in_flight.count += 1

    def see(self, output: RequestOutput) -> None:
        """An output arrived: metered. (Its tokens count against the tenant's budget at `close`
        once the caller sets `last`: not for a first output that fails the request.)"""
        if self.meter is not None:
            self.meter.see(output)

    async def commit_usage(self, last: RequestOutput) -> None:
        """Store a finished request's usage record before its usage is reported (its body
        returned, its usage chunk sent)."""
        if self.meter is None or self.usage_log is None or self.meter.recorded:
            return
        finish_reason = last.outputs[0].finish_reason if last.outputs else None
        await self.usage_log.commit(self.meter.record("completed", finish_reason))

    def end_usage(self, exc: BaseException | None, *, failed: bool = False) -> None:
        """Record a request that ends without reporting usage: `cancelled` when its client went
        away (a cancellation) or the server drained, `failed` otherwise. Never waits or raises."""
        if self.meter is None or self.usage_log is None or self.meter.recorded:
            return
        status: UsageStatus = "failed"
        if not failed and isinstance(exc, asyncio.CancelledError | GeneratorExit | ShuttingDownError):
            status = "cancelled"
        self.usage_log.submit(self.meter.record(status, "abort" if status == "cancelled" else "error"))

    async def close(self, exc: BaseException | None = None) -> None:
        """Give everything back (once; later calls do nothing). `exc`: what ended the request,
        if not its own end (its usage is then recorded `cancelled` or `failed`)."""
        if self._closed:
            return
        self._closed = True
        if self.outputs is not None:
            self.in_flight.count -= 1
        if self._holds_slot:
            used = self.num_tokens_used
            if used is None:
                used = num_tokens(self.last) if self.last is not None else 0
            self.limiter.release(self.tenant, used)
        if exc is not None:
            self.end_usage(exc)
        if self.outputs is not None:
            await self.outputs.aclose()  # a request still running in the engine is aborted

    async def __aenter__(self) -> RequestScope:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close(exc)
