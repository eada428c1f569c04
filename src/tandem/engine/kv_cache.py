"""Paged KV-cache bookkeeping: block pool and per-request block tables (no torch).

Physical KV memory is `num_blocks` blocks of `block_size` token slots each; the tensors live
in the model runner. Here we only decide which request owns which block.

Invariants (checked by `check_integrity()`):
- every block is either free (ref count 0, in the free list exactly once) or in use (ref > 0);
- the sum of ref counts equals the number of block-table entries of live requests;
- a block's generation tag changes every time it is handed out, so a holder of a stale
  (block id, generation) pair can tell that the block was reassigned;
- block tables are append-only while a request runs, and freed as a whole.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """Fixed set of physical blocks with ref counts, a free list in eviction order and tags.

    The free list is ordered oldest-freed first; `allocate` takes from its head, so a block that
    was freed recently is reused last (what a prefix cache wants to keep around longest).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.generations = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Hand out `num_blocks` free blocks (ref count 1, generation bumped) or raise."""
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self.ref_counts[block_id] = 1
            self.generations[block_id] += 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero go to the free list's tail.

        Blocks are released in reverse so a request's tail blocks are evicted before its head.
        """
        for block_id in reversed(block_ids):
            ref = self.ref_counts[block_id]
            if ref <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            self.ref_counts[block_id] = ref - 1
            if ref == 1:
                self._free[block_id] = None

    def check_integrity(self) -> None:
        free = self._free
        assert len(free) + sum(1 for r in self.ref_counts if r > 0) == self.num_blocks, "block leak"
        for block_id, ref in enumerate(self.ref_counts):
            assert ref >= 0, f"negative ref count on block {block_id}"
            assert (ref == 0) == (block_id in free), f"block {block_id}: ref {ref} vs free list"


@dataclass
class BlockTable:
    """One request's blocks in logical order and the generation each had when it was handed out."""

    block_ids: list[int]
    generations: list[int]


class KVCacheManager:
    """Owns the block pool and one `BlockTable` per live request."""

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.tables: dict[str, BlockTable] = {}
        # Admission keeps this many blocks spare so just-admitted requests do not preempt at once.
        self.num_watermark_blocks = int(watermark * num_blocks)

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> BlockTable:
        return self.tables[request_id]

    def num_new_blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        table = self.tables.get(request_id)
        have = len(table.block_ids) if table is not None else 0
        return max(0, self.num_blocks_for(num_total_tokens) - have)

    def allocate_slots(self, request_id: str, num_total_tokens: int, *, admission: bool = False) -> bool:
        """Grow the request's table to hold `num_total_tokens` tokens. False if blocks are short.

        With `admission=True` the watermark must remain free afterwards. Never partially allocates.
        """
        num_new = self.num_new_blocks_needed(request_id, num_total_tokens)
        reserve = self.num_watermark_blocks if admission else 0
        if num_new + reserve > self.pool.num_free_blocks:
            return False
        table = self.tables.setdefault(request_id, BlockTable([], []))
        if num_new:
            new_ids = self.pool.allocate(num_new)
            table.block_ids.extend(new_ids)
            table.generations.extend(self.pool.generations[b] for b in new_ids)
        return True

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        if table is not None:
            self.pool.free(table.block_ids)

    def is_table_current(self, request_id: str) -> bool:
        """True when every block of the request still carries the generation it was given."""
        table = self.tables[request_id]
        generations = self.pool.generations
        return all(generations[b] == g for b, g in zip(table.block_ids, table.generations, strict=True))

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs = [0] * self.pool.num_blocks
        for request_id, table in self.tables.items():
            assert len(table.block_ids) == len(table.generations), request_id
            for block_id in table.block_ids:
                refs[block_id] += 1
        assert refs == self.pool.ref_counts, "ref counts differ from block-table references"
        for request_id in self.tables:
            assert self.is_table_current(request_id), f"{request_id} holds a reassigned block"
