"""Kernels against their plain references."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.attention import paged_attention, reference_attention, write_kv
from tandem.kernels.attention_metadata import build_attention_metadata
from tandem.kernels.sampling import (
    apply_penalties,
    apply_token_bitmask_,
    apply_token_bitmask_reference,
    filter_logits,
    finite_rows,
    greedy_tokens,
    sample_rows,
)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_matches_dense_for_mixed_batch(block_size: int) -> None:
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, num_blocks = 6, 2, 8, 64
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    # (cached tokens, new tokens): pure prefill, chunk after a cached prefix, decodes of various lengths
    shapes = [(0, 7), (5, 3), (9, 1), (1, 1), (0, 1), (16, 1)]
    perm = torch.randperm(num_blocks).tolist()  # scattered, non-contiguous blocks
    tables, full_k, full_v = [], [], []
    for cached, new in shapes:
        need = -(-(cached + new) // block_size)
        tables.append([perm.pop() for _ in range(need)])
        full_k.append(torch.randn(cached + new, num_kv_heads, head_dim))
        full_v.append(torch.randn(cached + new, num_kv_heads, head_dim))
    # write the cached prefixes as earlier steps would have
    for (cached, _), table, k, v in zip(shapes, tables, full_k, full_v, strict=True):
        if cached:
            meta = build_attention_metadata(
                [table], [cached], [cached], block_size, num_kv_heads, torch.device("cpu")
            )
            write_kv(k[:cached], v[:cached], k_cache, v_cache, meta.slot_mapping)
    meta = build_attention_metadata(
        tables,
        [n for _, n in shapes],
        [c + n for c, n in shapes],
        block_size,
        num_kv_heads,
        torch.device("cpu"),
    )
    q = torch.randn(sum(n for _, n in shapes), num_heads, head_dim)
    k_new = torch.cat([k[c:] for (c, _), k in zip(shapes, full_k, strict=True)])
    v_new = torch.cat([v[c:] for (c, _), v in zip(shapes, full_v, strict=True)])
    write_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping)
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, meta, scale=head_dim**-0.5)
    row = 0
    for (_, new), k, v in zip(shapes, full_k, full_v, strict=True):
        expected = reference_attention(q[row : row + new], k, v, scale=head_dim**-0.5)
        torch.testing.assert_close(out[row : row + new], expected, atol=1e-5, rtol=1e-5)
        row += new


@pytest.mark.parametrize("writer", ["shared cache", "latent (one tensor as keys and values)", "head pool"])
def test_a_float16_cache_never_holds_an_infinity_whoever_writes_it(writer: str) -> None:
    """Keys and values past float16's range are stored as +-65504 and non-finite ones as 0 by
    every writer of a float16 cache (`write_kv` itself: the decoder, latent attention and the
    head-block pool all write through it), never as infinities or NaN."""
    from tandem.kernels.head_attention import write_head_kv

    limit = torch.finfo(torch.float16).max
    k = torch.tensor([[[1e6, -1e6, 3.0, float("nan")]], [[float("inf"), 2.0, -7e4, 1.0]]])  # [2, 1, 4]
    v = -k
    want_k = torch.tensor([[limit, -limit, 3.0, 0.0], [0.0, 2.0, -limit, 1.0]], dtype=torch.float16)
    cache = torch.zeros(2, 2, 1, 4, dtype=torch.float16)  # [N, bs, Hk, D]
    slots = torch.tensor([1, 2])
    if writer == "shared cache":
        v_cache = torch.zeros_like(cache)
        write_kv(k, v, cache, v_cache, slots)
        assert torch.equal(v_cache.view(-1, 4)[slots], -want_k)
    elif writer.startswith("latent"):
        write_kv(k, k, cache, cache, slots)
    else:
        pool, v_pool = cache.view(2, 2, 4), torch.zeros(2, 2, 4, dtype=torch.float16)
        write_head_kv(k, v, pool, v_pool, slots.view(2, 1))
        assert torch.equal(v_pool.view(-1, 4)[slots], -want_k)
    assert torch.equal(cache.view(-1, 4)[slots], want_k)
    assert torch.isfinite(cache.float()).all()


def test_filter_logits_top_k_top_p_min_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4)
    logits = probs.log()
    kept = filter_logits(
        logits,
        top_k=torch.tensor([2, 0, 0, 0]),
        top_p=torch.tensor([1.0, 0.7, 1.0, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.5, 0.0]),
    ).softmax(-1)
    assert (kept[0] > 0).tolist() == [True, True, False, False]  # top-k 2
    assert (kept[1] > 0).tolist() == [True, True, False, False]  # 0.5 < 0.7 -> keep the crossing token
    assert (kept[2] > 0).tolist() == [True, True, False, False]  # >= 0.5 * 0.5
    assert (kept[3] > 0).tolist() == [True, True, True, True]
    torch.testing.assert_close(kept[3], probs[3])


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, 49152])
def test_token_bitmask_matches_the_shifting_reference_and_llguidance(vocab: int) -> None:
    import llguidance.numpy as llg_np

    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=generator)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=generator)
    bitmask[1] = 0  # nothing allowed
    bitmask[2] = -1  # everything allowed
    masked = apply_token_bitmask_(logits.clone(), bitmask)
    torch.testing.assert_close(masked, apply_token_bitmask_reference(logits, bitmask), rtol=0, atol=0)
    library = logits.clone().numpy()
    llg_np.apply_token_bitmask_inplace(library, bitmask.numpy())  # the grammar library's own (-inf)
    assert torch.equal(torch.from_numpy(library) == float("-inf"), masked == torch.finfo(torch.float32).min)
    assert torch.equal(masked[2], logits[2])


def test_penalties_follow_openai_formula() -> None:
    logits = torch.zeros(1, 4)
    counts = torch.tensor([[0.0, 1.0, 3.0, 0.0]])
    out = apply_penalties(logits, counts, presence=torch.tensor([0.5]), frequency=torch.tensor([0.25]))
    torch.testing.assert_close(out, torch.tensor([[0.0, -0.75, -1.25, 0.0]]))


@pytest.mark.parametrize(("num_rows", "vocab"), [(1, 5), (3, 17), (1, 40_000), (2, 262_144), (40, 49_152)])
def test_greedy_tokens_answer_as_torch_argmax(num_rows: int, vocab: int) -> None:
    """The native argmax (rows split across threads) gives torch.argmax's index on random rows,
    ties (the first largest), NaNs (the first NaN), rows of -inf (0) and +inf, and strided rows."""
    from tandem.kernels import int4_native

    if int4_native.load() is None:
        pytest.skip("the native library does not run here")
    g = torch.Generator().manual_seed(vocab)
    cases = [
        torch.randn(num_rows, vocab, generator=g),
        torch.randint(-2, 3, (num_rows, vocab), generator=g).float(),  # many ties
        torch.full((num_rows, vocab), float("-inf")),
        torch.full((num_rows, vocab), float("inf")),
        torch.randn(num_rows, 2 * vocab, generator=g)[:, ::2],  # not contiguous
    ]
    nans = torch.randn(num_rows, vocab, generator=g)
    nans[torch.rand(num_rows, vocab, generator=g) < 0.001] = float("nan")
    nans[0, vocab - 1] = float("nan")
    cases.append(nans)
    late = torch.full((num_rows, vocab), -1.0)
    late[:, vocab - 1] = 2.0  # the largest value in the last element: the tail after the vector part
    cases.append(late)
    for logits in cases:
        assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))


def test_finite_rows_flag_what_a_sum_flags() -> None:
    """A row with a NaN, an infinity or a sum past float32's range is not finite; others are."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 262_144, generator=g)
    logits[1, 7] = float("nan")
    logits[2, 262_143] = float("inf")  # the last element
    logits[3, 100_000] = float("-inf")
    logits[4, :] = 3e33  # every value finite, the sum not
    logits[5, :5] = float("nan")  # fewer values than a vector: the tail
    expected = torch.isfinite(logits.sum(dim=-1)).tolist()
    assert expected == [True, False, False, False, False, False, True, True]
    assert finite_rows(logits) == expected
    assert finite_rows(logits[:, :13]) == torch.isfinite(logits[:, :13].sum(dim=-1)).tolist()


