"""What paged attention needs to know of a step, built once per step and read by every layer
(`build_attention_metadata`): where each row's keys are, which rows the native kernel attends,
the decode rows' gathered keys and masks, and the prompt segments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from tandem.kernels import int4_native
from tandem.kernels.paged_rows import PagedRows, build_paged_rows
from tandem.kernels.triton_support import uses_triton

# Segments of at most this many rows after a cached prefix go to the native kernel with the decode
# rows (a verification step's 1 + k rows); whole prompts and longer chunks to
# scaled_dot_product_attention.
NATIVE_SEGMENT_MAX_ROWS = 16
# Steps with more rows than this for the native kernel use the torch paths for all of them: in
# large steps the batched gather-and-matmul path is faster (docs/performance.md).
NATIVE_ATTENTION_MAX_ROWS = 16
NATIVE_ATTENTION = os.environ.get("TANDEM_NATIVE_ATTENTION", "1") != "0"


@dataclass
class PrefillSegment:
    """A request computing more than one token this step (a prompt chunk)."""

    query_start: int  # first row in q
    query_end: int  # one past the last row
    kv_index: torch.Tensor | None  # [Hk * L] rows of the cache's [-1, D] view; None: no cached prefix
    mask: torch.Tensor | None  # [n, L] bool (True = attend); None: plain causal (no cached prefix)
    # At most NATIVE_SEGMENT_MAX_ROWS rows after a cached prefix (a verification step): its rows
    # are in `native_rows`. A whole prompt attends its own keys as computed, not as cached.
    short: bool = False
    context_len: int = 0  # L: the request's tokens after this step (its rows sit at L - n .. L - 1)
    window_masks: dict[int, torch.Tensor] = field(
        default_factory=dict
    )  # window -> [n, L] (built once per step)

    def mask_for(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """[n, L] bool: what query row i (position L - n + i) attends with a sliding `window`
        (keys p - window + 1 .. p, HF's `kv_idx > q_idx - sliding_window`); without one, `mask`."""
        if window is None or window >= self.context_len:
            return self.mask
        if window not in self.window_masks:
            n, length = self.query_end - self.query_start, self.context_len
            keys = torch.arange(length)[None, :]
            query_positions = torch.arange(length - n, length)[:, None]
            allowed = (keys <= query_positions) & (keys > query_positions - window)
            self.window_masks[window] = allowed.to(device)
        return self.window_masks[window]


@dataclass
class AttentionMetadata:
    """Per-step inputs to attention, shared by all layers.

    Gathers use the cache's `[num_blocks * block_size * Hk, D]` view with row
    `slot * Hk + h`, so one `index_select` yields K already laid out as `[B, Hk, L, D]`.
    """

    slot_mapping: torch.Tensor  # [T] slots the step's new tokens are written to
    decode_rows: torch.Tensor  # [Bd] rows of q that are single-token decodes
    decode_kv_index: torch.Tensor  # [Bd * Hk * Lmax] cache rows, padding points at row 0
    decode_mask: torch.Tensor  # [Bd, 1, 1, Lmax] bool, True = valid key
    decode_max_len: int
    prefills: list[PrefillSegment]
    num_decodes: int
    # Rows the native kernel attends where it runs: every decode row and every row of a short
    # segment after a cached prefix (a speculative verification), each over its request's keys
    # 0..position through its block table, so that a row's attention is computed the same way
    # whether it decodes alone or verifies drafts.
    native_rows: torch.Tensor | None = None  # [R] int64 rows of q
    native_positions: torch.Tensor | None = None  # [R] int64
    native_block_tables: torch.Tensor | None = None  # [R, max_blocks] int64
    decode_lens: torch.Tensor | None = None  # [Bd] int64 context length of each decode row
    decode_window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> [Bd, 1, 1, Lmax]
    # Where Triton runs: every row goes through its kernel, and the fields above stay empty.
    paged: PagedRows | None = None

    def decode_mask_for(self, window: int | None) -> torch.Tensor:
        """`decode_mask` narrowed to each decode row's last `window` keys."""
        if window is None or window >= self.decode_max_len or self.decode_lens is None:
            return self.decode_mask
        if window not in self.decode_window_masks:
            keys = torch.arange(self.decode_max_len, device=self.decode_mask.device)
            recent = keys[None, :] >= (self.decode_lens[:, None] - window)
            self.decode_window_masks[window] = self.decode_mask & recent.view_as(self.decode_mask)
        return self.decode_window_masks[window]


def _head_rows(slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[..., L] slots -> [..., Hk, L] rows of the [-1, D] cache view."""
    heads = torch.arange(num_kv_heads, dtype=torch.int64)
    return slots.unsqueeze(-2) * num_kv_heads + heads[:, None]


def _decode_keys(
    decode_tables: list[list[int]], decode_lens: list[int], block_size: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode rows' key rows of the [-1, D] cache view ([B * Hk * L]) and their mask
    [B, 1, 1, L] (L: the longest context; shorter ones padded and masked)."""
    num_decodes = len(decode_tables)
    if not num_decodes:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, 1, 1, 0, dtype=torch.bool)
    max_len = max(decode_lens)
    offsets = torch.arange(block_size, dtype=torch.int64)
    table_tensor = _padded_tables(decode_tables, -(-max_len // block_size))
    decode_slots = (table_tensor[:, :, None] * block_size + offsets).reshape(num_decodes, -1)[:, :max_len]
    decode_index = _head_rows(decode_slots, num_kv_heads).reshape(-1)
    lens = torch.tensor(decode_lens, dtype=torch.int64)
    decode_mask = (torch.arange(max_len)[None, :] < lens[:, None]).view(num_decodes, 1, 1, max_len)
    return decode_index, decode_mask


def _padded_tables(tables: list[list[int]], width: int | None = None) -> torch.Tensor:
    """Block tables as one [len(tables), width] int64 tensor, zero-padded."""
    out = torch.zeros(len(tables), width or max(len(t) for t in tables), dtype=torch.int64)
    for i, table in enumerate(tables):
        out[i, : len(table)] = torch.tensor(table, dtype=torch.int64)
    return out


def _uses_native(num_native: int, every_row_native: bool, device: torch.device) -> bool:
    """Whether the native kernel attends the step's rows that it can: on a CPU where the native
    library loaded, and in a larger step only when every row must be native (else the batched
    torch path is faster)."""
    return (
        num_native > 0
        and (every_row_native or num_native <= NATIVE_ATTENTION_MAX_ROWS)
        and device.type == "cpu"
        and NATIVE_ATTENTION
        and int4_native.load() is not None
    )


def _prompt_segment(
    blocks: list[int], row: int, n: int, ctx: int, short: bool, block_size: int, num_kv_heads: int,
    device: torch.device,
) -> tuple[PrefillSegment, torch.Tensor]:  # fmt: skip
    """A request computing `n` > 1 tokens at the end of its `ctx`-token context (rows `row`..):
    its segment, and the slots its new tokens are written to."""
    offsets = torch.arange(block_size, dtype=torch.int64)
    all_slots = (torch.tensor(blocks, dtype=torch.int64)[:, None] * block_size + offsets[None, :]).reshape(
        -1
    )[:ctx]
    kv_index = mask = None
    if ctx != n:  # cached prefix: query j (position ctx-n+j) sees keys <= its position
        kv_index = _head_rows(all_slots, num_kv_heads).reshape(-1).to(device)
        mask = (torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]).to(device)
    return PrefillSegment(row, row + n, kv_index, mask, short=short, context_len=ctx), all_slots[ctx - n :]


def build_attention_metadata(
    block_tables: list[list[int]],
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    device: torch.device,
    every_row_native: bool = False,
) -> AttentionMetadata:
    """Index tensors for one step. Request i has `query_lens[i]` new tokens and, after them,
    `context_lens[i]` tokens in its context; its new tokens are the last ones of the context.
    `every_row_native` (a batch-invariant engine): where the native kernel runs, it attends every
    row of the step, prompt chunks and large batches included, each over its own keys in one fixed
    order, so that a row's attention never depends on the step it is in."""
    if uses_triton(device):
        return build_paged_metadata(block_tables, query_lens, context_lens, block_size, device)
    slot_chunks: list[torch.Tensor] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillSegment] = []
    native_rows: list[int] = []
    native_positions: list[int] = []
    native_tables: list[list[int]] = []
    attends_natively = _attends_always if every_row_native else _attends_natively
    num_native = sum(n for n, ctx in zip(query_lens, context_lens, strict=True) if attends_natively(n, ctx))
    use_native = _uses_native(num_native, every_row_native, device)
    row = 0
    for table, n, ctx in zip(block_tables, query_lens, context_lens, strict=True):
        num_blocks = -(-ctx // block_size)
        short = use_native and attends_natively(n, ctx)
        if short:
            native_rows.extend(range(row, row + n))
            native_positions.extend(range(ctx - n, ctx))
            native_tables.extend([table[:num_blocks]] * n)
        if n == 1:
            decode_rows.append(row)
            decode_tables.append(table[:num_blocks])
            decode_lens.append(ctx)
            last_slot = table[(ctx - 1) // block_size] * block_size + (ctx - 1) % block_size
            slot_chunks.append(torch.tensor([last_slot], dtype=torch.int64))
        else:
            segment, slots = _prompt_segment(
                table[:num_blocks], row, n, ctx, short, block_size, num_kv_heads, device
            )
            slot_chunks.append(slots)
            prefills.append(segment)
        row += n

    return _metadata(
        slot_chunks, decode_rows, decode_tables, decode_lens, prefills, native_rows, native_positions,
        native_tables, block_size, num_kv_heads, device,
    )  # fmt: skip


def _metadata(
    slot_chunks: list[torch.Tensor], decode_rows: list[int], decode_tables: list[list[int]],
    decode_lens: list[int], prefills: list[PrefillSegment], native_rows: list[int],
    native_positions: list[int], native_tables: list[list[int]], block_size: int, num_kv_heads: int,
    device: torch.device,
) -> AttentionMetadata:  # fmt: skip
    """The step's rows (`build_attention_metadata`) as tensors on `device`."""
    decode_index, decode_mask = _decode_keys(decode_tables, decode_lens, block_size, num_kv_heads)
    native_block_tables = _padded_tables(native_tables) if native_rows else None
    return AttentionMetadata(
        slot_mapping=torch.cat(slot_chunks).to(device),
        decode_rows=torch.tensor(decode_rows, dtype=torch.int64, device=device),
        decode_kv_index=decode_index.to(device),
        decode_mask=decode_mask.to(device),
        decode_max_len=max(decode_lens, default=0),
        prefills=prefills,
        num_decodes=len(decode_rows),
        native_rows=torch.tensor(native_rows, dtype=torch.int64, device=device) if native_rows else None,
        native_positions=torch.tensor(native_positions, dtype=torch.int64, device=device)
        if native_rows
        else None,
        native_block_tables=None if native_block_tables is None else native_block_tables.to(device),
        decode_lens=torch.tensor(decode_lens, dtype=torch.int64, device=device),
    )


def build_paged_metadata(
    block_tables: list[list[int]],
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """`build_attention_metadata` for the Triton kernel: the new tokens' slots and `PagedRows`."""
    slot_mapping, paged = build_paged_rows(block_tables, query_lens, context_lens, block_size, device)
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        decode_rows=empty,
        decode_kv_index=empty,
        decode_mask=torch.zeros(0, 1, 1, 0, dtype=torch.bool, device=device),
        decode_max_len=0,
        prefills=[],
        num_decodes=0,
        paged=paged,
    )


def _attends_natively(query_len: int, context_len: int) -> bool:
    """A decode row, or a short segment after a cached prefix (a verification step's rows)."""
    return query_len == 1 or (query_len <= NATIVE_SEGMENT_MAX_ROWS and context_len != query_len)


def _attends_always(query_len: int, context_len: int) -> bool:
    return True
