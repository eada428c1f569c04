"""Building an engine's parts from an `EngineConfig`: precision, the model (and its INT4 decode
copy), the draft model or head, KV sizing, LoRA, grammars and the runner (`build_parts`).

`LLMEngine.from_config` calls it; `LLMEngine` itself takes ready parts, so tests inject their own.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable

import torch

from tandem.engine.draft_setup import LoadedDraft, build_proposer, load_draft
from tandem.engine.encoder_setup import build_encoder_parts
from tandem.engine.engine_parts import EngineParts
from tandem.engine.host.batch_invariance import DISABLED, BatchInvariance, make_batch_invariant
from tandem.engine.host.precision import PrecisionChoice, choose_precision
from tandem.engine.host.precision import pinned as pinned_precision
from tandem.engine.host.precision_probe import probe_precision
from tandem.engine.host.quality_gate import DTYPES, hold_to_bound, kv_cache_dtype
from tandem.engine.io.generation_defaults import GenerationDefaults
from tandem.engine.lora.manager import LoRALimits, LoRAManager, LoRAModelShape
from tandem.engine.model_weights import build_models, kv_cache_spec
from tandem.engine.models.interface import CausalLM, ModelConfig
from tandem.engine.models.loader import (
    LoadedModel,
    default_cache_dir,
    load_model,
)
from tandem.engine.models.moe_layer import SparseMoE
from tandem.engine.models.pooling import read_pooling
from tandem.engine.runner import KVCacheSpec, ModelRunner
from tandem.engine.structured.grammar import GrammarCompiler
from tandem.kernels import int4_native
from tandem.kernels.head_attention import head_pool_dtype, head_slot_bytes
from tandem.kernels.kv_eviction import EvictionPolicy
from tandem.kernels.triton_support import uses_triton
from tandem.platform.config import EngineConfig
from tandem.platform.cpu import cpu_flags, usable_cpus
from tandem.platform.errors import InvalidRequestError

logger = logging.getLogger("tandem.engine")


# Builds the model (and its decode copy) for a precision, its position tables covering `max_positions`.
BuildModels = Callable[[PrecisionChoice, int], tuple[CausalLM, CausalLM | None]]


@dataclasses.dataclass
class _Sizes:
    num_blocks: int  # of the shared cache (a draft's cache has as many)
    num_head_blocks: int  # of the compression pool
    max_model_len: int
    max_positions: int  # what the position tables cover (compressed requests may be longer)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def uses_decode_graphs(config: EngineConfig, device: torch.device) -> bool:
    """CUDA graphs for decode steps: on CUDA through the Triton kernels, unless turned off."""
    return config.cuda_graphs and device.type == "cuda" and uses_triton(device)


def graph_capturable(model: object) -> bool:
    """Whether a decode step's shapes are fixed by its batch size (what a CUDA graph replays):
    sparse MoE layers size their expert matmuls by the routing, so those models run eagerly."""
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    return not any(isinstance(module, SparseMoE) for module in modules)


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on `device`: CUDA's free bytes (cached allocator blocks handed back first),
    or the host's available RAM."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def eviction_policy(config: EngineConfig) -> EvictionPolicy:
    """How compressed requests are evicted (the runner scores and plans; the scheduler times)."""
    return EvictionPolicy(
        per_head=config.kv_compression_policy == "per_head", interval=config.kv_compression_interval
    )


def build_parts(config: EngineConfig) -> EngineParts:
    """Load `config.model`, size the KV cache, build the model (and its INT4 decode copy with
    `weight_dtype="hybrid"`), the draft, the LoRA manager and the runner."""
    device = resolve_device(config.device)
    tune_threads = _set_threads(config, device)
    loaded = load_model(config.model)
    if loaded.architecture.encoder:
        return build_encoder_parts(config, loaded, device)
    cfg = loaded.config
    check_features(config, loaded)
    build = functools.partial(build_models, config, loaded, device=device)
    precision = _choose_precision(config, loaded, device, build)
    dtype = DTYPES[precision.dtype]
    kv_dtype = kv_cache_dtype(config, precision.dtype)
    kv_spec = kv_cache_spec(loaded, config.block_size, kv_dtype)
    draft = load_draft(config, loaded, dtype, device, kv_dtype)
    window = kv_window(config, loaded, draft is not None)
    if device.type == "cuda":
        # Weights first: the KV budget is a fraction of the device memory they leave free. Their
        # position tables then cover the model's whole context (max_positions is not known yet).
        model, decode_model = build(precision, cfg.max_position_embeddings)
        sizes = _size(config, cfg, kv_spec, draft, device, dtype, window)
    else:
        sizes = _size(config, cfg, kv_spec, draft, device, dtype, window)
        model, decode_model = build(precision, sizes.max_positions)
    proposer = build_proposer(
        config, loaded, model, draft, sizes.num_blocks, sizes.max_model_len, dtype, device
    )
    lora = _lora_manager(config, loaded, device, dtype)
    eos_token_ids = frozenset(cfg.eos_token_ids) | frozenset(loaded.tokenizer.eos_token_ids)
    grammars = GrammarCompiler(loaded.tokenizer, cfg.vocab_size, sorted(eos_token_ids))
    invariance = _batch_invariance(config, precision, device, tune_threads, model, decode_model)
    pooling = read_pooling(loaded.path if loaded.path.is_dir() else loaded.path.parent, encoder=False)
    runner = ModelRunner(
        model, kv_spec, sizes.num_blocks, device, seed=config.seed, lora=lora, compile_decode=config.compile_decode,
        decode_model=decode_model, decode_model_max_batch=config.hybrid_int4_max_batch, draft=proposer,
        native_decoder=config.native_decoder, grammars=grammars, num_head_blocks=sizes.num_head_blocks,
        eviction=eviction_policy(config),
        decode_graphs="capture" if uses_decode_graphs(config, device) and graph_capturable(model) else "off",
        graph_max_batch=min(config.cuda_graph_max_batch, config.max_num_seqs), max_model_len=sizes.max_model_len,
        batch_invariant=invariance.holds or (config.batch_invariant and precision.weight_dtype != "hybrid"),
        pooling=pooling,
    )  # fmt: skip
    runner.warmup_decode()
    runner.capture_graphs()
    generation_defaults = (
        loaded.generation_defaults if config.generation_config == "auto" else GenerationDefaults()
    )
    parts = EngineParts(
        model_name=loaded.name, model_config=cfg, tokenizer=loaded.tokenizer, eos_token_ids=eos_token_ids,
        runner=runner, num_blocks=sizes.num_blocks, max_model_len=sizes.max_model_len,
        kv_cache_dtype=str(kv_dtype).removeprefix("torch."), lora=lora, precision=precision, grammars=grammars,
        num_head_blocks=sizes.num_head_blocks, max_positions=sizes.max_positions, kv_window=window,
        tuned_threads=torch.get_num_threads() if tune_threads else None,
        generation_defaults=generation_defaults, batch_invariance=invariance, pooling=pooling,
        quant_types=loaded.quant_types,
    )  # fmt: skip
    _log_ready(parts, runner, device, config.block_size)
    return parts


def _set_threads(config: EngineConfig, device: torch.device) -> bool:
    """Set this process's intra-op threads; whether the engine tunes them per step."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    elif device.type == "cpu":  # torch's default, but no more than the CPUs this process may use
        torch.set_num_threads(min(torch.get_num_threads(), usable_cpus()))
    return device.type == "cpu" and config.adaptive_threads


