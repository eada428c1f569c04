"""BlockPool / KVCacheManager: exact block ids, eviction order, tags, and a state machine."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.engine.kv.block_manager import KVCacheManager
from tandem.engine.kv.block_pool import BlockPool, NoFreeBlocksError


def test_allocate_takes_oldest_free_first_and_free_appends_in_reverse() -> None:
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(2) == [2, 3]
    pool.free([0, 1])  # tail block released first: 1 then 0
    assert pool.allocate(4) == [4, 5, 1, 0]
    pool.check_integrity()


def test_generation_changes_on_every_reassignment() -> None:
    pool = BlockPool(1)
    [block] = pool.allocate(1)
    first = pool.generations[block]
    pool.free([block])
    assert pool.allocate(1) == [block]
    assert pool.generations[block] == first + 1


def test_over_allocation_and_double_free_raise() -> None:
    pool = BlockPool(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2  # nothing half-allocated
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(ids)


def test_manager_grows_tables_and_detects_reassignment() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, watermark=0.0)
    assert kv.allocate_slots("a", 5)  # 2 blocks
    assert kv.block_table("a").block_ids == [0, 1]
    assert kv.allocate_slots("a", 8)  # still 2 blocks
    assert kv.allocate_slots("a", 9)
    assert kv.block_table("a").block_ids == [0, 1, 2]
    assert not kv.allocate_slots("b", 8)  # needs 2, 1 free: all or nothing
    assert "b" not in kv.tables
    assert kv.is_table_current("a")
    kv.pool.generations[1] += 1  # as if block 1 had been handed to someone else
    assert not kv.is_table_current("a")


def test_admission_keeps_watermark() -> None:
    kv = KVCacheManager(num_blocks=100, block_size=1, watermark=0.05)
    assert not kv.allocate_slots("a", 96, admission=True)
    assert kv.allocate_slots("a", 95, admission=True)
    assert kv.allocate_slots("a", 100)  # growth of a running request may use the watermark


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / grow / free sequences; invariants after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=16, block_size=4, watermark=0.0)
        self.lengths: dict[str, int] = {}
        self.counter = 0

    @rule(num_tokens=st.integers(1, 40))
    def add(self, num_tokens: int) -> None:
        rid = f"r{self.counter}"
        self.counter += 1
        free_before = self.kv.pool.num_free_blocks
        ok = self.kv.allocate_slots(rid, num_tokens)
        need = -(-num_tokens // 4)
        assert ok == (need <= free_before)
        if ok:
            self.lengths[rid] = num_tokens
            assert self.kv.pool.num_free_blocks == free_before - need
        else:
            assert self.kv.pool.num_free_blocks == free_before

    @precondition(lambda self: self.lengths)
    @rule(data=st.data(), extra=st.integers(1, 12))
    def grow(self, data: st.DataObject, extra: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.lengths)))
        before = list(self.kv.block_table(rid).block_ids)
        if self.kv.allocate_slots(rid, self.lengths[rid] + extra):
            self.lengths[rid] += extra
        assert self.kv.block_table(rid).block_ids[: len(before)] == before  # append-only

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.lengths)))
        blocks = self.kv.block_table(rid).block_ids
        self.kv.free(rid)
        del self.lengths[rid]
        assert all(self.kv.pool.ref_counts[b] == 0 for b in blocks)

    @invariant()
    def integrity(self) -> None:
        self.kv.check_integrity()
        used = sum(len(t.block_ids) for t in self.kv.tables.values())
        assert used == self.kv.pool.num_used_blocks
        all_blocks = [b for t in self.kv.tables.values() for b in t.block_ids]
        assert len(all_blocks) == len(set(all_blocks)), "a block is in two tables"


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
