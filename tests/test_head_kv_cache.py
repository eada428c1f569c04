"""Per-(layer, KV head) paging for compressed requests: bookkeeping, attention over it, and which
tokens eviction keeps (the engine side is in test_kv_compression.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.engine.kv.head_cache import HeadKVCacheManager
from tandem.kernels.fp8 import quantize_fp8
from tandem.kernels.head_attention import (
    HeadAttentionMetadata,
    head_attention_layer,
    head_paged_attention,
    head_slots_of,
    move_head_slots,
    native_decode_available,
    reference_head_attention,
    write_head_kv,
)
from tandem.kernels.kv_eviction import (
    EvictionPolicy,
    num_kept_for_rate,
    observation_scores,
    plan_kept,
    pool_scores,
    protected_window_for,
    select_kept,
)


def test_head_tables_hold_exact_block_ids_through_append_evict_and_free() -> None:
    kv = HeadKVCacheManager(num_blocks=16, block_size=4, num_layers=1, num_kv_heads=2)
    slots = kv.append_slots("r", 6)
    assert [t.block_ids for t in kv.head_tables("r")] == [[0, 1], [2, 3]]
    assert slots == [[0, 1, 2, 3, 4, 5], [8, 9, 10, 11, 12, 13]]

    moves = kv.evict("r", [[0, 5], [0, 1, 2, 3, 4]])
    assert (moves.src_slots, moves.dst_slots, moves.freed_block_ids) == ([5], [1], [1])
    assert [t.block_ids for t in kv.head_tables("r")] == [[0], [2, 3]]
    assert kv.num_tokens("r") == [2, 5]

    # Head 0 fills block 0 and takes the oldest free block (4; block 1 went to the tail).
    assert kv.append_slots("r", 3) == [[2, 3, 16], [13, 14, 15]]
    assert [t.block_ids for t in kv.head_tables("r")] == [[0, 4], [2, 3]]
    kv.check_integrity()
    # Integrity tags: each block's generation as handed out; a reassigned block makes "r" stale.
    assert [t.generations for t in kv.head_tables("r")] == [[1, 1], [1, 1]]
    assert kv.stale_requests(["r", "absent"]) == []
    kv.pool.generations[4] += 1  # block 4 handed to someone else behind the table's back
    assert kv.stale_requests(["r"]) == ["r"]
    with pytest.raises(AssertionError, match="reassigned"):
        kv.check_integrity()
    kv.pool.generations[4] -= 1
    kv.free("r")
    assert kv.pool.num_free_blocks == 16
    kv.check_integrity()


def test_append_never_partially_allocates_and_eviction_input_is_checked() -> None:
    kv = HeadKVCacheManager(num_blocks=5, block_size=4, num_layers=2, num_kv_heads=2)
    assert kv.append_slots("a", 4) is not None  # 4 heads x 1 block
    assert kv.append_slots("b", 1) is None  # needs 4 blocks, 1 free
    assert "b" not in kv.tables and kv.pool.num_free_blocks == 1
    with pytest.raises(ValueError, match="keep no tokens"):
        kv.evict("a", [[0], [], [0], [0]])
    with pytest.raises(ValueError, match="increase"):
        kv.evict("a", [[1, 0], [0], [0], [0]])
    with pytest.raises(ValueError, match="increase"):
        kv.evict("a", [[4], [0], [0], [0]])
    kv.check_integrity()


def _fill(kv: HeadKVCacheManager, request_id: str, k_pool: torch.Tensor, v_pool: torch.Tensor,
          keys: torch.Tensor, values: torch.Tensor, k_scale: torch.Tensor | None = None,
          v_scale: torch.Tensor | None = None) -> None:  # fmt: skip
    """Append keys/values [L, T, Hk, D] (all layers) to every head of the request."""
    num_tokens = keys.shape[1]
    slots = kv.append_slots(request_id, num_tokens)
    assert slots is not None
    heads = kv.num_kv_heads
    for layer in range(kv.num_layers):
        head_slots = torch.tensor(slots[layer * heads : (layer + 1) * heads]).T  # [T, Hk]
        write_head_kv(keys[layer], values[layer], k_pool, v_pool, head_slots, k_scale, v_scale)


def _layer_tables(
    kv: HeadKVCacheManager, request_ids: list[str], layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    heads = kv.num_kv_heads
    tables = [kv.head_tables(r)[layer * heads : (layer + 1) * heads] for r in request_ids]
    width = max(len(t.block_ids) for ts in tables for t in ts)
    block_tables = torch.tensor(
        [[t.block_ids + [0] * (width - len(t.block_ids)) for t in ts] for ts in tables]
    )
    head_lens = torch.tensor([[t.num_tokens for t in ts] for ts in tables])
    return block_tables, head_lens


def _fp8_round_trip(x: torch.Tensor) -> torch.Tensor:  # what an FP8 pool gives back
    codes, scale = quantize_fp8(x)
    return (codes.float() * scale.float().unsqueeze(-1)).to(x.dtype)


@pytest.mark.parametrize("num_new,native", [(3, False), (1, False), (1, True)])
@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float8_e4m3fn)])  # fmt: skip
def test_attention_over_a_compressed_per_head_cache_equals_dense_attention_over_kept_tokens(
    dtype: torch.dtype, pool_dtype: torch.dtype, num_new: int, native: bool
) -> None:
    """Two requests, 2 layers, GQA 6/2 heads: prefill, per-head eviction with a different number
    kept in each head, then a step of `num_new` tokens each (appended to every head; one token
    each is the decode path: batched matmuls, or the native kernel). The paged result equals
    dense attention over exactly the tokens each head kept, in order (for an FP8 pool, over the
    vectors as FP8 gives them back: e4m3 codes times their scales)."""
    if native and not native_decode_available(torch.device("cpu"), pool_dtype):
        pytest.skip("the native library is not available here")
    fp8 = pool_dtype == torch.float8_e4m3fn
    torch.manual_seed(0)
    num_layers, num_kv_heads, num_q_heads, head_dim, bs = 2, 2, 6, 8, 4
    kv = HeadKVCacheManager(num_blocks=64, block_size=bs, num_layers=num_layers, num_kv_heads=num_kv_heads)
    k_pool = torch.zeros(64, bs, head_dim, dtype=pool_dtype)
    v_pool = torch.zeros(64, bs, head_dim, dtype=pool_dtype)
    k_scale = torch.ones(64, bs, dtype=torch.float16) if fp8 else None
    v_scale = torch.ones(64, bs, dtype=torch.float16) if fp8 else None
    stored = _fp8_round_trip if fp8 else (lambda x: x)
    lengths = {"a": 13, "b": 7}
    dense: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for request_id, length in lengths.items():
        keys = torch.randn(num_layers, length, num_kv_heads, head_dim, dtype=dtype)
        values = torch.randn(num_layers, length, num_kv_heads, head_dim, dtype=dtype)
        _fill(kv, request_id, k_pool, v_pool, keys, values, k_scale, v_scale)
        dense[request_id] = (stored(keys), stored(values))
    kept = {
        "a": [[0, 1, 5, 12], [2, 3, 4, 6, 7, 8, 9, 10, 11, 12], [12], list(range(13))],
        "b": [[6], [0, 6], [1, 2, 3, 4, 5, 6], [0, 3, 6]],
    }
    for request_id, keep in kept.items():
        moves = kv.evict(request_id, keep)
        move_head_slots(k_pool, v_pool, torch.tensor(moves.src_slots, dtype=torch.long),
                        torch.tensor(moves.dst_slots, dtype=torch.long), k_scale, v_scale)  # fmt: skip
    new = {r: (torch.randn(num_layers, num_new, num_kv_heads, head_dim, dtype=dtype),
               torch.randn(num_layers, num_new, num_kv_heads, head_dim, dtype=dtype)) for r in lengths}  # fmt: skip
    for request_id, (keys, values) in new.items():
        _fill(kv, request_id, k_pool, v_pool, keys, values, k_scale, v_scale)
        new[request_id] = (stored(keys), stored(values))
    kv.check_integrity()

    q = torch.randn(2 * num_new, num_q_heads, head_dim, dtype=dtype)  # num_new rows per request
    scale = head_dim**-0.5
    for layer in range(num_layers):
        block_tables, head_lens = _layer_tables(kv, ["a", "b"], layer)
        out = head_paged_attention(
            q, [0, num_new, 2 * num_new], k_pool, v_pool, block_tables, head_lens, scale, native=native,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        for i, request_id in enumerate(["a", "b"]):
            keys, values = dense[request_id]
            new_keys, new_values = new[request_id]
            per_head_k = [
                torch.cat([keys[layer, kept[request_id][layer * num_kv_heads + h], h], new_keys[layer, :, h]])
                for h in range(num_kv_heads)
            ]
            per_head_v = [
                torch.cat(
                    [values[layer, kept[request_id][layer * num_kv_heads + h], h], new_values[layer, :, h]]
                )
                for h in range(num_kv_heads)
            ]
            rows = slice(num_new * i, num_new * (i + 1))
            want = reference_head_attention(q[rows], per_head_k, per_head_v, scale)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out[rows], want, atol=tol, rtol=tol)


def test_compression_frees_the_blocks_it_claims() -> None:
    """At rate 8 a 64-token request in 2 layers x 3 heads keeps ceil(3 * 64 / 8) = 24 vectors per
    layer; the pool gets back every block beyond ceil(kept / block_size) per head."""
    torch.manual_seed(1)
    num_layers, num_kv_heads, bs, length = 2, 3, 4, 64
    kv = HeadKVCacheManager(num_blocks=200, block_size=bs, num_layers=num_layers, num_kv_heads=num_kv_heads)
    assert kv.append_slots("r", length) is not None
    assert kv.pool.num_free_blocks == 200 - num_layers * num_kv_heads * length // bs
    budget = num_kept_for_rate(length, num_kv_heads, 8.0, protected_window=4)
    assert budget == 24
    kept: list[list[int]] = []
    for _ in range(num_layers):
        kept += select_kept(torch.rand(num_kv_heads, length), budget, protected_window=4)
    kv.evict("r", kept)
    assert sum(len(k) for k in kept) == num_layers * budget
    assert kv.num_blocks_used("r") == sum(math.ceil(len(k) / bs) for k in kept)
    assert kv.pool.num_free_blocks == 200 - kv.num_blocks_used("r")
    kv.check_integrity()


def test_per_head_budget_follows_scores_and_uniform_splits_evenly() -> None:
    """Head 0 spreads its attention (many similar scores), head 1 reads two tokens: per-head
    eviction gives head 0 most of the budget, uniform gives each head the same; both keep the
    protected window and stay within the budget."""
    num_tokens, window = 32, 2
    scores = torch.stack([torch.full((num_tokens,), 0.5), torch.zeros(num_tokens)])
    scores[1, 3] = scores[1, 9] = 1.0
    per_head = select_kept(scores, budget=16, protected_window=window, per_head=True)
    uniform = select_kept(scores, budget=16, protected_window=window, per_head=False)
    assert per_head[1] == [3, 9, 30, 31]  # its two strong tokens and the window
    assert len(per_head[0]) == 12 and per_head[0][-2:] == [30, 31]
    assert [len(k) for k in uniform] == [8, 8]
    assert {30, 31} <= set(uniform[1]) and {3, 9} <= set(uniform[1])


def test_observation_scores_are_squared_causal_attention_summed_over_the_group() -> None:
    torch.manual_seed(2)
    num_tokens, window, num_q_heads, num_kv_heads, head_dim = 10, 3, 4, 2, 8
    q = torch.randn(window, num_q_heads, head_dim)
    k = torch.randn(num_tokens, num_kv_heads, head_dim)
    scores = observation_scores(q, k, scale=0.3)
    want = torch.zeros(num_kv_heads, num_tokens)
    for g in range(num_q_heads):
        h = g // (num_q_heads // num_kv_heads)
        for j in range(window):
            position = num_tokens - window + j
            weights = torch.softmax(k[: position + 1, h] @ q[j, g] * 0.3, dim=-1)
            want[h, : position + 1] += weights.square()
    torch.testing.assert_close(scores, want)


def test_observation_scores_over_ragged_heads_read_each_heads_own_tokens() -> None:
    """After an eviction heads hold different numbers of tokens (padded to the longest): window
    query j of head h reads that head's indices up to lengths[h] - W + j, padding scores 0."""
    torch.manual_seed(3)
    num_tokens, window, num_q_heads, num_kv_heads, head_dim = 9, 2, 4, 2, 8
    lengths = torch.tensor([9, 5])
    q = torch.randn(window, num_q_heads, head_dim)
    k = torch.randn(num_tokens, num_kv_heads, head_dim)
    k[5:, 1] = 1e4  # head 1's padding: read, it would take all the attention
    scores = observation_scores(q, k, scale=0.3, lengths=lengths)
    want = torch.zeros(num_kv_heads, num_tokens)
    for g in range(num_q_heads):
        h = g // (num_q_heads // num_kv_heads)
        for j in range(window):
            last = int(lengths[h]) - window + j
            weights = torch.softmax(k[: last + 1, h] @ q[j, g] * 0.3, dim=-1)
            want[h, : last + 1] += weights.square()
    torch.testing.assert_close(scores, want)
    assert scores[1, 5:].eq(0).all()
    torch.testing.assert_close(
        observation_scores(q, k[:, :1], 0.3, lengths[:1]), observation_scores(q, k[:, :1], 0.3)
    )


