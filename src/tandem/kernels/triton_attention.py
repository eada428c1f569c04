"""Triton kernels for the paged KV cache: attention over block tables, and the KV write.

Both follow `attention.py`'s layout and semantics (its module docstring is the contract; its
torch functions are the references the tests compare against):

- cache, per layer: `k_cache`, `v_cache` [num_blocks, block_size, Hk, D]; an FP8 cache stores
  e4m3 codes (passed as their uint8 view) and `k_scale`, `v_scale` [num_blocks, block_size, Hk]
  float16, one per (token, head): value = code * scale.
- `paged_attention_triton`: every query row of a step in one launch (prompt chunks, decodes and
  speculative verifications alike). Query row r of request i sits at position
  `p = seq_lens[i] - n_i + (r - query_start[i])` (n_i its rows this step) and attends, through
  `block_tables[i]`, the cached keys at positions `max(0, p - window + 1) .. p` (all of `0 .. p`
  without a window): the step's own keys are written before attention, so keys are read from
  the cache, except a whole prompt's under a narrower cache (FP8), which it attends as computed. Scores are `q . k * scale`, then `softcap * tanh(s / softcap)` with soft-capping.
  A program takes one KV head and a tile of up to `BLOCK_Q` rows of one request, its GQA group's
  query heads stacked into the tile's `BLOCK_Q * G` rows, and walks the request's keys
  `BLOCK_N` at a time with an online softmax (flash attention over pages). Block-table entries
  of positions it never reads (a window's released blocks, -1) are never dereferenced.
- `write_kv_triton`: `k_cache.view(-1, Hk, D)[slot_mapping] = k` (and v); slots < 0 are skipped
  (the padding rows of a captured decode graph). FP8: each (token, head) vector quantised with
  its own scale exactly as `fp8.quantize_fp8` does: the scale `amax / 448` clamped and
  rounded to float16, the code the e4m3 value nearest `x / scale` (ties to even). The quotient
  is rounded onto the e4m3 grid in float32 before the cast, so the cast itself is exact (Triton's
  interpreter rounds some float32 -> e4m3 casts wrongly).

Interpreter note: under `TRITON_INTERPRET=1` the dot products take float32 operands (the
interpreter's bfloat16 `tl.dot` multiplies raw bit patterns); on a GPU they take the query's dtype
(tensor cores), float32 queries at full ("ieee") precision.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.triton_support import interpreting, next_power_of_2

# as fp8.quantize_fp8 (constexpr: the kernels read them)
FP8_E4M3_MAX = tl.constexpr(448.0)
_MIN_SCALE = tl.constexpr(2.0**-24)
_MAX_SCALE = tl.constexpr(65504.0)  # float16's largest finite value


@triton.jit
def _e4m3_to_float(codes):
    """uint8 e4m3 codes -> float32 (never NaN: the writer clamps to +-448)."""
    return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _tile_keys(
    k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, k_new_ptr, v_new_ptr, table, n, n_ok, d, d_ok, kv_head,
    first_position, query_start, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
    stride_nt, stride_nh, stride_vnt, stride_vnh,
    BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, FRESH_KEYS: tl.constexpr,
):  # fmt: skip
    """The keys and values [BLOCK_N, D] at positions `n` of one KV head: from the paged cache
    (FP8 codes widened times their scales), or, for a whole prompt computed this step
    (FRESH_KEYS), as computed (as the torch path does: the cache holds them narrower)."""
    cached = n_ok
    if FRESH_KEYS:
        # per key, not a scalar: Triton's interpreter cannot broadcast a scalar mask in `&`
        fresh = (n * 0 + first_position) == 0
        cached = n_ok & (fresh == 0)
    block = tl.load(table + n // BLOCK_SIZE, mask=cached, other=0)
    offset = block.to(tl.int64) * stride_kb + (n % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
    kv_mask = cached[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + offset[:, None] + d[None, :], mask=kv_mask, other=0)
    v = tl.load(v_ptr + offset[:, None] + d[None, :], mask=kv_mask, other=0)
    if FP8:
        scale_offset = block.to(tl.int64) * stride_sb + (n % BLOCK_SIZE) * stride_ss + kv_head
        k_scale = tl.load(k_scale_ptr + scale_offset, mask=cached, other=0.0).to(tl.float32)
        v_scale = tl.load(v_scale_ptr + scale_offset, mask=cached, other=0.0).to(tl.float32)
        k = _e4m3_to_float(k) * k_scale[:, None]
        v = _e4m3_to_float(v) * v_scale[:, None]
    if FRESH_KEYS:
        new_row = (query_start + n).to(tl.int64)
        new_mask = (n_ok & fresh)[:, None] & d_ok[None, :]
        k_offset = new_row * stride_nt + kv_head * stride_nh
        v_offset = new_row * stride_vnt + kv_head * stride_vnh
        k_new = tl.load(k_new_ptr + k_offset[:, None] + d[None, :], mask=new_mask, other=0.0)
        v_new = tl.load(v_new_ptr + v_offset[:, None] + d[None, :], mask=new_mask, other=0.0)
        k = tl.where(fresh[:, None], k_new.to(tl.float32), k.to(tl.float32))
        v = tl.where(fresh[:, None], v_new.to(tl.float32), v.to(tl.float32))
    return k, v


@triton.jit
def _tile_scores(
    q, k, n, n_ok, row_ok, position, scale, softcap, window,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """[BLOCK_M, BLOCK_N] scaled (and soft-capped) scores of the tile's rows against keys `n`,
    -inf where a row may not see a key (causal, window)."""
    scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
    if HAS_SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both ends (exp overflows to inf -> 1)
        scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
    visible = row_ok[:, None] & n_ok[None, :] & (n[None, :] <= position[:, None])
    if HAS_WINDOW:
        visible = visible & (n[None, :] > position[:, None] - window)
    scores = tl.where(visible, scores, float("-inf"))
    return scores


@triton.jit
def _online_softmax_step(
    scores, v, running_max, running_sum, acc, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr
):
    """Fold one key tile's masked scores [BLOCK_M, BLOCK_N] and values into the running max,
    sum and weighted values (flash attention's online softmax)."""
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows that saw no key yet
    probs = tl.exp(scores - safe_max[:, None])
    correction = tl.exp(running_max - safe_max)
    running_sum = running_sum * correction + tl.sum(probs, 1)
    acc = acc * correction[:, None] + tl.dot(
        probs.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION
    )
    return new_max, running_sum, acc


@triton.jit
def _unified_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, k_new_ptr, v_new_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr, tile_request_ptr, tile_row_ptr,
    scale, softcap, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_nt, stride_nh, stride_vnt, stride_vnh,
    stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr, FRESH_KEYS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = tl.load(tile_request_ptr + tile)
    first_row = tl.load(tile_row_ptr + tile)
    query_start = tl.load(query_start_ptr + request)
    query_end = tl.load(query_start_ptr + request + 1)
    seq_len = tl.load(seq_lens_ptr + request)
    first_position = seq_len - (query_end - query_start)  # position of the request's first row
    m = tl.arange(0, BLOCK_M)  # tile rows: (query row, head of the group)
    row = first_row + m // GROUP
    head = kv_head * GROUP + m % GROUP
    row_ok = (m < BLOCK_Q * GROUP) & (row < query_end)
    position = first_position + (row - query_start)  # [BLOCK_M]
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    mask = row_ok[:, None] & d_ok[None, :]
    q_rows = q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_rows, mask=mask, other=0.0).to(DOT_DTYPE)  # [BLOCK_M, D]
    last_row = tl.minimum(first_row + BLOCK_Q, query_end) - 1
    last_key = first_position + (last_row - query_start)  # the tile's largest position
    first_key = 0
    if HAS_WINDOW:
        first_key = tl.maximum(first_position + (first_row - query_start) - window + 1, 0)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + request * stride_bt
    for start in range((first_key // BLOCK_N) * BLOCK_N, last_key + 1, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # key positions
        n_ok = (n >= first_key) & (n <= last_key)
        k, v = _tile_keys(
            k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, k_new_ptr, v_new_ptr, table, n, n_ok, d, d_ok, kv_head,
            first_position, query_start, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
            stride_nt, stride_nh, stride_vnt, stride_vnh, BLOCK_SIZE, FP8, FRESH_KEYS,
        )  # fmt: skip
        scores = _tile_scores(
            q, k, n, n_ok, row_ok, position, scale, softcap, window,
            HAS_SOFTCAP, HAS_WINDOW, DOT_DTYPE, DOT_PRECISION,
        )  # fmt: skip
        running_max, running_sum, acc = _online_softmax_step(
            scores, v, running_max, running_sum, acc, DOT_DTYPE, DOT_PRECISION
        )
    out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
    out_rows = out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=mask)


def key_tile(device: torch.device) -> int:
    """BLOCK_N: keys per iteration (small under the interpreter, where each op is costly)."""
    return 16 if device.type == "cpu" else 64


def paged_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hk, D] float32/bfloat16/float16, or float8_e4m3fn
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32 (entries never read may be -1)
    seq_lens: torch.Tensor,  # [B] int32: each request's context length after this step
    query_start: torch.Tensor,  # [B + 1] int32: request i's rows are query_start[i] .. query_start[i+1]-1
    tile_request: torch.Tensor,  # [num_tiles] int32: the request of each query tile
    tile_row: torch.Tensor,  # [num_tiles] int32: the first row of each query tile
    block_q: int,  # rows per query tile (`paged_rows.query_tile_rows`)
    scale: float,
    k_scale: torch.Tensor | None = None,  # [N, bs, Hk] float16 for an FP8 cache
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    k: torch.Tensor | None = None,  # [T, Hk, D] this step's keys as computed (see below)
    v: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, D] in q's dtype
    """Paged attention of every row of a step (module docstring). Tiles cover each request's rows
    in runs of `block_q` (`paged_rows.build_query_tiles`). Given this step's `k` and `v` and a
    cache narrower than q (FP8, or 16-bit under float32 queries), a request whose whole context is
    this step's rows (a prompt) attends them as computed rather than as cached, as the torch path
    does."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_tokens == 0 or tile_request.numel() == 0:
        return out
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:
        assert k_scale is not None and v_scale is not None, "an FP8 cache needs its scales"
    k_view = k_cache.view(torch.uint8) if fp8 else k_cache
    v_view = v_cache.view(torch.uint8) if fp8 else v_cache
    scales = k_scale if fp8 and k_scale is not None else q.new_empty(1, 1, 1)
    fresh = k is not None and v is not None and k_cache.dtype != q.dtype
    k_new = _unit_stride(k) if fresh and k is not None else q
    v_new = _unit_stride(v) if fresh and v is not None else q
    q = q.contiguous()
    dot_dtype, precision = _dot_settings(q.dtype)
    grid = (tile_request.numel(), num_kv_heads)
    _unified_attention_kernel[grid](
        q, k_view, v_view, scales, v_scale if fp8 else scales, k_new, v_new, out,
        block_tables, seq_lens, query_start, tile_request, tile_row,
        scale, softcap or 1.0, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1),
        k_view.stride(0), k_view.stride(1), k_view.stride(2), scales.stride(0), scales.stride(1),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, next_power_of_2(head_dim)),
        BLOCK_Q=block_q, BLOCK_M=max(16, next_power_of_2(block_q * group)), BLOCK_N=key_tile(q.device),
        BLOCK_SIZE=block_size, FP8=fp8, FRESH_KEYS=fresh, HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None, DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
    )  # fmt: skip
    return out


def _dot_settings(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """The dot products' operand type and precision (module docstring, interpreter note)."""
    if interpreting() or dtype == torch.float32:
        return tl.float32, "ieee"
    return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), "tf32"


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@triton.jit
def _round_to_e4m3_grid(x):
    """float32 x with |x| <= 448 -> the nearest e4m3 value (ties to even), still float32."""
    magnitude = tl.abs(x)
    bits = x.to(tl.int32, bitcast=True)
    # normal e4m3 (|x| >= 2^-6): keep 3 mantissa bits of the float32, rounding half to even
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -0x100000).to(tl.float32, bitcast=True)
    # subnormal e4m3 (|x| < 2^-6): multiples of 2^-9; adding 2^14 makes float32's ulp 2^-9
    tiny = (magnitude + 16384.0) - 16384.0
    tiny = tl.where(x < 0, -tiny, tiny)
    return tl.where(magnitude >= 0.015625, normal, tiny)


