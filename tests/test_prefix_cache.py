"""Prefix caching (exact block ids: hit, partial hit, eviction order, adapter and tenant
separation; same greedy output on and off) and KV-page integrity (fault injection)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem import LLM, SamplingParams
from tandem.engine.kv.block_manager import KVCacheManager
from tandem.engine.protocol import GenerationRequest
from tests.kv_faults import inject_kv_fault

BS = 4


def tokens_of(ids: list[int]):  # type: ignore[no-untyped-def]
    return lambda start, end: ids[start:end]


def admit(kv: KVCacheManager, rid: str, ids: list[int], salt: object = None) -> int:
    """What the scheduler does on admission: prefix hits, then blocks for the rest."""
    cached = kv.allocate_cached_prefix(rid, len(ids), tokens_of(ids), salt)
    assert kv.allocate_slots(rid, len(ids))
    kv.cache_full_blocks(rid, tokens_of(ids), len(ids), salt)  # as if computed in one step
    return cached


def test_hit_partial_hit_and_eviction_order() -> None:
    kv = KVCacheManager(8, BS, watermark=0.0, enable_prefix_caching=True)
    a = list(range(1, 11))  # 10 tokens: blocks [1-4] [5-8] and a partial [9, 10]
    assert admit(kv, "a", a) == 0
    a_blocks = list(kv.block_table("a").block_ids)
    assert a_blocks == [0, 1, 2]
    b = a[:8] + [99, 98, 97]  # same first two blocks
    assert admit(kv, "b", b) == 8
    assert kv.block_table("b").block_ids[:2] == a_blocks[:2] and kv.pool.ref_counts[0] == 2
    c = a[:4] + [50, 51, 52, 53, 54]  # only the first block matches
    assert admit(kv, "c", c) == 4 and kv.block_table("c").block_ids[0] == 0
    same = list(a[:8])  # exactly two full blocks: the last one is recomputed, not shared
    assert admit(kv, "d", same) == 4
    kv.check_integrity()
    for rid in ("a", "b", "c", "d"):
        kv.free(rid)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == 8 and len(kv.pool.cached) > 0
    # Freed cached blocks stay cached; a hit takes them back without recomputing.
    hits_before = kv.num_prefix_hits
    assert admit(kv, "e", a) == 8
    assert kv.num_prefix_hits - hits_before == 8 and kv.block_table("e").block_ids[:2] == a_blocks[:2]
    kv.free("e")
    # Eviction takes the free list from its head (oldest freed); the newest freed survive.
    free_order = list(kv.pool._free)
    evictions_before = kv.pool.num_evictions
    big = [1000 + i for i in range(4 * 7)]  # 7 fresh blocks
    assert admit(kv, "big", big) == 0
    assert kv.block_table("big").block_ids == free_order[:7]
    assert kv.pool.num_evictions > evictions_before
    survivor = free_order[7]
    assert kv.pool.block_hash[survivor] is not None  # still cached
    kv.free("big")
    kv.check_integrity()


def test_adapter_and_tenant_separate_the_cache() -> None:
    kv = KVCacheManager(16, BS, watermark=0.0, enable_prefix_caching=True)
    ids = list(range(1, 10))
    assert admit(kv, "t1", ids, salt=(None, "acme")) == 0
    assert admit(kv, "t1-again", ids, salt=(None, "acme")) == 8
    assert admit(kv, "t2", ids, salt=(None, "globex")) == 0  # another tenant: no sharing
    assert admit(kv, "lora", ids, salt=("acme/bot@1", "acme")) == 0  # another adapter: no sharing
    assert admit(kv, "lora-again", ids, salt=("acme/bot@1", "acme")) == 8
    kv.check_integrity()


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path) -> tuple[LLM, LLM]:
    options = {"kv_cache_memory": 4 << 20, "max_num_batched_tokens": 64, "block_size": 8}
    return LLM(str(tiny_model_dir), **options), LLM(
        str(tiny_model_dir), enable_prefix_caching=False, **options
    )


def test_greedy_output_is_the_same_with_caching_on_and_off(pair: tuple[LLM, LLM]) -> None:
    cached, plain = pair
    system = "You are a careful assistant. Answer briefly and precisely. " * 3
    prompts = [system + q for q in ("What is paging?", "What is batching?", "Why cache prefixes?")]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    cached.generate(prompts[:1], params)  # warm the shared system prompt
    hits_before = cached.stats()["prefix_cache_hits"]
    outs = cached.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert cached.stats()["prefix_cache_hits"] > hits_before
    assert all(o.metrics.num_cached_tokens >= 8 for o in outs)
    assert plain.stats()["prefix_cache_hits"] == 0


@pytest.mark.parametrize("overwrite", [False, True])
def test_reassigned_block_aborts_only_its_request(pair: tuple[LLM, LLM], overwrite: bool) -> None:
    """A buggy allocator hands a running request's block to someone else (and, with `overwrite`,
    new KV lands in it): that request ends with finish_reason 'error' and no further tokens; the
    others finish exactly as in a clean run."""
    _, llm = pair
    engine = llm.engine
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [f"Request number {i} talks about paging" for i in range(3)]
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    ids = [f"fault-{overwrite}-{i}" for i in range(3)]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(GenerationRequest(rid, prompt=prompt, sampling_params=params))
    finished = {}
    steps = 0
    aborts_before = engine.num_kv_integrity_aborts
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps == 4:  # mid-decode
            inject_kv_fault(engine, ids[1], 0, overwrite=overwrite)
    victim = finished[ids[1]]
    assert victim.outputs[0].finish_reason == "error" and victim.error_code == "kv_integrity"
    assert len(victim.outputs[0].token_ids) < 16  # nothing generated after the fault
    assert victim.outputs[0].token_ids == clean[1][: len(victim.outputs[0].token_ids)]
    for i in (0, 2):
        assert finished[ids[i]].outputs[0].token_ids == clean[i]
    assert engine.num_kv_integrity_aborts == aborts_before + 1
    engine.kv_manager.pool.check_integrity()


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random admissions (prompts sharing prefixes, several salts) and frees under memory pressure.
    A shadow copy of what each block holds checks that a cache hit always returns a block holding
    exactly the requested tokens at those positions; integrity invariants after every rule."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(12, BS, watermark=0.0, enable_prefix_caching=True)
        self.contents: dict[int, tuple[object, tuple[int, ...]]] = {}  # block -> (salt, tokens)
        self.live: list[str] = []
        self.counter = 0

    @rule(
        base=st.integers(0, 2),
        shared=st.integers(0, 12),
        extra=st.integers(1, 9),
        salt=st.sampled_from(["x", "y"]),
    )
    def admit(self, base: int, shared: int, extra: int, salt: str) -> None:
        ids = [base * 100 + i for i in range(shared)] + [1000 + self.counter * 10 + i for i in range(extra)]
        rid = f"r{self.counter}"
        self.counter += 1
        cached = self.kv.allocate_cached_prefix(rid, len(ids), tokens_of(ids), salt)
        assert cached % BS == 0 and cached < len(ids)
        for index, block in enumerate(self.kv.tables[rid].block_ids if cached else []):
            assert self.contents[block] == (salt, tuple(ids[index * BS : (index + 1) * BS])), (
                "wrong cached KV"
            )
        if not self.kv.allocate_slots(rid, len(ids)):
            self.kv.free(rid)
            return
        for index, block in enumerate(self.kv.tables[rid].block_ids):
            if index * BS >= cached:
                self.contents[block] = (salt, tuple(ids[index * BS : (index + 1) * BS]))
        self.kv.cache_full_blocks(rid, tokens_of(ids), len(ids), salt)
        self.live.append(rid)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.live))
        self.live.remove(rid)
        self.kv.free(rid)

    @invariant()
    def integrity(self) -> None:
        self.kv.check_integrity()


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