def _choose_precision(
    config: EngineConfig, loaded: LoadedModel, device: torch.device, build: BuildModels
) -> PrecisionChoice:
    """`dtype` / `weight_dtype` as configured or measured on this host (`choose_precision`),
    then held to the quality bound on the checkpoint (`hold_to_bound`)."""
    native_int4 = device.type == "cpu" and config.int4_kernel != "torch" and int4_native.load() is not None
    probing = (
        config.precision_probe and device.type == "cpu" and config.dtype == "auto" and not pinned_precision()
    )
    precision = choose_precision(
        device_type=device.type,
        dtype=config.dtype,
        weight_dtype=config.weight_dtype,
        flags=cpu_flags(),
        native_int4=native_int4,
        pin=pinned_precision(),
        stored_quant_types=loaded.stored_quant_types,
        probe=probe_precision(loaded.config, device, default_cache_dir(), int4=native_int4)
        if probing
        else None,
    )
    return hold_to_bound(
        config, loaded, precision, kv_cache_spec(loaded, config.block_size, torch.float32), device,
        default_cache_dir(), build,
    )  # fmt: skip


def _lora_manager(
    config: EngineConfig, loaded: LoadedModel, device: torch.device, dtype: torch.dtype
) -> LoRAManager | None:
    if not config.enable_lora:
        return None
    return LoRAManager(
        LoRAModelShape.from_config(loaded.config, loaded.architecture.lora_targets),
        max_loras=config.max_loras,
        max_cpu_loras=config.max_cpu_loras or 4 * config.max_loras,
        limits=LoRALimits(max_lora_rank=config.max_lora_rank),
        device=device,
        dtype=dtype,
    )


