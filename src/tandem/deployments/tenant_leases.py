"""Tenant limits across several ingress replicas: `TenantBudgetShard` deployments (each a
`FleetBudget` for the tenants hashed to it) and each ingress replica's `LeasedTenantLimiter`
(platform/tenant_budget.py says how the leases work). Most admissions are decided in the ingress
replica; a round trip goes to the tenant's shard only when the replica holds no free slot of the
tenant, plus one reconcile call per shard per `reconcile_s` while it has anything to report. With
more ingress replicas, more shards (`AppConfig.tenant_budget_shards`), so the calls each shard
serves stay level as the fleet grows."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
import zlib
from typing import cast

from ray.serve.handle import DeploymentHandle

from tandem.platform.tenancy import CONCURRENCY_LIMITED, RateLimitError, TenantLimits, TenantRegistry
from tandem.platform.tenant_budget import FleetBudget, LocalBudget, Refusal, Reply, Report

logger = logging.getLogger("tandem.fleet")

TENANT_BUDGET_DEPLOYMENT = "TenantBudget"
WAKE_MARGIN_S = 0.01  # after a tight slot's linger, before the reconcile that returns it
RETRY_MARGIN_S = 0.05  # past a lingering slot's return, before the first retry of a refused lease
# Later retries of a lease refused at the concurrency limit, each after the previous one's wait
# doubled: a slot another replica freed returns through that replica's reconcile, which a loaded
# host (or Ray) can delay past the first retry; a client that keeps to its limit is not refused
# for that, and one that does not learns it within about a second.
NUM_LEASE_RETRIES = 3


def shard_of(tenant: str, num_shards: int) -> int:
    """The shard that keeps `tenant`'s budget (a stable hash: the same in every process)."""
    return zlib.crc32(tenant.encode()) % num_shards


class TenantBudgetShard:
    """One shard's `FleetBudget` (a Serve deployment with one replica). Its state is soft: a
    restarted shard starts its tenants' counts from zero, and replicas' slots are leased anew."""

    def __init__(self, owner_ttl_s: float = 30.0) -> None:
        self.budget = FleetBudget(owner_ttl_s)

    def lease(
        self, owner: str, tenant: str, max_concurrent_requests: int | None, tokens_per_minute: int | None,
        requests_per_minute: int | None,
    ) -> Refusal | int:  # fmt: skip
        """One concurrency slot of `tenant` for `owner` (the tenant's slots still free after it),
        or (message, retry-after, code)."""
        limits = TenantLimits(max_concurrent_requests, tokens_per_minute, requests_per_minute)
        return self.budget.lease(owner, tenant, limits, time.monotonic())

    def reconcile(self, owner: str, report: Report) -> Reply:
        """An ingress replica's periodic report (slots given back, tokens, admissions, refusals)."""
        return self.budget.reconcile(owner, report, time.monotonic())

    def refusals(self) -> dict[str, dict[str, int]]:
        """This shard's tenants' limit 429s of the last hour, by tenant and code."""
        return self.budget.refusal_log.totals(time.monotonic())


