"""Paged attention over a block-structured KV cache (plain-torch reference).

Cache layout, per layer: `k_cache`, `v_cache`: [num_blocks, block_size, num_kv_heads, head_dim].
Token slot `s` lives at block `s // block_size`, offset `s % block_size`. An FP8 (e4m3) cache adds
`k_scale`, `v_scale`: [num_blocks, block_size, num_kv_heads] float16, one scale per (token, head)
vector: written with the vector, multiplied back in when it is gathered.

Semantics (for each request i with query rows q[qs[i]:qs[i+1]] and context length L_i):
    K_i = k_cache.view(-1, Hk, D)[slots_i[:L_i]]          # slots from the block table
    out[qs[i]:qs[i+1]] = softmax(q_i @ K_i^T * scale + causal_mask) @ V_i
where query row j of request i sits at position L_i - n_i + j (n_i = qs[i+1] - qs[i]) and may
attend keys at positions <= its own. GQA: query head h reads KV head h // (Hq // Hk).

The metadata is built once per step (`attention_metadata.build_attention_metadata`) and reused
by every layer; the FP8 cache's quantisation is `fp8.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels import int4_native
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.fp8 import E4M3_AS_WIDE_FACTOR, e4m3_bits_as, quantize_fp8
from tandem.kernels.triton_support import uses_triton


def finite_kv(
    x: torch.Tensor,  # [T, Hk, D] keys or values about to be written
    cache_dtype: torch.dtype,
) -> torch.Tensor:  # [T, Hk, D] the same, non-finite entries set to 0
    """Keys and values as the cache may hold them: finite, and within `cache_dtype`'s range.

    Why: the cache is shared. Decode attention reads padding keys (the tail of a request's last
    block, block 0 for shorter rows) with probability exactly 0, and 0 * NaN = NaN: one request's
    non-finite KV, left in a block it no longer owns, would poison whoever reads that block next.
    Finite entries are unchanged (clamped only where the cache type is narrower, float16)."""
    out = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    if cache_dtype == torch.float16:
        limit = torch.finfo(torch.float16).max
        out = out.clamp_(-limit, limit)
    return out


def write_kv(
    k: torch.Tensor,  # [T, Hk, D]
    v: torch.Tensor,  # [T, Hk, D]
    k_cache: torch.Tensor,  # [N, bs, Hk, D]
    v_cache: torch.Tensor,  # [N, bs, Hk, D]
    slot_mapping: torch.Tensor,  # [T] int64, flat slot index per token
    k_scale: torch.Tensor | None = None,  # [N, bs, Hk] float16, only for an FP8 cache
    v_scale: torch.Tensor | None = None,
) -> None:
    """k_cache.view(-1, Hk, D)[slot_mapping] = k (and the same for v). An FP8 cache stores each
    (token, head) vector quantised with its own scale (see `quantize_fp8`); a float16 cache holds
    them through `finite_kv` (past float16's range they would be infinities, and attention over
    them NaN), as the native CPU stack writes them. Where Triton runs
    (`triton_support.uses_triton`) one kernel does it (`triton_attention.write_kv_triton`, which
    also skips slots < 0); this body is its reference."""
    if k_cache.dtype == torch.float16:
        shared_input = v is k  # latent attention writes one tensor as both
        k = finite_kv(k, k_cache.dtype)
        v = k if shared_input else finite_kv(v, v_cache.dtype)
    if uses_triton(k.device):
        from tandem.kernels.triton_attention import write_kv_triton

        write_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    write_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def write_kv_reference(
    k: torch.Tensor,  # [T, Hk, D]
    v: torch.Tensor,  # [T, Hk, D]
    k_cache: torch.Tensor,  # [N, bs, Hk, D]
    v_cache: torch.Tensor,  # [N, bs, Hk, D]
    slot_mapping: torch.Tensor,  # [T] int64, flat slot index per token (all >= 0)
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """`write_kv` in plain torch, on any device (the CPU path, and the Triton kernel's reference).
    A shared-KV cache (`v_cache is k_cache`, latent attention: v is k) is written once."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    shared = v_cache is k_cache
    if k_scale is None or v_scale is None:
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        if not shared:
            v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        return
    targets = ((k, k_cache, k_scale),) if shared else ((k, k_cache, k_scale), (v, v_cache, v_scale))
    for values, cache, scales in targets:
        q, scale = quantize_fp8(values)
        # Copied as bytes: CPU torch has no index_copy_ for float8 dtypes.
        cache.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(
            0, slot_mapping, q.view(torch.uint8)
        )
        scales.view(-1, num_kv_heads).index_copy_(0, slot_mapping, scale)


def _gather_unscaled(
    rows: torch.Tensor,  # [N*bs*Hk, D] the cache's row view
    scales: torch.Tensor | None,  # [N*bs*Hk] per-row scales of an FP8 cache
    index: torch.Tensor,  # [n] rows to read
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows as `dtype` and, for FP8, their scales kept apart ([n] float32: value = row * scale), so
    decode attention can apply them to scores and probabilities ([.., L]) instead of K and V."""
    if scales is None:
        return rows.index_select(0, index).to(dtype), None
    gathered = rows.view(torch.uint8).index_select(0, index)  # float8 has no CPU gather
    row_scales = scales.index_select(0, index).to(torch.float32)
    if gathered.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        # they hold value / 2^120 (float16's exponent would underflow); the factor joins the scale
        return e4m3_bits_as(gathered, dtype), row_scales.mul_(E4M3_AS_WIDE_FACTOR)
    return gathered.view(rows.dtype).to(dtype), row_scales


def _gather_rows(
    rows: torch.Tensor,  # [N*bs*Hk, D] the cache's row view
    scales: torch.Tensor | None,  # [N*bs*Hk] per-row scales of an FP8 cache
    index: torch.Tensor,  # [n] rows to read
    dtype: torch.dtype,
) -> torch.Tensor:  # [n, D] in `dtype`, scales applied
    values, row_scales = _gather_unscaled(rows, scales, index, dtype)
    if row_scales is None:
        return values
    return (values.float() * row_scales.unsqueeze(-1)).to(dtype)


def _decode_attention(
    q: torch.Tensor,  # [B, Hk, G, D] one token per request, the GQA group as query rows
    k: tuple[torch.Tensor, torch.Tensor | None],  # [B*Hk*L, D] rows, optional [B*Hk*L] scales
    v: tuple[torch.Tensor, torch.Tensor | None],
    mask: torch.Tensor,  # [B, 1, 1, L] True = valid key
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:  # [B, Hk, G, D]
    """softmax(q K^T * scale (soft-capped), masked) V with per-key scales s_k, s_v folded in:
    (q . k_l s_k[l]) = (q . k_l) s_k[l] and sum_l p_l s_v[l] v_l. Plain matmuls: at one query per
    request they beat CPU flash attention, and the FP8 scales cost an [.., L] multiply each."""
    batch, num_kv_heads, _, head_dim = q.shape
    k_rows, k_scales = k
    v_rows, v_scales = v
    shape = (batch, num_kv_heads, -1, head_dim)
    scores = torch.matmul(q, k_rows.view(shape).transpose(-1, -2))  # [B, Hk, G, L]
    if k_scales is not None:
        scores.mul_(k_scales.view(batch, num_kv_heads, 1, -1))
    scores.mul_(scale)
    if softcap:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    scores.masked_fill_(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)
    if v_scales is not None:
        probs.mul_(v_scales.view(batch, num_kv_heads, 1, -1))
    return torch.matmul(probs, v_rows.view(shape))


_NATIVE_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float16: 3}


def native_paged_attention(
    q: torch.Tensor,  # [R, Hq, D] query rows
    k_cache: torch.Tensor,  # [N, bs, Hk, D] float32, bfloat16, float8_e4m3fn or float16
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [R, max_blocks] int64: each row's request's blocks
    positions: torch.Tensor,  # [R] int64: row r attends keys 0..positions[r] of its table
    scale: float,
    k_scale: torch.Tensor | None = None,  # [N, bs, Hk] float16 for an FP8 cache
    v_scale: torch.Tensor | None = None,
    window: int | None = None,  # row r attends only keys positions[r] - window + 1 .. positions[r]
    softcap: float | None = None,  # scores -> softcap * tanh(score / softcap)
) -> torch.Tensor:  # [R, Hq, D] float32
    """Paged attention of independent rows in one native call (`csrc/decoder_cpu.c`,
    `tandem_paged_attention`): for a decode row the same as `_decode_attention` over the gathered
    keys (its reference), for a row of a short segment the same as that segment's causal
    attention (its keys, this step's included, are already in the cache); without materialising
    gathers: each key and value is read from its block and widened to float32 (times its FP8
    scale) once per GQA group. CPU only."""
    lib = int4_native.load()
    assert lib is not None, "native decode attention needs the native library"
    batch, num_heads, head_dim = q.shape
    q32 = q.float().contiguous()
    out = torch.empty(batch, num_heads, head_dim, dtype=torch.float32)
    tables = block_tables.contiguous()
    lib.tandem_paged_attention(
        q32.data_ptr(), batch, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
        _NATIVE_KV_DTYPES[k_cache.dtype], scale, k_cache.data_ptr(), v_cache.data_ptr(),
        None if k_scale is None else k_scale.data_ptr(), None if v_scale is None else v_scale.data_ptr(),
        positions.contiguous().data_ptr(), tables.data_ptr(), tables.shape[1], window or 0, softcap or 0.0,
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hk, D] this step's keys (already written to the cache)
    v: torch.Tensor,  # [T, Hk, D]
    k_cache: torch.Tensor,  # [N, bs, Hk, D]
    v_cache: torch.Tensor,  # [N, bs, Hk, D]
    metadata: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,  # [N, bs, Hk] for an FP8 cache (dequantised on read)
    v_scale: torch.Tensor | None = None,
    window: int | None = None,  # sliding window: a row at position p attends keys p - window + 1 .. p
    softcap: float | None = None,  # scores -> softcap * tanh(score / softcap) before masking
) -> torch.Tensor:  # [T, Hq, D]
    """Each row's attention over its request's keys (module docstring), for one layer: with a
    `window`, only the last `window` positions (keys before it are never read, so their blocks may
    already be freed); with `softcap`, Gemma 2's capped scores. With `metadata.paged` (where
    Triton runs) one kernel computes every row from the cache
    (`triton_attention.paged_attention_triton`)."""
    if metadata.paged is not None:
        return _triton_paged_attention(
            q, k, v, k_cache, v_cache, metadata, scale, k_scale, v_scale, window, softcap
        )
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k_rows = k_cache.view(-1, head_dim)
    v_rows = v_cache.view(-1, head_dim)
    k_scale_rows = None if k_scale is None else k_scale.view(-1)
    v_scale_rows = None if v_scale is None else v_scale.view(-1)
    out = torch.empty_like(q)

    # native_rows is set only for small CPU steps where the library loaded (build_attention_metadata)
    native = metadata.native_rows is not None and k_cache.dtype in _NATIVE_KV_DTYPES
    if native:
        assert metadata.native_rows is not None and metadata.native_block_tables is not None
        assert metadata.native_positions is not None
        o_native = native_paged_attention(
            q.index_select(0, metadata.native_rows), k_cache, v_cache, metadata.native_block_tables,
            metadata.native_positions, scale, k_scale, v_scale, window, softcap,
        )  # fmt: skip
        out.index_copy_(0, metadata.native_rows, o_native.to(q.dtype))
    elif metadata.num_decodes:
        bd = metadata.num_decodes
        # One query token per request: fold the GQA group into the query-length axis.
        q_dec = q.index_select(0, metadata.decode_rows).view(bd, num_kv_heads, group, head_dim)
        o_dec = _decode_attention(
            q_dec,
            _gather_unscaled(k_rows, k_scale_rows, metadata.decode_kv_index, q.dtype),
            _gather_unscaled(v_rows, v_scale_rows, metadata.decode_kv_index, q.dtype),
            metadata.decode_mask_for(window),
            scale,
            softcap,
        )
        out.index_copy_(0, metadata.decode_rows, o_dec.reshape(bd, num_heads, head_dim))

    _attend_prefills(
        q, k, v, k_rows, v_rows, k_scale_rows, v_scale_rows, metadata, out, scale, window, softcap, native
    )
    return out


def _triton_paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    metadata: AttentionMetadata, scale: float, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
    window: int | None, softcap: float | None,
) -> torch.Tensor:  # fmt: skip
    """Every row from the cache in one Triton kernel (`triton_attention.paged_attention_triton`)."""
    from tandem.kernels.triton_attention import paged_attention_triton

    paged = metadata.paged
    assert paged is not None
    return paged_attention_triton(
        q, k_cache, v_cache, paged.block_tables, paged.seq_lens, paged.query_start, paged.tile_request,
        paged.tile_row, paged.block_q, scale, k_scale, v_scale, window, softcap, k, v,
    )  # fmt: skip


def _attend_prefills(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hk, D] this step's keys
    v: torch.Tensor,
    k_rows: torch.Tensor,  # [N * bs * Hk, D] the cache's rows
    v_rows: torch.Tensor,
    k_scale_rows: torch.Tensor | None,
    v_scale_rows: torch.Tensor | None,
    metadata: AttentionMetadata,
    out: torch.Tensor,  # [T, Hq, D], written at each segment's rows
    scale: float,
    window: int | None,
    softcap: float | None,
    native: bool,
) -> None:
    """`paged_attention`'s prompt segments (those the native kernel did not attend): SDPA over
    this step's keys, or over the gathered context after a cached prefix; soft-capped by hand."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    for seg in metadata.prefills:
        if native and seg.short:
            continue
        n = seg.query_end - seg.query_start
        q_seg = q[seg.query_start : seg.query_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if seg.kv_index is None:  # the whole context is this step's tokens
            k_seg = k[seg.query_start : seg.query_end].transpose(0, 1).unsqueeze(0)  # [1, Hk, n, D]
            v_seg = v[seg.query_start : seg.query_end].transpose(0, 1).unsqueeze(0)
        else:
            length = seg.kv_index.numel() // num_kv_heads
            k_seg = _gather_rows(k_rows, k_scale_rows, seg.kv_index, q.dtype).view(
                1, num_kv_heads, length, head_dim
            )
            v_seg = _gather_rows(v_rows, v_scale_rows, seg.kv_index, q.dtype).view(
                1, num_kv_heads, length, head_dim
            )
        mask = seg.mask_for(window, q.device)
        if softcap:
            o_seg = _capped_attention(q_seg, k_seg, v_seg, mask, scale, softcap)
        else:
            o_seg = F.scaled_dot_product_attention(
                q_seg, k_seg, v_seg, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )
        out[seg.query_start : seg.query_end] = (
            o_seg.squeeze(0).transpose(0, 1).reshape(n, num_heads, head_dim)
        )


def _capped_attention(
    q: torch.Tensor,  # [1, Hq, n, D]
    k: torch.Tensor,  # [1, Hk, L, D]
    v: torch.Tensor,  # [1, Hk, L, D]
    mask: torch.Tensor | None,  # [n, L] True = attend; None: causal over the last n positions
    scale: float,
    softcap: float,
) -> torch.Tensor:  # [1, Hq, n, D]
    """softmax(softcap * tanh(q K^T * scale / softcap), masked) V: SDPA has no soft-capping, so
    the scores are materialised ([Hq, n, L]; chunked prefill bounds n)."""
    group = q.shape[1] // k.shape[1]
    n, length = q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).div_(softcap).tanh_().mul_(softcap)
    if mask is None:
        keys = torch.arange(length, device=q.device)[None, :]
        mask = keys <= torch.arange(length - n, length, device=q.device)[:, None]
    scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v)


def reference_attention(
    q: torch.Tensor,  # [n, Hq, D] queries at positions L-n .. L-1
    k: torch.Tensor,  # [L, Hk, D] contiguous keys of the whole context
    v: torch.Tensor,  # [L, Hk, D]
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [n, Hq, D]
    """Dense causal attention with explicit GQA expansion, for testing `paged_attention`."""
    n, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(seq_len - n, seq_len)[:, None]
    key_pos = torch.arange(seq_len)[None, :]
    hidden = key_pos > q_pos
    if window is not None:
        hidden |= key_pos <= q_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)
