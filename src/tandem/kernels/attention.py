"""Paged attention over a block-structured KV cache (plain-torch reference).

Cache layout, per layer: `k_cache`, `v_cache`: [num_blocks, block_size, num_kv_heads, head_dim].
Token slot `s` lives at block `s // block_size`, offset `s % block_size`.

Semantics (for each request i with query rows q[qs[i]:qs[i+1]] and context length L_i):
    K_i = k_cache.view(-1, Hk, D)[slots_i[:L_i]]          # slots from the block table
    out[qs[i]:qs[i+1]] = softmax(q_i @ K_i^T * scale + causal_mask) @ V_i
where query row j of request i sits at position L_i - n_i + j (n_i = qs[i+1] - qs[i]) and may
attend keys at positions <= its own. GQA: query head h reads KV head h // (Hq // Hk).

The metadata is built once per step (`build_attention_metadata`) and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def write_kv(
    k: torch.Tensor,  # [T, Hk, D]
    v: torch.Tensor,  # [T, Hk, D]
    k_cache: torch.Tensor,  # [N, bs, Hk, D]
    v_cache: torch.Tensor,  # [N, bs, Hk, D]
    slot_mapping: torch.Tensor,  # [T] int64, flat slot index per token
) -> None:
    """k_cache.view(-1, Hk, D)[slot_mapping] = k (and the same for v)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


@dataclass
class PrefillSegment:
    """A request computing more than one token this step (a prompt chunk)."""

    query_start: int  # first row in q
    query_end: int  # one past the last row
    kv_slots: torch.Tensor  # [L] int64 flat slots of the whole context (cached + new)
    mask: torch.Tensor | None  # [n, L] bool (True = attend); None: plain causal (no cached prefix)


@dataclass
class AttentionMetadata:
    """Per-step inputs to attention, shared by all layers."""

    slot_mapping: torch.Tensor  # [T] slots the step's new tokens are written to
    decode_rows: torch.Tensor  # [Bd] rows of q that are single-token decodes
    decode_kv_slots: torch.Tensor  # [Bd, Lmax] flat slots, padded with 0
    decode_mask: torch.Tensor  # [Bd, 1, 1, Lmax] bool, True = valid key
    prefills: list[PrefillSegment]
    num_decodes: int


def build_attention_metadata(
    block_tables: list[list[int]],
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Index tensors for one step. Request i has `query_lens[i]` new tokens and, after them,
    `context_lens[i]` tokens in its context; its new tokens are the last ones of the context."""
    slot_chunks: list[torch.Tensor] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillSegment] = []
    row = 0
    offsets = torch.arange(block_size, dtype=torch.int64)
    for table, n, ctx in zip(block_tables, query_lens, context_lens, strict=True):
        num_blocks = -(-ctx // block_size)
        blocks = torch.tensor(table[:num_blocks], dtype=torch.int64)
        all_slots = (blocks[:, None] * block_size + offsets[None, :]).reshape(-1)[:ctx]
        slot_chunks.append(all_slots[ctx - n :])
        if n == 1:
            decode_rows.append(row)
            decode_tables.append(table[:num_blocks])
            decode_lens.append(ctx)
        else:
            mask = None
            if ctx != n:  # cached prefix: query j (position ctx-n+j) sees keys <= its position
                q_pos = torch.arange(ctx - n, ctx)[:, None]
                mask = torch.arange(ctx)[None, :] <= q_pos
            prefills.append(PrefillSegment(row, row + n, all_slots.to(device), None if mask is None else mask.to(device)))
        row += n

    max_len = max(decode_lens, default=0)
    num_decodes = len(decode_rows)
    if num_decodes:
        max_blocks = -(-max_len // block_size)
        table_tensor = torch.zeros(num_decodes, max_blocks, dtype=torch.int64)
        for i, table in enumerate(decode_tables):
            table_tensor[i, : len(table)] = torch.tensor(table, dtype=torch.int64)
        decode_slots = (table_tensor[:, :, None] * block_size + offsets).reshape(num_decodes, -1)[:, :max_len]
        lens = torch.tensor(decode_lens, dtype=torch.int64)
        decode_mask = (torch.arange(max_len)[None, :] < lens[:, None]).view(num_decodes, 1, 1, max_len)
    else:
        decode_slots = torch.zeros(0, 0, dtype=torch.int64)
        decode_mask = torch.zeros(0, 1, 1, 0, dtype=torch.bool)
    return AttentionMetadata(
        slot_mapping=torch.cat(slot_chunks).to(device),
        decode_rows=torch.tensor(decode_rows, dtype=torch.int64, device=device),
        decode_kv_slots=decode_slots.to(device),
        decode_mask=decode_mask.to(device),
        prefills=prefills,
        num_decodes=num_decodes,
    )


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hk, D]  (already holds this step's keys)
    v_cache: torch.Tensor,  # [N, bs, Hk, D]
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)

    if metadata.num_decodes:
        bd = metadata.num_decodes
        # One query token per request: fold the GQA group into the query-length axis.
        q_dec = q.index_select(0, metadata.decode_rows).view(bd, num_kv_heads, group, head_dim)
        k_dec = k_flat[metadata.decode_kv_slots].to(q.dtype).transpose(1, 2)  # [Bd, Hk, L, D]
        v_dec = v_flat[metadata.decode_kv_slots].to(q.dtype).transpose(1, 2)
        o_dec = F.scaled_dot_product_attention(q_dec, k_dec, v_dec, attn_mask=metadata.decode_mask, scale=scale)
        out.index_copy_(0, metadata.decode_rows, o_dec.reshape(bd, num_heads, head_dim))

    for seg in metadata.prefills:
        q_seg = q[seg.query_start : seg.query_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        k_seg = k_flat[seg.kv_slots].to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hk, L, D]
        v_seg = v_flat[seg.kv_slots].to(q.dtype).transpose(0, 1).unsqueeze(0)
        o_seg = F.scaled_dot_product_attention(
            q_seg, k_seg, v_seg, attn_mask=seg.mask, is_causal=seg.mask is None, scale=scale, enable_gqa=True
        )
        out[seg.query_start : seg.query_end] = o_seg.squeeze(0).transpose(0, 1)
    return out


def reference_attention(
    q: torch.Tensor,  # [n, Hq, D] queries at positions L-n .. L-1
    k: torch.Tensor,  # [L, Hk, D] contiguous keys of the whole context
    v: torch.Tensor,  # [L, Hk, D]
    scale: float,
) -> torch.Tensor:  # [n, Hq, D]
    """Dense causal attention with explicit GQA expansion, for testing `paged_attention`."""
    n, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    q_pos = torch.arange(seq_len - n, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)
