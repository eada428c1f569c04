"""KV bookkeeping paged per (layer, KV head), for requests whose cache is compressed (no torch).

A compressed request evicts different tokens in each attention head, so its heads hold different
numbers of tokens. In the shared layout (`kv_cache.KVCacheManager`) a block holds a token for
every layer and head at once, so evicting a token in one head frees nothing. Here each head of
each layer has its own block table over a pool of *head blocks*: one head block holds
`block_size` tokens of one (layer, KV head), keys and values (`head_dim` each). Evicting a head's
tokens packs the tokens it keeps to the front of its table and returns the blocks that are then
empty to the pool, for any request to use.

Head index `h` below is `layer * num_kv_heads + kv_head`. A head's tokens are numbered by where
they sit in its table (0 .. num_tokens - 1), not by their positions in the sequence: after an
eviction, index i of two heads may be different tokens. Keys are stored after RoPE, so attention
needs only the kept vectors, not their positions.

Invariants (checked by `check_integrity()`):
- every head block is free or owned by exactly one (request, head) table (no sharing: the
  compressed state of a request is private to it, so no request can read another's evictions);
- a head's table has exactly `ceil(num_tokens / block_size)` blocks, its tokens packed from slot 0;
- all heads of a request have received the same number of tokens in total (appended), evicted
  ones included;
- every head block still carries the generation it had when its table got it (integrity tags,
  as in `kv_cache`: `stale_requests` finds holders of reassigned blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.engine.kv.block_pool import BlockPool, NoFreeBlocksError


@dataclass
class HeadTable:
    """One (layer, KV head) of one request: its head blocks in order, and how many tokens it
    holds (packed from slot 0 of the first block)."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    generations: list[int] = field(default_factory=list)  # each block's generation when handed out


@dataclass(frozen=True)
class EvictionMoves:
    """What the runner must do after `HeadKVCacheManager.evict`: copy the vector at flat head slot
    `src_slots[i]` to `dst_slots[i]` (flat slot = head block id * block_size + offset) for every i,
    all sources read before any destination is written (a gather, then a scatter). Blocks in
    `freed_block_ids` are back in the pool when `evict` returns: the copies must run before the
    next step writes anything."""

    src_slots: list[int]
    dst_slots: list[int]
    freed_block_ids: list[int]


