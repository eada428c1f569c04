"""`FleetState` (plain class, no Ray): tenant limits across ingress replicas and engine figures."""

from __future__ import annotations

import asyncio

import pytest

from tandem.deployments.fleet import FleetState
from tandem.platform.tenancy import RateLimitError, TenantLimits
from tandem.platform.tenant_budget import FleetBudget, LocalBudget, Report


def _admit(local: LocalBudget, fleet: FleetBudget, owner: str, limits: TenantLimits, now: float) -> str:
    """One request of acme through a replica's budget: "ok", or the 429's code."""
    admitted = local.admit("acme", limits, now)
    if isinstance(admitted, RateLimitError):
        return admitted.code or ""
    if admitted:
        return "ok"
    granted = fleet.lease(owner, "acme", limits, now)
    if isinstance(granted, tuple):
        assert granted[1] >= 1
        return granted[2]
    local.leased("acme", limits, granted)
    return "ok"


def test_concurrency_slots_hold_across_replicas_and_a_silent_replica_gives_its_slots_back() -> None:
    # lingering as if never tight (a tight tenant's slot lingers 0.1 s: the next test)
    fleet = FleetBudget(owner_ttl_s=30.0)
    a, b = LocalBudget(linger_s=2.0, tight_linger_s=2.0), LocalBudget(linger_s=2.0, tight_linger_s=2.0)
    limits = TenantLimits(max_concurrent_requests=2)
    assert _admit(a, fleet, "a", limits, 0.0) == "ok"
    assert _admit(b, fleet, "b", limits, 0.0) == "ok"
    assert _admit(a, fleet, "a", limits, 0.1) == "rate_limit_exceeded"  # 2 leased across both
    a.release("acme", 5, 0.2, slot=True)  # a's slot lingers there for its next request
    assert _admit(a, fleet, "a", limits, 0.3) == "ok" and fleet.leased("acme") == 2  # no lease needed
    a.release("acme", 5, 0.4, slot=True)
    assert _admit(b, fleet, "b", limits, 0.5) == "rate_limit_exceeded"  # b's refusal marks acme
    reply = fleet.reconcile("a", a.report(0.6), 0.6)  # a hears of it at its next reconcile
    assert reply.reclaim == {"acme"}
    fleet.reconcile("a", a.report(0.6, reply.reclaim), 0.6)  # and gives its idle slot back
    assert fleet.leased("acme") == 1
    assert _admit(b, fleet, "b", limits, 0.7) == "ok"
    # b dies holding two slots; a stays in touch; after the ttl b's slots are back
    fleet.reconcile("a", a.report(20.0), 20.0)
    assert _admit(a, fleet, "a", limits, 20.0) == "rate_limit_exceeded"
    assert _admit(a, fleet, "a", limits, 31.0) == "ok" and fleet.leased("acme") == 1


def test_a_tight_tenants_freed_slot_goes_back_after_a_short_linger() -> None:
    """Limit 8: a lease that leaves under 2 free marks the tenant tight at that replica; its freed
    slot lingers 0.1 s (reused by the next request there) rather than 0.5 s."""
    fleet, a, b = FleetBudget(), LocalBudget(), LocalBudget()
    limits = TenantLimits(max_concurrent_requests=8)
    assert [_admit(a, fleet, "a", limits, 0.0) for _ in range(6)] == ["ok"] * 6
    assert not a.release("acme", 1, 0.1, slot=True)  # 2 were free at its lease: not tight, lingers 0.5 s
    assert _admit(a, fleet, "a", limits, 0.2) == "ok" and fleet.leased("acme") == 6  # the lingering slot
    assert [_admit(a, fleet, "a", limits, 0.2) for _ in range(2)] == ["ok"] * 2  # the last lease left 0
    assert fleet.leased("acme") == 8
    assert a.release("acme", 1, 0.3, slot=True)  # tight: the caller reconciles after 0.1 s
    fleet.reconcile("a", a.report(0.35), 0.35)
    assert fleet.leased("acme") == 8  # 0.05 s idle: still lingering
    fleet.reconcile("a", a.report(0.4), 0.4)
    assert fleet.leased("acme") == 7  # back
    assert _admit(b, fleet, "b", limits, 0.5) == "ok"


