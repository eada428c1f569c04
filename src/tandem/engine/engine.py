"""`LLMEngine`: validate and add requests, then `step()` = schedule -> run -> update.

Single-threaded; `AsyncEngine` (async_engine.py) drives it from a background thread.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from tandem.engine.draft import DraftProposer, EagleProposer, PagedDraftCache
from tandem.engine.fair_share import FairShare
from tandem.engine.grammar import GrammarCompiler
from tandem.engine.head_kv_cache import HeadKVCacheManager
from tandem.engine.kv_cache import KVCacheManager
from tandem.engine.kv_transfer import (
    KVPage,
    KVPrefixEvictedError,
    KVTransfer,
    fingerprint,
    page_checksum,
    verify,
)
from tandem.engine.lora import LoRAAdapter, LoRALimits, LoRAManager, LoRAModelShape, parse_peft_adapter
from tandem.engine.models.eagle import EagleDraft, is_eagle_folder, load_eagle
from tandem.engine.models.loader import build_model, load_model, resolve_model_path
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.parallel_sampling import ChoiceFamilies, choice_requests
from tandem.engine.precision import PrecisionChoice, choose_precision
from tandem.engine.precision import pinned as pinned_precision
from tandem.engine.protocol import GenerationRequest, RequestOutput, merge_deltas
from tandem.engine.request import Priority, Request, RequestStatus
from tandem.engine.runner import GRAMMAR_FAILED, KVCacheSpec, ModelRunner, allocate_kv_caches
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler
from tandem.engine.speculative import SpeculationSettings
from tandem.engine.step import RequestUpdate, RunnerResult, ScheduledRequest, SchedulerOutput
from tandem.engine.tokenizer import Tokenizer
from tandem.kernels import int4_native
from tandem.kernels.head_attention import head_pool_dtype, head_slot_bytes
from tandem.kernels.int8 import Int8HeadLinear
from tandem.kernels.kv_eviction import EvictionPolicy
from tandem.platform.config import EngineConfig
from tandem.platform.cpu import cpu_flags
from tandem.platform.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    NotFoundError,
    ServiceUnavailableError,
)

logger = logging.getLogger("tandem.engine")

# Single-request steps in a row whose model pass raised before the runner is declared broken
# (one bad request fails alone; the same failure step after step is the runner, not a request).
MAX_CONSECUTIVE_FAILED_STEPS = 3


class EngineBrokenError(RuntimeError):
    """The runner failed in a way no single request explains; the engine must be replaced."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


@dataclasses.dataclass
class EngineParts:
    """What an engine runs on. `LLMEngine.from_config` loads the model and builds them; a test
    may pass its own (a fake runner, a small tokenizer)."""

    model_name: str
    model_config: Any  # the model's LlamaConfig (vocab_size is read)
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    runner: Any  # ModelRunner, or anything with its execute(SchedulerOutput) -> RunnerResult
    num_blocks: int  # KV blocks the runner's cache holds
    max_model_len: int
    kv_cache_dtype: str  # what the cache stores, for stats ("float32", "float8_e4m3fn", ...)
    lora: LoRAManager | None = None
    precision: PrecisionChoice | None = None  # what dtype / weight_dtype "auto" resolved to, and why
    grammars: GrammarCompiler | None = None  # output constraints (the runner's); None: refused
    num_head_blocks: int = 0  # head blocks of the KV compression pool (0: no compressed requests)
    max_positions: int | None = None  # positions the model's RoPE tables cover (None: max_model_len)


