"""Decode steps replayed from CUDA graphs, one per batch-size bucket (`DecodeGraphs`).

A decode step of B requests (one token each, no LoRA rows, no drafts) runs the graph of the
smallest bucket >= B: its static inputs are overwritten in place (token ids, positions, the
new tokens' slots, block tables, context lengths), rows B.. are padding (token 0 at position 0,
slot -1: written nowhere, context length 0: attending nothing), and the first B rows of the
static logits are the step's. Every other step runs eagerly.

Contract: the graphs are captured once at start (`capture`), largest bucket first, into one
shared memory pool, after a warm-up run of each; the time and the device memory they took are
logged. The forward must take its attention metadata as `AttentionMetadata.paged` (the Triton
path), whose tensors are these static buffers. `capture=False` keeps the buffers and padding but
calls the forward eagerly at each step: the same code path without CUDA (the CPU tests use it with
the Triton interpreter).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from tandem.engine.models.interface import KVLayer
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.paged_rows import PagedRows, build_paged_rows

logger = logging.getLogger("tandem.engine.runner")

Forward = Callable[..., torch.Tensor]


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Buckets up to `max_batch`: 1, 2, 4, 8, then every 8 to 64, then every 32 (vLLM's spacing:
    padding wastes at most a few rows where steps are cheap and few percent beyond)."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(96, 1025, 32)]
    chosen = [size for size in sizes if size < max_batch]
    return [*chosen, max_batch]


class _Graph:
    """One bucket's static buffers, metadata and (when captured) its graph and output."""

    def __init__(self, batch: int, max_blocks: int, device: torch.device) -> None:
        self.batch = batch
        self.input_ids = torch.zeros(batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(batch, dtype=torch.int64, device=device)
        self.logits_rows = torch.arange(batch, dtype=torch.int64, device=device)
        self.metadata = AttentionMetadata(
            slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device=device),
            decode_rows=torch.zeros(0, dtype=torch.int64, device=device),
            decode_kv_index=torch.zeros(0, dtype=torch.int64, device=device),
            decode_mask=torch.zeros(0, 1, 1, 0, dtype=torch.bool, device=device),
            decode_max_len=0,
            prefills=[],
            num_decodes=0,
            paged=PagedRows(
                block_tables=torch.full((batch, max_blocks), -1, dtype=torch.int32, device=device),
                seq_lens=torch.zeros(batch, dtype=torch.int32, device=device),
                query_start=torch.arange(batch + 1, dtype=torch.int32, device=device),
                tile_request=torch.arange(batch, dtype=torch.int32, device=device),
                tile_row=torch.arange(batch, dtype=torch.int32, device=device),
                block_q=1,
            ),
        )
        self.graph: Any = None
        self.logits: torch.Tensor | None = None


class DecodeGraphs:
    def __init__(
        self,
        forward: Forward,
        kv_caches: list[KVLayer],
        block_size: int,
        max_model_len: int,
        batch_sizes: list[int],
        device: torch.device,
    ) -> None:
        self.forward = forward
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self.graphs = {size: _Graph(size, self.max_blocks, device) for size in sorted(batch_sizes)}
        self.max_batch = max(batch_sizes)
        self.captured = False
        self.num_replays = 0

    def capture(self) -> None:
        """Warm up and capture each bucket's graph, largest first, in one memory pool."""
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for graph in sorted(self.graphs.values(), key=lambda g: -g.batch):
                self._call(graph)  # warm-up: Triton compiles, allocator settles
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for graph in sorted(self.graphs.values(), key=lambda g: -g.batch):
            graph.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph.graph, pool=pool):
                graph.logits = self._call(graph)
        torch.cuda.synchronize(self.device)
        self.captured = True
        logger.info(
            "decode graphs captured",
            extra={
                "batch_sizes": sorted(self.graphs), "seconds": round(time.perf_counter() - started, 2),
                "memory_bytes": int(free_before - torch.cuda.mem_get_info(self.device)[0]),
            },
        )  # fmt: skip

    def _call(self, graph: _Graph) -> torch.Tensor:
        return self.forward(
            graph.input_ids, graph.positions, self.kv_caches, graph.metadata, graph.logits_rows
        )

    def run(
        self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]
    ) -> torch.Tensor:  # [B, vocab] float32
        """One decode step of B = len(token_ids) requests (B <= max_batch): request i's token
        `token_ids[i]` at `positions[i]`, its blocks `block_tables[i]` (module docstring)."""
        batch = len(token_ids)
        graph = self.graphs[min(size for size in self.graphs if size >= batch)]
        paged = graph.metadata.paged
        assert paged is not None
        padding = graph.batch - batch
        lens = [p + 1 for p in positions]
        slots, rows = build_paged_rows(block_tables, [1] * batch, lens, self.block_size, torch.device("cpu"))
        # padding rows: token 0 at position 0, written nowhere (slot -1), attending nothing (length 0);
        # only the table columns some row reads are refreshed (a row never reads past its own blocks)
        graph.input_ids.copy_(torch.tensor(token_ids + [0] * padding, dtype=torch.int64), non_blocking=True)
        graph.positions.copy_(torch.tensor(positions + [0] * padding, dtype=torch.int64), non_blocking=True)
        graph.metadata.slot_mapping.copy_(
            torch.cat([slots, slots.new_full((padding,), -1)]), non_blocking=True
        )
        paged.seq_lens.copy_(torch.tensor(lens + [0] * padding, dtype=torch.int32), non_blocking=True)
        paged.block_tables[:batch, : rows.block_tables.shape[1]].copy_(rows.block_tables, non_blocking=True)
        if self.captured:
            graph.graph.replay()
            assert graph.logits is not None
            logits = graph.logits
        else:
            logits = self._call(graph)
        self.num_replays += 1
        return logits[:batch]
