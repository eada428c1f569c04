"""`LeasedTenantLimiter`: tenant limits of one of several ingress replicas, on budget leases from
the fleet state (`platform/tenant_budget.py`): most admissions are decided here, a round trip
to the fleet only when the replica holds no free slot of the tenant, and one reconcile call per
`reconcile_s` while it has anything to report."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import cast

from ray.serve.handle import DeploymentHandle

from tandem.platform.tenancy import RateLimitError, TenantRegistry
from tandem.platform.tenant_budget import LocalBudget, Refusal, Reply

logger = logging.getLogger("tandem.fleet")


class LeasedTenantLimiter:
    """`TenantLimiter` (openai_server.py) over a `LocalBudget` and the fleet state's `FleetBudget`."""

    def __init__(
        self, fleet: DeploymentHandle, tenants: TenantRegistry, *, reconcile_s: float = 1.0, linger_s: float = 2.0
    ) -> None:
        self.fleet, self.tenants = fleet, tenants
        self.owner = uuid.uuid4().hex  # this process
        self.reconcile_s = reconcile_s
        self.budget = LocalBudget(linger_s)
        self.num_fleet_calls = 0
        self._slotted: dict[str, int] = {}  # tenant -> admitted requests that hold a slot
        self._reconciler: asyncio.Task[None] | None = None

    async def acquire(self, tenant: str) -> None:
        limits = self.tenants.limits_for(tenant)
        if not limits.enforced:
            return  # nothing to enforce: no bookkeeping
        admitted = self.budget.admit(tenant, limits, time.monotonic())
        if isinstance(admitted, RateLimitError):
            self._ensure_reconciler()
            raise admitted
        if not admitted:  # no free slot here: lease one
            call = asyncio.ensure_future(self._lease(tenant))
            try:
                refusal = await asyncio.shield(call)
            except asyncio.CancelledError:
                # The caller went away while the fleet granted a slot, perhaps: keep it idle here,
                # given back at the next reconcile.
                call.add_done_callback(lambda done: self._idle_late(done, tenant))
                raise
            if refusal is not None:
                message, retry_after_s, code = refusal
                self._ensure_reconciler()
                raise RateLimitError(message, retry_after_s=retry_after_s, code=code)
            self.budget.leased(tenant)
        if limits.max_concurrent_requests is not None:
            self._slotted[tenant] = self._slotted.get(tenant, 0) + 1
        self._ensure_reconciler()

    async def _lease(self, tenant: str) -> Refusal | None:
        limits = self.tenants.limits_for(tenant)
        self.num_fleet_calls += 1
        return cast(
            "Refusal | None",
            await self.fleet.lease.remote(
                self.owner, tenant, limits.max_concurrent_requests, limits.tokens_per_minute,
                limits.requests_per_minute,
            ),
        )  # fmt: skip

    def _idle_late(self, done: asyncio.Future[Refusal | None], tenant: str) -> None:
        if not done.cancelled() and done.exception() is None and done.result() is None:
            self.budget.add_idle_slot(tenant)
            self._ensure_reconciler()

    def release(self, tenant: str, num_tokens: int) -> None:
        slot = self._slotted.get(tenant, 0) > 0
        if slot:
            self._slotted[tenant] -= 1
        elif not self.tenants.limits_for(tenant).enforced:
            return  # no limit to count against
        self.budget.release(tenant, num_tokens, time.monotonic(), slot=slot)
        self._ensure_reconciler()

    async def refusals(self) -> dict[str, dict[str, int]]:
        """The fleet's tenant-limit 429s of the last hour (every replica reports its own)."""
        try:
            return cast(dict[str, dict[str, int]], await self.fleet.refusals.remote())
        except Exception:  # noqa: BLE001 - the fleet state restarted: this replica's own view
            return self.budget.refusal_log.totals(time.monotonic())

    def _ensure_reconciler(self) -> None:
        if self._reconciler is None or self._reconciler.done():
            self._reconciler = asyncio.get_running_loop().create_task(self._reconcile_loop())

    async def _reconcile_loop(self) -> None:
        """Report every `reconcile_s` while there is anything to report or slots are held."""
        while self.budget.needs_reconcile():
            await asyncio.sleep(self.reconcile_s)
            await self.reconcile()

    async def reconcile(self, reclaim: set[str] | None = None) -> None:
        report = self.budget.report(time.monotonic(), reclaim or set())
        self.num_fleet_calls += 1
        try:
            reply = cast(Reply, await self.fleet.reconcile.remote(self.owner, report))
        except Exception as exc:  # noqa: BLE001 - the fleet state restarted or is unreachable
            self.budget.restore(report)
            logger.warning("tenant budget reconcile failed; retried", extra={"error": str(exc)[:200]})
            return
        self.budget.learn(reply)
        if reply.reclaim:  # another replica was refused while slots idle here: give them back now
            with contextlib.suppress(Exception):
                report = self.budget.report(time.monotonic(), reply.reclaim)
                if not report.empty:
                    self.num_fleet_calls += 1
                    self.budget.learn(cast(Reply, await self.fleet.reconcile.remote(self.owner, report)))