class LLMEngine:
    def __init__(self, config: EngineConfig, parts: EngineParts) -> None:
        """An engine over `parts` (see `from_config`, which loads them from `config.model`)."""
        self.config = config
        self.model_name = parts.model_name
        self.served_model_name = config.api_model_name
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        self.max_model_len = parts.max_model_len
        self.max_positions = parts.max_positions or parts.max_model_len  # the model's RoPE tables
        self.runner = parts.runner
        self.lora = parts.lora
        self.kv_cache_dtype = parts.kv_cache_dtype
        self.precision = parts.precision
        self.grammars = parts.grammars
        self.kv_manager = KVCacheManager(
            parts.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.head_kv = (
            HeadKVCacheManager(
                parts.num_head_blocks, config.block_size,
                parts.model_config.num_hidden_layers, parts.model_config.num_key_value_heads,
            )  # fmt: skip
            if parts.num_head_blocks
            else None
        )
        self.num_kv_integrity_aborts = 0
        self.num_failed_requests = 0  # requests the runner could not compute (ended with an error)
        self.num_consecutive_failed_steps = 0  # steps in a row whose model pass raised for every request
        # Steps that ran the model, their wall seconds, and the CPU seconds of the calling thread
        # over them: wall well above CPU means the step waited (other processes on its cores, or
        # other threads holding the GIL), which is how serving overhead shows up inside the engine.
        self.num_steps = 0
        self.step_wall_s = 0.0
        self.step_thread_cpu_s = 0.0
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            # Compressed requests may be longer than the shared cache holds: the engine checks
            # each request's context when it is made; this is only the backstop.
            max_model_len=max(self.max_model_len, self.compressed_max_len),
            batch_kv_occupancy_limit=config.batch_kv_occupancy_limit,
            batch_max_prefill_tokens=config.batch_max_prefill_tokens,
            batch_tokens_under_load=config.batch_tokens_under_load,
            batch_tokens_after_interactive=config.batch_tokens_after_interactive,
            batch_tokens_beside_interactive_prompt=config.batch_tokens_beside_interactive_prompt,
            interactive_quiet_s=config.interactive_quiet_s,
            max_loras=config.max_loras if config.enable_lora else 0,
            share_prefix_cache_across_tenants=config.share_prefix_cache_across_tenants,
            speculation=_speculation_settings(config, has_draft=getattr(parts.runner, "draft", None) is not None),
            head_kv=self.head_kv,
            eviction_interval=config.kv_compression_interval,
            eviction_window=_eviction_policy(config).window,
            fair_share=FairShare(config.tenant_weights),
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.families = ChoiceFamilies()  # requests with n > 1 choices, by parent id

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Load `config.model`, size the KV cache, build the model (and its INT4 decode copy with
        `weight_dtype="hybrid"`), the LoRA manager and the runner."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = _resolve_device(config.device)
        precision = choose_precision(
            device_type=device.type,
            dtype=config.dtype,
            weight_dtype=config.weight_dtype,
            flags=cpu_flags(),
            native_int4=device.type == "cpu" and config.int4_kernel != "torch" and int4_native.load() is not None,
            pin=pinned_precision(),
        )
        dtype_name = precision.dtype
        dtype = _DTYPES[dtype_name]
        loaded = load_model(config.model)
        cfg = loaded.config
        kv_dtype = {"auto": dtype, "fp8_e4m3": torch.float8_e4m3fn, **_DTYPES}[config.kv_cache_dtype]
        kv_spec = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, config.block_size, kv_dtype)
        draft_path = _draft_path(config)
        head: EagleDraft | None = None
        draft_loaded = None
        draft_spec = None
        if draft_path is not None and is_eagle_folder(draft_path):
            try:
                head = load_eagle(draft_path, dtype=dtype, device=device, max_positions=cfg.max_position_embeddings)
            except ValueError as exc:
                raise InvalidRequestError(str(exc), param="speculative.draft_model") from exc
            hcfg = head.config
            draft_spec = KVCacheSpec(1, hcfg.num_key_value_heads, hcfg.head_dim, config.block_size, kv_dtype)
        elif draft_path is not None:
            draft_loaded = _load_draft(config, loaded)
            dcfg = draft_loaded.config
            draft_spec = KVCacheSpec(dcfg.num_hidden_layers, dcfg.num_key_value_heads, dcfg.head_dim, config.block_size, kv_dtype)
        budget = config.kv_cache_memory or int(config.kv_cache_memory_fraction * _available_memory_bytes(device))
        num_head_blocks = 0
        if config.enable_kv_compression or config.kv_compression_rate is not None:
            # The compression pool (per-(layer, head) blocks, 16-bit) takes its share of the budget.
            head_block_bytes = config.block_size * head_slot_bytes(head_pool_dtype(kv_dtype, dtype), cfg.head_dim)
            head_budget = int(config.kv_compression_memory_fraction * budget)
            num_head_blocks = head_budget // head_block_bytes
            if num_head_blocks < cfg.num_hidden_layers * cfg.num_key_value_heads:
                raise InvalidRequestError(
                    f"the KV compression pool ({head_budget} bytes) holds less than one block per head; "
                    "raise kv_cache_memory or kv_compression_memory_fraction",
                    param="kv_compression_memory_fraction",
                )
            budget -= head_budget
        # A draft model's cache sits beside the target's, block for block: both come out of the budget.
        num_blocks = budget // (kv_spec.bytes_per_block + (draft_spec.bytes_per_block if draft_spec else 0))
        if num_blocks < 2:
            raise InvalidRequestError(
                f"kv_cache_memory {budget} bytes holds {num_blocks} blocks of {kv_spec.bytes_per_block} bytes; "
                "give at least two blocks' worth",
                param="kv_cache_memory",
            )
        capacity = num_blocks * config.block_size
        if config.max_model_len is not None:
            if config.max_model_len > cfg.max_position_embeddings:
                raise InvalidRequestError(
                    f"max_model_len {config.max_model_len} exceeds the model's context "
                    f"({cfg.max_position_embeddings})",
                    param="max_model_len",
                )
            if config.max_model_len > capacity:
                raise InvalidRequestError(
                    f"max_model_len {config.max_model_len} exceeds the KV cache capacity ({capacity} tokens); "
                    "raise kv_cache_memory or lower max_model_len",
                    param="max_model_len",
                )
            max_model_len = config.max_model_len
        else:
            max_model_len = min(cfg.max_position_embeddings, capacity)
        if draft_loaded is not None:
            max_model_len = min(max_model_len, draft_loaded.config.max_position_embeddings)
        if head is not None:
            max_model_len = min(max_model_len, head.max_positions)

        # Compressed requests' context is the compression pool's (before eviction), within the model's.
        compressed_len = (num_head_blocks // (cfg.num_hidden_layers * cfg.num_key_value_heads)) * config.block_size
        max_positions = max(max_model_len, min(cfg.max_position_embeddings, compressed_len))
        hybrid = precision.weight_dtype == "hybrid"
        build = functools.partial(
            build_model,
            loaded,
            dtype=dtype,
            device=device,
            max_positions=max_positions,
            int4_group_size=config.int4_group_size,
            int4_double_quant=config.int4_double_quant,
            int4_kernel=config.int4_kernel,
        )
        model = build(
            # inductor cannot lower oneDNN's prepacked (opaque) weights; it plans its own GEMMs
            pack_weights=hybrid or not config.compile_decode,
            weight_dtype="int4" if precision.weight_dtype == "int4" else "dense",
        )
        decode_model = build(weight_dtype="int4") if hybrid else None
        if decode_model is not None and isinstance(decode_model.lm_head, Int8HeadLinear):
            # Decode steps above the INT8 head's rows take the dense model's head (its compute
            # dtype, prepacked): no second 16-bit copy, and the logits of the dense path.
            decode_model.lm_head.use_dense_head(model.lm_head, dtype)
        draft: PagedDraftCache | None = None
        if head is not None and draft_spec is not None:
            weights = loaded.weights
            prefix = "model." if "model.norm.weight" in weights else ""
            try:
                head.attach_target(
                    model.embed_tokens,
                    weights[prefix + "norm.weight"],
                    weights.get("lm_head.weight", weights[prefix + "embed_tokens.weight"]),
                )
            except ValueError as exc:
                raise InvalidRequestError(str(exc), param="speculative.draft_model") from exc
            draft = EagleProposer(
                head, allocate_kv_caches(draft_spec, num_blocks, device), draft_spec.num_kv_heads, config.block_size, device
            )
        elif draft_loaded is not None and draft_spec is not None:
            draft_model = build_model(draft_loaded, dtype=dtype, device=device, max_positions=max_model_len)
            draft = DraftProposer(
                draft_model,
                allocate_kv_caches(draft_spec, num_blocks, device),
                draft_spec.num_kv_heads,
                config.block_size,
                device,
            )
        lora = None
        if config.enable_lora:
            lora = LoRAManager(
                LoRAModelShape.from_config(cfg),
                max_loras=config.max_loras,
                max_cpu_loras=config.max_cpu_loras or 4 * config.max_loras,
                limits=LoRALimits(max_lora_rank=config.max_lora_rank),
                device=device,
                dtype=dtype,
            )
        eos_token_ids = frozenset(cfg.eos_token_ids) | frozenset(loaded.tokenizer.eos_token_ids)
        grammars = GrammarCompiler(loaded.tokenizer, cfg.vocab_size, sorted(eos_token_ids))
        runner = ModelRunner(
            model,
            kv_spec,
            num_blocks,
            device,
            seed=config.seed,
            lora=lora,
            compile_decode=config.compile_decode,
            decode_model=decode_model,
            decode_model_max_batch=config.hybrid_int4_max_batch,
            draft=draft,
            native_decoder=config.native_decoder,
            grammars=grammars,
            num_head_blocks=num_head_blocks,
            eviction=_eviction_policy(config),
        )
        runner.warmup_decode()
        parts = EngineParts(
            model_name=loaded.name,
            model_config=cfg,
            tokenizer=loaded.tokenizer,
            eos_token_ids=eos_token_ids,
            runner=runner,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
            lora=lora,
            precision=precision,
            grammars=grammars,
            num_head_blocks=num_head_blocks,
            max_positions=max_positions,
        )
        del loaded
        logger.info(
            "engine ready",
            extra={
                "model": parts.model_name,
                "device": str(device),
                "dtype": dtype_name,
                "weight_dtype": precision.weight_dtype,
                "precision_reason": precision.reason,
                "native_decoder": runner.native is not None,
                "native_decoder_unavailable": runner.native_unavailable_reason if runner.native is None else "",
                "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
                "kv_blocks": num_blocks,
                "kv_capacity_tokens": capacity,
                "max_model_len": max_model_len,
            },
        )
        return cls(config, parts)

    @classmethod
    def from_options(cls, model: str | None = None, **options: Any) -> LLMEngine:
        if model is not None:
            options["model"] = model
        return cls.from_config(EngineConfig(**options))

    # -- requests -----------------------------------------------------------------------
    def make_request(self, gen: GenerationRequest, *, compress: bool = True) -> tuple[Request, str | None]:
        """Validate and tokenise; raises `InvalidRequestError` before anything is allocated.
        `compress=False`: the shared layout whatever the request or engine asks (KV hand-over)."""
        given = [x is not None for x in (gen.prompt, gen.prompt_token_ids, gen.messages)]
        if sum(given) != 1:
            raise InvalidRequestError(
                "give exactly one of prompt, prompt_token_ids or messages", param="prompt"
            )
        prompt = gen.prompt
        if gen.messages is not None:
            if not gen.messages:
                raise InvalidRequestError("messages must not be empty", param="messages")
            prompt = self.tokenizer.apply_chat_template(gen.messages, add_generation_prompt=True)
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise InvalidRequestError("prompt must be a non-empty string", param="prompt")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(gen.prompt_token_ids or [])
            if not token_ids:
                raise InvalidRequestError("prompt_token_ids must not be empty", param="prompt")
            vocab = self.model_config.vocab_size
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
                raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        params = gen.sampling_params
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be token ids of this model: in [0, {vocab})", param="stop_token_ids")
        rate = params.kv_compression_rate if params.kv_compression_rate is not None else self.config.kv_compression_rate
        compressed = compress and rate is not None and rate > 1.0
        if compressed:
            params = self._check_compression(params, gen)
        # A compressed request must fit the compression pool alone before eviction (so it can
        # always run); the others, the shared cache.
        context = self.compressed_max_len if compressed else self.max_model_len
        if len(token_ids) >= context:
            raise ContextLengthExceededError(
                f"the prompt has {len(token_ids)} tokens; this model's context is {context} tokens "
                f"{'(the KV compression pool) ' if compressed else ''}and at least one must be left to generate"
            )
        remaining = context - len(token_ids)
        if params.max_tokens is None:
            limit = remaining if gen.default_max_tokens is None else min(remaining, gen.default_max_tokens)
            params = dataclasses.replace(params, max_tokens=limit)
        elif params.max_tokens > remaining:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {context} tokens; the prompt has "
                f"{len(token_ids)} and max_tokens asks for {params.max_tokens} more. Reduce the prompt or "
                f"max_tokens (at most {remaining} here), or leave max_tokens out",
                param="max_tokens",
            )
        if gen.lora_name is not None:
            self._check_lora(gen.lora_name)
        if params.structured is not None:
            if self.grammars is None:
                raise InvalidRequestError(
                    "this engine has no grammar support for structured output", param=params.structured.param
                )
            self.grammars.compile(params.structured)  # 400 for a bad schema; cached for the runner
        request = Request(
            request_id=gen.request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            priority=gen.priority,
            tenant_id=gen.tenant_id,
            lora_name=gen.lora_name,
            kv_compression_rate=rate if compressed else None,
        )
        return request, prompt

    def _check_compression(self, params: SamplingParams, gen: GenerationRequest) -> SamplingParams:
        """A compressed request needs the head-block pool and no adapter; it does not speculate
        (its heads keep different tokens)."""
        if self.head_kv is None:
            raise InvalidRequestError(
                "this engine has no KV compression pool; start it with kv_compression_rate or "
                "enable_kv_compression=True",
                param="kv_compression_rate",
            )
        if gen.lora_name is not None:
            raise InvalidRequestError(
                "KV compression cannot be combined with a LoRA adapter yet", param="kv_compression_rate"
            )
        return dataclasses.replace(params, speculative=False)

    @property
    def compressed_capacity_tokens(self) -> int:
        """Tokens one compressed request can hold in every head before any eviction."""
        if self.head_kv is None:
            return 0
        return (self.head_kv.pool.num_blocks // self.head_kv.num_heads) * self.head_kv.block_size

    @property
    def compressed_max_len(self) -> int:
        """The context of a compressed request: the compression pool's, within the model's."""
        return min(self.compressed_capacity_tokens, self.max_positions)

    def _check_lora(self, name: str) -> None:
        if self.lora is None:
            raise InvalidRequestError(
                "this engine serves no LoRA adapters; start it with enable_lora=True", param="model"
            )
        if not self.lora.has(name):
            raise NotFoundError(f"LoRA adapter {name!r} is not loaded", param="model", code="model_not_found")

    # -- LoRA adapters --------------------------------------------------------------------
    def add_lora(self, name: str, source: str | LoRAAdapter) -> LoRAAdapter:
        """Register an adapter by name: a PEFT folder (adapter_config.json +
        adapter_model.safetensors) or an already parsed `LoRAAdapter`. Thread-safe."""
        if self.lora is None:
            raise InvalidRequestError("LoRA is not enabled; pass enable_lora=True", param="enable_lora")
        if isinstance(source, LoRAAdapter):
            adapter = source
        else:
            folder = Path(source)
            config_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
            if not config_path.is_file() or not weights_path.is_file():
                raise NotFoundError(
                    f"{folder} must hold adapter_config.json and adapter_model.safetensors "
                    "(PEFT save_pretrained output; .bin checkpoints are refused)",
                    param="lora",
                )
            return self.add_lora_checkpoint(name, config_path.read_bytes(), weights_path.read_bytes())
        self.lora.add(adapter)
        return adapter

    def add_lora_checkpoint(self, name: str, config: bytes, weights: bytes) -> LoRAAdapter:
        """Register an adapter from a PEFT checkpoint's two files' bytes (validated). Thread-safe."""
        if self.lora is None:
            raise InvalidRequestError("LoRA is not enabled; pass enable_lora=True", param="enable_lora")
        adapter = parse_peft_adapter(name, config, weights, self.lora.shape, self.lora.limits)
        self.lora.add(adapter)
        return adapter

    def remove_lora(self, name: str) -> bool:
        return self.lora.remove(name) if self.lora is not None else False

    def lora_info(self) -> dict[str, Any]:
        """What an API needs to validate adapter uploads for this engine."""
        if self.lora is None:
            return {"enabled": False}
        return {
            "enabled": True,
            "max_lora_rank": self.lora.limits.max_lora_rank,
            "shape": dict(self.lora.shape.__dict__),
        }

    def list_loras(self) -> list[str]:
        return list(self.lora.adapters) if self.lora is not None else []

    def add_request(self, gen: GenerationRequest, *, stream_text: bool = False) -> Request:
        request, prompt = self.make_request(gen)
        return self.add_prepared(request, prompt, stream_text=stream_text, final_only=not gen.stream)

    def add_prepared(
        self, request: Request, prompt: str | None, *, stream_text: bool = False, final_only: bool = False
    ) -> Request:
        """Queue a request built by `make_request` (validated and tokenised once, by the caller).
        `stream_text`: decode text at every step; `final_only`: `step()` returns only the request's
        first output and its last (`GenerationRequest.stream`)."""
        if request.request_id in self.scheduler.requests or request.request_id in self.families:
            raise InvalidRequestError(
                f"request id {request.request_id!r} is already running", param="request_id"
            )
        if request.lora_name is not None:
            self._check_lora(request.lora_name)
        children = choice_requests(request) if request.sampling_params.n > 1 else [request]
        for child in children:
            if child.lora_name is not None:
                assert self.lora is not None
                self.lora.acquire(child.lora_name)  # raises when it was removed meanwhile
            self.scheduler.add_request(child)
            self.output_processor.add(child, prompt, stream_text, final_only)
        if len(children) > 1:
            self.families.add(request.request_id, [c.request_id for c in children])
        return request

    # -- KV hand-over (kv_transfer.py) ----------------------------------------------------------
    def make_prefill_request(self, gen: GenerationRequest) -> tuple[Request, str | None]:
        """`make_request` for a prefill: compute the prompt, sample one token, and keep the KV
        blocks for `export_kv` (or until `kv_hold_ttl_s` passes)."""
        request, prompt = self.make_request(gen, compress=False)  # handed over in the shared layout, whole
        request.sampling_params = dataclasses.replace(request.sampling_params, max_tokens=1, n=1, speculative=False)
        request.hold_kv = True
        return request, prompt

    def add_prefill_request(self, gen: GenerationRequest) -> Request:
        """Queue `gen` as a prefill (`make_prefill_request`)."""
        return self.add_prepared(*self.make_prefill_request(gen))

    def kv_fingerprint(self) -> str:
        cfg = self.model_config
        return fingerprint(self.model_name, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size)

    def cached_prefix_pages(self, gen: GenerationRequest) -> int:
        """How many leading pages (blocks) of `gen`'s prompt this engine's prefix cache holds now:
        a sender need not send them (`export_kv(skip_pages=...)`)."""
        request, _ = self.make_request(gen, compress=False)
        return self.kv_manager.num_cached_prefix_blocks(
            request.num_tokens, request.token_ids_slice, self.scheduler.cache_salt(request)
        )

    def export_kv(self, request_id: str, cache_dtype: str | None = None, skip_pages: int = 0) -> KVTransfer:
        """The prompt KV of a finished prefill request (`add_prefill_request`) as checksummed
        pages in `cache_dtype` (this cache's own, or "float8_e4m3fn" for an FP8 receiver), from
        page `skip_pages` on (the receiver holds the ones before), and its first token; its
        blocks are freed. Raises `NotFoundError` when it is not held."""
        request = self.scheduler.held.get(request_id)
        if request is None:
            raise NotFoundError(f"no prefilled KV is held for request {request_id!r} (expired or never made)")
        try:
            dtype = self.kv_cache_dtype if cache_dtype is None else cache_dtype
            if dtype not in (self.kv_cache_dtype, "float8_e4m3fn"):
                raise InvalidRequestError(
                    f"this engine's {self.kv_cache_dtype} cache exports as itself or float8_e4m3fn, not {dtype}",
                    param="cache_dtype",
                )
            prompt = request.prompt_token_ids
            size = self.kv_manager.block_size
            if not 0 <= skip_pages <= (len(prompt) - 1) // size:
                raise InvalidRequestError(
                    f"skip_pages {skip_pages} must be between 0 and {(len(prompt) - 1) // size} for a prompt of "
                    f"{len(prompt)} tokens (the last token's page is always sent)",
                    param="skip_pages",
                )
            block_ids = self.kv_manager.block_table(request_id).block_ids
            datas = self.runner.export_pages(block_ids[skip_pages:], len(prompt) - skip_pages * size, getattr(torch, dtype))
            pages = []
            for index, data in enumerate(datas, start=skip_pages):
                tokens = tuple(prompt[index * size : (index + 1) * size])
                pages.append(KVPage(index, tokens, data, page_checksum(request_id, index, tokens, dtype, data)))
            return KVTransfer(
                request_id, self.kv_fingerprint(), dtype, size, request.output_token_ids[0], tuple(pages), skip_pages
            )
        finally:
            self.scheduler.release_held(request_id)

    def add_request_with_kv(self, gen: GenerationRequest, transfer: KVTransfer, *, stream_text: bool = False) -> RequestOutput:
        """Continue a request whose prompt another engine computed: verify the transfer (model,
        cache type, checksums, the prompt's tokens), copy its pages into blocks of this cache, and
        decode from there. Returns the output of its first token (sampled by the sender). A bad
        transfer raises `KVTransferError` and allocates nothing; no free blocks: 503."""
        request, prompt = self.make_request(gen, compress=False)  # the transfer's pages: shared layout
        if request.sampling_params.n > 1:
            raise InvalidRequestError("a handed-over prompt continues as one choice: compute n > 1 here", param="n")
        verify(
            transfer,
            model_fingerprint=self.kv_fingerprint(),
            cache_dtype=self.kv_cache_dtype,
            block_size=self.kv_manager.block_size,
            prompt_token_ids=request.prompt_token_ids,
        )
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running", param="request_id")
        num_prompt = request.num_prompt_tokens
        size = self.kv_manager.block_size
        num_cached_blocks = 0
        if transfer.num_skipped_pages:  # take the pages left out from this engine's prefix cache
            cached = self.kv_manager.allocate_cached_prefix(
                request.request_id, request.num_tokens, request.token_ids_slice, self.scheduler.cache_salt(request)
            )
            num_cached_blocks = cached // size
            if num_cached_blocks < transfer.num_skipped_pages:
                self.kv_manager.free(request.request_id)
                raise KVPrefixEvictedError(
                    f"{transfer.num_skipped_pages} prompt pages were left out of the KV transfer but only "
                    f"{num_cached_blocks} are still cached here; the request needs a whole transfer"
                )
            request.num_cached_tokens = cached
        if not self.kv_manager.allocate_slots(request.request_id, num_prompt + 1, admission=True):
            self.kv_manager.free(request.request_id)
            raise ServiceUnavailableError("no free KV blocks for a handed-over request; retry shortly", code="kv_cache_full")
        try:
            block_ids = self.kv_manager.block_table(request.request_id).block_ids
            # Never into cached (shared) blocks: only the pages past this engine's own prefix.
            imported = [p for p in transfer.pages if p.index >= num_cached_blocks]
            self.runner.import_pages(
                block_ids[num_cached_blocks:], [(len(p.token_ids), p.data) for p in imported]
            )
            if hasattr(self.runner, "imported_prompt"):
                self.runner.imported_prompt(request.request_id, num_cached_blocks * size, num_prompt)
            if request.lora_name is not None:
                self._check_lora(request.lora_name)
                assert self.lora is not None
                self.lora.acquire(request.lora_name)
        except BaseException:
            self.kv_manager.free(request.request_id)
            raise
        request.num_computed_tokens = num_prompt
        self.scheduler.add_running(request)
        self.output_processor.add(request, prompt, stream_text)
        # The sender's first token, through the same stop checks and output path as any other.
        result = RunnerResult({request.request_id: [transfer.first_token_id]})
        handed = SchedulerOutput(
            [
                ScheduledRequest(
                    request_id=request.request_id,
                    token_ids=[],
                    start_position=num_prompt,
                    block_ids=block_ids,
                    sample=True,
                    sampling_params=request.sampling_params,
                    output_token_ids=[],
                    is_new=False,
                )
            ],
            0,
        )
        return self._outputs(self.scheduler.update_from_output(handed, result))[0]

    def _release(self, request: Request) -> None:
        if request.lora_name is not None and self.lora is not None:
            self.lora.release(request.lora_name)

    def abort_request(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> RequestOutput | None:
        """Finish a request now; its KV blocks are free when this returns."""
        if request_id in self.families:  # every choice of a request with n > 1
            outputs = [self._finish_one(c, status) for c in self.families.unfinished_children(request_id)]
            parents, _ = self.families.to_parents([o for o in outputs if o is not None])
            return parents[0] if parents else None
        output = self._finish_one(request_id, status)
        if output is None:
            return None
        return self._to_parents([output])[0]

    def _finish_one(self, request_id: str, status: RequestStatus) -> RequestOutput | None:
        request = self.scheduler.finish_request(request_id, status)
        if request is None:
            return None
        self._release(request)
        return self.output_processor.finish(request)

    def _to_parents(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Choices' outputs as their parents' (`ChoiceFamilies`); a choice that failed ends its
        siblings, whose last outputs join the parent's."""
        if not self.families.families:
            return outputs
        parents, to_end = self.families.to_parents(outputs)
        while to_end:
            ended = [self._finish_one(c, RequestStatus.FINISHED_ABORTED) for c in to_end]
            more, to_end = self.families.to_parents([o for o in ended if o is not None])
            parents = _merge_by_id(parents, more)
        return parents

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @staticmethod
    def new_request_id() -> str:
        return uuid.uuid4().hex

    # -- the loop -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.scheduler.held:
            self.scheduler.expire_held(self.config.kv_hold_ttl_s)
        scheduled = self.scheduler.schedule()
        aborted: list[RequestOutput] = []
        if self.config.kv_integrity_check and not scheduled.is_empty:
            aborted = self._abort_stale(scheduled)
        if scheduled.is_empty:
            return self._to_parents(aborted)
        self.output_processor.mark_scheduled(
            [s.request_id for s in scheduled.scheduled if s.is_new], time.monotonic()
        )
        started_wall, started_cpu = time.perf_counter(), time.thread_time()
        result = self.runner.execute(scheduled)
        num_rows = sum(1 + s.num_draft_tokens for s in scheduled.scheduled if s.sample)
        self.scheduler.step_cost.observe(
            scheduled.num_scheduled_tokens, num_rows, time.perf_counter() - started_wall
        )
        aborted += self._fail_requests(result, len(scheduled.scheduled))
        outputs = self._outputs(self.scheduler.update_from_output(scheduled, result))
        self.num_steps += 1
        self.step_wall_s += time.perf_counter() - started_wall
        self.step_thread_cpu_s += time.thread_time() - started_cpu
        return self._to_parents(aborted + outputs)

    def _outputs(self, updates: list[RequestUpdate]) -> list[RequestOutput]:
        """Outputs for applied updates; requests that finished (a stop token, length, or a stop
        string the output processor found) give back their adapter and blocks."""
        outputs, stopped_ids = self.output_processor.process(updates)
        for update in updates:
            if update.finished:
                self._release(update.request)
        for request_id in stopped_ids:  # a stop string matched: release the request's blocks
            stopped = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
            if stopped is not None:
                self._release(stopped)
        return outputs

    def _fail_requests(self, result: RunnerResult, num_scheduled: int) -> list[RequestOutput]:
        """End the requests the runner could not compute, before their step's results are applied
        (so none of their tokens is kept). Non-finite logits and sampling errors are always the
        request's own. A model pass that raised for every request alone is not: with several
        requests, or `MAX_CONSECUTIVE_FAILED_STEPS` steps in a row, the runner itself is broken
        (`EngineBrokenError`: the caller fails every request in flight and reports unhealthy)."""
        if result.forward_failed:
            self.num_consecutive_failed_steps += 1
            if num_scheduled > 1 or self.num_consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
                raise EngineBrokenError(
                    f"the model pass failed for every request of the step ({num_scheduled}), each run alone; "
                    f"{self.num_consecutive_failed_steps} such steps in a row"
                )
        else:
            self.num_consecutive_failed_steps = 0
        outputs = []
        for request_id, message in result.failed.items():
            request = self.scheduler.requests.get(request_id)
            if request is None:
                continue
            # A constraint the model could not continue is the schema's to fix, not a server fault.
            request.error, request.error_code = message, ("constraint_failed" if message == GRAMMAR_FAILED else "request_failed")
            self.num_failed_requests += 1
            output = self._finish_one(request_id, RequestStatus.FINISHED_ERROR)  # step() maps choices
            if output is not None:
                outputs.append(output)
        return outputs

    def _abort_stale(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        """KV-page integrity: a scheduled request holding a block whose generation changed (the
        block was reassigned: an allocator bug, a late KV transfer) is aborted alone, before the
        step could compute or answer anything from someone else's KV."""
        request_ids = [s.request_id for s in scheduled.scheduled]
        stale = self.kv_manager.stale_requests(request_ids)
        if self.head_kv is not None:  # compressed requests' head blocks carry the same tags
            stale += self.head_kv.stale_requests([r for r in request_ids if r not in stale])
        if not stale:
            return []
        outputs = []
        for request_id in stale:
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                request.error = "a KV block of this request was reassigned; retry the request"
                request.error_code = "kv_integrity"
            logger.error("kv integrity violation; aborting request", extra={"request_id": request_id})
            self.num_kv_integrity_aborts += 1
            output = self._finish_one(request_id, RequestStatus.FINISHED_ERROR)  # step() maps choices
            if output is not None:
                outputs.append(output)
        stale_ids = set(stale)
        scheduled.scheduled = [s for s in scheduled.scheduled if s.request_id not in stale_ids]
        return outputs

    def inject_kv_fault(self, request_id: str, block_index: int = 0, *, overwrite: bool = False) -> int:
        """Test hook: act as a buggy allocator (or a late KV transfer) on a running request's
        block: hand it out again (its generation changes) and, with `overwrite`, scribble over its
        KV. Returns the physical block id. For a compressed request: its head blocks, in table
        order over all its heads (`HeadKVCacheManager`), and the head-block pool."""
        request = self.scheduler.requests.get(request_id)
        if request is not None and request.compressed and self.head_kv is not None:
            head_block_ids = [b for table in self.head_kv.head_tables(request_id) for b in table.block_ids]
            block_id = head_block_ids[block_index]
            self.head_kv.pool.generations[block_id] += 1
            if overwrite and self.runner.head_pool is not None:
                for pool in self.runner.head_pool[:2]:
                    pool[block_id].view(torch.uint8).fill_(0x7F)
            return block_id
        block_id = self.kv_manager.block_table(request_id).block_ids[block_index]
        self.kv_manager.pool.generations[block_id] += 1
        if overwrite:
            for layer in self.runner.kv_caches:
                layer[0][block_id].view(torch.uint8).fill_(0x7F)
                layer[1][block_id].view(torch.uint8).fill_(0x7F)
        return block_id

    def stats(self) -> dict[str, Any]:
        pool = self.kv_manager.pool
        loras = self.list_loras()
        return {
            "kv_capacity_tokens": self.kv_manager.capacity_tokens,
            "kv_cache_dtype": self.kv_cache_dtype,
            "prefix_cache_queries": self.kv_manager.num_prefix_queries,
            "prefix_cache_hits": self.kv_manager.num_prefix_hits,
            "prefix_cache_hit_rate": self.kv_manager.num_prefix_hits
            / max(1, self.kv_manager.num_prefix_queries),
            "prefix_cache_evictions": self.kv_manager.pool.num_evictions,
            "num_kv_integrity_aborts": self.num_kv_integrity_aborts,
            "num_failed_requests": self.num_failed_requests,
            "loras_loaded": loras,
            "num_loras_loaded": len(loras),
            "dtype": self.precision.dtype if self.precision else None,
            "weight_dtype": self.precision.weight_dtype if self.precision else self.config.weight_dtype,
            "precision_reason": self.precision.reason if self.precision else "",
            "native_decoder": getattr(self.runner, "native", None) is not None,
            "num_native_decoder_steps": int(getattr(self.runner, "num_native_steps", 0)),
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used_blocks,
            "kv_occupancy": pool.num_used_blocks / pool.num_blocks,
            "block_size": self.kv_manager.block_size,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "queued_prompt_tokens": self.scheduler.num_uncomputed_prompt_tokens(),
            "num_preemptions": self.scheduler.num_preemptions_total,
            "num_output_tokens_interactive": self.scheduler.num_output_tokens_total[Priority.INTERACTIVE],
            "num_output_tokens_batch": self.scheduler.num_output_tokens_total[Priority.BATCH],
            "max_model_len": self.max_model_len,
            "num_steps": self.num_steps,
            "num_draft_tokens": self.scheduler.num_draft_tokens_total,
            "num_accepted_draft_tokens": self.scheduler.num_accepted_tokens_total,
            "draft_acceptance_rate": self.scheduler.num_accepted_tokens_total
            / max(1, self.scheduler.num_draft_tokens_total),
            "draft_wall_s": float(getattr(self.runner, "draft_wall_s", 0.0)),
            "step_wall_s": self.step_wall_s,
            "step_thread_cpu_s": self.step_thread_cpu_s,
            "grammar_mask_s": float(getattr(self.runner, "grammar_mask_s", 0.0)),
            **(self.grammars.stats() if self.grammars is not None else {}),
            **self._compression_stats(),
        }

    def _compression_stats(self) -> dict[str, Any]:
        head_kv = self.head_kv
        if head_kv is None:
            return {}
        return {
            "kv_compression_head_blocks_total": head_kv.pool.num_blocks,
            "kv_compression_head_blocks_used": head_kv.pool.num_used_blocks,
            "kv_compression_capacity_tokens": self.compressed_capacity_tokens,
            "kv_compression_evictions": self.scheduler.num_compressed_evictions,
            "kv_compression_vectors_evicted": self.scheduler.num_vectors_evicted,
        }


def _merge_by_id(first: list[RequestOutput], then: list[RequestOutput]) -> list[RequestOutput]:
    """`first` with the outputs of `then` of the same request folded in (their completions
    replace those of the same index; a finished one carries every choice)."""
    by_id = {o.request_id: o for o in first}
    merged = list(first)
    for output in then:
        earlier = by_id.get(output.request_id)
        if earlier is None:
            merged.append(output)
            continue
        earlier_by_index = {c.index: c for c in earlier.outputs}
        completions = [
            merge_deltas(earlier_by_index.pop(c.index), c) if c.index in earlier_by_index else c
            for c in output.outputs
        ]
        earlier.outputs = sorted([*earlier_by_index.values(), *completions], key=lambda c: c.index)
        earlier.finished = output.finished
        earlier.metrics = output.metrics
        earlier.error, earlier.error_code = output.error or earlier.error, output.error_code or earlier.error_code
    return merged


def _eviction_policy(config: EngineConfig) -> EvictionPolicy:
    """How compressed requests are evicted (the runner scores and plans; the scheduler times)."""
    return EvictionPolicy(
        per_head=config.kv_compression_policy == "per_head", interval=config.kv_compression_interval
    )


def _speculation_settings(config: EngineConfig, *, has_draft: bool) -> SpeculationSettings | None:
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


# Draft heads trained for bundled models (scripts/train_draft.py), by model name.
BUNDLED_DRAFTS = {"smollm2-135m-instruct": Path(__file__).parent / "drafts" / "smollm2-135m-instruct-eagle"}


def _draft_path(config: EngineConfig) -> Path | None:
    """Where the draft comes from: `draft_model`, else the head bundled for the model (methods
    'draft' and 'auto'); None for prompt lookup alone."""
    spec = config.speculative
    if spec is None or spec.method == "ngram":
        return None
    if spec.draft_model is not None:
        return resolve_model_path(spec.draft_model)
    bundled = BUNDLED_DRAFTS.get(config.model.lower())
    if bundled is not None and (bundled / "model.safetensors").exists():
        return bundled
    if spec.method == "draft":
        raise InvalidRequestError(
            f"speculative method 'draft' needs draft_model: no draft is bundled for {config.model!r}",
            param="speculative.draft_model",
        )
    return None


def _load_draft(config: EngineConfig, target: Any) -> Any:
    """The draft model's loaded weights, checked to share the target's vocabulary token for
    token."""
    spec = config.speculative
    assert spec is not None and spec.draft_model is not None
    draft = load_model(spec.draft_model)
    if draft.tokenizer.token_bytes_table() != target.tokenizer.token_bytes_table():
        raise InvalidRequestError(
            f"draft model {spec.draft_model!r} does not share the target's vocabulary; a draft must "
            "tokenise exactly as the target does",
            param="speculative.draft_model",
        )
    return draft
