"""Model runner: turns a `SchedulerOutput` into tensors, runs the model, samples.

Owns everything torch: the model, the paged KV tensors and per-request sampling state
(seeded generators, output-token counts for penalties).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tandem.engine.draft import PagedDraftCache
from tandem.engine.grammar import GrammarCompiler, GrammarMatcher
from tandem.engine.lora import LoRAManager, LoRAStep
from tandem.engine.models.llama import KVLayer, LlamaForCausalLM
from tandem.engine.models.native import NativeLlama, NativeStep
from tandem.engine.step import RunnerResult, ScheduledRequest, SchedulerOutput
from tandem.kernels.attention import build_attention_metadata, quantize_fp8
from tandem.kernels.head_attention import HeadAttentionMetadata, HeadPool, head_pool_dtype, move_head_slots
from tandem.kernels.kv_eviction import EvictionPolicy, plan_kept
from tandem.kernels.sampling import (
    apply_penalties,
    apply_token_bitmask_,
    filter_logits,
    sample_rows,
    top_logprobs,
    verify_drafts,
)

logger = logging.getLogger(__name__)

# What a client is told when its request failed in the runner (details go to the log only).
REQUEST_FAILED = "this request could not be computed by the engine; the server log has the details"
NON_FINITE_LOGITS = (
    "the model produced non-finite logits for this request (an adapter with extreme weights?)"
)
GRAMMAR_FAILED = "the output constraint (response_format or tools) could not be continued"


@dataclass
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # element type of the cache (torch.float8_e4m3fn for FP8)

    @property
    def is_fp8(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block, including FP8's per-(token, head) float16 scales."""
        element = torch.empty((), dtype=self.dtype).element_size()
        per_vector = self.head_dim * element + (2 if self.is_fp8 else 0)
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * per_vector


