"""The KV-occupancy + queue-depth policy as pure functions, and its Serve adapter."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tandem.deployments.autoscaling import KVOccupancyPolicy, ScalingTargets, apply_delays, desired_replicas

T = ScalingTargets(
    target_kv_occupancy=0.7,
    target_waiting_per_replica=2.0,
    min_replicas=1,
    max_replicas=4,
    upscale_delay_s=5.0,
    downscale_delay_s=30.0,
)


@pytest.mark.parametrize(
    ("current", "kv", "waiting", "want"),
    [
        (1, [0.0], [0], 1),  # idle stays at min
        (1, [0.7], [0], 1),  # at target
        (1, [0.95], [0], 2),  # KV pressure
        (2, [0.9, 0.9], [0, 0], 3),
        (1, [0.1], [5], 3),  # prefill-heavy: low KV, long queue
        (3, [0.1, 0.1, 0.1], [0, 0, 0], 1),  # drained: back to min
        (4, [1.0] * 4, [50] * 4, 4),  # capped at max
    ],
)
def test_desired_replicas(current: int, kv: list[float], waiting: list[float], want: int) -> None:
    assert desired_replicas(current, kv, waiting, T) == want


def test_delays_hold_changes_until_they_persist() -> None:
    state: dict = {}
    target, state = apply_delays(1, 3, state, now=100.0, targets=T)
    assert target == 1  # wanted since 100
    target, state = apply_delays(1, 3, state, now=104.0, targets=T)
    assert target == 1
    target, state = apply_delays(1, 3, state, now=105.0, targets=T)
    assert target == 3 and "pending_direction" not in state
    target, state = apply_delays(3, 1, state, now=110.0, targets=T)
    target, state = apply_delays(3, 3, state, now=120.0, targets=T)  # load came back: reset
    target, state = apply_delays(3, 1, state, now=125.0, targets=T)
    target, state = apply_delays(3, 1, state, now=150.0, targets=T)
    assert target == 3  # only 25 s of continuous wish to shrink
    target, state = apply_delays(3, 1, state, now=155.0, targets=T)
    assert target == 1


def test_serve_adapter_reads_replica_metrics() -> None:
    policy = KVOccupancyPolicy(upscale_delay_s=0.0, max_replicas=8)
    ctx = SimpleNamespace(
        aggregated_metrics={"kv_occupancy": {"r1": 0.9, "r2": 0.95}, "num_waiting": {"r1": 1.0, "r2": 0.0}},
        current_num_replicas=2,
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=8,
        current_time=10.0,
        policy_state={},
    )
    target, _ = policy(ctx)
    assert target == 3
    with pytest.raises(ValueError, match="target_kv_occupancy"):
        KVOccupancyPolicy(target_kv_occupancy=1.5)
