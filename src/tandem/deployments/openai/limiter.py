"""Tenants' concurrency and rate limits on one ingress: `TenantLimiter` is what the request
path asks (acquire a slot, release it with the tokens used); `LocalTenantLimiter` keeps them in
this process (a fleet uses `tenant_leases.LeasedTenantLimiter`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Protocol

from tandem.platform.tenancy import CONCURRENCY_LIMITED, RateLimitError, TenantRegistry


class TenantLimiter(Protocol):
    """Admits a tenant's real-time requests under its limits (429 `RateLimitError` when over)."""

    async def acquire(self, tenant: str) -> None: ...

    def release(self, tenant: str, num_tokens: int) -> None:
        """Give the slot back. Never waits and never raises: it runs in `finally` blocks, also
        under cancellation (a client that went away)."""
        ...

    async def refusals(self) -> dict[str, dict[str, int]]:
        """Requests refused by tenant limits (429) in the last hour, per tenant and error code."""
        ...


class LocalTenantLimiter:
    """`TenantLimiter` of one API process: the registry's own counts (exact when this process
    admits every request, as a single ingress replica does).

    A request over its tenant's concurrency limit waits its turn, first come first served per
    tenant, up to `max_wait_s` for one of that tenant's requests to end, and only then gets the
    429 (0: at once). Waiting costs an idle connection, where an immediate 429 invites a retry
    loop that keeps the API process busy for everyone. A token-rate refusal is immediate."""

    def __init__(self, tenants: TenantRegistry, max_wait_s: float = 0.0) -> None:
        self.tenants = tenants
        self.max_wait_s = max_wait_s
        self._waiters: dict[str, deque[asyncio.Future[None]]] = {}  # per tenant, in arrival order

    async def acquire(self, tenant: str) -> None:
        waiters = self._waiters.setdefault(tenant, deque())
        if not waiters:
            try:
                self.tenants.acquire(tenant)
                return
            except RateLimitError as exc:
                if exc.code != CONCURRENCY_LIMITED or self.max_wait_s <= 0:
                    raise
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        turn: asyncio.Future[None] = loop.create_future()
        waiters.append(turn)
        try:
            while True:
                if waiters[0] is turn:  # first in line: a slot may be free
                    try:
                        self.tenants.acquire(tenant)
                        return
                    except RateLimitError as exc:
                        if exc.code != CONCURRENCY_LIMITED:
                            raise
                    if turn.done():
                        turn = waiters[0] = loop.create_future()
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise RateLimitError(
                        f"tenant {tenant!r} is at its limit of concurrent requests and none of them "
                        f"ended within {self.max_wait_s:g} s; retry when one finishes",
                        retry_after_s=1.0,
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(turn), remaining)
        finally:
            was_first = waiters[0] is turn
            waiters.remove(turn)
            if was_first and waiters:
                self._wake(tenant)  # the next in line tries (the slot may still be free)
            if not waiters:
                self._waiters.pop(tenant, None)

    def _wake(self, tenant: str) -> None:
        waiters = self._waiters.get(tenant)
        if waiters and not waiters[0].done():
            waiters[0].set_result(None)

    def release(self, tenant: str, num_tokens: int) -> None:
        self.tenants.release(tenant, num_tokens)
        self._wake(tenant)

    async def refusals(self) -> dict[str, dict[str, int]]:
        return self.tenants.refusals()