def allocate_kv_caches(kv_spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[KVLayer]:
    """Per layer (K, V, K scales, V scales): [num_blocks, block_size, Hk, D] each (scales
    [num_blocks, block_size, Hk] float16 for FP8, else None), zeroed."""
    shape = (num_blocks, kv_spec.block_size, kv_spec.num_kv_heads, kv_spec.head_dim)

    def layer_cache() -> KVLayer:
        k = torch.zeros(shape, dtype=kv_spec.dtype, device=device)
        v = torch.zeros(shape, dtype=kv_spec.dtype, device=device)
        if not kv_spec.is_fp8:
            return (k, v, None, None)
        k_scale = torch.zeros(shape[:3], dtype=torch.float16, device=device)
        return (k, v, k_scale, torch.zeros_like(k_scale))

    return [layer_cache() for _ in range(kv_spec.num_layers)]


# Most token rows a step may have to go through the native decoder stack (its INT4 matmuls are
# row kernels: beyond a few dozen rows the dequantise-then-GEMM path of the eager model wins).
NATIVE_MAX_ROWS = 16


def _add_padded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # [Hk, Ta] + [Hk, Tb]
    """Sum of two score tensors over the same heads' tokens, the shorter padded with zeros at its
    end (a head's tokens keep their indices until the next eviction; new ones are appended)."""
    width = max(a.shape[1], b.shape[1])
    return F.pad(a, (0, width - a.shape[1])) + F.pad(b, (0, width - b.shape[1]))


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_spec: KVCacheSpec,
        num_blocks: int,
        device: torch.device,
        seed: int = 0,
        lora: LoRAManager | None = None,
        compile_decode: bool = False,
        decode_model: LlamaForCausalLM | None = None,
        decode_model_max_batch: int = 0,
        draft: PagedDraftCache | None = None,
        native_decoder: bool = True,
        grammars: GrammarCompiler | None = None,
        num_head_blocks: int = 0,
        eviction: EvictionPolicy | None = None,
    ) -> None:
        """`decode_model` (optional, e.g. an INT4 copy of `model` sharing nothing but the cache)
        runs decode-only steps of at most `decode_model_max_batch` requests; `model` runs the rest.
        Those decode steps, when they have no LoRA rows and at most `NATIVE_MAX_ROWS` rows, go
        through the native decoder stack (`NativeLlama`) where the decode model's linears are
        native INT4 and `native_decoder` is set (with such a stack, a LoRA-free decode step that
        has more rows runs the dense `model`); else, with `compile_decode`, through one compiled
        graph. At small batch the eager step is dominated by per-op dispatch, not by the matmuls.

        `grammars` compiles the output constraints of requests that have one (`structured`): each
        such request's rows are masked to the tokens its grammar allows before sampling and
        verification, and its matcher advances on the tokens it is given.

        `num_head_blocks` > 0 allocates the head-block pool of compressed requests (KV paged per
        (layer, KV head), `kernels.head_attention`; of the shared cache's type, `head_pool_dtype`):
        their rows run in a forward of their own (small unobserved decode steps through the native
        stack over the pool), and `eviction` decides what each head keeps once a request's context
        is computed and again every `eviction.interval` decode steps (0: once)."""
        self.model = model
        self.decode_model = decode_model or model
        self.decode_model_max_batch = decode_model_max_batch if decode_model is not None else 1 << 30
        self._decode_forward: Any = (
            torch.compile(self.decode_model.forward, dynamic=True) if compile_decode else None
        )
        self.num_compiled_steps = 0
        self.num_decode_model_steps = 0
        self.lora = lora
        self.kv_spec = kv_spec
        self.device = device
        self.block_size = kv_spec.block_size
        self.kv_caches = allocate_kv_caches(kv_spec, num_blocks, device)
        self.native: NativeLlama | None = None
        self.native_unavailable_reason = "disabled (native_decoder=False)"
        if native_decoder and self._decode_forward is None:
            self.native_unavailable_reason = NativeLlama.unsupported_reason(self.decode_model, self.kv_caches)
            self.native = NativeLlama.build(self.decode_model, self.kv_caches, self.block_size)
        self.num_native_steps = 0
        self.draft = draft
        self.draft_wall_s = 0.0  # wall seconds spent proposing with the draft model
        self.vocab_size = model.config.vocab_size
        self._generators: dict[str, torch.Generator] = {}
        self._default_generator = torch.Generator(device=device)
        self._default_generator.manual_seed(seed)
        self.grammars = grammars
        self._matchers: dict[str, GrammarMatcher] = {}
        self.grammar_mask_s = 0.0  # wall seconds computing and applying grammar masks
        self.eviction = eviction or EvictionPolicy()
        # Compressed requests inside a decode observation window: per layer [Hk, T] the squared
        # attention their observed rows gave each head's tokens so far (`ScheduledRequest.observe`).
        self._observed: dict[str, list[torch.Tensor]] = {}
        # Compressed requests' head blocks: (k, v) [N, bs, D], and for an FP8 pool their
        # per-vector scales (k, v) [N, bs] float16 (else None).
        self.head_pool: HeadPool | None = None
        if num_head_blocks > 0:
            pool_dtype = head_pool_dtype(kv_spec.dtype, model.norm.dtype)
            shape = (num_head_blocks, kv_spec.block_size, kv_spec.head_dim)
            fp8 = pool_dtype == torch.float8_e4m3fn
            self.head_pool = (
                torch.zeros(shape, dtype=pool_dtype, device=device),
                torch.zeros(shape, dtype=pool_dtype, device=device),
                torch.ones(shape[:2], dtype=torch.float16, device=device) if fp8 else None,
                torch.ones(shape[:2], dtype=torch.float16, device=device) if fp8 else None,
            )
        # The native decoder stack over that pool, for compressed requests' decode rows (where the
        # stack runs for shared decode steps).
        self.native_heads: NativeLlama | None = None
        if self.native is not None and self.head_pool is not None:
            pool_layers: list[KVLayer] = [self.head_pool] * model.config.num_hidden_layers
            self.native_heads = NativeLlama.build(self.decode_model, pool_layers, self.block_size)
        self.num_native_head_steps = 0

    # -- KV pages for hand-over (kv_transfer.py) -------------------------------------------------
    def export_pages(self, block_ids: list[int], num_tokens: int, dtype: torch.dtype) -> list[bytes]:
        """The KV of the first `num_tokens` tokens held in `block_ids`, one page per block, in
        `dtype` (this cache's own dtype, or FP8 from a wider cache: quantised as `write_kv` does)."""
        pages = []
        for index, block_id in enumerate(block_ids):
            count = min(self.block_size, num_tokens - index * self.block_size)
            if count <= 0:
                break
            keys_values: list[torch.Tensor] = []
            scales: list[torch.Tensor] = []
            for k_cache, v_cache, k_scale, v_scale in self.kv_caches:
                for cache, scale in ((k_cache, k_scale), (v_cache, v_scale)):
                    rows = cache[block_id, :count]  # [count, Hk, D]
                    if scale is not None:  # an FP8 cache: its codes and scales as stored
                        keys_values.append(rows.view(torch.uint8))
                        scales.append(scale[block_id, :count])
                    elif dtype == torch.float8_e4m3fn:
                        codes, row_scales = quantize_fp8(rows)
                        keys_values.append(codes.view(torch.uint8))
                        scales.append(row_scales)
                    else:
                        keys_values.append(rows.to(dtype))
            parts = [t.contiguous().view(torch.uint8).reshape(-1) for t in keys_values + scales]
            pages.append(torch.cat(parts).numpy().tobytes())
        return pages

    def import_pages(self, block_ids: list[int], pages: list[tuple[int, bytes]]) -> None:
        """Write pages (token count, bytes in this cache's dtype) into `block_ids`, in order."""
        num_kv_heads, head_dim = self.kv_spec.num_kv_heads, self.kv_spec.head_dim
        element = torch.empty((), dtype=self.kv_spec.dtype).element_size()
        for block_id, (count, data) in zip(block_ids, pages, strict=False):
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            vector_bytes = count * num_kv_heads * head_dim * element
            scale_bytes = count * num_kv_heads * 2
            offset = 0
            for k_cache, v_cache, _, _ in self.kv_caches:
                for cache in (k_cache, v_cache):
                    chunk = raw[offset : offset + vector_bytes].view(cache.dtype if element > 1 else torch.uint8)
                    cache[block_id, :count].view(torch.uint8 if element == 1 else cache.dtype).copy_(
                        chunk.view(count, num_kv_heads, head_dim)
                    )
                    offset += vector_bytes
            if self.kv_spec.is_fp8:
                for _, _, k_scale, v_scale in self.kv_caches:
                    for scale in (k_scale, v_scale):
                        assert scale is not None
                        scale[block_id, :count].copy_(
                            raw[offset : offset + scale_bytes].view(torch.float16).view(count, num_kv_heads)
                        )
                        offset += scale_bytes
            if offset != len(data):
                raise ValueError(f"a KV page of {count} tokens has {len(data)} bytes, expected {offset}")

    def imported_prompt(self, request_id: str, first_position: int, num_tokens: int) -> None:
        """A request whose prompt KV another engine computed (positions first_position..num_tokens-1
        imported; those before come from this cache's prefix blocks): there are no target states
        for them, so a draft head catches up on them from zero states (never on the shared
        prefix blocks, whose head KV their filler wrote)."""
        if self.draft is not None and self.draft.wants_hidden and num_tokens > first_position:
            width = self.model.config.hidden_size * max(1, len(self.draft.hidden_layers))
            zeros = torch.zeros(num_tokens - first_position, width)
            self.draft.record(request_id, first_position, self.draft.prepare_states(zeros))

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)
            self._matchers.pop(request_id, None)
            self._observed.pop(request_id, None)
        if self.draft is not None:
            self.draft.forget(request_ids)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerResult:
        """Run one step. Failure is per request: a request whose rows break the step (its
        sampling parameters, its adapter, its logits) is reported in `RunnerResult.failed` and the
        others are computed. When the batched step raises, each request is rerun alone (its KV
        slots are rewritten with the same values) to find the ones that fail. When the model pass
        raised for every request alone, `forward_failed` says so, and the engine decides whether
        the runner itself is broken."""
        self.forget(sched.finished_request_ids)
        if sched.head_move_src_slots and self.head_pool is not None:  # evictions, before any write
            k_pool, v_pool, k_scale, v_scale = self.head_pool
            move_head_slots(
                k_pool,
                v_pool,
                torch.tensor(sched.head_move_src_slots, dtype=torch.int64, device=self.device),
                torch.tensor(sched.head_move_dst_slots, dtype=torch.int64, device=self.device),
                k_scale,
                v_scale,
            )
        for request_id in sched.preempted_request_ids:  # its head tokens are recomputed anew
            self._observed.pop(request_id, None)
        if self.draft is not None:  # a preempted request's draft KV went with its blocks
            self.draft.forget(sched.preempted_request_ids)
        try:
            return self._execute(sched.scheduled)
        except Exception:
            if len(sched.scheduled) == 1:
                return dataclasses.replace(self._failed_alone(sched.scheduled[0]), forward_failed=True)
            logger.warning(
                "step failed; rerunning its requests one by one", extra={"num_requests": len(sched.scheduled)}
            )
        result = RunnerResult({})
        num_raised = 0
        for item in sched.scheduled:
            try:
                result.merge(self._execute([item]))
            except Exception:
                result.merge(self._failed_alone(item))
                num_raised += 1
        result.forward_failed = num_raised == len(sched.scheduled)
        return result

    def _failed_alone(self, item: ScheduledRequest) -> RunnerResult:
        """Called from an `except` block: the step of `item` alone raised."""
        logger.exception("request failed in the model runner", extra={"request_id": item.request_id})
        return RunnerResult({}, failed={item.request_id: REQUEST_FAILED})

    def _execute(self, items: list[ScheduledRequest]) -> RunnerResult:
        """Shared-layout rows in one forward (`_execute_shared`), compressed requests' rows in
        another (`_execute_compressed`)."""
        compressed = [item for item in items if item.is_compressed]
        if not compressed:
            return self._execute_shared(items)
        result = self._execute_compressed(compressed)
        if len(compressed) < len(items):
            result.merge(self._execute_shared([item for item in items if not item.is_compressed]))
        return result

    def _execute_compressed(self, items: list[ScheduledRequest]) -> RunnerResult:
        """One forward of `model` over compressed requests' rows, reading and writing the
        head-block pool; then sampling, and for requests whose context this step completed
        (`observe`), the tokens each head keeps (`RunnerResult.kept_tokens`)."""
        if self.head_pool is None:
            raise RuntimeError("a compressed request reached a runner without a head-block pool")
        cfg = self.model.config
        num_layers, num_kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
        for item in items:
            if item.prefix_src_slots:
                self._copy_prefix_into_heads(item)
        input_ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        query_start_loc = [0]
        head_slots: list[torch.Tensor] = []
        for item in items:
            n = len(item.token_ids)
            input_ids.extend(item.token_ids)
            positions.extend(range(item.start_position, item.start_position + n))
            if item.sample:
                logits_rows.append(len(input_ids) - 1)
            query_start_loc.append(len(input_ids))
            assert item.head_slots is not None
            slots = torch.tensor(item.head_slots, dtype=torch.int64).view(num_layers, num_kv_heads, n)
            head_slots.append(slots.transpose(1, 2))  # [L, n, Hk]
        width = max(len(ids) for item in items for ids in item.head_block_ids)
        tables = torch.tensor(
            [[ids + [0] * (width - len(ids)) for ids in item.head_block_ids] for item in items], dtype=torch.int64
        ).view(len(items), num_layers, num_kv_heads, width)
        lens = torch.tensor([item.head_num_tokens for item in items], dtype=torch.int64)
        decoding = all(item.sample and len(item.token_ids) == 1 and not item.observe for item in items)
        if self.native_heads is not None and decoding and len(items) <= min(NATIVE_MAX_ROWS, self.decode_model_max_batch):
            # Decode rows that no eviction observes, as many as the INT4 copy serves for shared
            # decode steps (beyond, the dense model is as fast: 16 rows, 2026-12-02): the native
            # stack, no per-layer torch ops.
            self.num_native_head_steps += 1
            logits = self.native_heads.forward_heads(
                torch.tensor(input_ids, dtype=torch.int64),
                torch.tensor(positions, dtype=torch.int64),
                torch.cat(head_slots, dim=1).contiguous(),  # [L, T, Hk]
                tables.permute(1, 0, 2, 3).contiguous(),  # [L, T, Hk, M]
                lens.view(len(items), num_layers, num_kv_heads).permute(1, 0, 2).contiguous(),
            )
            return self._finish(items, logits, False, {})
        metadata = HeadAttentionMetadata(
            k_pool=self.head_pool[0],
            v_pool=self.head_pool[1],
            k_scale=self.head_pool[2],
            v_scale=self.head_pool[3],
            head_slots=torch.cat(head_slots, dim=1).to(self.device),  # [L, T, Hk]
            block_tables=tables.permute(1, 0, 2, 3).contiguous().to(self.device),  # [L, B, Hk, M]
            head_lens=lens.view(len(items), num_layers, num_kv_heads).permute(1, 0, 2).contiguous().to(self.device),
            query_start_loc=query_start_loc,
            observe=[(i, self.eviction.window) for i, item in enumerate(items) if item.observe],
        )
        caches: list[KVLayer] = [self.head_pool] * num_layers  # the model reads `metadata`, not these
        logits = self.model.forward(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            caches,
            metadata,
            torch.tensor(logits_rows, dtype=torch.int64, device=self.device),
        )
        result = self._finish(items, logits, False, {})
        for index, layer_scores in metadata.scores.items():
            item = items[index]
            observed = self._observed.pop(item.request_id, None)
            if item.request_id in result.failed:
                continue
            if observed is not None:  # earlier steps of this observation window
                layer_scores = [_add_padded(a, b) for a, b in zip(observed, layer_scores, strict=True)]
            if not item.evict:
                self._observed[item.request_id] = layer_scores
                continue
            result.kept_tokens[item.request_id] = plan_kept(
                layer_scores,
                item.kv_compression_rate or 1.0,
                self.eviction,
                head_lens=item.head_num_tokens,
                num_seen=item.start_position + len(item.token_ids),
            )
        return result

    def _copy_prefix_into_heads(self, item: ScheduledRequest) -> None:
        """A compressed request's cached prompt prefix, from the shared cache into its own head
        blocks (`ScheduledRequest.prefix_src_slots`): the same bytes, as both hold one dtype
        (`head_pool_dtype`), FP8 scales included."""
        assert self.head_pool is not None
        k_pool, v_pool, k_scale, v_scale = self.head_pool
        num_kv_heads = self.kv_spec.num_kv_heads
        src = torch.tensor(item.prefix_src_slots, dtype=torch.int64, device=self.device)  # [n]
        dst = torch.tensor(item.prefix_dst_head_slots, dtype=torch.int64, device=self.device)  # [L * Hk, n]
        target_layers = self.kv_caches[: self.model.config.num_hidden_layers]
        for layer, (k_cache, v_cache, k_cache_scale, v_cache_scale) in enumerate(target_layers):
            layer_dst = dst[layer * num_kv_heads : (layer + 1) * num_kv_heads].reshape(-1)  # [Hk * n]
            for cache, pool in ((k_cache, k_pool), (v_cache, v_pool)):
                if cache.dtype != pool.dtype:
                    raise RuntimeError(f"prefix copy from a {cache.dtype} cache into a {pool.dtype} head pool")
                width = cache.shape[-1] * cache.element_size()
                rows = cache.view(torch.uint8).view(-1, num_kv_heads, width).index_select(0, src)  # [n, Hk, B]
                pool.view(torch.uint8).view(-1, width).index_copy_(0, layer_dst, rows.transpose(0, 1).reshape(-1, width))
            for cache_scale, pool_scale in ((k_cache_scale, k_scale), (v_cache_scale, v_scale)):
                if cache_scale is not None and pool_scale is not None:
                    scales = cache_scale.view(-1, num_kv_heads).index_select(0, src)  # [n, Hk]
                    pool_scale.view(-1).index_copy_(0, layer_dst, scales.transpose(0, 1).reshape(-1))

    def _execute_shared(self, items: list[ScheduledRequest]) -> RunnerResult:
        draft_probs: dict[str, torch.Tensor] = {}
        if self.draft is not None and any(item.num_draft_slots for item in items):
            items, draft_probs = self._propose(items)
        input_ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        lora_names = {item.lora_name for item in items if item.lora_name is not None}
        slot_of = self.lora.slots_for_step(lora_names) if self.lora is not None and lora_names else {}
        token_slots: list[int] = []
        for item in items:
            n = len(item.token_ids)
            if slot_of:
                token_slots.extend([slot_of[item.lora_name] if item.lora_name else -1] * n)
            input_ids.extend(item.token_ids)
            positions.extend(range(item.start_position, item.start_position + n))
            if item.sample:  # the last token's row, and one per draft token before it
                logits_rows.extend(range(len(input_ids) - 1 - item.num_draft_tokens, len(input_ids)))
        wants_hidden = self.draft is not None and self.draft.wants_hidden
        hidden_layers = self.draft.hidden_layers if self.draft is not None else ()
        # Decode steps (each request computes its last token, and its drafts if it speculates)
        # go to the decode model: the native stack where it applies, else (without drafts) the
        # compiled graph, else eager.
        decoding = all(item.sample and len(item.token_ids) == 1 + item.num_draft_tokens for item in items)
        small = decoding and len(items) <= self.decode_model_max_batch
        if small and self.native is not None and not slot_of and len(input_ids) <= NATIVE_MAX_ROWS:
            self.num_decode_model_steps += 1
            self.num_native_steps += 1
            step = NativeStep.build(
                [item.token_ids for item in items],
                [item.start_position for item in items],
                [item.block_ids for item in items],
                self.block_size,
            )
            output = self.native.forward(
                step,
                torch.tensor(logits_rows, dtype=torch.int64),
                return_hidden=wants_hidden,
                hidden_layers=hidden_layers,
            )
            return self._finish(items, output, wants_hidden, draft_probs)
        metadata = build_attention_metadata(
            [item.block_ids for item in items],
            [len(item.token_ids) for item in items],
            [item.start_position + len(item.token_ids) for item in items],
            self.block_size,
            self.kv_spec.num_kv_heads,
            self.device,
        )
        lora_step = (
            LoRAStep(self.lora.slots, torch.tensor(token_slots, device=self.device))
            if slot_of and self.lora
            else None
        )
        forward = self.model.forward
        # A hybrid's INT4 copy is for the native stack's small steps; a LoRA-free decode step that
        # reaches here has too many rows for that stack (drafts) and runs faster on the dense model.
        dense_is_faster = self.native is not None and not slot_of and self.decode_model is not self.model
        if small and not dense_is_faster:
            forward = self.decode_model.forward
            self.num_decode_model_steps += 1
            if self._decode_forward is not None and lora_step is None and not metadata.prefills:
                forward = self._decode_forward
                self.num_compiled_steps += 1
        output = forward(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            self.kv_caches,
            metadata,
            torch.tensor(logits_rows, dtype=torch.int64, device=self.device),
            lora=lora_step,
            return_hidden=wants_hidden,
            hidden_layers=hidden_layers,
        )
        return self._finish(items, output, wants_hidden, draft_probs)

    def _finish(
        self, items: list[ScheduledRequest], output: Any, wants_hidden: bool, draft_probs: dict[str, torch.Tensor]
    ) -> RunnerResult:
        """Sample (and verify drafts) from a forward's output; hand the draft head its states."""
        logits, hidden = output if wants_hidden else (output, None)
        sampling_items = [item for item in items if item.sample]
        result = self.sample(logits, sampling_items, draft_probs)
        if hidden is not None:
            self._record_states(items, hidden, result)
        return result

    def _record_states(self, items: list[ScheduledRequest], hidden: torch.Tensor, result: RunnerResult) -> None:
        """Hand the draft head the target's states [T, hidden] of the positions each request
        keeps: its own tokens and its accepted drafts (none of a failed request)."""
        assert self.draft is not None
        hidden = self.draft.prepare_states(hidden)  # once for the step's rows
        offset = 0
        for item in items:
            num_rows = len(item.token_ids)
            num_kept = num_rows
            if item.sample:
                tokens = result.sampled_token_ids.get(item.request_id)
                num_kept = num_rows - item.num_draft_tokens + len(tokens) - 1 if tokens else 0
            if num_kept > 0 and item.request_id not in result.failed:
                self.draft.record(item.request_id, item.start_position, hidden[offset : offset + num_kept])
            offset += num_rows

    @property
    def compiles_decode(self) -> bool:
        return self._decode_forward is not None

    @torch.inference_mode()
    def warmup_decode(self, batch_sizes: tuple[int, ...] = (1, 2)) -> None:
        """Compile the decode graph before the first request (batch 1 and batch >= 2 are separate
        graphs: torch specialises sizes 0 and 1). Writes one dummy token into block 0, which holds
        no request's KV before the engine starts. On any compile error, decode stays eager."""
        if self._decode_forward is None:
            return
        started = time.perf_counter()
        try:
            for batch in batch_sizes:
                metadata = build_attention_metadata(
                    [[0, 0]] * batch,
                    [1] * batch,
                    [2] * batch,
                    self.block_size,
                    self.kv_spec.num_kv_heads,
                    self.device,
                )
                self._decode_forward(
                    torch.zeros(batch, dtype=torch.int64, device=self.device),
                    torch.ones(batch, dtype=torch.int64, device=self.device),
                    self.kv_caches,
                    metadata,
                    torch.arange(batch, dtype=torch.int64, device=self.device),
                    return_hidden=self.draft is not None and self.draft.wants_hidden,
                    hidden_layers=self.draft.hidden_layers if self.draft is not None else (),
                )
        except Exception as exc:  # noqa: BLE001 - any backend failure means: stay eager
            logger.warning(
                "decode compilation failed; decode steps run eagerly",
                extra={"error": f"{type(exc).__name__}: {exc}"[:500]},
            )
            self._decode_forward = None
            return
        logger.info("decode graph compiled", extra={"seconds": round(time.perf_counter() - started, 1)})

    def _propose(
        self, items: list[ScheduledRequest]
    ) -> tuple[list[ScheduledRequest], dict[str, torch.Tensor]]:
        """The draft model's drafts appended to the items that have draft slots, and the draft
        distributions of sampled requests (for rejection sampling)."""
        assert self.draft is not None
        proposing = [item for item in items if item.num_draft_slots]
        started = time.perf_counter()
        proposals = self.draft.propose(proposing, self._generator_for)
        self.draft_wall_s += time.perf_counter() - started
        filled, draft_probs = [], {}
        for item in items:
            if not item.num_draft_slots:
                filled.append(item)
                continue
            tokens, probs = proposals[item.request_id]
            if probs is not None:
                draft_probs[item.request_id] = probs
            filled.append(
                dataclasses.replace(
                    item, token_ids=item.token_ids + tokens, draft_token_ids=tokens, num_draft_slots=0
                )
            )
        return filled, draft_probs

    def sample(
        self,
        logits: torch.Tensor,
        items: list[ScheduledRequest],
        draft_probs: dict[str, torch.Tensor] | None = None,
    ) -> RunnerResult:
        """logits: [R, V] float32, `1 + num_draft_tokens` rows per item (in order). An item with a
        non-finite logit in any of its rows (an adapter's extreme weights) fails its request;
        sampling that raises for the batch is redone item by item, so a request whose
        parameters break it fails alone. Items with drafts are verified (`_verify`)."""
        if not items:
            return RunnerResult({})
        # A row with a NaN or an infinity sums to one (so does one whose sum overflows: logits
        # near 1e34, as broken); one reduction, about 10x cheaper than isfinite().all().
        finite_rows = torch.isfinite(logits.sum(dim=-1)).tolist()  # [R]
        starts, failed = [], {}
        row = 0
        for item in items:
            starts.append(row)
            span = 1 + item.num_draft_tokens
            if not all(finite_rows[row : row + span]):
                failed[item.request_id] = NON_FINITE_LOGITS
            row += span
        if failed:
            logger.error("non-finite logits; failing those requests", extra={"request_ids": sorted(failed)})
        for item in items:
            if item.sampling_params.structured is not None and item.request_id not in failed:
                try:
                    matcher = self._matcher_for(item)
                except Exception:
                    logger.exception("grammar matcher failed", extra={"request_id": item.request_id})
                    failed[item.request_id] = GRAMMAR_FAILED
                    continue
                if matcher is not None and matcher.error is not None:
                    logger.error("grammar matcher in error", extra={"request_id": item.request_id, "error": matcher.error})
                    failed[item.request_id] = GRAMMAR_FAILED
        plain = [(item, start) for item, start in zip(items, starts, strict=True) if item.request_id not in failed]
        drafted = [(item, start) for item, start in plain if item.num_draft_tokens]
        plain = [(item, start) for item, start in plain if not item.num_draft_tokens]
        result = RunnerResult({})
        if plain:
            rows = torch.tensor([start for _, start in plain], dtype=torch.int64, device=logits.device)
            plain_logits = logits.index_select(0, rows) if len(plain) < logits.shape[0] else logits
            plain_items = [item for item, _ in plain]
            try:
                result.merge(self._sample_rows(plain_logits, plain_items))
            except Exception:
                logger.warning("batched sampling failed; sampling row by row", exc_info=True)
                for index, item in enumerate(plain_items):
                    try:
                        result.merge(self._sample_rows(plain_logits[index : index + 1], [item]))
                    except Exception:
                        result.merge(self._failed_alone(item))
        for item, start in drafted:
            try:
                rows = logits[start : start + 1 + item.num_draft_tokens]
                result.merge(self._verify(rows, item, (draft_probs or {}).get(item.request_id)))
            except Exception:
                result.merge(self._failed_alone(item))
        result.failed.update(failed)
        self._advance_matchers(items, result)
        return result

    def _matcher_for(self, item: ScheduledRequest) -> GrammarMatcher | None:
        """The request's grammar matcher (made at its first sampled token, fed the tokens it
        already has: a request whose first token another engine sampled, or one whose runner
        state is new), or None without a constraint."""
        spec = item.sampling_params.structured
        if spec is None or self.grammars is None:
            return None
        matcher = self._matchers.get(item.request_id)
        if matcher is None:
            matcher = self.grammars.matcher(spec)
            if item.output_token_ids and not matcher.accept(list(item.output_token_ids)):
                raise RuntimeError(f"the grammar refused the request's earlier tokens ({matcher.error})")
            self._matchers[item.request_id] = matcher
        return matcher

    def _advance_matchers(self, items: list[ScheduledRequest], result: RunnerResult) -> None:
        """Feed each constrained request's new tokens to its matcher; a refusal (a library fault:
        they were sampled under its masks) fails the request."""
        for item in items:
            matcher = self._matchers.get(item.request_id)
            tokens = result.sampled_token_ids.get(item.request_id)
            if matcher is None or not tokens or matcher.accept(tokens):
                continue
            logger.error(
                "grammar refused a sampled token", extra={"request_id": item.request_id, "error": matcher.error}
            )
            del result.sampled_token_ids[item.request_id]
            result.logprobs.pop(item.request_id, None)
            result.failed[item.request_id] = GRAMMAR_FAILED

    def _constrain_rows(self, logits: torch.Tensor, items: list[ScheduledRequest]) -> torch.Tensor:
        """logits: [B, V], one row per item; the rows of constrained items masked to what their
        grammars allow next (in place, or in a copy when one of them also wants logprobs, which are
        the model's own)."""
        if self.grammars is None:
            return logits
        pairs = [(row, self._matcher_for(item)) for row, item in enumerate(items)]
        constrained = [(row, matcher) for row, matcher in pairs if matcher is not None]
        if not constrained:
            return logits
        rows = [row for row, _ in constrained]
        started = time.perf_counter()
        if any(items[row].sampling_params.logprobs is not None for row in rows):
            logits = logits.clone()
        bitmask = self.grammars.fill_bitmasks([matcher for _, matcher in constrained])  # [n, W]
        if len(rows) == logits.shape[0]:
            apply_token_bitmask_(logits, bitmask)
        else:
            index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            logits.index_copy_(0, index, apply_token_bitmask_(logits.index_select(0, index), bitmask))
        self.grammar_mask_s += time.perf_counter() - started
        return logits

    def _verify(
        self, logits: torch.Tensor, item: ScheduledRequest, draft_probs: torch.Tensor | None = None
    ) -> RunnerResult:
        """logits: [k + 1, V] finite float32 at the request's last token and its k drafts. Greedy:
        the drafts the target's argmax agrees with, then the argmax after them (identical to
        decoding one token at a time). Random: rejection sampling (`verify_drafts`) against the
        draft model's distributions `draft_probs` [k, V], or a one-hot proposal when None."""
        params, drafts = item.sampling_params, item.draft_token_ids
        num_proposed = len(drafts)
        raw_logits = logits
        matcher = self._matcher_for(item)
        if matcher is not None:  # drafts the grammar refuses cannot be accepted: verify up to them
            started = time.perf_counter()
            bitmask, num_valid = matcher.draft_bitmasks(drafts)
            drafts = drafts[:num_valid]
            logits = apply_token_bitmask_(logits[: num_valid + 1].clone(), bitmask)
            self.grammar_mask_s += time.perf_counter() - started
            if draft_probs is not None:
                draft_probs = draft_probs[:num_valid]
        if params.greedy:
            targets = logits.argmax(dim=-1).tolist()  # [k + 1]
            num_accepted = 0
            while num_accepted < len(drafts) and drafts[num_accepted] == targets[num_accepted]:
                num_accepted += 1
            tokens = targets[: num_accepted + 1]
        else:
            scaled = logits / params.temperature
            if params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0:
                num_rows = scaled.shape[0]
                scaled = filter_logits(
                    scaled,
                    torch.full((num_rows,), params.top_k, device=logits.device),
                    torch.full((num_rows,), params.top_p, device=logits.device),
                    torch.full((num_rows,), params.min_p, device=logits.device),
                )
            tokens = verify_drafts(scaled.softmax(dim=-1), drafts, self._generator_for(item), draft_probs)
        if self.draft is not None:
            self.draft.accepted(item.request_id, item.start_position, num_proposed, len(tokens) - 1)
        result = RunnerResult({item.request_id: tokens})
        if params.logprobs is not None:
            chosen = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
            chosen_lp, top_ids, top_vals = top_logprobs(raw_logits[: len(tokens)], chosen, params.logprobs)
            entries = []
            for i, token_id in enumerate(tokens):
                entry = {token_id: float(chosen_lp[i])}
                for top_id, value in zip(top_ids[i].tolist(), top_vals[i].tolist(), strict=True):
                    entry.setdefault(top_id, value)
                entries.append(entry)
            result.logprobs[item.request_id] = entries
        return result

    def _sample_rows(self, logits: torch.Tensor, items: list[ScheduledRequest]) -> RunnerResult:
        """logits: [B, V] finite float32, one row per item (in order)."""
        if not items:
            return RunnerResult({})
        raw_logits = logits
        logits = self._constrain_rows(logits, items)
        params = [item.sampling_params for item in items]
        if any(p.has_penalties for p in params):
            counts = torch.zeros_like(logits)
            for row, item in enumerate(items):
                if item.output_token_ids and item.sampling_params.has_penalties:
                    ids = torch.tensor(item.output_token_ids, dtype=torch.int64, device=logits.device)
                    counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
            logits = apply_penalties(
                logits,
                counts,
                torch.tensor([p.presence_penalty for p in params], device=logits.device),
                torch.tensor([p.frequency_penalty for p in params], device=logits.device),
            )
        chosen = logits.argmax(dim=-1)
        random_rows = [row for row, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, dtype=torch.int64, device=logits.device)
            sub = logits.index_select(0, rows) / torch.tensor(
                [params[r].temperature for r in random_rows], device=logits.device
            ).unsqueeze(1)
            if any(
                params[r].top_k > 0 or params[r].top_p < 1.0 or params[r].min_p > 0.0 for r in random_rows
            ):
                sub = filter_logits(
                    sub,
                    torch.tensor([params[r].top_k for r in random_rows], device=logits.device),
                    torch.tensor([params[r].top_p for r in random_rows], device=logits.device),
                    torch.tensor([params[r].min_p for r in random_rows], device=logits.device),
                )
            generators = [self._generator_for(items[r]) for r in random_rows]
            chosen[rows] = sample_rows(sub.softmax(dim=-1), generators)

        chosen_list = chosen.tolist()
        result = RunnerResult({item.request_id: [chosen_list[row]] for row, item in enumerate(items)})
        logprob_rows = [row for row, p in enumerate(params) if p.logprobs is not None]
        if logprob_rows:
            num_top = max(params[r].logprobs or 0 for r in logprob_rows)
            rows = torch.tensor(logprob_rows, dtype=torch.int64, device=logits.device)
            chosen_lp, top_ids, top_vals = top_logprobs(
                raw_logits.index_select(0, rows), chosen[rows], num_top
            )
            for i, row in enumerate(logprob_rows):
                n = params[row].logprobs or 0
                entry = {chosen_list[row]: float(chosen_lp[i])}
                for token_id, value in zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist(), strict=True):
                    entry.setdefault(token_id, value)
                result.logprobs[items[row].request_id] = [entry]
        return result

    def _generator_for(self, item: ScheduledRequest) -> torch.Generator | None:
        seed = item.sampling_params.seed
        if seed is None:
            return self._default_generator
        generator = self._generators.get(item.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self._generators[item.request_id] = generator
        return generator