def _batch_invariance(
    config: EngineConfig,
    precision: PrecisionChoice,
    device: torch.device,
    tune_threads: bool,
    model: CausalLM,
    decode_model: CausalLM | None,
) -> BatchInvariance:
    """Whether every row is computed alike in any batch (`make_batch_invariant`), and why."""
    if not config.batch_invariant:
        return DISABLED
    if precision.weight_dtype == "hybrid":
        return BatchInvariance(
            True, False, "off with weight_dtype hybrid (INT4 small decode steps, dense others)"
        )
    threads = torch.get_num_threads()
    return make_batch_invariant(
        device, (threads, 1) if tune_threads and threads > 1 else (threads,), model, decode_model
    )


def _log_ready(parts: EngineParts, runner: ModelRunner, device: torch.device, block_size: int) -> None:
    precision = parts.precision
    assert precision is not None
    logger.info(
        "engine ready",
        extra={
            "model": parts.model_name, "device": str(device), "dtype": precision.dtype,
            "weight_dtype": precision.weight_dtype, "precision_reason": precision.reason,
            "quant_types": parts.quant_types,
            "native_decoder": runner.native is not None,
            "native_decoder_unavailable": runner.native_unavailable_reason if runner.native is None else "",
            "kernels": "triton" if uses_triton(device) else "torch/native",
            "decode_graph_max_batch": runner.paths.graph_max_batch,
            "kv_cache_dtype": parts.kv_cache_dtype, "kv_blocks": parts.num_blocks,
            "kv_capacity_tokens": parts.num_blocks * block_size, "max_model_len": parts.max_model_len,
            "quality_probe": [q.describe() for q in precision.quality],
            "generation_defaults": parts.generation_defaults.as_dict(),
            "batch_invariant": parts.batch_invariance.holds, "batch_invariance": parts.batch_invariance.reason,
        },
    )  # fmt: skip


def check_features(config: EngineConfig, loaded: LoadedModel) -> None:
    """Refuse, naming the setting, engine features the model's architecture does not compute
    exactly: per-head KV compression over sliding-window or soft-capped attention (the head-block
    pool attends every kept key, unwindowed and uncapped)."""
    architecture, layers = loaded.architecture, loaded.architecture.kv_layers(loaded.config)
    windowed = any(layer.window is not None for layer in layers)
    capped = getattr(loaded.config, "attn_logit_softcap", None) is not None
    if (config.enable_kv_compression or config.kv_compression_rate is not None) and layers[0].shared_kv:
        raise InvalidRequestError(
            f"per-head KV compression is not supported for {architecture.name} models: their latent KV "
            "is shared by every head, so no head can drop its own tokens; leave enable_kv_compression off",
            param="enable_kv_compression",
        )
    if (config.enable_kv_compression or config.kv_compression_rate is not None) and (windowed or capped):
        kind = "sliding-window" if windowed else "soft-capped"
        raise InvalidRequestError(
            f"per-head KV compression is not supported for {architecture.name} models ({kind} attention); "
            "leave enable_kv_compression off for this model",
            param="enable_kv_compression",
        )


