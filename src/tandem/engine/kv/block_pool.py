"""The pool of physical KV blocks (no torch): ref counts, the free list in eviction order, the
prefix cache's hashes, and each block's generation tag (`Generations`: bumped every time the block
is handed out; the writes are remembered, so the holders of a reassigned block are found from what
changed, not by reading every table: `KVCacheManager.stale_requests`)."""

from __future__ import annotations

from collections import OrderedDict

# A block-table entry whose block left the sliding window and went back to the pool (generation 0).
FREED_BLOCK = -1


class Generations(list[int]):
    """Each block's generation; remembers which blocks' generations were written since the last
    `take_written` (reads are a plain list's)."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__([0] * num_blocks)
        self._written: set[int] = set()

    def __setitem__(self, index: int, value: int) -> None:  # type: ignore[override]
        super().__setitem__(index, value)
        self._written.add(index)

    def take_written(self) -> set[int]:
        """The blocks whose generation was written since the last call."""
        written, self._written = self._written, set()
        return written


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
        self.generations = Generations(num_blocks)
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.num_evictions = 0

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
            old_hash = self.block_hash[block_id]
            if old_hash is not None:  # evict its cached contents
                self.block_hash[block_id] = None
                if self.cached.get(old_hash) == block_id:
                    del self.cached[old_hash]
                self.num_evictions += 1
            self.ref_counts[block_id] = 1
            self.generations[block_id] += 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_id: int) -> None:
        """Take one more reference to a cached block (a prefix-cache hit); a free one leaves the
        free list without changing its generation."""
        if self.ref_counts[block_id] == 0:
            del self._free[block_id]
        self.ref_counts[block_id] += 1

    def cache(self, block_id: int, block_hash: int) -> None:
        """Record that `block_id` (full, in use) holds the contents named by `block_hash`."""
        if block_hash in self.cached or self.block_hash[block_id] is not None:
            return  # the same contents are cached in another block already, or this one is
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id

    def reset_prefix_cache(self) -> None:
        for block_hash, block_id in list(self.cached.items()):
            self.block_hash[block_id] = None
            del self.cached[block_hash]

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero go to the free list's tail.

        Blocks are released in reverse so a request's tail blocks are evicted before its head.
        """
        for block_id in reversed(block_ids):
            if block_id == FREED_BLOCK:
                continue
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
        for block_hash, block_id in self.cached.items():
            assert self.block_hash[block_id] == block_hash, f"cache map and block {block_id} disagree"
        assert sum(h is not None for h in self.block_hash) == len(self.cached), "stray block hash"