@triton.jit
def _store_fp8(values, code_ptrs, scale_ptrs, mask, heads_ok):
    """[Hk, D] values -> e4m3 codes and per-head float16 scales, as `fp8.quantize_fp8`."""
    x = values.to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    # div_rn: correctly rounded, as torch divides (a GPU's default float32 `/` may be 2 ulp off)
    row_scale = tl.minimum(tl.maximum(tl.math.div_rn(amax, FP8_E4M3_MAX), _MIN_SCALE), _MAX_SCALE).to(
        tl.float16
    )
    quotient = tl.math.div_rn(x, row_scale.to(tl.float32)[:, None])
    quotient = tl.minimum(tl.maximum(quotient, -FP8_E4M3_MAX), FP8_E4M3_MAX)
    codes = _round_to_e4m3_grid(quotient).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(code_ptrs, codes, mask=mask)
    tl.store(scale_ptrs, row_scale, mask=heads_ok)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch, stride_ss,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, HEADS_PAD)
        d = tl.arange(0, HEAD_DIM_PAD)
        mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        dst = slot * stride_cs + h[:, None] * stride_ch + d[None, :]
        k = tl.load(k_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
        v = tl.load(v_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
        if FP8:
            heads_ok = h < NUM_KV_HEADS
            _store_fp8(k, k_cache_ptr + dst, k_scale_ptr + slot * stride_ss + h, mask, heads_ok)
            _store_fp8(v, v_cache_ptr + dst, v_scale_ptr + slot * stride_ss + h, mask, heads_ok)
        else:
            tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    k: torch.Tensor,  # [T, Hk, D]
    v: torch.Tensor,  # [T, Hk, D]
    k_cache: torch.Tensor,  # [N, bs, Hk, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int32/int64 flat slots; < 0: not written
    k_scale: torch.Tensor | None = None,  # [N, bs, Hk] float16, only for an FP8 cache
    v_scale: torch.Tensor | None = None,
) -> None:
    """The KV write (module docstring): one program per token, all its heads."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "slots index a contiguous cache"
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if not fp8:  # rounded by torch, as the reference does (the interpreter truncates to bfloat16)
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k, v = _unit_stride(k), _unit_stride(v)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    k_view = k_cache.view(torch.uint8) if fp8 else k_cache
    v_view = v_cache.view(torch.uint8) if fp8 else v_cache
    if fp8:
        assert k_scale is not None and v_scale is not None, "an FP8 cache needs its scales"
    k_scales = k_scale if fp8 else k.new_empty(1, 1, 1, dtype=torch.float16)
    v_scales = v_scale if fp8 else k_scales
    assert k_scales is not None and v_scales is not None
    _write_kv_kernel[(num_tokens,)](
        k, v, k_view, v_view, k_scales, v_scales, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_view.stride(1), k_view.stride(2), k_scales.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=next_power_of_2(head_dim), FP8=fp8,
    )  # fmt: skip