def test_rates_count_every_replicas_usage_within_a_reconcile() -> None:
    fleet, a, b = FleetBudget(), LocalBudget(), LocalBudget()
    tokens = TenantLimits(tokens_per_minute=100)
    for owner, local in (("a", a), ("b", b)):
        assert _admit(local, fleet, owner, tokens, 0.0) == "ok"
        local.release("acme", 60, 0.5, slot=False)
        local.learn(fleet.reconcile(owner, local.report(1.0), 1.0))
    assert _admit(a, fleet, "a", tokens, 1.1) == "ok"  # a reconciled before b: one reconcile behind
    a.learn(fleet.reconcile("a", a.report(2.0), 2.0))
    assert _admit(a, fleet, "a", tokens, 2.0) == "tokens_per_minute_exceeded"  # 120 fleet-wide
    a.learn(fleet.reconcile("a", a.report(62.0), 62.0))  # a minute later the window is empty
    assert _admit(a, fleet, "a", tokens, 62.0) == "ok"
    requests = TenantLimits(requests_per_minute=3)
    fleet, a, b = FleetBudget(), LocalBudget(), LocalBudget()
    assert [_admit(a, fleet, "a", requests, 0.0) for _ in range(2)] == ["ok", "ok"]
    a.learn(fleet.reconcile("a", a.report(1.0), 1.0))
    assert _admit(b, fleet, "b", requests, 1.0) == "ok"
    b.learn(fleet.reconcile("b", b.report(2.0), 2.0))
    assert _admit(b, fleet, "b", requests, 2.0) == "requests_per_minute_exceeded"  # 3 across both
    assert _admit(a, fleet, "a", requests, 2.0) == "ok"  # a has not heard yet: one reconcile behind
    a.learn(fleet.reconcile("a", a.report(3.0), 3.0))
    assert _admit(a, fleet, "a", requests, 3.0) == "requests_per_minute_exceeded"
    fleet.reconcile("b", b.report(3.0), 3.0)
    fleet.reconcile("a", a.report(3.0), 3.0)  # each replica's refusals reach the fleet's count
    assert fleet.refusal_log.totals(3.0) == {"acme": {"requests_per_minute_exceeded": 2}}


