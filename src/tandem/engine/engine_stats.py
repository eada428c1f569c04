"""`LLMEngine.stats()`: what an engine reports (KV occupancy, prefix cache, speculation, steps)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem.engine.request import Priority, Request

if TYPE_CHECKING:
    from tandem.engine.engine import LLMEngine


def engine_stats(engine: LLMEngine) -> dict[str, Any]:
    """The engine's counters and gauges (`LLMEngine.stats`; replicas report them)."""
    runner = engine.runner.stats()
    pool = engine.kv_manager.pool
    loras = engine.list_loras()
    return {
        "kv_capacity_tokens": engine.kv_manager.capacity_tokens,
        "kv_cache_dtype": engine.kv_cache_dtype,
        "prefix_cache_queries": engine.kv_manager.num_prefix_queries,
        "prefix_cache_hits": engine.kv_manager.num_prefix_hits,
        "prefix_cache_hit_rate": engine.kv_manager.num_prefix_hits
        / max(1, engine.kv_manager.num_prefix_queries),
        "prefix_cache_evictions": engine.kv_manager.pool.num_evictions,
        "kv_window_released_blocks": engine.kv_manager.num_window_released,
        "num_kv_integrity_aborts": engine.num_kv_integrity_aborts,
        "num_failed_requests": engine.num_failed_requests,
        "loras_loaded": loras,
        "num_loras_loaded": len(loras),
        "dtype": engine.precision.dtype if engine.precision else None,
        "weight_dtype": engine.precision.weight_dtype if engine.precision else engine.config.weight_dtype,
        "precision_reason": engine.precision.reason if engine.precision else "",
        "precision_probe": engine.precision.probe.as_stats()
        if engine.precision and engine.precision.probe
        else None,
        "quality_probe": [q.as_stats() for q in engine.precision.quality] if engine.precision else [],
        "generation_defaults": engine.generation_defaults.as_dict(),
        "batch_invariant": engine.batch_invariance.holds,
        "batch_invariance": engine.batch_invariance.reason,
        "native_decoder": runner.native_decoder,
        "num_native_decoder_steps": runner.num_native_decoder_steps,
        "num_graph_steps": runner.num_graph_steps,
        "kv_blocks_total": pool.num_blocks,
        "kv_blocks_used": pool.num_used_blocks,
        "kv_occupancy": pool.num_used_blocks / pool.num_blocks,
        "block_size": engine.kv_manager.block_size,
        "role": engine.config.role,
        "num_running": engine.scheduler.num_running,
        "requests_by_tenant": requests_by_tenant(engine.scheduler.running, engine.scheduler.waiting),
        "num_waiting": engine.scheduler.num_waiting,
        "queued_prompt_tokens": engine.scheduler.num_uncomputed_prompt_tokens(),
        "num_preemptions": engine.scheduler.num_preemptions_total,
        "num_output_tokens_interactive": engine.scheduler.num_output_tokens_total[Priority.INTERACTIVE],
        "num_output_tokens_batch": engine.scheduler.num_output_tokens_total[Priority.BATCH],
        "max_model_len": engine.max_model_len,
        "num_steps": engine.num_steps,
        "num_draft_tokens": engine.scheduler.speculation.num_draft_tokens_total,
        "num_accepted_draft_tokens": engine.scheduler.speculation.num_accepted_tokens_total,
        "draft_acceptance_rate": engine.scheduler.speculation.num_accepted_tokens_total
        / max(1, engine.scheduler.speculation.num_draft_tokens_total),
        "speculation_by_batch": engine.scheduler.speculation.guard.stats(),
        "speculation_guard_switches": engine.scheduler.speculation.guard.num_switches,
        "draft_wall_s": runner.draft_wall_s,
        "step_wall_s": engine.step_wall_s,
        "step_thread_cpu_s": engine.step_thread_cpu_s,
        "grammar_mask_s": runner.grammar_mask_s,
        **(engine.grammars.stats() if engine.grammars is not None else {}),
        **_compression_stats(engine),
        **_moe_stats(runner.expert_tokens),
    }


def requests_by_tenant(running: list[Request], waiting: list[Request]) -> dict[str, dict[str, int]]:
    """Running and waiting requests per tenant (requests without one under "")."""
    out: dict[str, dict[str, int]] = {}
    for state, requests in (("running", running), ("waiting", waiting)):
        for request in requests:
            counts = out.setdefault(request.tenant_id or "", {"running": 0, "waiting": 0})
            counts[state] += 1
    return out


def _moe_stats(expert_tokens: list[int]) -> dict[str, Any]:
    """A MoE model's tokens per expert (all sparse layers) and the load imbalance: the busiest
    expert's tokens over the mean (1.0 is even). Empty for a dense model."""
    if not expert_tokens:
        return {}
    mean = sum(expert_tokens) / len(expert_tokens)
    return {
        "moe_expert_tokens": expert_tokens,
        "moe_expert_imbalance": max(expert_tokens) / mean if mean else 1.0,
    }


def _compression_stats(engine: LLMEngine) -> dict[str, Any]:
    head_kv, layout = engine.head_kv, engine.scheduler.head_layout
    if head_kv is None:
        return {}
    return {
        "kv_compression_head_blocks_total": head_kv.pool.num_blocks,
        "kv_compression_head_blocks_used": head_kv.pool.num_used_blocks,
        "kv_compression_capacity_tokens": engine.compressed_capacity_tokens,
        "kv_compression_evictions": layout.num_evictions if layout is not None else 0,
        "kv_compression_vectors_evicted": layout.num_vectors_evicted if layout is not None else 0,
    }
