"""Where a request's KV lives, behind one interface the scheduler asks (no torch).

Two layouts implement `KVLayout`:
- `SharedLayout`: the paged cache shared by every layer and head (`KVCacheManager`): a request
  holds one block table; full blocks are published to the prefix cache.
- `HeadLayout`: the per-head layout of compressed requests (`Request.compressed`,
  `HeadKVCacheManager`): blocks per (layer, KV head), so each head keeps its own tokens after an
  eviction. A compressed request admitted with a prefix-cache hit holds the shared blocks of that
  prefix for its first step only, while the runner copies them into its heads.

Contract shared by both: `allocate` is all-or-nothing and makes room for a request's first
`num_total_tokens` tokens; `free` gives back what the request holds in the layout (it may be
called for a request holding nothing); `describe` fills a `ScheduledRequest` with where this
step's tokens are written and read (the block table, or the head slots and tables).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from tandem.engine.kv.block_manager import KVCacheManager
from tandem.engine.kv.block_pool import BlockPool
from tandem.engine.kv.head_cache import HeadKVCacheManager
from tandem.engine.request import Request
from tandem.engine.sched.step import HeadStep, ScheduledRequest


class KVLayout(Protocol):
    @property
    def pool(self) -> BlockPool:
        """The block pool requests of this layout draw from (occupancy, room checks)."""
        ...

    def allocate(self, request: Request, num_total_tokens: int, *, admission: bool = False) -> bool: ...

    def free(self, request_id: str) -> None: ...

    def num_new_blocks_needed(self, request: Request) -> int:
        """Blocks the request still needs for its whole current length (room checks)."""
        ...

    def describe(self, item: ScheduledRequest, request: Request) -> None: ...

    def stale_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Those of `request_ids` holding a block whose generation changed (KV integrity)."""
        ...

    def check_request(self, request: Request) -> None:
        """Assert a running request holds what its computed tokens need."""
        ...


class SharedLayout:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        # The request's block table as the runner reads it, grown to hold `num_total_tokens`
        # tokens; None when blocks are short: the manager's own method (once per decode per step)
        self.decode_block_ids: Callable[[str, int], list[int] | None] = kv.decode_block_ids

    @property
    def pool(self) -> BlockPool:
        return self.kv.pool

    def allocate(self, request: Request, num_total_tokens: int, *, admission: bool = False) -> bool:
        return self.kv.allocate_slots(request.request_id, num_total_tokens, admission=admission)

    def free(self, request_id: str) -> None:
        self.kv.free(request_id)

    def num_new_blocks_needed(self, request: Request) -> int:
        return self.kv.num_new_blocks_needed(request.request_id, request.num_tokens)

    def describe(self, item: ScheduledRequest, request: Request) -> None:
        item.block_ids = self.kv.runner_block_ids(request.request_id)

    def stale_requests(self, request_ids: Iterable[str]) -> list[str]:
        return self.kv.stale_requests(request_ids)

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def windowed(self) -> bool:
        """Whether blocks outside a sliding window are released (`release_outside_window`)."""
        return self.kv.sliding_window is not None

    def holds(self, request_id: str) -> bool:
        """Whether the request holds a block table here."""
        return request_id in self.kv.tables

    def fork(self, request_id: str, parent_id: str, num_blocks: int) -> int:
        """Share the parent's first `num_blocks` blocks (a parallel-sampling choice); returns the
        tokens they hold."""
        return self.kv.fork(request_id, parent_id, num_blocks)

    def take_cached_prefix(self, request: Request, num_tokens: int, salt: object, *, whole: bool) -> int:
        """Allocate what the prefix cache holds of the request's first `num_tokens` tokens;
        returns the tokens it holds (`KVCacheManager.allocate_cached_prefix`)."""
        return self.kv.allocate_cached_prefix(
            request.request_id, num_tokens, request.token_ids_slice, salt, whole=whole
        )

    def publish_full_blocks(self, request: Request, salt: object) -> None:
        """Publish the request's blocks filled with computed tokens to the prefix cache."""
        self.kv.cache_full_blocks(
            request.request_id, request.token_ids_slice, request.num_computed_tokens, salt
        )

    def release_outside_window(self, request: Request) -> None:
        """Give back the blocks no query of the request can read again (a sliding window)."""
        self.kv.release_outside_window(request.request_id, request.num_computed_tokens)

    def check_request(self, request: Request) -> None:
        table = self.kv.tables.get(request.request_id)
        need = self.kv.num_blocks_for(request.num_computed_tokens)
        assert table is not None and len(table.block_ids) >= need, request.request_id


