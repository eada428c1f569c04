"""`FleetState` (plain class, no Ray): tenant limits across ingress replicas and engine figures."""

from __future__ import annotations

import asyncio

import pytest

from tandem.deployments.fleet import FleetState


def test_limits_hold_across_owners_and_a_silent_owner_gives_its_slots_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [100.0]
    monkeypatch.setattr("tandem.deployments.fleet.time.monotonic", lambda: clock[0])
    state = FleetState(owner_ttl_s=30.0)
    assert state.acquire("acme", 2, None, owner="ingress-1") is None
    assert state.acquire("acme", 2, None, owner="ingress-2") is None
    refusal = state.acquire("acme", 2, None, owner="ingress-1")  # 2 in flight across both owners
    assert refusal is not None and refusal[2] == "rate_limit_exceeded" and refusal[1] >= 1
    assert state.acquire("globex", 2, None, owner="ingress-1") is None  # another tenant's count
    state.release("acme", 10, owner="ingress-2")
    assert state.acquire("acme", 2, None, owner="ingress-2") is None
    # ingress-1 dies holding an acme slot; ingress-2 stays in touch; after the ttl the slot is back.
    clock[0] += 20
    state.heartbeat("ingress-2")
    assert state.acquire("acme", 2, None, owner="ingress-2") is not None
    clock[0] += 15
    assert state.acquire("acme", 2, None, owner="ingress-2") is None
    state.release("acme", 0, owner="ingress-1")  # a late release of a dropped slot: not counted twice
    assert state.acquire("acme", 2, None, owner="ingress-2") is not None


def test_tokens_per_minute_count_every_owners_usage(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr("tandem.deployments.fleet.time.monotonic", lambda: clock[0])
    state = FleetState()
    for owner in ("a", "b"):
        assert state.acquire("acme", None, 100, owner=owner) is None
        state.release("acme", 60, owner=owner)
    refusal = state.acquire("acme", None, 100, owner="a")
    assert refusal is not None and refusal[2] == "tokens_per_minute_exceeded"
    clock[0] += 61
    assert state.acquire("acme", None, 100, owner="a") is None


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
    """A `FleetState` behind a fake deployment handle whose answers take `delay_s`."""

    def __init__(self, state: FleetState, delay_s: float) -> None:
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
    """A client gone while its admission was in flight: the slot the fleet granted meanwhile is
    released when the answer arrives, so the tenant is not left a slot short."""
    from tandem.deployments.fleet import FleetTenantLimiter
    from tandem.platform.tenancy import TenantLimits, TenantRegistry, parse_keys

    state = FleetState()
    limiter = FleetTenantLimiter(
        SlowFleetHandle(state, 0.05), TenantRegistry(parse_keys("k=acme"), TenantLimits(max_concurrent_requests=1))  # type: ignore[arg-type]
    )

    async def main() -> None:
        admission = asyncio.ensure_future(limiter.acquire("acme"))
        await asyncio.sleep(0)  # the request is on its way
        admission.cancel()
        with pytest.raises(asyncio.CancelledError):
            await admission
        seen = []  # the fleet's admission lands, then the release: in-flight counts 1, then 0
        for _ in range(200):
            await asyncio.sleep(0.01)
            seen.append(state._usage.in_flight("acme"))
            if 1 in seen and seen[-1] == 0:
                break
        assert 1 in seen and seen[-1] == 0, seen
        await limiter.acquire("acme")  # the one slot is free

    asyncio.run(main())


def test_refusals_are_counted_per_tenant_and_code_for_an_hour(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr("tandem.deployments.fleet.time.monotonic", lambda: clock[0])
    monkeypatch.setattr("tandem.platform.tenancy.time.monotonic", lambda: clock[0])
    state = FleetState()
    assert state.acquire("acme", 1, None, owner="a") is None
    assert state.acquire("acme", 1, None, owner="b") is not None
    assert state.acquire("acme", 1, None, owner="a") is not None
    assert state.acquire("globex", 1, None, owner="a") is None
    assert state.refusals() == {"acme": {"rate_limit_exceeded": 2}}
    for _ in range(1000):  # a client retrying in a loop: counted, in one minute's counts
        state.acquire("acme", 1, None, owner="b")
    assert state.refusals() == {"acme": {"rate_limit_exceeded": 1002}}
    clock[0] += 3600
    assert state.refusals() == {"acme": {"rate_limit_exceeded": 1002}}  # their minute began < an hour ago
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
