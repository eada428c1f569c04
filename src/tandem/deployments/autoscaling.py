"""Replica autoscaling on KV-cache occupancy and queue depth (a Ray Serve custom policy).

KV occupancy tracks decode pressure but misses prefill-heavy saturation (long prompts wait in the
queue while occupancy is still low), so the policy also scales on waiting requests:

    by_kv    = ceil(current * mean_kv_occupancy / target_kv_occupancy)
    by_queue = ceil(total_waiting / target_waiting_per_replica)
    desired  = clamp(max(by_kv, by_queue, min_replicas), min_replicas, max_replicas)

Serve applies `upscale_delay_s` / `downscale_delay_s` (and its smoothing factors) on top of any
custom policy, so the policy only says how many replicas it wants; the delays are Serve config
(`build_app` passes them through). `desired_replicas` is a pure function; `KVOccupancyPolicy`
adapts it to Serve's `AutoscalingContext` and reads what `LLMReplica.record_autoscaling_stats`
reports.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


@dataclass(frozen=True)
class ScalingTargets:
    target_kv_occupancy: float = 0.7
    target_waiting_per_replica: float = 2.0
    min_replicas: int = 1
    max_replicas: int = 4

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


class KVOccupancyPolicy:
    """Serve class-callable policy: `policy_function="tandem.deployments.autoscaling:KVOccupancyPolicy"`,
    `policy_kwargs` = `ScalingTargets` fields."""

    def __init__(self, **kwargs: Any) -> None:
        self.targets = ScalingTargets(**kwargs)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, object]]:
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
        return desired_replicas(ctx.current_num_replicas, kv, waiting, bounds), dict(ctx.policy_state or {})


@dataclass(frozen=True)
class BatchQueueTargets:
    target_shards_per_replica: float = 4.0
    min_replicas: int = 1
    max_replicas: int = 4


def desired_batch_workers(
    queued_shards: float, targets: BatchQueueTargets, workers_for_seats: float | None = None
) -> int:
    """Batch workers wanted for `queued_shards` uncommitted shards (the queue is global, so every
    worker reports the same number: callers pass one value, not a sum), and no more than the
    engines' batch seats can keep busy (`workers_for_seats`: the LLM replicas' batch seats over
    the lines one worker sends; a worker beyond that only waits on refusals, in a process that
    shares the engines' CPUs)."""
    desired = math.ceil(queued_shards / targets.target_shards_per_replica - 1e-9)
    if workers_for_seats is not None:
        desired = min(desired, math.ceil(workers_for_seats - 1e-9))
    return min(max(desired, targets.min_replicas), targets.max_replicas)


class BatchQueuePolicy:
    """Serve policy for `BatchWorkerReplica`, on what its `record_autoscaling_stats` reports."""

    def __init__(self, **kwargs: Any) -> None:
        self.targets = BatchQueueTargets(**kwargs)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, object]]:
        metrics = ctx.aggregated_metrics or {}
        reported = [float(v) for v in metrics.get("queued_shards", {}).values()]
        seats = [float(v) for v in metrics.get("workers_for_seats", {}).values()]
        bounds = BatchQueueTargets(
            self.targets.target_shards_per_replica,
            ctx.capacity_adjusted_min_replicas,
            ctx.capacity_adjusted_max_replicas,
        )
        return (
            desired_batch_workers(max(reported, default=0.0), bounds, max(seats) if seats else None),
            dict(ctx.policy_state or {}),
        )


@dataclass(frozen=True)
class PrefillQueueTargets:
    target_prompt_tokens_per_replica: float = 4096.0
    min_replicas: int = 1
    max_replicas: int = 4


def desired_prefill_replicas(queued_prompt_tokens: list[float], targets: PrefillQueueTargets) -> int:
    """Prefill replicas wanted for the prompt tokens their engines have yet to compute (summed
    over replicas): prefill is compute-bound, so the queue of prompt tokens is its load."""
    desired = math.ceil(sum(queued_prompt_tokens) / targets.target_prompt_tokens_per_replica - 1e-9)
    return min(max(desired, targets.min_replicas), targets.max_replicas)


class PrefillQueuePolicy:
    """Serve policy for `PrefillReplica` (disaggregated mode), on `queued_prompt_tokens`."""

    def __init__(self, **kwargs: Any) -> None:
        self.targets = PrefillQueueTargets(**kwargs)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, object]]:
        queued = [float(v) for v in (ctx.aggregated_metrics or {}).get("queued_prompt_tokens", {}).values()]
        bounds = PrefillQueueTargets(
            self.targets.target_prompt_tokens_per_replica,
            ctx.capacity_adjusted_min_replicas,
            ctx.capacity_adjusted_max_replicas,
        )
        return desired_prefill_replicas(queued, bounds), dict(ctx.policy_state or {})


class AutoscalingConfig(BaseModel):
    """`AppConfig.autoscaling`: the LLM replicas' policy targets (`ScalingTargets`, whose defaults
    these are) and Serve's delays around any policy."""

    model_config = ConfigDict(extra="forbid")

    target_kv_occupancy: float = Field(default=ScalingTargets.target_kv_occupancy, gt=0.0, le=1.0)
    target_waiting_per_replica: float = Field(default=ScalingTargets.target_waiting_per_replica, gt=0.0)
    min_replicas: int = Field(default=ScalingTargets.min_replicas, ge=0)
    max_replicas: int = Field(default=ScalingTargets.max_replicas, ge=1)
    upscale_delay_s: float = Field(default=5.0, ge=0.0, description="Serve waits this long to add replicas")
    downscale_delay_s: float = Field(default=30.0, ge=0.0, description="... and this long to remove them")
    look_back_period_s: float | None = Field(default=None, gt=0.0, description="Serve's metrics window")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingConfig:
        self.targets()  # ScalingTargets checks min_replicas <= max_replicas
        return self

    def targets(self) -> ScalingTargets:
        return ScalingTargets(
            self.target_kv_occupancy, self.target_waiting_per_replica, self.min_replicas, self.max_replicas
        )

    def serve_delays(self) -> dict[str, float]:
        """Serve's own autoscaling fields, for `autoscaling_config`."""
        delays = {"upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s}
        if self.look_back_period_s is not None:
            delays["look_back_period_s"] = self.look_back_period_s
        return delays
