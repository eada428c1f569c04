"""Replica autoscaling on KV-cache occupancy and queue depth (a Ray Serve custom policy).

KV occupancy tracks decode pressure but misses prefill-heavy saturation (long prompts wait in the
queue while occupancy is still low), so the policy also scales on waiting requests:

    by_kv    = ceil(current * mean_kv_occupancy / target_kv_occupancy)
    by_queue = ceil(total_waiting / target_waiting_per_replica)
    desired  = clamp(max(by_kv, by_queue, min_replicas), min_replicas, max_replicas)

A change takes effect only after it has been wanted continuously for `upscale_delay_s`
(growing) or `downscale_delay_s` (shrinking); the pending decision lives in the policy state.
`desired_replicas` and `apply_delays` are pure functions; `KVOccupancyPolicy` adapts them to
Serve's `AutoscalingContext` and reads the metrics `LLMReplica.record_autoscaling_stats` reports.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ScalingTargets:
    target_kv_occupancy: float = 0.7
    target_waiting_per_replica: float = 2.0
    min_replicas: int = 1
    max_replicas: int = 4
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0.0 < self.target_kv_occupancy <= 1.0:
            raise ValueError(f"target_kv_occupancy must be in (0, 1], got {self.target_kv_occupancy}")
        if self.target_waiting_per_replica <= 0:
            raise ValueError("target_waiting_per_replica must be > 0")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"need 0 <= min_replicas ({self.min_replicas}) <= max_replicas ({self.max_replicas})"
            )


def desired_replicas(
    current: int, kv_occupancy: list[float], num_waiting: list[float], targets: ScalingTargets
) -> int:
    """Replicas wanted now, from per-replica KV occupancy (0..1) and waiting-request counts."""
    mean_kv = sum(kv_occupancy) / len(kv_occupancy) if kv_occupancy else 0.0
    by_kv = math.ceil(max(current, 1) * mean_kv / targets.target_kv_occupancy - 1e-9) if mean_kv > 0 else 0
    by_queue = math.ceil(sum(num_waiting) / targets.target_waiting_per_replica - 1e-9)
    desired = max(by_kv, by_queue, targets.min_replicas)
    return min(max(desired, targets.min_replicas), targets.max_replicas)


def apply_delays(
    current: int, desired: int, state: dict[str, Any], now: float, targets: ScalingTargets
) -> tuple[int, dict[str, Any]]:
    """Hold a change until it has been wanted continuously for the delay of its direction."""
    state = dict(state)
    direction = (desired > current) - (desired < current)
    if direction == 0:
        state.pop("pending_direction", None)
        state.pop("pending_since", None)
        return current, state
    if state.get("pending_direction") != direction:
        state["pending_direction"] = direction
        state["pending_since"] = now
    delay = targets.upscale_delay_s if direction > 0 else targets.downscale_delay_s
    if now - state["pending_since"] >= delay:
        state.pop("pending_direction")
        state.pop("pending_since")
        return desired, state
    return current, state


class KVOccupancyPolicy:
    """Serve class-callable policy: `policy_function="tandem.deployments.autoscaling:KVOccupancyPolicy"`,
    `policy_kwargs` = `ScalingTargets` fields."""

    def __init__(self, **kwargs: Any) -> None:
        self.targets = ScalingTargets(**kwargs)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        kv = [float(v) for v in metrics.get("kv_occupancy", {}).values()]
        waiting = [float(v) for v in metrics.get("num_waiting", {}).values()]
        bounds = ScalingTargets(
            **{
                **asdict(self.targets),
                "min_replicas": ctx.capacity_adjusted_min_replicas,
                "max_replicas": ctx.capacity_adjusted_max_replicas,
            }
        )
        desired = desired_replicas(ctx.current_num_replicas, kv, waiting, bounds)
        now = ctx.current_time if ctx.current_time is not None else time.time()
        return apply_delays(ctx.current_num_replicas, desired, ctx.policy_state or {}, now, bounds)
