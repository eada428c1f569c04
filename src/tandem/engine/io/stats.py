"""`LLMEngine.stats()`: typed statistics per component, composed into one `EngineStats`.

Each part is read from the component that owns it (`KVStats.of` the block manager,
`SchedulerStats.of` the scheduler, `SpeculationStats.of` its planner, the runner's own
`RunnerStats`); `EngineStats.as_dict()` is the flat JSON object replicas report (its keys are the
stable names `/v1/models`, the console and the autoscaler read).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.kv.block_manager import KVCacheManager
from tandem.engine.kv.head_cache import HeadKVCacheManager
from tandem.engine.kv.layout import HeadLayout
from tandem.engine.request import Priority, Request
from tandem.engine.sched.scheduler import Scheduler
from tandem.engine.sched.step import RunnerStats
from tandem.engine.spec.planner import SpeculationPlanner


@dataclass(frozen=True)
class KVStats:
    kv_capacity_tokens: int
    kv_cache_dtype: str
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    prefix_cache_evictions: int
    kv_window_released_blocks: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_occupancy: float
    block_size: int

    @classmethod
    def of(cls, kv: KVCacheManager, kv_cache_dtype: str) -> KVStats:
        pool = kv.pool
        return cls(
            kv_capacity_tokens=kv.capacity_tokens,
            kv_cache_dtype=kv_cache_dtype,
            prefix_cache_queries=kv.num_prefix_queries,
            prefix_cache_hits=kv.num_prefix_hits,
            prefix_cache_hit_rate=kv.num_prefix_hits / max(1, kv.num_prefix_queries),
            prefix_cache_evictions=pool.num_evictions,
            kv_window_released_blocks=kv.num_window_released,
            kv_blocks_total=pool.num_blocks,
            kv_blocks_used=pool.num_used_blocks,
            kv_occupancy=pool.num_used_blocks / pool.num_blocks,
            block_size=kv.block_size,
        )


@dataclass(frozen=True)
class CompressionStats:
    kv_compression_head_blocks_total: int
    kv_compression_head_blocks_used: int
    kv_compression_capacity_tokens: int
    kv_compression_evictions: int
    kv_compression_vectors_evicted: int

    @classmethod
    def of(
        cls, head_kv: HeadKVCacheManager, layout: HeadLayout | None, capacity_tokens: int
    ) -> CompressionStats:
        return cls(
            kv_compression_head_blocks_total=head_kv.pool.num_blocks,
            kv_compression_head_blocks_used=head_kv.pool.num_used_blocks,
            kv_compression_capacity_tokens=capacity_tokens,
            kv_compression_evictions=layout.num_evictions if layout is not None else 0,
            kv_compression_vectors_evicted=layout.num_vectors_evicted if layout is not None else 0,
        )


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    requests_by_tenant: dict[str, dict[str, int]]
    queued_prompt_tokens: int
    num_preemptions: int
    num_output_tokens_interactive: int
    num_output_tokens_batch: int

    @classmethod
    def of(cls, scheduler: Scheduler) -> SchedulerStats:
        return cls(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            requests_by_tenant=requests_by_tenant(scheduler.running, scheduler.waiting),
            queued_prompt_tokens=scheduler.num_uncomputed_prompt_tokens(),
            num_preemptions=scheduler.num_preemptions_total,
            num_output_tokens_interactive=scheduler.num_output_tokens_total[Priority.INTERACTIVE],
            num_output_tokens_batch=scheduler.num_output_tokens_total[Priority.BATCH],
        )


@dataclass(frozen=True)
class SpeculationStats:
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    draft_acceptance_rate: float
    speculation_by_batch: dict[str, dict[str, float | bool]]
    speculation_guard_switches: int

    @classmethod
    def of(cls, planner: SpeculationPlanner) -> SpeculationStats:
        return cls(
            num_draft_tokens=planner.num_draft_tokens_total,
            num_accepted_draft_tokens=planner.num_accepted_tokens_total,
            draft_acceptance_rate=planner.num_accepted_tokens_total / max(1, planner.num_draft_tokens_total),
            speculation_by_batch=planner.guard.stats(),
            speculation_guard_switches=planner.guard.num_switches,
        )


@dataclass(frozen=True)
class EngineStats:
    """An engine's counters and gauges. `model`: precision, defaults and other facts of the
    served model (`LLMEngine.model_stats`); `counters`: the engine's own; `extra`: a component's
    optional block (grammar cache)."""

    kv: KVStats
    scheduler: SchedulerStats
    speculation: SpeculationStats
    runner: RunnerStats
    model: dict[str, object]
    counters: dict[str, int | float]
    compression: CompressionStats | None = None
    extra: dict[str, object] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """The flat JSON object replicas report (`LLMEngine.stats`, built after every step: the
        components' fields copied shallowly; their nested dicts are fresh on each call)."""
        runner = self.runner
        out: dict[str, object] = {
            **vars(self.kv),
            **self.model,
            **self.counters,
            **vars(self.scheduler),
            **vars(self.speculation),
            "native_decoder": runner.native_decoder,
            "num_native_decoder_steps": runner.num_native_decoder_steps,
            "num_graph_steps": runner.num_graph_steps,
            "draft_wall_s": runner.draft_wall_s,
            "grammar_mask_s": runner.grammar_mask_s,
            **self.extra,
        }
        if self.compression is not None:
            out.update(vars(self.compression))
        out.update(moe_stats(runner.expert_tokens))
        return out


def requests_by_tenant(running: list[Request], waiting: list[Request]) -> dict[str, dict[str, int]]:
    """Running and waiting requests per tenant (requests without one under "")."""
    out: dict[str, dict[str, int]] = {}
    for state, requests in (("running", running), ("waiting", waiting)):
        for request in requests:
            counts = out.setdefault(request.tenant_id or "", {"running": 0, "waiting": 0})
            counts[state] += 1
    return out


def moe_stats(expert_tokens: list[int]) -> dict[str, object]:
    """A MoE model's tokens per expert (all sparse layers) and the load imbalance: the busiest
    expert's tokens over the mean (1.0 is even). Empty for a dense model."""
    if not expert_tokens:
        return {}
    mean = sum(expert_tokens) / len(expert_tokens)
    return {
        "moe_expert_tokens": list(expert_tokens),
        "moe_expert_imbalance": max(expert_tokens) / mean if mean else 1.0,
    }
