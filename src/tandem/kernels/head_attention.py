"""Attention over a KV cache paged per (layer, KV head), for compressed requests (plain torch,
and the native paged-attention kernel for decode rows on CPU).

Pool layout, shared by every layer and head: `k_pool`, `v_pool`: [num_head_blocks, block_size,
head_dim], in float32, 16-bit or FP8 (e4m3 codes; then `k_scale`, `v_scale` [num_head_blocks,
block_size] float16 hold one scale per vector, as the shared FP8 cache does). One head block
holds `block_size` tokens of one (layer, KV head); flat head slot `s` is block
`s // block_size`, offset `s % block_size`. A request's head h (of one layer) holds
`head_lens[h]` tokens packed from slot 0 of its block table `block_tables[h]`
(`engine.head_kv_cache.HeadKVCacheManager` decides which blocks).

Semantics, for request i with query rows q[qs[i]:qs[i+1]] (n_i rows) and KV head h holding
L = head_lens[i, h] tokens (this step's n_i tokens last, already written):
    K = k_pool.view(-1, D)[slots of head h's first L tokens]
    query row j (of n_i) of query head g (h = g // (Hq // Hk)) attends key index t iff
    t <= L - n_i + j: every kept older token, and the new ones up to itself.
This is the causal mask in "kept index" space: with nothing evicted it is the usual causal mask;
after an eviction (which only ever happens between steps, to tokens already computed) the step's
new tokens still sit last in every head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tandem.kernels import int4_native
from tandem.kernels.attention import native_paged_attention, write_kv
from tandem.kernels.attention_metadata import NATIVE_ATTENTION
from tandem.kernels.kv_eviction import observation_scores

FP8 = torch.float8_e4m3fn
# A head-block pool: keys, values [N, bs, D]; an FP8 pool's per-vector scales [N, bs] (else None).
HeadPool = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
_POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, FP8)


def head_pool_dtype(cache_dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
    """What head blocks store: the shared cache's type (FP8 included: e4m3 codes with a float16
    scale per vector, as the shared cache quantises), else the compute type. One rule for sizing
    the pool (engine) and allocating it (runner)."""
    return cache_dtype if cache_dtype in _POOL_DTYPES else compute_dtype


def head_slot_bytes(pool_dtype: torch.dtype, head_dim: int) -> int:
    """Bytes of one (token, head) slot, keys and values: the vectors, and FP8's scales."""
    return 2 * (head_dim * pool_dtype.itemsize + (2 if pool_dtype == FP8 else 0))


def write_head_kv(
    k: torch.Tensor,  # [T, Hk, D] one layer's new keys
    v: torch.Tensor,  # [T, Hk, D]
    k_pool: torch.Tensor,  # [N, bs, D]
    v_pool: torch.Tensor,  # [N, bs, D]
    head_slots: torch.Tensor,  # [T, Hk] int64: flat head slot of token t in KV head h
    k_scale: torch.Tensor | None = None,  # [N, bs] float16: an FP8 pool's per-vector scales
    v_scale: torch.Tensor | None = None,
) -> None:
    """k_pool.view(-1, D)[head_slots[t, h]] = k[t, h] (and the same for v); an FP8 pool stores
    each vector quantised with its own scale. The shared cache's `attention.write_kv`, with every
    (token, head) vector a token of a one-head cache."""
    head_dim = k.shape[-1]
    write_kv(
        k.reshape(-1, 1, head_dim),
        v.reshape(-1, 1, head_dim),
        k_pool.unsqueeze(2),  # [N, bs, 1, D]
        v_pool.unsqueeze(2),
        head_slots.reshape(-1),
        None if k_scale is None else k_scale.unsqueeze(2),  # [N, bs, 1]
        None if v_scale is None else v_scale.unsqueeze(2),
    )