class LeasedTenantLimiter:
    """`TenantLimiter` (openai/limiter.py) over a `LocalBudget` and the tenants' budget shards."""

    def __init__(
        self,
        shards: list[DeploymentHandle],
        tenants: TenantRegistry,
        *,
        reconcile_s: float = 1.0,
        linger_s: float = 0.5,
    ) -> None:
        if not shards:
            raise ValueError("a leased tenant limiter needs at least one budget shard")
        self.shards, self.tenants = shards, tenants
        self.owner = uuid.uuid4().hex  # this process
        self.reconcile_s = reconcile_s
        self.budget = LocalBudget(linger_s)
        self.num_fleet_calls = 0
        self._slotted: dict[str, int] = {}  # tenant -> admitted requests that hold a slot
        self._reconciler: asyncio.Task[None] | None = None
        self._reconcile_now = asyncio.Event()

    def _shard(self, tenant: str) -> DeploymentHandle:
        return self.shards[shard_of(tenant, len(self.shards))]

    async def acquire(self, tenant: str) -> None:
        limits = self.tenants.limits_for(tenant)
        if not limits.enforced:
            return  # nothing to enforce: no bookkeeping
        admitted = self.budget.admit(tenant, limits, time.monotonic())
        if isinstance(admitted, RateLimitError):
            self._ensure_reconciler()
            raise admitted
        if not admitted:  # no free slot here: lease one
            granted = await self._lease_once(tenant, limits)
            wait_s = self.budget.tight_linger_s + RETRY_MARGIN_S
            for _ in range(NUM_LEASE_RETRIES):
                if not (isinstance(granted, tuple) and granted[2] == CONCURRENCY_LIMITED):
                    break
                # Refused at the limit: a slot another replica just freed may linger there for
                # `tight_linger_s` and then travel back through its reconcile; try again after it,
                # so that a client keeping to its limit across replicas is not refused for that.
                await asyncio.sleep(wait_s)
                wait_s *= 2
                granted = await self._lease_once(tenant, limits)
            if isinstance(granted, tuple):  # refused
                self._ensure_reconciler()
                raise self.budget.lease_refused(tenant, granted, time.monotonic())
            self.budget.leased(tenant, limits, granted)
        if limits.max_concurrent_requests is not None:
            self._slotted[tenant] = self._slotted.get(tenant, 0) + 1
        self._ensure_reconciler()

    async def _lease_once(self, tenant: str, limits: TenantLimits) -> Refusal | int:
        call = asyncio.ensure_future(self._lease(tenant, limits))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            # The caller went away while the shard granted a slot, perhaps: keep it idle here,
            # given back at the next reconcile.
            call.add_done_callback(lambda done: self._idle_late(done, tenant))
            raise

    async def _lease(self, tenant: str, limits: TenantLimits) -> Refusal | int:
        self.num_fleet_calls += 1
        return cast(
            "Refusal | int",
            await self._shard(tenant).lease.remote(
                self.owner, tenant, limits.max_concurrent_requests, limits.tokens_per_minute,
                limits.requests_per_minute,
            ),
        )  # fmt: skip

    def _idle_late(self, done: asyncio.Future[Refusal | int], tenant: str) -> None:
        if not done.cancelled() and done.exception() is None and not isinstance(done.result(), tuple):
            self.budget.add_idle_slot(tenant)
            self._ensure_reconciler()

    def release(self, tenant: str, num_tokens: int) -> None:
        slot = self._slotted.get(tenant, 0) > 0
        if slot:
            self._slotted[tenant] -= 1
        limits = self.tenants.limits_for(tenant)
        if not slot and not limits.enforced:
            return  # no limit to count against
        count_tokens = limits.tokens_per_minute is not None
        if self.budget.release(tenant, num_tokens, time.monotonic(), slot=slot, count_tokens=count_tokens):
            # a tight tenant's slot goes back soon if it stays idle
            # (a little after the linger: the loop may run a timer up to its clock resolution early)
            wake_s = self.budget.tight_linger_s + WAKE_MARGIN_S
            asyncio.get_running_loop().call_later(wake_s, self._reconcile_now.set)
        self._ensure_reconciler()

    async def refusals(self) -> dict[str, dict[str, int]]:
        """The tenant-limit 429s of the last hour over every shard (every replica reports its own);
        this replica's own where a shard does not answer."""
        totals: dict[str, dict[str, int]] = {}
        for shard in self.shards:
            try:
                part = cast(dict[str, dict[str, int]], await shard.refusals.remote())
            except Exception:  # noqa: BLE001 - a shard restarting: what this replica saw
                part = self.budget.refusal_log.totals(time.monotonic())
            for tenant, by_code in part.items():
                mine = totals.setdefault(tenant, {})
                for code, count in by_code.items():
                    mine[code] = mine.get(code, 0) + count
        return totals

    def _ensure_reconciler(self) -> None:
        if self._reconciler is None or self._reconciler.done():
            self._reconciler = asyncio.get_running_loop().create_task(self._reconcile_loop())

    async def _reconcile_loop(self) -> None:
        """Report every `reconcile_s` while there is anything to report or slots are held."""
        while self.budget.needs_reconcile():
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(self._reconcile_now.wait(), self.reconcile_s)
            self._reconcile_now.clear()
            reclaim = await self.reconcile()
            if reclaim:  # another replica was refused while slots idle here: give them back now
                await self.reconcile(reclaim)

    async def reconcile(self, reclaim: set[str] | None = None) -> set[str]:
        """Send each shard its part of the report; returns the tenants shards asked to reclaim."""
        report = self.budget.report(time.monotonic(), reclaim or set())
        parts = report.split(lambda tenant: shard_of(tenant, len(self.shards)))
        asked: set[str] = set()
        for index, part in parts.items():
            if reclaim is not None and part.empty:
                continue
            self.num_fleet_calls += 1
            try:
                reply = cast(Reply, await self.shards[index].reconcile.remote(self.owner, part))
            except Exception as exc:  # noqa: BLE001 - the shard restarted or is unreachable
                self.budget.restore(part)
                logger.warning("tenant budget reconcile failed; retried", extra={"error": str(exc)[:200]})
                continue
            self.budget.learn(reply)
            asked |= reply.reclaim
        return asked