class HeadLayout:
    """The per-head layout. Its slots are appended at `allocate` and handed out at `describe`;
    evictions (`apply_eviction`) are copied by the runner before the next step's writes
    (`take_moves`). After its context's eviction a request is evicted again every
    `eviction_interval` decode steps (0: never), observed over the last `eviction_window`."""

    def __init__(
        self, head_kv: HeadKVCacheManager, shared: KVCacheManager, *, eviction_interval: int = 0,
        eviction_window: int = 16,
    ) -> None:  # fmt: skip
        self.head_kv = head_kv
        self.shared = shared  # where a cached prompt prefix is copied from
        self.eviction_interval = eviction_interval
        self.eviction_window = eviction_window
        self._slots: dict[str, list[list[int]]] = {}  # appended at allocation, not yet handed out
        self._pending_moves: dict[str, tuple[list[int], list[int]]] = {}  # evictions to copy
        self._prefix_copies: dict[str, int] = {}  # cached prefix tokens to copy at the first step
        self.num_evictions = 0  # evictions applied (contexts computed, and later ones)
        self.num_vectors_evicted = 0  # (layer, head, token) K/V vectors dropped by them

    @property
    def pool(self) -> BlockPool:
        return self.head_kv.pool

    def allocate(self, request: Request, num_total_tokens: int, *, admission: bool = False) -> bool:
        num_new = num_total_tokens - self.head_kv.num_appended.get(request.request_id, 0)
        if num_new <= 0:
            return True
        slots = self.head_kv.append_slots(request.request_id, num_new)
        if slots is None:
            return False
        self._slots[request.request_id] = slots
        return True

    def free(self, request_id: str) -> None:
        self.head_kv.free(request_id)
        self._slots.pop(request_id, None)
        self._pending_moves.pop(request_id, None)  # its blocks are free: nothing to copy
        self._prefix_copies.pop(request_id, None)

    def num_new_blocks_needed(self, request: Request) -> int:
        done = self.head_kv.num_appended.get(request.request_id, 0)
        return self.head_kv.num_new_blocks_needed(request.request_id, request.num_tokens - done)

    def prefix_lookup_tokens(self, request: Request) -> int:
        """How much of its prompt a request may take from the prefix cache: all but the
        observation window, whose queries score its tokens."""
        return max(1, request.num_tokens - self.eviction_window + 1)

    def copy_prefix(self, request: Request, num_cached_tokens: int) -> None:
        """The request starts with `num_cached_tokens` cached in shared blocks: copy them into its
        heads at its first step."""
        if num_cached_tokens:
            self._prefix_copies[request.request_id] = num_cached_tokens

    def describe(self, item: ScheduledRequest, request: Request) -> None:
        rid = request.request_id
        tables = self.head_kv.head_tables(rid)
        head = HeadStep(
            slots=self._slots.pop(rid, [[] for _ in tables]),
            block_ids=[list(t.block_ids) for t in tables],
            num_tokens=[t.num_tokens for t in tables],
            kv_compression_rate=request.kv_compression_rate,
        )
        copied = self._prefix_copies.pop(rid, 0)
        if copied:  # its first appended tokens are the cached prefix: copied, not computed
            bs = self.shared.block_size
            shared = self.shared.block_table(rid).block_ids
            head.prefix_src_slots = [shared[i // bs] * bs + i % bs for i in range(copied)]
            head.prefix_dst_slots = [slots[:copied] for slots in head.slots]
            head.slots = [slots[copied:] for slots in head.slots]
        end = item.start_position + len(item.token_ids)
        if not request.kv_evicted:  # the chunk that completes the context
            head.observe = head.evict = item.sample
        elif self.eviction_interval and item.sample:
            since = end - request.num_tokens_at_eviction  # this step's tokens included
            head.observe = since > self.eviction_interval - self.eviction_window
            head.evict = since >= self.eviction_interval
        item.head = head

    def apply_eviction(self, request: Request, item: ScheduledRequest, kept: list[list[int]]) -> None:
        """What each head keeps (the runner's plan); the moves wait for `take_moves`."""
        held = sum(self.head_kv.num_tokens(request.request_id))
        moves = self.head_kv.evict(request.request_id, kept)
        self.num_evictions += 1
        self.num_vectors_evicted += held - sum(len(k) for k in kept)
        self._pending_moves[request.request_id] = (moves.src_slots, moves.dst_slots)
        request.kv_evicted = True
        request.num_tokens_at_eviction = item.start_position + len(item.token_ids)

    def take_moves(self) -> tuple[list[int], list[int]]:
        """The evictions' copies (sources, destinations) since the last call."""
        move_src: list[int] = []
        move_dst: list[int] = []
        for src, dst in self._pending_moves.values():
            move_src += src
            move_dst += dst
        self._pending_moves.clear()
        return move_src, move_dst

    def stale_requests(self, request_ids: Iterable[str]) -> list[str]:
        return self.head_kv.stale_requests(list(request_ids))

    def check_request(self, request: Request) -> None:
        assert request.request_id not in self.shared.tables, "a compressed request holds shared blocks"
        assert self.head_kv.num_appended[request.request_id] >= request.num_computed_tokens
