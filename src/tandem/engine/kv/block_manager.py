"""Paged KV-cache bookkeeping: block pool and per-request block tables (no torch).

Physical KV memory is `num_blocks` blocks of `block_size` token slots each; the tensors live
in the model runner. Here we only decide which request owns which block.

Invariants (checked by `check_integrity()`):
- every block is either free (ref count 0, in the free list exactly once) or in use (ref > 0);
- the sum of ref counts equals the number of block-table entries of live requests;
- a block's generation tag changes every time it is handed out, so a holder of a stale
  (block id, generation) pair can tell that the block was reassigned;
- block tables are append-only while a request runs, and freed as a whole, except that with a
  sliding window (every layer of the model attends only its last `sliding_window` positions) a
  block no future query can read is given back early and its entry becomes `FREED_BLOCK`
  (`release_outside_window`): a table's length stays the request's length in blocks;
- only full, computed blocks are in more than one table (prefix-cache hits, `fork`), so a
  shared block is never written again;
- prefix cache: a full block may carry a hash (of its parent block's hash, its tokens and the
  request's cache salt: adapter and tenant; with a sliding window a hit needs only the blocks
  inside the window of its first computed position, `_usable_prefix`); `cached` maps each hash to exactly one block with that
  hash. A cached block stays cached while free (it is only evicted when the free list hands it
  out again, oldest-freed first), so a new request with the same prefix reuses it without
  recomputing. Reusing a cached block does not change its generation (its contents are the same);
  handing it out for new contents does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import chain

import numpy as np

from tandem.engine.kv.block_pool import FREED_BLOCK, BlockPool, NoFreeBlocksError

__all__ = ["FREED_BLOCK", "BlockPool", "BlockTable", "KVCacheManager", "NoFreeBlocksError"]

TokenSlice = Callable[[int, int], list[int]]  # (start, end) -> token ids [start, end) of a request


@dataclass
class BlockTable:
    """One request's blocks in logical order and the generation each had when it was handed out."""

    block_ids: list[int]
    generations: list[int]
    # Its leading blocks already published to the prefix cache (or taken from it): a block is
    # published once, when it fills (`KVCacheManager.cache_full_blocks`).
    num_published: int = 0