def move_head_slots(
    k_pool: torch.Tensor,  # [N, bs, D]
    v_pool: torch.Tensor,  # [N, bs, D]
    src_slots: torch.Tensor,  # [M] int64
    dst_slots: torch.Tensor,  # [M] int64
    k_scale: torch.Tensor | None = None,  # [N, bs] float16 (FP8 pool)
    v_scale: torch.Tensor | None = None,
) -> None:
    """Apply an eviction's moves: every source is read before any destination is written."""
    if src_slots.numel() == 0:
        return
    for pool in (k_pool, v_pool):
        flat = pool.view(torch.uint8).view(-1, pool.shape[-1] * pool.element_size())
        flat.index_copy_(0, dst_slots, flat.index_select(0, src_slots))
    for scales in (k_scale, v_scale):
        if scales is not None:
            flat_scales = scales.view(-1)
            flat_scales.index_copy_(0, dst_slots, flat_scales.index_select(0, src_slots))


def gather_head_vectors(
    pool: torch.Tensor,  # [N, bs, D]
    scales: torch.Tensor | None,  # [N, bs] float16 for an FP8 pool
    slots: torch.Tensor,  # [...] int64 flat head slots
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., D] in dtype (FP8: codes times their scales)
    head_dim = pool.shape[-1]
    if scales is None:
        return pool.view(-1, head_dim)[slots].to(dtype)
    codes = pool.view(torch.uint8).view(-1, head_dim)[slots].view(FP8).float()
    return (codes * scales.view(-1)[slots].float().unsqueeze(-1)).to(dtype)


def native_decode_available(device: torch.device, pool_dtype: torch.dtype) -> bool:
    """Whether decode rows can attend through the native kernel here."""
    return (
        device.type == "cpu"
        and pool_dtype in (torch.float32, torch.bfloat16, FP8)
        and NATIVE_ATTENTION
        and int4_native.load() is not None
    )


def head_slots_of(
    block_tables: torch.Tensor,  # [Hk, M] int64 head block ids (padding: any valid id)
    block_size: int,
) -> torch.Tensor:  # [Hk, M * bs] flat head slots, in table order
    offsets = torch.arange(block_size, device=block_tables.device)
    return (block_tables.unsqueeze(-1) * block_size + offsets).reshape(block_tables.shape[0], -1)