def test_select_kept_over_ragged_heads_keeps_no_padding_and_each_heads_own_tail() -> None:
    num_tokens, window, sinks = 12, 2, 1
    scores = torch.rand(3, num_tokens, generator=torch.Generator().manual_seed(4))
    scores[:, 8:] = 5.0  # high scores on indices past heads 1 and 2's lengths: padding there
    lengths = [12, 8, 4]
    for per_head in (True, False):
        kept = select_kept(scores, 12, window, per_head, sinks, lengths)
        for head, (keep, length) in enumerate(zip(kept, lengths, strict=True)):
            assert keep == sorted(keep) and all(index < length for index in keep), (per_head, head, keep)
            assert {0, length - 2, length - 1} <= set(keep)  # sink and the head's own last tokens
        assert sum(len(keep) for keep in kept) == 12 if per_head else [len(k) for k in kept] == [4, 4, 4]
    assert select_kept(scores, 100, window, True, sinks, lengths) == [list(range(n)) for n in lengths]
    with pytest.raises(ValueError):
        select_kept(scores, 4, window, True, sinks, [13, 1, 1])


def test_high_rates_protect_fewer_recent_tokens_so_the_rate_is_met() -> None:
    """The protected window shrinks where a head's share of the budget could not hold it, the
    sinks and as much again by score: the requested rate is then met, not held up by a floor."""
    assert [protected_window_for(1024, rate, 16, 4) for rate in (2, 8, 32, 64, 1024)] == [16, 16, 14, 6, 1]
    assert protected_window_for(20, 64, 16, 4) == 16  # a short context is all protected
    for rate in (8, 32, 64):
        protected = protected_window_for(1024, rate, 16, 4)
        assert num_kept_for_rate(1024, 3, rate, protected, 4) == math.ceil(3 * 1024 / rate)


