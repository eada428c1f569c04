"""A step's rows as the Triton attention kernel reads them (`PagedRows`), built on the host.

Contract (`build_paged_rows`): request i has `query_lens[i]` rows this step, the last ones of its
`context_lens[i]` positions, and its blocks `block_tables[i]` (entries for released positions may
be -1: they are passed through and never read). The rows are cut into query tiles of `block_q`
rows, each within one request (`build_query_tiles`): 1 row for decode-only steps, 16 otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedRows:
    """What `triton_attention.paged_attention_triton` reads besides the cache. All int32, on the
    device."""

    block_tables: torch.Tensor  # [B, width] each request's blocks, -1 past them (width: the longest)
    seq_lens: torch.Tensor  # [B] context length after this step
    query_start: torch.Tensor  # [B + 1] first row of each request, then the row count
    tile_request: torch.Tensor  # [num_tiles] the request of each query tile
    tile_row: torch.Tensor  # [num_tiles] the first row of each query tile
    block_q: int  # rows per tile


def query_tile_rows(max_query_len: int) -> int:
    """BLOCK_Q, the query rows one program takes: 1 for decode-only steps (a tile is one row's GQA
    group), else 16 (with a group of 4, 64 tile rows)."""
    return 1 if max_query_len <= 1 else 16


def build_query_tiles(query_lens: list[int], block_q: int) -> tuple[list[int], list[int]]:
    """(tile_request, tile_row): each request's rows in runs of `block_q`, in row order."""
    tile_request: list[int] = []
    tile_row: list[int] = []
    row = 0
    for request, n in enumerate(query_lens):
        for first in range(row, row + n, block_q):
            tile_request.append(request)
            tile_row.append(first)
        row += n
    return tile_request, tile_row


def build_paged_rows(
    block_tables: list[list[int]],
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, PagedRows]:
    """(slot_mapping [T] int64: the flat cache slot of each new token, the step's `PagedRows`).
    One host tensor per field (a Python loop per request would cost milliseconds at 256 rows)."""
    used = [table[: -(-ctx // block_size)] for table, ctx in zip(block_tables, context_lens, strict=True)]
    width = max(1, max((len(blocks) for blocks in used), default=1))
    tables = [blocks + [-1] * (width - len(blocks)) for blocks in used] or [[-1]]
    slots: list[int] = []
    for table, n, ctx in zip(block_tables, query_lens, context_lens, strict=True):
        if n == 1:
            slots.append(table[(ctx - 1) // block_size] * block_size + (ctx - 1) % block_size)
        else:
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(ctx - n, ctx))
    query_start = [0]
    for n in query_lens:
        query_start.append(query_start[-1] + n)
    block_q = query_tile_rows(max(query_lens, default=0))
    tile_request, tile_row = build_query_tiles(query_lens, block_q)

    def on_device(values: list[int] | list[list[int]], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.as_tensor(values, dtype=dtype).to(device, non_blocking=True)

    rows = PagedRows(
        block_tables=on_device(tables),
        seq_lens=on_device(context_lens),
        query_start=on_device(query_start),
        tile_request=on_device(tile_request),
        tile_row=on_device(tile_row),
        block_q=block_q,
    )
    return on_device(slots, torch.int64), rows