def test_replicas_that_stop_reporting_drop_out(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr("tandem.deployments.fleet.time.monotonic", lambda: clock[0])
    state = FleetState(stats_ttl_s=5.0)
    state.report("r1", {"kv_occupancy": 0.5})
    clock[0] += 3
    state.report("r2", {"kv_occupancy": 0.1})
    assert set(state.snapshot()) == {"r1", "r2"}
    clock[0] += 3
    assert state.snapshot() == {"r2": {"kv_occupancy": 0.1}}


class SlowFleetHandle:
    """A deployment's object behind a fake deployment handle whose answers take `delay_s`."""

    def __init__(self, state: object, delay_s: float) -> None:
        self.state, self.delay_s = state, delay_s

    def __getattr__(self, method: str) -> object:
        state, delay_s = self.state, self.delay_s

        class Method:
            def remote(self, *args: object) -> object:
                async def call() -> object:
                    await asyncio.sleep(delay_s)  # the round trip to the fleet's replica
                    return getattr(state, method)(*args)

                return asyncio.ensure_future(call())

        return Method()


def test_a_caller_cancelled_while_the_fleet_admits_it_gives_the_slot_back() -> None:
    """A client gone while its lease was in flight: the slot the fleet granted meanwhile is given
    back at the replica's next reconcile, so the tenant is not left a slot short."""
    from tandem.deployments.tenant_leases import LeasedTenantLimiter, TenantBudgetShard
    from tandem.platform.api_keys import parse_keys
    from tandem.platform.tenancy import TenantRegistry

    state = TenantBudgetShard()
    limiter = LeasedTenantLimiter(
        [SlowFleetHandle(state, 0.05)],  # type: ignore[list-item]
        TenantRegistry(parse_keys("k=acme"), TenantLimits(max_concurrent_requests=1)),
        reconcile_s=0.05,
    )

    async def main() -> None:
        admission = asyncio.ensure_future(limiter.acquire("acme"))
        await asyncio.sleep(0)  # the request is on its way
        admission.cancel()
        with pytest.raises(asyncio.CancelledError):
            await admission
        seen = []  # the fleet's lease lands, then the reconcile gives it back: 1, then 0
        for _ in range(200):
            await asyncio.sleep(0.01)
            seen.append(state.budget.leased("acme"))
            if 1 in seen and seen[-1] == 0:
                break
        assert 1 in seen and seen[-1] == 0, seen
        await limiter.acquire("acme")  # the one slot is free

    asyncio.run(main())


def test_a_busy_tenant_is_admitted_without_a_round_trip_per_request() -> None:
    """200 requests of one tenant, 4 at a time under a limit of 4, through one replica: the
    fleet state sees the 4 leases and the periodic reconciles, not 400 calls."""
    from tandem.deployments.tenant_leases import LeasedTenantLimiter, TenantBudgetShard
    from tandem.platform.api_keys import parse_keys
    from tandem.platform.tenancy import TenantRegistry

    state = TenantBudgetShard()
    limiter = LeasedTenantLimiter(
        [SlowFleetHandle(state, 0.002)],  # type: ignore[list-item]
        TenantRegistry(parse_keys("k=acme"), TenantLimits(max_concurrent_requests=4)),
        reconcile_s=0.05,
    )

    async def one() -> None:
        await limiter.acquire("acme")
        await asyncio.sleep(0.005)  # the request runs
        limiter.release("acme", 3)

    async def main() -> None:
        for _ in range(50):
            await asyncio.gather(*(one() for _ in range(4)))

    asyncio.run(main())
    assert state.budget.leased("acme") <= 4
    assert limiter.num_fleet_calls < 40, limiter.num_fleet_calls  # 4 leases + about one reconcile per 50 ms


def test_refusals_are_counted_per_tenant_and_code_for_an_hour(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.deployments.tenant_leases import TenantBudgetShard

    clock = [0.0]
    monkeypatch.setattr("tandem.deployments.tenant_leases.time.monotonic", lambda: clock[0])
    state = TenantBudgetShard()
    assert state.lease("a", "acme", 1, None, None) == 0  # granted: none left
    assert isinstance(state.lease("b", "acme", 1, None, None), tuple)
    assert isinstance(state.lease("a", "acme", 1, None, None), tuple)
    assert state.lease("a", "globex", 1, None, None) == 0
    assert state.refusals() == {"acme": {"rate_limit_exceeded": 2}}
    for _ in range(1000):  # a client retrying in a loop: counted, in one minute's counts
        state.lease("b", "acme", 1, None, None)
    state.reconcile("b", Report(refusals={"acme": {"tokens_per_minute_exceeded": 5}}))  # refused at a replica
    assert state.refusals() == {"acme": {"rate_limit_exceeded": 1002, "tokens_per_minute_exceeded": 5}}
    clock[0] += 3600
    assert state.refusals()["acme"]["rate_limit_exceeded"] == 1002  # their minute began < an hour ago
    clock[0] += 60
    assert state.refusals() == {}


def test_the_autoscaling_history_samples_replicas_against_the_policys_target(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two replicas at 90% KV occupancy against a 70% target: the policy wants three; samples come
    at most every 10 s and are kept for an hour; prefill replicas are not counted."""
    clock, wall = [0.0], [1_000_000.0]
    monkeypatch.setattr("tandem.deployments.fleet.time.monotonic", lambda: clock[0])
    monkeypatch.setattr("tandem.deployments.fleet.time.time", lambda: wall[0])
    state = FleetState(stats_ttl_s=30.0, scaling_targets={"target_kv_occupancy": 0.7, "max_replicas": 4})
    stats = {"role": "colocated", "kv_occupancy": 0.9, "num_waiting": 0}
    state.report("r1", stats)
    state.report("r2", stats)  # within 10 s of the first sample: none taken
    state.report("p1", {**stats, "role": "prefill"})
    assert [(s["replicas"], s["target"]) for s in state.scaling_history()] == [(1, 2)]
    clock[0] += 10
    wall[0] += 10
    state.report("r1", stats)
    assert [(s["replicas"], s["target"]) for s in state.scaling_history()] == [(1, 2), (2, 3)]
    clock[0] += 10
    wall[0] += 3601
    state.report("r1", {**stats, "kv_occupancy": 0.1})  # mean occupancy (0.1 + 0.9) / 2: two are enough
    history = state.scaling_history()
    assert [(s["replicas"], s["target"]) for s in history] == [(2, 2)]  # the hour-old samples dropped
    untargeted = FleetState()
    untargeted.report("r1", stats)
    assert untargeted.scaling_history()[0]["target"] is None
