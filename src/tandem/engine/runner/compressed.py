"""The per-head KV layout's tensors and forward (KV compression, `Request.compressed`).

A compressed request's KV lives in the head-block pool, paged per (layer, KV head)
(`kernels.head_attention`), of the shared cache's type (`head_pool_dtype`). Its rows run in a
forward of their own over that pool. For requests whose step is observed (`ScheduledRequest.
observe`) the attention their rows gave each head's tokens is summed over the observation window;
on the evicting step the runner plans what each head keeps (`RunnerResult.kept_tokens`), which the
scheduler applies (`head_kv_cache.EvictionMoves`, copied here before the next step's writes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.engine.models.interface import CausalLM, KVLayer
from tandem.engine.models.native import NativeLlama
from tandem.engine.runner.forward_path import ForwardPath, StepShape
from tandem.engine.runner.kv_tensors import KVCacheSpec
from tandem.engine.sched.step import HeadStep, RunnerResult, ScheduledRequest
from tandem.kernels.head_attention import HeadAttentionMetadata, HeadPool, head_pool_dtype, move_head_slots
from tandem.kernels.kv_eviction import EvictionPolicy, plan_kept

# Sample (and verify) a forward's logits [B, V] for the step's items.
Finish = Callable[[list[ScheduledRequest], torch.Tensor], RunnerResult]


def _head(item: ScheduledRequest) -> HeadStep:
    assert item.head is not None, "a shared-layout request among compressed ones"
    return item.head


def _add_padded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # [Hk, Ta] + [Hk, Tb]
    """Sum of two score tensors over the same heads' tokens, the shorter padded with zeros at its
    end (a head's tokens keep their indices until the next eviction; new ones are appended)."""
    width = max(a.shape[1], b.shape[1])
    return F.pad(a, (0, width - a.shape[1])) + F.pad(b, (0, width - b.shape[1]))


def allocate_head_pool(
    num_head_blocks: int, block_size: int, head_dim: int, cache_dtype: torch.dtype, compute_dtype: torch.dtype,
    device: torch.device,
) -> HeadPool:  # fmt: skip
    """(k, v) [N, bs, D] of `head_pool_dtype`, and for an FP8 pool their per-vector scales
    (k, v) [N, bs] float16 (else None)."""
    pool_dtype = head_pool_dtype(cache_dtype, compute_dtype)
    shape = (num_head_blocks, block_size, head_dim)
    fp8 = pool_dtype == torch.float8_e4m3fn
    return (
        torch.zeros(shape, dtype=pool_dtype, device=device),
        torch.zeros(shape, dtype=pool_dtype, device=device),
        torch.ones(shape[:2], dtype=torch.float16, device=device) if fp8 else None,
        torch.ones(shape[:2], dtype=torch.float16, device=device) if fp8 else None,
    )


@dataclass
class _Rows:
    """A step's rows as the head-pool forward reads them."""

    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    logits_rows: list[int]  # [B'] the rows sampled (each sampling request's last)
    query_start_loc: list[int]  # [B + 1]
    head_slots: list[torch.Tensor]  # per request [L, n, Hk]: where each layer writes its rows' K/V
    layer_tables: torch.Tensor  # [L, B, Hk, M] head block tables
    layer_lens: torch.Tensor  # [L, B, Hk] head token counts once this step's rows are written


class HeadPoolForward:
    """The head-block pool, and forwards of compressed requests' rows over it."""

    def __init__(
        self, pool: HeadPool, model: CausalLM, native_heads: NativeLlama | None, eviction: EvictionPolicy,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.pool = pool
        self.model = model
        self.native_heads = native_heads  # the native stack over the pool (small decode steps)
        self.eviction = eviction
        self.device = device
        cfg = model.config
        self.num_layers, self.num_kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
        # Requests inside a decode observation window: per layer [Hk, T] the squared attention
        # their observed rows gave each head's tokens so far.
        self._observed: dict[str, list[torch.Tensor]] = {}
        self.num_native_steps = 0

    @classmethod
    def build(
        cls, num_head_blocks: int, kv_spec: KVCacheSpec, model: CausalLM, decode_model: CausalLM,
        native: NativeLlama | None, eviction: EvictionPolicy | None, device: torch.device,
    ) -> HeadPoolForward:  # fmt: skip
        """A pool of `num_head_blocks` and its forward: the native stack over it too, where the
        runner's native stack (`native`, over `decode_model`) runs shared steps."""
        pool = allocate_head_pool(
            num_head_blocks, kv_spec.block_size, kv_spec.head_dim, kv_spec.dtype, model.norm.dtype, device
        )
        native_heads = None
        if native is not None:
            native_heads = NativeLlama.build(
                decode_model, [pool] * model.config.num_hidden_layers, kv_spec.block_size
            )
        return cls(pool, model, native_heads, eviction or EvictionPolicy(), device)

    def forget(self, request_id: str) -> None:
        self._observed.pop(request_id, None)

    def move(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Evictions decided after the last step, before anything is written (sources read first)."""
        k_pool, v_pool, k_scale, v_scale = self.pool
        move_head_slots(
            k_pool,
            v_pool,
            torch.tensor(src_slots, dtype=torch.int64, device=self.device),
            torch.tensor(dst_slots, dtype=torch.int64, device=self.device),
            k_scale,
            v_scale,
        )

    def shape_of(self, items: list[ScheduledRequest]) -> StepShape:
        decoding = all(item.sample and len(item.token_ids) == 1 and not _head(item).observe for item in items)
        return StepShape(len(items), sum(len(i.token_ids) for i in items), decoding, compressed=True)

    def execute(
        self, items: list[ScheduledRequest], path: ForwardPath, shared_caches: list[KVLayer], finish: Finish
    ) -> RunnerResult:
        """One forward over the items' rows (`path`: the native stack or the model), then
        `finish`, then for observed requests their scores and (evicting) the tokens each head keeps."""
        heads = [_head(item) for item in items]
        for head in heads:
            if head.prefix_src_slots:
                self._copy_prefix_into_heads(head, shared_caches)
        rows = self._rows(items, heads)
        if path is ForwardPath.NATIVE_HEADS:
            assert self.native_heads is not None
            self.num_native_steps += 1
            logits = self.native_heads.forward_heads(
                torch.tensor(rows.input_ids, dtype=torch.int64),
                torch.tensor(rows.positions, dtype=torch.int64),
                torch.cat(rows.head_slots, dim=1).contiguous(),  # [L, T, Hk]
                rows.layer_tables,
                rows.layer_lens,
            )
            return finish(items, logits)
        k_pool, v_pool, k_scale, v_scale = self.pool
        metadata = HeadAttentionMetadata(
            k_pool=k_pool,
            v_pool=v_pool,
            k_scale=k_scale,
            v_scale=v_scale,
            head_slots=torch.cat(rows.head_slots, dim=1).to(self.device),  # [L, T, Hk]
            block_tables=rows.layer_tables.to(self.device),
            head_lens=rows.layer_lens.to(self.device),
            query_start_loc=rows.query_start_loc,
            observe=[(i, self.eviction.window) for i, head in enumerate(heads) if head.observe],
        )
        caches: list[KVLayer] = [self.pool] * self.num_layers  # the model reads `metadata`, not these
        logits = self.model.forward(
            torch.tensor(rows.input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(rows.positions, dtype=torch.int64, device=self.device),
            caches,
            metadata,
            torch.tensor(rows.logits_rows, dtype=torch.int64, device=self.device),
        )
        result = finish(items, logits)
        self._plan_evictions(items, metadata, result)
        return result

    def _rows(self, items: list[ScheduledRequest], heads: list[HeadStep]) -> _Rows:
        input_ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        query_start_loc = [0]
        head_slots: list[torch.Tensor] = []
        for item, head in zip(items, heads, strict=True):
            n = len(item.token_ids)
            input_ids.extend(item.token_ids)
            positions.extend(range(item.start_position, item.start_position + n))
            if item.sample:
                logits_rows.append(len(input_ids) - 1)
            query_start_loc.append(len(input_ids))
            slots = torch.tensor(head.slots, dtype=torch.int64).view(self.num_layers, self.num_kv_heads, n)
            head_slots.append(slots.transpose(1, 2))  # [L, n, Hk]
        width = max(len(ids) for head in heads for ids in head.block_ids)
        tables = torch.tensor(
            [[ids + [0] * (width - len(ids)) for ids in head.block_ids] for head in heads], dtype=torch.int64
        ).view(len(items), self.num_layers, self.num_kv_heads, width)
        lens = torch.tensor([head.num_tokens for head in heads], dtype=torch.int64)
        return _Rows(
            input_ids, positions, logits_rows, query_start_loc, head_slots,
            layer_tables=tables.permute(1, 0, 2, 3).contiguous(),
            layer_lens=lens.view(len(items), self.num_layers, self.num_kv_heads).permute(1, 0, 2).contiguous(),
        )  # fmt: skip

    def _plan_evictions(
        self, items: list[ScheduledRequest], metadata: HeadAttentionMetadata, result: RunnerResult
    ) -> None:
        """Add the observed rows' scores to each request's window; on its evicting step, what each
        head keeps (`RunnerResult.kept_tokens`)."""
        for index, layer_scores in metadata.scores.items():
            item = items[index]
            observed = self._observed.pop(item.request_id, None)
            if item.request_id in result.failed:
                continue
            if observed is not None:  # earlier steps of this observation window
                layer_scores = [_add_padded(a, b) for a, b in zip(observed, layer_scores, strict=True)]
            head = _head(item)
            if not head.evict:
                self._observed[item.request_id] = layer_scores
                continue
            result.kept_tokens[item.request_id] = plan_kept(
                layer_scores,
                head.kv_compression_rate or 1.0,
                self.eviction,
                head_lens=head.num_tokens,
                num_seen=item.start_position + len(item.token_ids),
            )

    def _copy_prefix_into_heads(self, head: HeadStep, shared_caches: list[KVLayer]) -> None:
        """A compressed request's cached prompt prefix, from the shared cache into its own head
        blocks (`HeadStep.prefix_src_slots`): the same bytes, as both hold one dtype
        (`head_pool_dtype`), FP8 scales included."""
        k_pool, v_pool, k_scale, v_scale = self.pool
        num_kv_heads = self.num_kv_heads
        src = torch.tensor(head.prefix_src_slots, dtype=torch.int64, device=self.device)  # [n]
        dst = torch.tensor(head.prefix_dst_slots, dtype=torch.int64, device=self.device)  # [L * Hk, n]
        for layer, (k_cache, v_cache, k_cache_scale, v_cache_scale) in enumerate(
            shared_caches[: self.num_layers]
        ):
            layer_dst = dst[layer * num_kv_heads : (layer + 1) * num_kv_heads].reshape(-1)  # [Hk * n]
            for cache, pool in ((k_cache, k_pool), (v_cache, v_pool)):
                if cache.dtype != pool.dtype:
                    raise RuntimeError(
                        f"prefix copy from a {cache.dtype} cache into a {pool.dtype} head pool"
                    )
                width = cache.shape[-1] * cache.element_size()
                rows = (
                    cache.view(torch.uint8).view(-1, num_kv_heads, width).index_select(0, src)
                )  # [n, Hk, B]
                pool.view(torch.uint8).view(-1, width).index_copy_(
                    0, layer_dst, rows.transpose(0, 1).reshape(-1, width)
                )
            for cache_scale, pool_scale in ((k_cache_scale, k_scale), (v_cache_scale, v_scale)):
                if cache_scale is not None and pool_scale is not None:
                    scales = cache_scale.view(-1, num_kv_heads).index_select(0, src)  # [n, Hk]
                    pool_scale.view(-1).index_copy_(0, layer_dst, scales.transpose(0, 1).reshape(-1))