def kv_window(config: EngineConfig, loaded: LoadedModel, has_draft: bool) -> int | None:
    """How far back every layer attends, when all of them slide (Mistral, Phi-3): the engine
    then gives back the blocks a request's queries can no longer read. None (keep every block)
    when a layer attends its whole context (Gemma 2/3, Qwen2 with `max_window_layers`: one block
    table serves all layers), for a draft model's cache (it shares the target's block tables and
    may not slide), and for a prefill-role engine (its blocks are exported whole)."""
    windows = [layer.window for layer in loaded.architecture.kv_layers(loaded.config)]
    if has_draft or config.role == "prefill" or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)


def _size(
    config: EngineConfig, cfg: ModelConfig, kv_spec: KVCacheSpec, draft: LoadedDraft | None, device: torch.device, dtype: torch.dtype,
    window: int | None = None,
) -> _Sizes:  # fmt: skip
    """Blocks of the shared cache (a draft's cache sits beside it, block for block) and of the
    compression pool out of the memory budget; the context that fits. With a sliding `window`
    whose blocks are given back (`kv_window`), a request holds at most its window's blocks and one
    step's chunk at a time, so once the cache holds that much the model's whole context fits."""
    budget = config.kv_cache_memory or int(config.kv_cache_memory_fraction * available_memory_bytes(device))
    num_head_blocks = 0
    if config.enable_kv_compression or config.kv_compression_rate is not None:
        head_block_bytes = config.block_size * head_slot_bytes(
            head_pool_dtype(kv_spec.dtype, dtype), cfg.head_dim
        )
        head_budget = int(config.kv_compression_memory_fraction * budget)
        num_head_blocks = head_budget // head_block_bytes
        if num_head_blocks < cfg.num_hidden_layers * cfg.num_key_value_heads:
            raise InvalidRequestError(
                f"the KV compression pool ({head_budget} bytes) holds less than one block per head; "
                "raise kv_cache_memory or kv_compression_memory_fraction",
                param="kv_compression_memory_fraction",
            )
        budget -= head_budget
    num_blocks = budget // (kv_spec.bytes_per_block + (draft.spec.bytes_per_block if draft else 0))
    if num_blocks < 2:
        raise InvalidRequestError(
            f"kv_cache_memory {budget} bytes holds {num_blocks} blocks of {kv_spec.bytes_per_block} bytes; "
            "give at least two blocks' worth",
            param="kv_cache_memory",
        )
    capacity = num_blocks * config.block_size
    if window is not None:
        bs = config.block_size
        most_held = -(-window // bs) + 1 + -(-config.max_num_batched_tokens // bs) + 1
        if num_blocks >= most_held:
            capacity = max(capacity, cfg.max_position_embeddings)
    max_model_len = _max_model_len(config, cfg, capacity)
    if draft is not None and draft.model is not None:
        max_model_len = min(max_model_len, draft.model.config.max_position_embeddings)
    if draft is not None and draft.head is not None:
        max_model_len = min(max_model_len, draft.head.max_positions)
    # Compressed requests' context is the compression pool's (before eviction), within the model's.
    compressed_len = (
        num_head_blocks // (cfg.num_hidden_layers * cfg.num_key_value_heads)
    ) * config.block_size
    max_positions = max(max_model_len, min(cfg.max_position_embeddings, compressed_len))
    return _Sizes(num_blocks, num_head_blocks, max_model_len, max_positions)


def _max_model_len(config: EngineConfig, cfg: ModelConfig, capacity: int) -> int:
    """`config.max_model_len` checked against the model's context and the cache, or the most of both."""
    if config.max_model_len is None:
        return int(min(cfg.max_position_embeddings, capacity))
    if config.max_model_len > cfg.max_position_embeddings:
        raise InvalidRequestError(
            f"max_model_len {config.max_model_len} exceeds the model's context ({cfg.max_position_embeddings})",
            param="max_model_len",
        )
    if config.max_model_len > capacity:
        raise InvalidRequestError(
            f"max_model_len {config.max_model_len} exceeds the KV cache capacity ({capacity} tokens); "
            "raise kv_cache_memory or lower max_model_len",
            param="max_model_len",
        )
    return config.max_model_len