class KVCacheManager:
    """Owns the block pool and one `BlockTable` per live request (plus the prefix cache)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
        sliding_window: int | None = None,
    ) -> None:
        self.block_size = block_size
        # Every layer attends at most this many latest positions: older blocks are given back
        # (`release_outside_window`). None: a request keeps its blocks until it ends.
        self.sliding_window = sliding_window
        self.num_window_released = 0  # blocks given back early because they left the window
        self.pool = BlockPool(num_blocks)
        self.tables: dict[str, BlockTable] = {}
        # Admission keeps this many blocks spare so just-admitted requests do not preempt at once.
        self.num_watermark_blocks = int(watermark * num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self._block_hashes: dict[str, list[int]] = {}  # request -> hashes of its full blocks so far
        # KV integrity, kept up to date from what changed: block -> the requests whose tables hold
        # it, and the requests holding a block handed out again since they got it
        self._holders: dict[int, set[str]] = {}
        self._stale: set[str] = set()
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of which found cached

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

    def _hashes(self, request_id: str, tokens: TokenSlice, num_full_blocks: int, salt: object) -> list[int]:
        """Hashes of the first `num_full_blocks` blocks (parent hash, block tokens, salt), kept
        per request so each block is hashed once. `tokens(start, end)` gives token ids."""
        return self._extend_hashes(request_id, tokens, num_full_blocks, salt)[:num_full_blocks]

    def _extend_hashes(
        self, request_id: str, tokens: TokenSlice, num_full_blocks: int, salt: object
    ) -> list[int]:
        """The request's kept hash list, extended to at least `num_full_blocks` (not a copy)."""
        hashes = self._block_hashes.setdefault(request_id, [])
        bs = self.block_size
        for index in range(len(hashes), num_full_blocks):
            parent = hashes[index - 1] if index else None
            hashes.append(hash((parent, tuple(tokens(index * bs, (index + 1) * bs)), salt)))
        return hashes

    def _usable_prefix(self, hashes: list[int], whole: bool = False) -> list[int]:
        """The block ids of the longest prefix a request with these leading block hashes can skip
        computing: without a window, the leading run of cached blocks; with one, the longest k
        whose blocks inside the window of position k * block_size (what its first computed token
        reads) are all cached, earlier entries `FREED_BLOCK` (they need not be cached: no query of
        the request reads them). A hash names a block's tokens and everything before them, so a
        cached block holds the right KV whatever became of its predecessors. `whole`: the leading
        run only (a prefill whose blocks are exported whole)."""
        present = [self.pool.cached.get(h) for h in hashes]
        if self.sliding_window is None or whole:
            run = next((i for i, block_id in enumerate(present) if block_id is None), len(present))
            return [b for b in present[:run] if b is not None]
        run_ending_at: list[int] = []  # [i]: consecutive cached blocks ending at index i
        for i, block_id in enumerate(present):
            run_ending_at.append(0 if block_id is None else 1 + (run_ending_at[i - 1] if i else 0))
        for k in range(len(present), 0, -1):
            first = max(0, k * self.block_size - self.sliding_window + 1) // self.block_size
            if run_ending_at[k - 1] >= k - first:
                return [FREED_BLOCK] * first + [b for b in present[first:k] if b is not None]
        return []

    def allocate_cached_prefix(
        self, request_id: str, num_tokens: int, tokens: TokenSlice, salt: object, *, whole: bool = False
    ) -> int:
        """For a request about to be admitted (no blocks yet): take the cached blocks of the
        longest usable prefix of its tokens (`_usable_prefix`; at least one token is always left
        to compute) and return how many tokens that prefix holds. Undo with `free(request_id)` if
        admission then fails."""
        if not self.enable_prefix_caching or request_id in self.tables:
            return 0
        max_blocks = (num_tokens - 1) // self.block_size
        hits = self._usable_prefix(self._hashes(request_id, tokens, max_blocks, salt), whole)
        self.num_prefix_queries += num_tokens
        self.num_prefix_hits += len(hits) * self.block_size
        if not hits:
            return 0
        for block_id in hits:
            if block_id != FREED_BLOCK:
                self.pool.touch(block_id)
        generations = [self.pool.generations[b] if b != FREED_BLOCK else 0 for b in hits]
        self.tables[request_id] = BlockTable(hits, generations, num_published=len(hits))
        self._hold(request_id, hits)
        return len(hits) * self.block_size

    def fork(self, request_id: str, parent_id: str, num_blocks: int) -> int:
        """For a request about to be admitted (no blocks yet) whose tokens start as `parent_id`'s:
        share the parent's first `num_blocks` blocks (full and computed: they are never written
        again, so sharing needs no copy) and return how many tokens they hold."""
        assert request_id not in self.tables, f"{request_id} already holds blocks"
        parent = self.tables[parent_id]
        assert 0 <= num_blocks <= len(parent.block_ids), "fork beyond the parent's blocks"
        shared = parent.block_ids[:num_blocks]
        for block_id in shared:
            if block_id != FREED_BLOCK:
                self.pool.touch(block_id)
        self.tables[request_id] = BlockTable(
            list(shared),
            list(parent.generations[:num_blocks]),
            num_published=min(num_blocks, parent.num_published),
        )
        self._hold(request_id, shared)
        return num_blocks * self.block_size

    def num_cached_prefix_blocks(self, num_tokens: int, tokens: TokenSlice, salt: object) -> int:
        """How many leading full blocks of a prompt of `num_tokens` tokens the prefix cache holds
        now (as `allocate_cached_prefix` would take them; a lookup: nothing is taken or touched)."""
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        hashes: list[int] = []
        parent: int | None = None
        for index in range((num_tokens - 1) // bs):
            parent = hash((parent, tuple(tokens(index * bs, (index + 1) * bs)), salt))
            hashes.append(parent)
        return len(self._usable_prefix(hashes))

    def cache_full_blocks(
        self, request_id: str, tokens: TokenSlice, num_computed_tokens: int, salt: object
    ) -> None:
        """Publish the request's blocks that are now full of computed tokens to the prefix cache:
        those past the ones published before (`BlockTable.num_published`), so a step costs what it
        filled, not the table. A block whose contents another block holds cached stays uncached
        (`BlockPool.cache`)."""
        if not self.enable_prefix_caching:
            return
        table = self.tables.get(request_id)
        if table is None:
            return
        num_full = min(num_computed_tokens // self.block_size, len(table.block_ids))
        if num_full <= table.num_published:
            return
        hashes = self._extend_hashes(request_id, tokens, num_full, salt)
        for index in range(table.num_published, num_full):
            block_id = table.block_ids[index]
            if block_id != FREED_BLOCK:
                self.pool.cache(block_id, hashes[index])
        table.num_published = num_full

    def allocate_slots(self, request_id: str, num_total_tokens: int, *, admission: bool = False) -> bool:
        """Grow the request's table to hold `num_total_tokens` tokens. False if blocks are short.

        With `admission=True` the watermark must remain free afterwards. Never partially allocates.
        """
        num_new = self.num_new_blocks_needed(request_id, num_total_tokens)
        reserve = self.num_watermark_blocks if admission else 0
        if num_new + reserve > self.pool.num_free_blocks:
            return False
        table = self.tables.get(request_id)
        if table is None:
            table = self.tables[request_id] = BlockTable([], [])
        if num_new:
            new_ids = self.pool.allocate(num_new)
            table.block_ids.extend(new_ids)
            table.generations.extend(self.pool.generations[b] for b in new_ids)
            self._hold(request_id, new_ids)
        return True

    def release_outside_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Give back the request's blocks that hold only positions below
        `num_computed_tokens - sliding_window + 1`: the next query (position `num_computed_tokens`
        or later) attends keys from there on, so no layer reads them again. Their entries become
        `FREED_BLOCK`; a prefix-cached block stays cached while free, as any freed block does.
        Returns how many entries were released (0 without a window)."""
        table = self.tables.get(request_id)
        if self.sliding_window is None or table is None:
            return 0
        first_needed = max(0, num_computed_tokens - self.sliding_window + 1)
        released = []
        for index in range(min(first_needed // self.block_size, len(table.block_ids))):
            if table.block_ids[index] != FREED_BLOCK:
                released.append(table.block_ids[index])
                table.block_ids[index] = FREED_BLOCK
                table.generations[index] = 0
        self._let_go(request_id, released)
        self.pool.free(released)
        self.num_window_released += len(released)
        return len(released)

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (its table less the entries released by the window)."""
        table = self.tables.get(request_id)
        return 0 if table is None else sum(1 for b in table.block_ids if b != FREED_BLOCK)

    def decode_block_ids(self, request_id: str, num_total_tokens: int) -> list[int] | None:
        """`runner_block_ids` once the request's table holds `num_total_tokens` tokens (a decode's
        block allocated when its token starts one); None when blocks are short (nothing changed)."""
        table = self.tables.get(request_id)
        if table is None:
            return None
        if len(table.block_ids) * self.block_size < num_total_tokens and not self.allocate_slots(
            request_id, num_total_tokens
        ):
            return None
        if self.sliding_window is None:
            return table.block_ids
        return [0 if b == FREED_BLOCK else b for b in table.block_ids]

    def runner_block_ids(self, request_id: str) -> list[int]:
        """The table as the attention kernels read it: released entries point at block 0, which
        only ever holds finite values and is masked out (it is outside the window)."""
        block_ids = self.tables[request_id].block_ids
        if self.sliding_window is None:
            return block_ids
        return [0 if b == FREED_BLOCK else b for b in block_ids]

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        self._block_hashes.pop(request_id, None)
        self._stale.discard(request_id)
        if table is not None:
            self._let_go(request_id, table.block_ids)
            self.pool.free(table.block_ids)

    def _hold(self, request_id: str, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if block_id != FREED_BLOCK:
                self._holders.setdefault(block_id, set()).add(request_id)

    def _let_go(self, request_id: str, block_ids: list[int]) -> None:
        for block_id in block_ids:
            holders = self._holders.get(block_id)
            if holders is not None:
                holders.discard(request_id)
                if not holders:
                    del self._holders[block_id]

    def stale_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Of `request_ids`, those holding a block whose generation changed since they got it.
        Kept from what changed: the blocks whose generation was written since the last call
        (`Generations.take_written`: handed out again, or tampered with) are compared with their
        holders' tables; a request found stale stays so until its blocks are freed. A step costs
        what was allocated in it, not the tables' length (it runs every step); `request_ids` is
        read only when some request is stale."""
        generations = self.pool.generations
        for block_id in generations.take_written():
            for request_id in self._holders.get(block_id, ()):
                table = self.tables[request_id]
                if table.generations[table.block_ids.index(block_id)] != generations[block_id]:
                    self._stale.add(request_id)
        if not self._stale:
            return []
        return [r for r in request_ids if r in self._stale]

    def scan_stale_requests(self, request_ids: list[str]) -> list[str]:
        """`stale_requests` by reading every (block, generation) pair of the requests' tables (one
        vectorised comparison): the reference `check_integrity` holds the kept answer to."""
        tables = [self.tables.get(r) for r in request_ids]
        lengths = [len(t.block_ids) if t is not None else 0 for t in tables]
        total = sum(lengths)
        if total == 0:
            return []
        pool_generations = self.pool.generations
        if self.sliding_window is None:  # no FREED_BLOCK entries: a C-level walk, no Python frame per block
            block_ids = chain.from_iterable(t.block_ids for t in tables if t)
            current = np.fromiter(map(pool_generations.__getitem__, block_ids), np.int64, total)
        else:
            current = np.fromiter(
                (pool_generations[b] if b != FREED_BLOCK else 0 for t in tables if t for b in t.block_ids),
                np.int64,
                total,
            )
        expected = np.fromiter(chain.from_iterable(t.generations for t in tables if t), np.int64, total)
        mismatch = current != expected
        if not mismatch.any():
            return []
        owner = np.repeat(np.arange(len(request_ids)), lengths)
        return [request_ids[i] for i in np.unique(owner[mismatch])]

    def is_table_current(self, request_id: str) -> bool:
        """True when every block of the request still carries the generation it was given."""
        return not self.stale_requests([request_id])

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs = [0] * self.pool.num_blocks
        for request_id, table in self.tables.items():
            assert len(table.block_ids) == len(table.generations), request_id
            for block_id in table.block_ids:
                if block_id != FREED_BLOCK:
                    refs[block_id] += 1
        assert refs == self.pool.ref_counts, "ref counts differ from block-table references"
        holders: dict[int, set[str]] = {}
        for request_id, table in self.tables.items():
            for block_id in table.block_ids:
                if block_id != FREED_BLOCK:
                    holders.setdefault(block_id, set()).add(request_id)
        assert holders == self._holders, "block holders differ from the block tables"
        stale = self.scan_stale_requests(list(self.tables))
        assert stale == self.stale_requests(list(self.tables)), "kept stale requests differ from a scan"
        assert not stale, f"{stale} hold reassigned blocks"