def test_a_later_eviction_keeps_the_rate_of_all_tokens_seen() -> None:
    """Budget of a decode-time eviction: ceil(Hk * seen / rate) per layer, however many tokens the
    heads hold, and never more than they hold."""
    policy = EvictionPolicy(window=2, sinks=1, pool_kernel=1)
    head_lens = [20, 30, 25, 25]  # 2 layers x 2 KV heads, after an earlier eviction and decodes
    scores = [torch.rand(2, 30), torch.rand(2, 25)]
    kept = plan_kept(scores, 8.0, policy, head_lens=head_lens, num_seen=160)
    assert [sum(len(k) for k in kept[0:2]), sum(len(k) for k in kept[2:4])] == [40, 40]
    assert all(max(k) < n for k, n in zip(kept, head_lens, strict=True))
    assert plan_kept(scores, 8.0, policy, head_lens=head_lens, num_seen=800) == [
        list(range(n)) for n in head_lens
    ]


def test_pooled_scores_keep_a_read_span_whole() -> None:
    scores = torch.zeros(2, 12)
    scores[0, 5] = 1.0  # one token of a span is read strongly
    scores[1, 0] = 0.5
    pooled = pool_scores(scores, 3)
    assert pooled[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0]
    assert pooled[1].tolist() == [0.5, 0.5] + [0] * 10
    assert torch.equal(pool_scores(scores, 1), scores)