def test_seeded_sampling_is_reproducible_and_follows_the_distribution() -> None:
    probs = torch.tensor([[0.1, 0.6, 0.3]]).repeat(4000, 1)
    gen_a, gen_b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    a = sample_rows(probs[:50], [gen_a] * 50)
    b = sample_rows(probs[:50], [gen_b] * 50)
    assert torch.equal(a, b)
    draws = sample_rows(probs, [torch.Generator().manual_seed(1)] * 4000)
    freq = torch.bincount(draws, minlength=3).float() / 4000
    torch.testing.assert_close(freq, probs[0], atol=0.03, rtol=0)


def test_packed_linear_matches_reference() -> None:
    from tandem.kernels.linear import PackedLinear, onednn_available, reference_linear

    if not onednn_available(torch.device("cpu"), torch.float32):
        pytest.skip("oneDNN not available")
    torch.manual_seed(0)
    weight = torch.randn(96, 40)
    packed = PackedLinear(weight)
    for rows in (1, 7, 33, 200):  # any M works, not only the packing hint
        x = torch.randn(rows, 40)
        torch.testing.assert_close(packed(x), reference_linear(x, weight), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_native_decode_attention_matches_the_torch_gather_path(cache_dtype: torch.dtype) -> None:
    """The native decode attention against the torch path it replaces (gather every key, two
    matmuls, masked softmax), on the same cache: float32, bfloat16, float16 and FP8 with per-row
    scales."""
    from tandem.kernels import int4_native
    from tandem.kernels.attention import _decode_attention, _gather_unscaled, native_paged_attention

    if int4_native.load() is None:
        pytest.skip(f"native library unavailable: {int4_native.unavailable_reason()}")
    torch.manual_seed(1)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 9, 3, 16, 4, 40
    fp8 = cache_dtype == torch.float8_e4m3fn
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.zeros(num_blocks, block_size, num_kv_heads, dtype=torch.float16) if fp8 else None
    v_scale = torch.zeros_like(k_scale) if fp8 else None
    lengths = [1, 5, 13, 8]
    perm = torch.randperm(num_blocks).tolist()
    tables = [[perm.pop() for _ in range(-(-n // block_size))] for n in lengths]
    for table, n in zip(tables, lengths, strict=True):
        meta = build_attention_metadata([table], [n], [n], block_size, num_kv_heads, torch.device("cpu"))
        keys, values = torch.randn(n, num_kv_heads, head_dim) * 3, torch.randn(n, num_kv_heads, head_dim)
        write_kv(keys, values, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    meta = build_attention_metadata(tables, [1] * 4, lengths, block_size, num_kv_heads, torch.device("cpu"))
    q = torch.randn(4, num_heads, head_dim)
    assert meta.native_block_tables is not None and meta.native_positions is not None
    got = native_paged_attention(
        q, k_cache, v_cache, meta.native_block_tables, meta.native_positions, head_dim**-0.5, k_scale, v_scale
    )
    k_rows, v_rows = k_cache.view(-1, head_dim), v_cache.view(-1, head_dim)
    k_scales = None if k_scale is None else k_scale.view(-1)
    v_scales = None if v_scale is None else v_scale.view(-1)
    want = _decode_attention(
        q.view(4, num_kv_heads, num_heads // num_kv_heads, head_dim),
        _gather_unscaled(k_rows, k_scales, meta.decode_kv_index, torch.float32),
        _gather_unscaled(v_rows, v_scales, meta.decode_kv_index, torch.float32),
        meta.decode_mask,
        head_dim**-0.5,
    ).view(4, num_heads, head_dim)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize(("window", "softcap"), [(4, None), (None, 2.0), (5, 3.0), (64, None)])
def test_sliding_window_and_softcap_match_dense(
    monkeypatch: pytest.MonkeyPatch,
    native: bool,
    cache_dtype: torch.dtype,
    window: int | None,
    softcap: float | None,
) -> None:
    """Every path of `paged_attention` (native rows, gathered decode, whole prompts, chunks after a
    cached prefix, short and long) with a sliding window and soft-capped scores, against the dense
    reference over the keys as the cache holds them (FP8: dequantised)."""
    from tandem.kernels import attention_metadata, int4_native
    from tandem.kernels.attention import _gather_rows

    if native and int4_native.load() is None:
        pytest.skip(f"native library unavailable: {int4_native.unavailable_reason()}")
    monkeypatch.setattr(attention_metadata, "NATIVE_ATTENTION", native)
    torch.manual_seed(2)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 6, 2, 8, 4, 96
    fp8 = cache_dtype == torch.float8_e4m3fn
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.zeros(num_blocks, block_size, num_kv_heads, dtype=torch.float16) if fp8 else None
    v_scale = torch.zeros_like(k_scale) if fp8 else None
    # (cached, new): a whole prompt, a short chunk after a prefix (native rows), a long chunk
    # after a prefix, decodes shorter and longer than the window
    shapes = [(0, 11), (9, 3), (6, 20), (13, 1), (2, 1), (30, 1)]
    perm = torch.randperm(num_blocks).tolist()
    tables = [[perm.pop() for _ in range(-(-(c + n) // block_size))] for c, n in shapes]
    full_k = [torch.randn(c + n, num_kv_heads, head_dim) * 2 for c, n in shapes]
    full_v = [torch.randn(c + n, num_kv_heads, head_dim) for c, n in shapes]
    cpu = torch.device("cpu")
    for (cached, _), table, k, v in zip(shapes, tables, full_k, full_v, strict=True):
        if cached:
            meta = build_attention_metadata([table], [cached], [cached], block_size, num_kv_heads, cpu)
            write_kv(k[:cached], v[:cached], k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    lens = [c + n for c, n in shapes]
    meta = build_attention_metadata(tables, [n for _, n in shapes], lens, block_size, num_kv_heads, cpu)
    assert (meta.native_rows is not None) == native
    q = torch.randn(sum(n for _, n in shapes), num_heads, head_dim)
    k_new = torch.cat([k[c:] for (c, _), k in zip(shapes, full_k, strict=True)])
    v_new = torch.cat([v[c:] for (c, _), v in zip(shapes, full_v, strict=True)])
    write_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    out = paged_attention(
        q,
        k_new,
        v_new,
        k_cache,
        v_cache,
        meta,
        head_dim**-0.5,
        k_scale,
        v_scale,
        window=window,
        softcap=softcap,
    )
    row = 0
    for (cached, new), table, k, v in zip(shapes, tables, full_k, full_v, strict=True):
        if (
            cached
        ):  # what attention reads back: the cache's values (a whole prompt attends its own as computed)
            slots = torch.tensor(
                [table[i // block_size] * block_size + i % block_size for i in range(cached + new)]
            )
            index = (slots[:, None] * num_kv_heads + torch.arange(num_kv_heads)).reshape(-1)
            k = _gather_rows(
                k_cache.view(-1, head_dim),
                None if k_scale is None else k_scale.view(-1),
                index,
                torch.float32,
            )
            v = _gather_rows(
                v_cache.view(-1, head_dim),
                None if v_scale is None else v_scale.view(-1),
                index,
                torch.float32,
            )
            k, v = k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)
        expected = reference_attention(
            q[row : row + new], k, v, head_dim**-0.5, window=window, softcap=softcap
        )
        torch.testing.assert_close(out[row : row + new], expected, atol=1e-4, rtol=1e-4)
        row += new
    if window is not None and window < 30:  # the window is not a no-op: the full context differs
        last = full_k[-1], full_v[-1]
        unwindowed = reference_attention(q[-1:], last[0], last[1], head_dim**-0.5, softcap=softcap)
        assert not torch.allclose(out[-1:], unwindowed, atol=1e-3)