def head_paged_attention(
    q: torch.Tensor,  # [T, Hq, D] this step's queries (all requests, concatenated)
    query_start_loc: list[int],  # [B + 1] row offsets of each request in q
    k_pool: torch.Tensor,  # [N, bs, D]
    v_pool: torch.Tensor,  # [N, bs, D]
    block_tables: torch.Tensor,  # [B, Hk, M] int64, this layer's head block tables (padded)
    head_lens: torch.Tensor,  # [B, Hk] int64 tokens held per head, this step's included
    scale: float,
    native: bool | None = None,  # decode rows through the native kernel; None: where it runs
    k_scale: torch.Tensor | None = None,  # [N, bs] float16: an FP8 pool's scales
    v_scale: torch.Tensor | None = None,
    k: torch.Tensor | None = None,  # [T, Hk, D] this step's keys as computed (before the pool)
    v: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Attention of each request's new rows over its own per-head paged KV (see the module
    docstring for the mask). Decode rows (one row per request) all at once: natively on CPU
    (`attention.native_paged_attention`, each (request, KV head) a row of its own over its own
    block table, no gathers), else in one padded pair of matmuls. Other requests one at a time,
    all heads in one `scaled_dot_product_attention` (GQA native); a request whose heads hold equal
    counts (not evicted yet: every prompt chunk) shares one [n, L] mask across heads. A request
    whose whole context is this step's rows attends over `k`, `v` as computed when they are given
    (as the shared layout does: an FP8 pool's rounding then starts at the next step)."""
    out = torch.empty_like(q)
    num_requests = len(query_start_loc) - 1
    decoding = [i for i in range(num_requests) if query_start_loc[i + 1] - query_start_loc[i] == 1]
    done: set[int] = set()
    if native is None:
        native = native_decode_available(q.device, k_pool.dtype)
    if decoding and (native or len(decoding) > 1):  # natively, or all of them in one padded call
        rows = torch.tensor([query_start_loc[i] for i in decoding], device=q.device)
        index = torch.tensor(decoding, device=q.device)
        decode = _native_decodes if native else _padded_decodes
        attended = decode(
            q.index_select(0, rows), head_lens.index_select(0, index), block_tables.index_select(0, index),
            k_pool, v_pool, k_scale, v_scale, scale,
        )  # fmt: skip
        out.index_copy_(0, rows, attended.to(q.dtype))
        done = set(decoding)
    for i in range(num_requests):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        n = end - start
        if n == 0 or i in done:
            continue
        out[start:end] = _attend_request(
            q[start:end], head_lens[i], block_tables[i], k_pool, v_pool, k_scale, v_scale,
            None if k is None else k[start:end], None if v is None else v[start:end], scale,
        )  # fmt: skip
    return out


def _native_decodes(
    q: torch.Tensor,  # [b, Hq, D] one row per request
    lens: torch.Tensor,  # [b, Hk]
    block_tables: torch.Tensor,  # [b, Hk, M]
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:  # [b, Hq, D] float32
    """Decode rows natively: (request, KV head) pairs as the rows of a one-KV-head cache."""
    num_decodes, num_q_heads, head_dim = q.shape
    num_kv_heads = block_tables.shape[1]
    attended = native_paged_attention(
        q.reshape(num_decodes * num_kv_heads, num_q_heads // num_kv_heads, head_dim),
        k_pool.unsqueeze(2),  # [N, bs, 1, D]
        v_pool.unsqueeze(2),
        block_tables.reshape(num_decodes * num_kv_heads, -1),
        lens.reshape(-1) - 1,  # each row reads its head's tokens
        scale,
        None if k_scale is None else k_scale.unsqueeze(2),  # [N, bs, 1]
        None if v_scale is None else v_scale.unsqueeze(2),
    )  # [b * Hk, G, D] float32
    return attended.view(num_decodes, num_q_heads, head_dim)


def _padded_decodes(
    q: torch.Tensor,  # [b, Hq, D] one row per request
    lens: torch.Tensor,  # [b, Hk]
    block_tables: torch.Tensor,  # [b, Hk, M]
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:  # [b, Hq, D]
    """Decode rows over their heads' keys, padded to the longest: two small matmuls (at one query
    row CPU SDPA with a mask costs several times more)."""
    num_decodes, num_q_heads, head_dim = q.shape
    num_kv_heads = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    max_len = int(lens.max())
    slots = head_slots_of(block_tables.flatten(0, 1), k_pool.shape[1])
    slots = slots[:, :max_len].view(num_decodes, num_kv_heads, max_len)  # [b, Hk, Lmax]
    keys = gather_head_vectors(k_pool, k_scale, slots, q.dtype)  # [b, Hk, Lmax, D]
    values = gather_head_vectors(v_pool, v_scale, slots, q.dtype)
    held = torch.arange(max_len, device=q.device).view(1, 1, 1, -1) < lens.view(
        *lens.shape, 1, 1
    )  # [b,Hk,1,L]
    qg = q.view(num_decodes, num_kv_heads, group, head_dim)  # [b, Hk, G, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # [b, Hk, G, Lmax]
    probs = torch.softmax(scores.masked_fill(~held, float("-inf")), dim=-1).to(q.dtype)
    return torch.matmul(probs, values).reshape(num_decodes, num_q_heads, head_dim)  # [b, Hq, D]


def _attend_request(
    q: torch.Tensor,  # [n, Hq, D] one request's rows
    lens: torch.Tensor,  # [Hk] tokens each head holds, this step's included
    block_table: torch.Tensor,  # [Hk, M]
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    k: torch.Tensor | None,  # [n, Hk, D] its keys as computed (None: read the pool)
    v: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:  # [n, Hq, D]
    """One request's rows over its heads (`head_paged_attention`): all heads in one SDPA call,
    one mask shared across heads while they hold equal counts."""
    n = q.shape[0]
    group = q.shape[1] // block_table.shape[0]
    block_size = k_pool.shape[1]
    max_len = int(lens.max())
    if k is not None and v is not None and n == max_len and int(lens.min()) == max_len:
        keys = k.transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hk, n, D]
        values = v.transpose(0, 1).unsqueeze(0).to(q.dtype)
    else:
        slots = head_slots_of(block_table, block_size)[:, :max_len]  # [Hk, Lmax]
        keys = gather_head_vectors(k_pool, k_scale, slots, q.dtype).unsqueeze(0)  # [1, Hk, Lmax, D]
        values = gather_head_vectors(v_pool, v_scale, slots, q.dtype).unsqueeze(0)
    key_index = torch.arange(max_len, device=q.device)  # [Lmax]
    row_offset = torch.arange(n, device=q.device)
    visible: torch.Tensor | None
    if n == max_len and int(lens.min()) == max_len:
        visible = None  # a whole context in one chunk: plain causal
    elif int(lens.min()) == max_len:
        visible = key_index.view(1, -1) <= (max_len - n + row_offset).view(-1, 1)  # [n, Lmax]
    else:
        last_visible = lens.view(-1, 1) - n + row_offset.view(1, -1)  # [Hk, n]
        visible = key_index.view(1, 1, -1) <= last_visible.unsqueeze(-1)  # [Hk, n, Lmax]
        visible = visible.repeat_interleave(group, dim=0).unsqueeze(0)  # [1, Hq, n, Lmax]
    qi = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    attended = F.scaled_dot_product_attention(
        qi, keys, values, attn_mask=visible, is_causal=visible is None, scale=scale, enable_gqa=True
    )  # [1, Hq, n, D]
    return attended[0].transpose(0, 1)


def reference_head_attention(
    q: torch.Tensor,  # [n, Hq, D] one request's new rows
    keys: list[torch.Tensor],  # per KV head: [L_h, D] the tokens it holds, in order
    values: list[torch.Tensor],  # per KV head: [L_h, D]
    scale: float,
) -> torch.Tensor:  # [n, Hq, D]
    """Dense attention per head over exactly the tokens each KV head holds (the semantics, for
    tests): one query head and one row at a time."""
    n, num_q_heads, _ = q.shape
    group = num_q_heads // len(keys)
    out = torch.empty_like(q)
    for g in range(num_q_heads):
        k, v = keys[g // group], values[g // group]
        for j in range(n):
            visible = k.shape[0] - n + j + 1
            weights = torch.softmax((k[:visible].float() @ q[j, g].float()) * scale, dim=-1)
            out[j, g] = (weights @ v[:visible].float()).to(q.dtype)
    return out


@dataclass
class HeadAttentionMetadata:
    """One step of compressed requests over the head-block pool, built once per step and read by
    every layer (`head_attention_layer`). Row order is the step's: request i owns q rows
    `query_start_loc[i]:query_start_loc[i + 1]`."""

    k_pool: torch.Tensor  # [N, bs, D]
    v_pool: torch.Tensor  # [N, bs, D]
    head_slots: torch.Tensor  # [L, T, Hk] int64: where each layer writes each row's K/V
    block_tables: torch.Tensor  # [L, B, Hk, M] int64 (padded with block 0)
    head_lens: torch.Tensor  # [L, B, Hk] int64, this step's rows included
    query_start_loc: list[int]  # [B + 1]
    k_scale: torch.Tensor | None = None  # [N, bs] float16: an FP8 pool's per-vector scales
    v_scale: torch.Tensor | None = None
    # Requests whose rows this step are observed for an eviction: (request index, window size W).
    # Their last W rows' queries (at most W) are scored against the tokens each head holds, per
    # layer, into `scores` (`kv_eviction.observation_scores`).
    observe: list[tuple[int, int]] = field(default_factory=list)
    scores: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # index -> per layer [Hk, T]


def head_attention_layer(
    metadata: HeadAttentionMetadata,
    layer: int,
    q: torch.Tensor,  # [T, Hq, D] after RoPE
    k: torch.Tensor,  # [T, Hk, D] after RoPE
    v: torch.Tensor,  # [T, Hk, D]
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Write the rows' K/V into the layer's head blocks, score observed requests' windows, and
    attend (`head_paged_attention`)."""
    write_head_kv(
        k, v, metadata.k_pool, metadata.v_pool, metadata.head_slots[layer], metadata.k_scale, metadata.v_scale
    )
    block_size = metadata.k_pool.shape[1]
    qs = metadata.query_start_loc
    single = [index for index, _ in metadata.observe if qs[index + 1] - qs[index] == 1]
    batched = set(single) if len(single) > 1 else set()  # decode rows: one padded call for all
    if batched:
        for index, scores in zip(single, _decode_row_scores(metadata, layer, q, single, scale), strict=True):
            metadata.scores.setdefault(index, []).append(scores)
    for index, window in metadata.observe:
        if index in batched:
            continue
        end = metadata.query_start_loc[index + 1]
        start = max(metadata.query_start_loc[index], end - window)
        lengths = metadata.head_lens[layer, index]  # [Hk]: heads may differ after an eviction
        num_tokens = int(lengths.max())
        slots = head_slots_of(metadata.block_tables[layer, index], block_size)[:, :num_tokens]  # [Hk, T]
        keys = gather_head_vectors(metadata.k_pool, metadata.k_scale, slots, q.dtype).transpose(
            0, 1
        )  # [T, Hk, D]
        metadata.scores.setdefault(index, []).append(observation_scores(q[start:end], keys, scale, lengths))
    return head_paged_attention(
        q, metadata.query_start_loc, metadata.k_pool, metadata.v_pool,
        metadata.block_tables[layer], metadata.head_lens[layer], scale,
        k_scale=metadata.k_scale, v_scale=metadata.v_scale, k=k, v=v,
    )  # fmt: skip


def _decode_row_scores(
    metadata: HeadAttentionMetadata,
    layer: int,
    q: torch.Tensor,  # [T, Hq, D]
    indices: list[int],  # requests with one row this step, observed
    scale: float,
) -> list[torch.Tensor]:  # per request [Hk, its longest head]: `observation_scores` of its row
    """`observation_scores` of one query row per request (a decode row sees every token its heads
    hold), for all the requests in one padded gather and two matmuls."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size = metadata.k_pool.shape[1]
    index = torch.tensor(indices, device=q.device)
    rows = torch.tensor([metadata.query_start_loc[i] for i in indices], device=q.device)
    lens = metadata.head_lens[layer].index_select(0, index)  # [b, Hk]
    num_requests, num_kv_heads = lens.shape
    max_len = int(lens.max())
    tables = metadata.block_tables[layer].index_select(0, index).flatten(0, 1)  # [b * Hk, M]
    slots = head_slots_of(tables, block_size)[:, :max_len].view(num_requests, num_kv_heads, max_len)
    keys = gather_head_vectors(metadata.k_pool, metadata.k_scale, slots, torch.float32)  # [b, Hk, Lmax, D]
    qg = (
        q.index_select(0, rows)
        .float()
        .view(num_requests, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    )
    logits = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # [b, Hk, G, Lmax]
    padding = torch.arange(max_len, device=q.device).view(1, 1, 1, -1) >= lens.view(
        num_requests, num_kv_heads, 1, 1
    )
    scores = (
        torch.softmax(logits.masked_fill(padding, float("-inf")), dim=-1).square().sum(dim=2)
    )  # [b, Hk, Lmax]
    return [scores[j, :, : int(lens[j].max())] for j in range(num_requests)]