@given(st.integers(1, 40), st.integers(1, 4), st.floats(1.0, 64.0), st.integers(0, 8))
@settings(max_examples=60, deadline=None)
def test_num_kept_for_rate_stays_within_bounds(
    num_tokens: int, num_kv_heads: int, rate: float, window: int
) -> None:
    kept = num_kept_for_rate(num_tokens, num_kv_heads, rate, window)
    assert num_kv_heads * min(window, num_tokens) <= kept <= num_kv_heads * num_tokens
    assert kept >= math.ceil(num_kv_heads * num_tokens / rate) or kept == num_kv_heads * num_tokens


class HeadCacheMachine(RuleBasedStateMachine):
    """Requests append, evict (random kept sets, moves applied to a simulated pool) and finish,
    in any order. The pool's contents always read back as each head's kept tokens, in order, and
    no block is ever owned twice, leaked, or read by another request."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = HeadKVCacheManager(num_blocks=48, block_size=4, num_layers=2, num_kv_heads=2)
        self.memory: dict[int, tuple[str, int]] = {}  # flat head slot -> (request, token id)
        self.model: dict[str, list[list[int]]] = {}  # request -> per head, the token ids it holds
        self.next_token: dict[str, int] = {}
        self.count = 0

    @rule(num_new=st.integers(1, 9), existing=st.booleans(), data=st.data())
    def append(self, num_new: int, existing: bool, data: st.DataObject) -> None:
        if existing and self.model:
            request_id = data.draw(st.sampled_from(sorted(self.model)))
        else:
            request_id, self.count = f"r{self.count}", self.count + 1
        free_before = self.kv.pool.num_free_blocks
        slots = self.kv.append_slots(request_id, num_new)
        if slots is None:
            assert self.kv.pool.num_free_blocks == free_before
            return
        heads = self.model.setdefault(request_id, [[] for _ in range(self.kv.num_heads)])
        first = self.next_token.get(request_id, 0)
        self.next_token[request_id] = first + num_new
        for head, head_slots in enumerate(slots):
            for offset, slot in enumerate(head_slots):
                self.memory[slot] = (request_id, first + offset)
                heads[head].append(first + offset)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.model)))
        kept = []
        for held in self.model[request_id]:
            chosen = data.draw(st.sets(st.integers(0, len(held) - 1), min_size=1, max_size=len(held)))
            kept.append(sorted(chosen))
        moves = self.kv.evict(request_id, kept)
        snapshot = [self.memory[s] for s in moves.src_slots]  # gather, then scatter
        for slot, value in zip(moves.dst_slots, snapshot, strict=True):
            self.memory[slot] = value
        self.model[request_id] = [
            [held[i] for i in keep] for held, keep in zip(self.model[request_id], kept, strict=True)
        ]

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.model)))
        self.kv.free(request_id)
        del self.model[request_id]

    @invariant()
    def contents_read_back(self) -> None:
        self.kv.check_integrity()
        bs = self.kv.block_size
        for request_id, heads in self.model.items():
            tables = self.kv.head_tables(request_id)
            for table, held in zip(tables, heads, strict=True):
                assert table.num_tokens == len(held)
                read = [self.memory[table.block_ids[i // bs] * bs + i % bs] for i in range(len(held))]
                assert read == [(request_id, t) for t in held]
        used = sum(self.kv.num_blocks_used(r) for r in self.model)
        assert used + self.kv.pool.num_free_blocks == self.kv.pool.num_blocks


TestHeadCacheMachine = HeadCacheMachine.TestCase
TestHeadCacheMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)


def test_decode_rows_observed_together_score_as_each_alone() -> None:
    """Observed decode rows of several requests, scored in one padded call, equal
    `observation_scores` of each row alone over its own ragged heads."""
    torch.manual_seed(5)
    num_layers, num_kv_heads, num_q_heads, head_dim, bs = 1, 2, 6, 8, 4
    kv = HeadKVCacheManager(num_blocks=64, block_size=bs, num_layers=num_layers, num_kv_heads=num_kv_heads)
    k_pool = torch.randn(64, bs, head_dim)
    v_pool = torch.randn(64, bs, head_dim)
    for request_id, length in (("a", 11), ("b", 6), ("c", 9)):
        kv.append_slots(request_id, length)
    kv.evict("a", [[0, 3, 10], list(range(11))])
    kv.evict("c", [list(range(9)), [8]])
    for request_id in ("a", "b", "c"):
        kv.append_slots(request_id, 1)  # this step's decode row
    block_tables, head_lens = _layer_tables(kv, ["a", "b", "c"], 0)
    q = torch.randn(3, num_q_heads, head_dim)
    k = torch.randn(3, num_kv_heads, head_dim)
    metadata = HeadAttentionMetadata(
        k_pool=k_pool, v_pool=v_pool,
        head_slots=torch.tensor([kv.head_tables(r)[h].block_ids[-1] * bs + (kv.head_tables(r)[h].num_tokens - 1) % bs
                                 for r in ("a", "b", "c") for h in range(num_kv_heads)]).view(1, 3, num_kv_heads),
        block_tables=block_tables.unsqueeze(0), head_lens=head_lens.unsqueeze(0),
        query_start_loc=[0, 1, 2, 3], observe=[(0, 16), (1, 16), (2, 16)],
    )  # fmt: skip
    head_attention_layer(metadata, 0, q, k, k, scale=0.3)
    for i in range(3):
        lengths = head_lens[i]
        slots = head_slots_of(block_tables[i], bs)[:, : int(lengths.max())]
        keys = k_pool.view(-1, head_dim)[slots].transpose(0, 1)
        want = observation_scores(q[i : i + 1], keys, 0.3, lengths)
        torch.testing.assert_close(metadata.scores[i][0], want)
