"""The paged KV cache's tensors: their layout, allocation, and pages in and out (hand-over).

One layer's cache is `KVLayer` = (k, v, k_scale, v_scale), k and v [num_blocks, block_size, Hk, D]
of the cache's dtype; the scales [num_blocks, block_size, Hk] float16 for an FP8 cache, else None.
With `shared_kv` (multi-head latent attention) v is k and v_scale is k_scale: one tensor, stored
and paged once. A page is one block's first `count` tokens of every layer, as bytes: per layer K
then V (K only when shared; the stored codes for FP8), then, for FP8, per layer the K then V
scales (K's only when shared).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

from tandem.engine.models.interface import KVLayer
from tandem.kernels import huge_pages
from tandem.kernels.fp8 import quantize_fp8

# What a KV page may be exported as, by name (`kv_transfer.KVTransfer.cache_dtype`).
PAGE_DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}  # fmt: skip


@dataclass
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # element type of the cache (torch.float8_e4m3fn for FP8)
    shared_kv: bool = False  # one vector per token is both K and V (`LayerKV.shared_kv`)

    @property
    def is_fp8(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block (K alone when shared), including FP8's
        per-(token, head) float16 scales."""
        return self.num_layers * self.block_size * self.num_kv_heads * self.bytes_per_token_vector

    @property
    def bytes_per_token_vector(self) -> int:
        """What one token of one layer and KV head takes: K and V (or the shared vector), with
        FP8's float16 scales."""
        element = torch.empty((), dtype=self.dtype).element_size()
        per_vector = self.head_dim * element + (2 if self.is_fp8 else 0)
        return (1 if self.shared_kv else 2) * per_vector


def allocate_kv_caches(kv_spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[KVLayer]:
    """Per layer (K, V, K scales, V scales): [num_blocks, block_size, Hk, D] each (scales
    [num_blocks, block_size, Hk] float16 for FP8, else None), zeroed. On a CPU in huge pages
    (`huge_pages`): a step reads its requests' blocks scattered over the pool."""
    shape = (num_blocks, kv_spec.block_size, kv_spec.num_kv_heads, kv_spec.head_dim)

    def layer_cache() -> KVLayer:
        k = huge_pages.zeros(shape, kv_spec.dtype, device)
        v = k if kv_spec.shared_kv else huge_pages.zeros(shape, kv_spec.dtype, device)
        if not kv_spec.is_fp8:
            return (k, v, None, None)
        k_scale = torch.zeros(shape[:3], dtype=torch.float16, device=device)
        return (k, v, k_scale, k_scale if kv_spec.shared_kv else torch.zeros_like(k_scale))

    return [layer_cache() for _ in range(kv_spec.num_layers)]


def export_pages(
    kv_caches: list[KVLayer], block_size: int, block_ids: list[int], num_tokens: int, dtype: torch.dtype
) -> list[bytes]:
    """The KV of the first `num_tokens` tokens held in `block_ids`, one page per block, in
    `dtype` (the cache's own dtype, or FP8 from a wider cache: quantised as `write_kv` does)."""
    pages = []
    for index, block_id in enumerate(block_ids):
        count = min(block_size, num_tokens - index * block_size)
        if count <= 0:
            break
        keys_values: list[torch.Tensor] = []
        scales: list[torch.Tensor] = []
        for k_cache, v_cache, k_scale, v_scale in kv_caches:
            for cache, scale in _stored((k_cache, k_scale), (v_cache, v_scale)):
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
        pages.append(torch.cat(parts).cpu().numpy().tobytes())
    return pages


def import_pages(
    kv_caches: list[KVLayer], kv_spec: KVCacheSpec, block_ids: list[int], pages: list[tuple[int, bytes]]
) -> None:
    """Write pages (token count, bytes in the cache's dtype) into `block_ids`, in order. Raises
    `ValueError` for a page whose size does not match its token count."""
    num_kv_heads, head_dim = kv_spec.num_kv_heads, kv_spec.head_dim
    element = torch.empty((), dtype=kv_spec.dtype).element_size()
    for block_id, (count, data) in zip(block_ids, pages, strict=False):
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        vector_bytes = count * num_kv_heads * head_dim * element
        scale_bytes = count * num_kv_heads * 2
        offset = 0
        for k_cache, v_cache, _, _ in kv_caches:
            for cache in _stored(k_cache, v_cache):
                chunk = raw[offset : offset + vector_bytes].view(cache.dtype if element > 1 else torch.uint8)
                cache[block_id, :count].view(torch.uint8 if element == 1 else cache.dtype).copy_(
                    chunk.view(count, num_kv_heads, head_dim)
                )
                offset += vector_bytes
        if kv_spec.is_fp8:
            for _, _, k_scale, v_scale in kv_caches:
                for scale in _stored(k_scale, v_scale):
                    assert scale is not None
                    scale[block_id, :count].copy_(
                        raw[offset : offset + scale_bytes].view(torch.float16).view(count, num_kv_heads)
                    )
                    offset += scale_bytes
        if offset != len(data):
            raise ValueError(f"a KV page of {count} tokens has {len(data)} bytes, expected {offset}")


T = TypeVar("T")


def _stored(k: T, v: T) -> tuple[T, ...]:
    """The layer's K and V as stored: K alone when V is K (a shared-KV cache)."""
    same = v is k or (isinstance(k, tuple) and isinstance(v, tuple) and v[0] is k[0])
    return (k,) if same else (k, v)
