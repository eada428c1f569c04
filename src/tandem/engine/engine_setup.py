"""What an engine builds from its config beside the model (torch-free): the KV block managers
and the scheduler over them, with its batch policy, fair shares and speculation settings."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tandem.engine.kv.block_manager import KVCacheManager
from tandem.engine.kv.head_cache import HeadKVCacheManager
from tandem.engine.request import Request
from tandem.engine.sched.batch_policy import BatchPolicy
from tandem.engine.sched.fair_share import FairShare
from tandem.engine.sched.scheduler import Scheduler
from tandem.engine.sched.step import Runner
from tandem.engine.spec.drafts import SpeculationSettings
from tandem.platform.config import EngineConfig

if TYPE_CHECKING:
    from tandem.engine.builder import EngineParts


def build_kv_managers(
    config: EngineConfig, parts: EngineParts
) -> tuple[KVCacheManager, HeadKVCacheManager | None]:
    """The shared cache's block manager, and the compression pool's (None: no pool)."""
    kv_manager = KVCacheManager(
        parts.num_blocks,
        config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        sliding_window=parts.kv_window,
    )
    cfg = parts.model_config
    head_kv = (
        HeadKVCacheManager(
            parts.num_head_blocks, config.block_size, cfg.num_hidden_layers, cfg.num_key_value_heads
        )
        if parts.num_head_blocks
        else None
    )
    return kv_manager, head_kv


def build_scheduler(
    config: EngineConfig,
    kv_manager: KVCacheManager,
    head_kv: HeadKVCacheManager | None,
    *,
    max_model_len: int,
    has_draft: bool,
    eviction_window: int,
    on_finish: Callable[[Request], None],
    schedule_ahead: bool = False,
) -> Scheduler:
    """`max_model_len`: the longest context of any request (compressed requests may be longer
    than the shared cache holds: the engine checks each request's context when it is made; this
    is only the backstop). `eviction_window`: the positions whose queries score a compressed
    request's keys (`kernels.kv_eviction.EvictionPolicy.window`). `schedule_ahead`: steps are
    scheduled while the previous one runs (`step_pipeline.py`), which plans no drafts."""
    return Scheduler(
        kv_manager,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        batch=BatchPolicy(
            kv_occupancy_limit=config.batch_kv_occupancy_limit,
            max_prefill_tokens=config.batch_max_prefill_tokens,
            tokens_under_load=config.batch_tokens_under_load,
            tokens_after_interactive=config.batch_tokens_after_interactive,
            tokens_beside_interactive_prompt=config.batch_tokens_beside_interactive_prompt,
            interactive_quiet_s=config.interactive_quiet_s,
        ),
        max_loras=config.max_loras if config.enable_lora else 0,
        share_prefix_cache_across_tenants=config.share_prefix_cache_across_tenants,
        speculation=None if schedule_ahead else speculation_settings(config, has_draft=has_draft),
        head_kv=head_kv,
        eviction_interval=config.kv_compression_interval,
        eviction_window=eviction_window,
        fair_share=FairShare(config.tenant_weights),
        kv_hold_ttl_s=config.kv_hold_ttl_s,
        check_kv_integrity=config.kv_integrity_check,
        on_finish=on_finish,
    )


def speculation_settings(config: EngineConfig, *, has_draft: bool) -> SpeculationSettings | None:
    """What the scheduler plans drafts with (None: no speculation); "auto" verifies the draft
    model's drafts and prompt lookup's where a draft is loaded, else prompt lookup's."""
    spec = config.speculative
    if spec is None:
        return None
    method = {"auto": "both" if has_draft else "ngram", "ngram": "ngram", "draft": "draft"}[spec.method]
    return SpeculationSettings(
        method=method,
        num_speculative_tokens=spec.num_speculative_tokens,
        prompt_lookup_min=spec.prompt_lookup_min,
        prompt_lookup_max=spec.prompt_lookup_max,
    )


def schedules_ahead(config: EngineConfig, runner: Runner, has_head_pool: bool) -> bool:
    """Whether the engine schedules each step while the previous one runs (`step_pipeline.py`):
    `async_scheduling` on, a runner whose steps may run on a device thread (`overlappable`), no
    draft model and no KV compression pool (drafts and evictions need the previous step's results)."""
    overlappable = bool(getattr(runner, "overlappable", False))
    return config.async_scheduling and overlappable and not runner.has_draft and not has_head_pool