class HeadKVCacheManager:
    """Per-(layer, KV head) block tables over one pool of head blocks."""

    def __init__(self, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int) -> None:
        self.block_size = block_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.num_heads = num_layers * num_kv_heads
        self.pool = BlockPool(num_blocks)
        self.tables: dict[str, list[HeadTable]] = {}  # request id -> one table per head
        self.num_appended: dict[str, int] = {}  # request id -> tokens appended to every head

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def head_tables(self, request_id: str) -> list[HeadTable]:
        return self.tables[request_id]

    def num_tokens(self, request_id: str) -> list[int]:
        """Tokens each head of the request holds now (index `layer * num_kv_heads + kv_head`)."""
        return [t.num_tokens for t in self.tables[request_id]]

    def num_blocks_used(self, request_id: str) -> int:
        return sum(len(t.block_ids) for t in self.tables.get(request_id, ()))

    def num_new_blocks_needed(self, request_id: str, num_new_tokens: int) -> int:
        """Head blocks that appending `num_new_tokens` to every head of the request would take."""
        tables = self.tables.get(request_id)
        if tables is None:
            return self.num_heads * self._blocks_for(num_new_tokens)
        return sum(self._blocks_for(t.num_tokens + num_new_tokens) - len(t.block_ids) for t in tables)

    def append_slots(self, request_id: str, num_new_tokens: int) -> list[list[int]] | None:
        """Room for `num_new_tokens` more tokens in every head of the request (a new request gets
        its tables here). Returns, per head, the flat head slots the new tokens go to, in order;
        None (and nothing allocated) when the pool is short."""
        if self.num_new_blocks_needed(request_id, num_new_tokens) > self.pool.num_free_blocks:
            return None
        tables = self.tables.setdefault(request_id, [HeadTable() for _ in range(self.num_heads)])
        self.num_appended[request_id] = self.num_appended.get(request_id, 0) + num_new_tokens
        bs = self.block_size
        slots: list[list[int]] = []
        for table in tables:
            num_new_blocks = self._blocks_for(table.num_tokens + num_new_tokens) - len(table.block_ids)
            if num_new_blocks:
                new_ids = self.pool.allocate(num_new_blocks)
                table.block_ids.extend(new_ids)
                table.generations.extend(self.pool.generations[b] for b in new_ids)
            start = table.num_tokens
            slots.append(
                [table.block_ids[i // bs] * bs + i % bs for i in range(start, start + num_new_tokens)]
            )
            table.num_tokens += num_new_tokens
        return slots

    def evict(self, request_id: str, kept: Sequence[Sequence[int]]) -> EvictionMoves:
        """Keep, in head h, only its tokens `kept[h]` (indices into the head's current tokens,
        strictly increasing; at least one per head) and free the blocks no longer needed.

        The kept tokens move to the front of the head's table in their order, so the head's
        attention sees the same vectors in the same order as before, minus the evicted ones."""
        tables = self.tables[request_id]
        if len(kept) != self.num_heads:
            raise ValueError(f"expected kept tokens for {self.num_heads} heads, got {len(kept)}")
        bs = self.block_size
        src_slots: list[int] = []
        dst_slots: list[int] = []
        freed: list[int] = []
        for head, (table, keep) in enumerate(zip(tables, kept, strict=True)):
            if not keep:
                raise ValueError(f"head {head} would keep no tokens (attention needs at least one)")
            previous = -1
            for index in keep:
                if not previous < index < table.num_tokens:
                    raise ValueError(
                        f"head {head}: kept indices must increase within 0..{table.num_tokens - 1}"
                    )
                previous = index
            for new_index, old_index in enumerate(keep):
                if new_index != old_index:
                    src_slots.append(table.block_ids[old_index // bs] * bs + old_index % bs)
                    dst_slots.append(table.block_ids[new_index // bs] * bs + new_index % bs)
            num_keep_blocks = self._blocks_for(len(keep))
            tail = table.block_ids[num_keep_blocks:]
            del table.block_ids[num_keep_blocks:]
            del table.generations[num_keep_blocks:]
            table.num_tokens = len(keep)
            freed.extend(tail)
        self.pool.free(freed)
        return EvictionMoves(src_slots, dst_slots, freed)

    def free(self, request_id: str) -> None:
        tables = self.tables.pop(request_id, None)
        self.num_appended.pop(request_id, None)
        if tables is not None:
            self.pool.free([b for t in tables for b in t.block_ids])

    def stale_requests(self, request_ids: Sequence[str]) -> list[str]:
        """Of `request_ids`, those holding a head block whose generation changed since it was
        handed to them (the KV integrity tags of `kv_cache`, per head block): such a block was
        given to someone else, and its contents may be theirs. O(their blocks)."""
        generations = self.pool.generations
        stale: list[str] = []
        for request_id in request_ids:
            tables = self.tables.get(request_id)
            if tables is None:
                continue
            block_ids = [b for t in tables for b in t.block_ids]
            expected = [g for t in tables for g in t.generations]
            if list(map(generations.__getitem__, block_ids)) != expected:
                stale.append(request_id)
        return stale

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        owners: dict[int, tuple[str, int]] = {}
        for request_id, tables in self.tables.items():
            assert len(tables) == self.num_heads, f"{request_id}: {len(tables)} head tables"
            for head, table in enumerate(tables):
                assert table.num_tokens >= 0, (request_id, head)
                assert len(table.block_ids) == self._blocks_for(table.num_tokens), (
                    f"{request_id} head {head}: {len(table.block_ids)} blocks for {table.num_tokens} tokens"
                )
                assert table.num_tokens <= self.num_appended[request_id], (request_id, head)
                assert len(table.generations) == len(table.block_ids), (request_id, head)
                for block_id in table.block_ids:
                    assert block_id not in owners, f"block {block_id} shared by {owners[block_id]}"
                    owners[block_id] = (request_id, head)
        assert len(owners) == self.pool.num_used_blocks, "head blocks used but owned by no table"
        stale = self.stale_requests(list(self.tables))
        assert not stale, f"{stale} hold reassigned head blocks"


__all__ = ["EvictionMoves", "HeadKVCacheManager", "HeadTable", "NoFreeBlocksError"]
