"""Quantisation: FP8 (e4m3) KV cache and INT4 weights, against plain-torch references and the
unquantised engine."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.kernels import int4_native
from tandem.kernels.attention import paged_attention, reference_attention, write_kv
from tandem.kernels.attention_metadata import build_attention_metadata
from tandem.kernels.fp8 import e4m3_to_float, quantize_fp8
from tandem.kernels.int4 import (
    NATIVE_GEMV_MAX_ROWS,
    Int4Linear,
    dequantize_int4,
    double_quantize_int4,
    fit_group_size,
    int4_linear_reference,
    quantize_int4,
)
from tandem.kernels.int8 import INT8_GEMV_MAX_ROWS, Int8HeadLinear, dequantize_int8, q8_mm
from tandem.kernels.linear import pack_linears

requires_native_int4 = pytest.mark.skipif(
    int4_native.load() is None, reason=f"native INT4 kernel unavailable: {int4_native.unavailable_reason()}"
)
# Rows for both native paths: the GEMV kernel (4-row blocks and a remainder) and dequantise + GEMM.
NATIVE_ROW_COUNTS = (1, 7, NATIVE_GEMV_MAX_ROWS + 5)

PROMPTS = ["The quick brown fox", "Paged attention stores", "0123456789 numbers", "Hello there"]


HYBRID_LOGPROB_TOLERANCE = 1.0  # INT4 decode vs float32 on the random tiny model, same path


def test_fp8_quantisation_error_is_bounded() -> None:
    x = torch.randn(64, 4, 32) * torch.logspace(-2, 2, 64)[:, None, None]  # rows of very different size
    q, scale = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 4)
    back = q.float() * scale.float()[..., None]
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each row's largest value.
    assert ((back - x).abs() <= x.abs().amax(-1, keepdim=True) * 2**-4 + 1e-6).all()


def test_e4m3_bit_conversion_matches_torch_for_every_code() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()
    got = e4m3_to_float(codes)
    finite = ~want.isnan()
    assert int(finite.sum()) == 254
    assert torch.equal(got[finite], want[finite])  # exact, subnormals and signed zero included
    assert torch.equal(got[finite].signbit(), want[finite].signbit())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_e4m3_bits_placed_in_a_wide_type_read_as_the_value_over_2_to_120(dtype: torch.dtype) -> None:
    """The decode gather's conversion (no factor applied: it joins the per-row scale)."""
    from tandem.kernels.fp8 import e4m3_bits_as

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()
    got = e4m3_bits_as(codes, dtype)
    finite = ~want.isnan()
    assert got.dtype == dtype
    assert torch.equal(got.float()[finite] * 2.0**120, want[finite])
    assert torch.equal(got.float()[finite].signbit(), want[finite].signbit())


def test_paged_attention_reads_fp8_cache_like_the_reference() -> None:
    """Decode and chunked prefill over an FP8 cache equal dense attention over the dequantised
    K/V that were written."""
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, hk, hq, d = 8, 4, 2, 4, 16
    k_cache = torch.zeros(num_blocks, block_size, hk, d, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.zeros(num_blocks, block_size, hk, dtype=torch.float16)
    v_scale = torch.zeros_like(k_scale)
    table, length = [5, 2, 7], 10
    k_all = torch.randn(length, hk, d, generator=gen)
    v_all = torch.randn(length, hk, d, generator=gen)
    # Write the first 7 tokens (prefix), then run a 3-token chunk that reads them back.
    meta = build_attention_metadata([table], [7], [7], block_size, hk, torch.device("cpu"))
    write_kv(k_all[:7], v_all[:7], k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    q = torch.randn(3, hq, d, generator=gen)
    meta = build_attention_metadata([table], [3], [10], block_size, hk, torch.device("cpu"))
    write_kv(k_all[7:], v_all[7:], k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    got = paged_attention(q, k_all[7:], v_all[7:], k_cache, v_cache, meta, d**-0.5, k_scale, v_scale)

    def dequant(x: torch.Tensor) -> torch.Tensor:
        qx, s = quantize_fp8(x)
        return qx.float() * s.float()[..., None]

    want = reference_attention(q, dequant(k_all), dequant(v_all), d**-0.5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    meta = build_attention_metadata([table], [1], [10], block_size, hk, torch.device("cpu"))  # decode
    got = paged_attention(q[2:], k_all[9:], v_all[9:], k_cache, v_cache, meta, d**-0.5, k_scale, v_scale)
    torch.testing.assert_close(got, want[2:], atol=1e-4, rtol=1e-4)


def test_fp8_cache_doubles_capacity_and_stays_close(tiny_model_dir: Path) -> None:
    """Same KV budget: a 16-bit cache holds 2x the float32 tokens, FP8 2D/(D+2) x the 16-bit ones
    (D = head dim; the float16 scale per vector is counted). Along the float32 run's greedy path,
    the FP8 run's log-probs stay close (the random tiny model has near-ties, so its greedy tokens
    are a poor yardstick; the default model's quality is measured by benchmarks/quant_quality.py).
    Not batch-invariant: there a prompt attends its own keys as the cache holds them (FP8), as a
    prefix-cache hit would; here its first token comes from its unrounded K/V."""
    budget = 4 << 20
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    runs = {}
    for kv_dtype in ("float32", "bfloat16", "fp8_e4m3"):
        llm = LLM(
            str(tiny_model_dir),
            kv_cache_memory=budget,
            kv_cache_dtype=kv_dtype,
            max_model_len=512,
            batch_invariant=False,
        )
        assert llm.stats()["kv_cache_dtype"] == {"fp8_e4m3": "float8_e4m3fn"}.get(kv_dtype, kv_dtype)
        runs[kv_dtype] = (llm.stats()["kv_capacity_tokens"], llm.generate(PROMPTS, params))
    cap32, cap16, cap8 = runs["float32"][0], runs["bfloat16"][0], runs["fp8_e4m3"][0]
    head_dim = 16  # the tiny model: 64 hidden / 4 heads
    assert cap16 == pytest.approx(2 * cap32, rel=0.02)
    assert cap8 == pytest.approx(cap16 * 2 * head_dim / (head_dim + 2), rel=0.02)
    for kv_dtype, tolerance in (("bfloat16", 0.1), ("fp8_e4m3", 0.4)):
        diffs = []
        for want, got in zip(runs["float32"][1], runs[kv_dtype][1], strict=True):
            w, g = want.outputs[0], got.outputs[0]
            assert g.token_ids[0] == w.token_ids[0]  # the first token comes from the prompt's own K/V
            for step, (a, b) in enumerate(zip(w.token_ids, g.token_ids, strict=True)):
                if a != b:
                    break
                diffs.append(abs(w.logprobs[step][a] - g.logprobs[step][b]))
        assert max(diffs) < tolerance and len(diffs) >= len(PROMPTS) * 3, kv_dtype


def test_hybrid_weights_route_small_decode_steps_to_int4(tiny_model_dir: Path) -> None:
    """weight_dtype="hybrid": prompt chunks run the float32 copy, decode steps of at most
    hybrid_int4_max_batch requests the INT4 copy, larger decode batches the float32 copy; both
    copies read and write the same KV cache."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    options = {"kv_cache_memory": 4 << 20, "max_model_len": 512}
    dense = LLM(
        str(tiny_model_dir), batch_invariant=False, **options
    )  # a hybrid engine is not batch-invariant
    hybrid = LLM(str(tiny_model_dir), weight_dtype="hybrid", hybrid_int4_max_batch=2, **options)
    assert not hybrid.stats()["batch_invariant"]
    runner = hybrid.engine.runner
    assert runner.decode_model is not runner.model
    prompts = PROMPTS[:3]

    # One request at a time: the first token comes from the float32 prefill (identical to the
    # float32 engine), every later one from an INT4 decode step reading the prefill's KV.
    diffs = []
    for prompt in prompts:
        want = dense.generate([prompt], params)[0].outputs[0]
        got = hybrid.generate([prompt], params)[0].outputs[0]
        assert got.token_ids[0] == want.token_ids[0]
        assert got.logprobs[0] == want.logprobs[0]
        for step in range(1, len(want.token_ids)):
            if got.token_ids[step - 1] != want.token_ids[step - 1]:
                break
            token = want.token_ids[step]
            if token in got.logprobs[step]:
                diffs.append(abs(want.logprobs[step][token] - got.logprobs[step][token]))
    assert runner.num_decode_model_steps == len(prompts) * (params.max_tokens - 1)
    assert diffs and 0 < max(diffs) < HYBRID_LOGPROB_TOLERANCE  # INT4 is in use, and reads good KV

    # Three requests admitted in one step: every decode step has 3 rows > 2, so the float32 copy
    # runs them and the answers are the float32 engine's, token for token.
    before = runner.num_decode_model_steps
    together = hybrid.generate(prompts, params)
    assert runner.num_decode_model_steps == before
    expected = dense.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in expected]


@pytest.mark.parametrize("shape", [(96, 64), (40, 256)])
def test_int4_linear_matches_reference(shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(*shape, generator=gen)
    w = quantize_int4(weight, fit_group_size(shape[1], 128))
    assert w.q.max() <= 15 and w.num_bytes < weight.numel() * 2 * 0.3  # < 0.3x of 16-bit
    group_err = (dequantize_int4(w) - weight).abs()
    assert (group_err <= (w.scale.repeat_interleave(w.group_size, 1) / 2 + 1e-5)).all()  # half a step
    x = torch.randn(5, shape[1], generator=gen)
    layer = Int4Linear(w, torch.device("cpu"), kernel="torch")
    assert layer.kernel == "torch"
    want = int4_linear_reference(x, w)
    torch.testing.assert_close(
        layer(x), want, atol=0.05 * want.abs().max().item(), rtol=0.02
    )  # bf16 activations and parameters


@requires_native_int4
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape", [(96, 64), (40, 256), (50, 576), (24, 160)])  # 2, 8, 18, 5 runs
def test_native_int4_linear_matches_reference(shape: tuple[int, int], double_quant: bool) -> None:
    """The native kernel against the dequantised reference, on both of its paths, for Q4_1-style
    float16 parameters and for int8 codes. It reads the codes exactly and rounds activations to
    16 bits per run of 32, so it is two orders of magnitude closer to the reference than torch's
    bfloat16 kernel (checked side by side)."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(*shape, generator=gen) * torch.logspace(-1, 1, shape[1])
    w = quantize_int4(weight, fit_group_size(shape[1], 128 if shape[1] != 576 else 32))
    if double_quant:
        w = double_quantize_int4(w)
    assert torch.equal(int4_native.unpack_rows(int4_native.pack_rows(w.q)), w.q)
    native = Int4Linear(w, torch.device("cpu"), kernel="native")
    torch_kernel = Int4Linear(w, torch.device("cpu"), kernel="torch")
    assert native.kernel == "native" and (native.param_codes is not None) == double_quant
    for rows in NATIVE_ROW_COUNTS:
        x = torch.randn(rows, shape[1], generator=gen)
        x[0, :32] = 0.0  # a run of zeros: its activation scale is 0, not a division by zero
        want = int4_linear_reference(x, w)
        err = (native(x) - want).abs().max().item() / want.abs().max().item()
        torch_err = (torch_kernel(x) - want).abs().max().item() / want.abs().max().item()
        assert err < (3e-3 if not double_quant else 2e-4), (rows, err)  # float16 params vs float32
        assert err < torch_err / 4, (rows, err, torch_err)


@requires_native_int4
def test_native_int4_compiles_as_one_graph_and_is_refused_where_it_cannot_run() -> None:
    gen = torch.Generator().manual_seed(4)
    w = double_quantize_int4(quantize_int4(torch.randn(64, 576, generator=gen), 32))
    layer = Int4Linear(w, torch.device("cpu"), kernel="native")
    compiled = torch.compile(layer, fullgraph=True)  # a graph break (the ctypes call) would raise
    for rows in (3, NATIVE_GEMV_MAX_ROWS + 2):
        x = torch.randn(rows, 576, generator=gen)
        torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-5)
    wide = quantize_int4(torch.randn(16, 1024, generator=gen), 512)  # no specialisation for 512
    with pytest.raises(RuntimeError, match="int4_kernel='native' cannot be used: group size 512"):
        Int4Linear(wide, torch.device("cpu"), kernel="native")
    assert Int4Linear(wide, torch.device("cpu")).kernel == "torch"  # 'auto' falls back


@requires_native_int4
def test_int8_head_is_one_precision_for_every_step_unless_a_hybrid_shares_its_dense_head() -> None:
    """An INT4 model's head reads its INT8 copy at every row count (a request's logits never depend
    on its step's size); only when a hybrid engine shares the dense model's head (`use_dense_head`)
    do larger steps take exactly that head's output, in its dtype, and the bfloat16 copy is gone."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(300, 128, generator=gen) * 0.05
    head = Int8HeadLinear(weight)
    assert head.int8 is not None and head.interleaved is not None

    def head_kernel(x: torch.Tensor) -> torch.Tensor:  # the head's INT8 copy through its kernel
        assert head.interleaved is not None
        return q8_mm(x, *head.interleaved, 300)

    small = torch.randn(INT8_GEMV_MAX_ROWS, 128, generator=gen)
    large = torch.randn(INT8_GEMV_MAX_ROWS + 3, 128, generator=gen)
    assert torch.equal(head(small), head_kernel(small))
    torch.testing.assert_close(head(small), small @ dequantize_int8(head.int8).T, rtol=1e-3, atol=1e-4)
    assert torch.equal(head(large), head_kernel(large))
    assert torch.equal(head(large)[:1], head(large[:1]))  # a row's logits whatever the step's size
    before = head(large)
    exact = large @ weight.T
    dense_model = torch.nn.Sequential(torch.nn.Linear(128, 300, bias=False))
    dense_model[0].weight.data.copy_(weight)
    pack_linears(dense_model)  # as the engine's dense model: oneDNN prepacked where available
    dense = dense_model[0]
    head.use_dense_head(dense, torch.float32)
    assert head.weight.numel() == 0
    assert torch.equal(head(large), dense(large))
    torch.testing.assert_close(head(large), exact, rtol=1e-5, atol=1e-5)
    assert (head(large) - exact).abs().max() < (before - exact).abs().max()
    assert torch.equal(head(small), head_kernel(small))  # small steps still read INT8
    assert not list(head.children())  # the dense head stays the dense model's (not a submodule)


def test_double_quantised_int4_stores_int8_group_params_and_keeps_the_values() -> None:
    """Group 32 with bfloat16 (scale, zero) is 5 bits per weight; with int8 codes under per-
    super-block scales it is under 0.3x of 16-bit, the expanded parameters are exactly the weight's
    (scale, zero), the re-rounded values stay within a fraction of a step of the originals, and the
    layer keeps only the codes resident while matching the reference."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 576, generator=gen) * torch.logspace(-1, 1, 576)  # groups of unequal size
    w = quantize_int4(weight, 32)
    dq = double_quantize_int4(w)
    assert dq.int8_params is not None and dq.int8_params.groups_per_superblock == 6  # 18 groups per row
    assert w.num_bytes / (weight.numel() * 2) == 0.3125
    assert dq.num_bytes / (weight.numel() * 2) < 0.3
    expanded = dq.int8_params.expand().float()
    assert torch.equal(expanded[..., 0], dq.scale) and torch.equal(expanded[..., 1], dq.zero)
    moved = (dequantize_int4(dq) - dequantize_int4(w)).abs()
    step = w.scale.repeat_interleave(32, 1)
    assert (moved <= step).all() and moved.mean() < 0.1 * step.mean()
    assert not torch.equal(dq.scale, w.scale)  # the parameters did move: the check above is not vacuous

    layer = Int4Linear(dq, torch.device("cpu"))
    assert layer.scales_and_zeros is None
    resident = sum(b.numel() * b.element_size() for b in layer.buffers())
    assert resident < weight.numel() * 2 * 0.3
    x = torch.randn(5, 576, generator=gen)
    want = int4_linear_reference(x, dq)
    torch.testing.assert_close(layer(x), want, atol=0.05 * want.abs().max().item(), rtol=0.02)


def test_gguf_q4_1_loads_as_int4_without_a_round_trip(default_model_path: Path) -> None:
    """Every Q4_1 tensor of the default model becomes INT4 weights whose dequantised values are
    bit for bit what gguf's own dequantiser gives (after the q/k row permutation is undone)."""
    from tandem.engine.models.gguf_stored import read_stored, stored_int4
    from tandem.engine.models.loader import load_model

    loaded = load_model(str(default_model_path))
    native = stored_int4(read_stored(default_model_path))
    assert len(native) == 7 * loaded.config.num_hidden_layers
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        np.testing.assert_array_equal(dequantize_int4(native[name]).numpy(), loaded.weights[name].numpy())


def test_int4_group_size_unset_keeps_q4_1_and_set_requantises(default_model_path: Path) -> None:
    def layer0(llm: LLM) -> list[Int4Linear]:
        layer = llm.engine.runner.model.layers[0]
        return [layer.self_attn.qkv_proj, layer.mlp.down_proj]

    native = LLM(str(default_model_path), weight_dtype="int4", kv_cache_memory=16 << 20)
    assert [m.group_size for m in layer0(native)] == [32, 32]  # Q4_1's blocks, as stored
    requantised = LLM(
        str(default_model_path),
        weight_dtype="int4",
        int4_group_size=128,
        int4_method="rtn",
        kv_cache_memory=16 << 20,
    )
    assert [m.group_size for m in layer0(requantised)] == [64, 128]  # 576 inputs: 64 divides, 128 not
    assert sum(m.num_weight_bytes for m in layer0(requantised)) < sum(
        m.num_weight_bytes for m in layer0(native)
    )
    double_quantised = LLM(
        str(default_model_path), weight_dtype="int4", int4_double_quant=True, kv_cache_memory=16 << 20
    )
    layers = layer0(double_quantised)
    assert [m.group_size for m in layers] == [32, 32]  # the Q4_1 blocks, int8 group parameters
    assert all(m.param_codes is not None for m in layers)
    bf16_bytes = sum(2 * m.in_features * m.out_features for m in layers)
    assert sum(m.num_weight_bytes for m in layers) < 0.3 * bf16_bytes


def _next_token_logprobs(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """[N-1, V] teacher-forced next-token log-probs through the engine's model and paged KV."""
    from tandem.kernels.attention_metadata import build_attention_metadata

    runner = llm.engine.runner
    block_size = llm.engine.kv_manager.block_size
    table = list(range(-(-len(token_ids) // block_size)))
    rows = []
    for start in range(0, len(token_ids) - 1, 16):  # chunks: later ones read earlier KV back
        end = min(start + 16, len(token_ids) - 1)
        metadata = build_attention_metadata(
            [table], [end - start], [end], block_size, runner.kv_spec.num_kv_heads, runner.device
        )
        with torch.inference_mode():
            logits = runner.model(
                torch.tensor(token_ids[start:end]), torch.arange(start, end), runner.kv_caches, metadata,
                torch.arange(end - start),
            )  # fmt: skip
        rows.append(torch.log_softmax(logits.float(), dim=-1))
    return torch.cat(rows)


@pytest.mark.slow
def test_int4_and_fp8_keep_the_default_model_close(default_model_path: Path) -> None:
    """Teacher-forced over a paragraph: next-token argmax mostly unchanged and small KL against the
    unquantised model, for INT4 weights (the GGUF's Q4_1 as is, and with int8 group parameters)
    and for an FP8 KV cache."""
    text = (
        "The lighthouse keeper kept a notebook of every ship that passed the point, and over forty "
        "years the notebook grew into a small library. He wrote down the name of each vessel when he "
        "could read it, the direction of the wind, and whether the gulls were flying low."
    )
    base = LLM("smollm2-135m-instruct", kv_cache_memory=64 << 20)
    ids = base.tokenizer.encode(text)
    want = _next_token_logprobs(base, ids)
    for options in (
        {"weight_dtype": "int4"},
        {"weight_dtype": "int4", "int4_double_quant": True},
        {"kv_cache_dtype": "fp8_e4m3"},
    ):
        llm = LLM("smollm2-135m-instruct", kv_cache_memory=64 << 20, **options)
        got = _next_token_logprobs(llm, ids)
        agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        kl = (want.exp() * (want - got)).sum(-1).mean().item()
        assert agreement >= 0.9 and kl < 0.01, (options, agreement, kl)


def test_int8_linear_matches_its_dequantised_weight_and_keeps_each_rows_bits() -> None:
    """`Int8Linear` (weight_dtype="int8"): Q8_0 codes in the native kernel's output-interleaved
    layout (an exact round trip, 100 outputs padded to 112), close to x @ dequantised(W).T, and
    each row the same bits whatever the call's size (one arithmetic per row and output)."""
    from tandem.kernels.int8 import (
        Int8Linear,
        deinterleave_outputs,
        dequantize_int8,
        interleave_outputs,
        quantize_int8,
    )

    gen = torch.Generator().manual_seed(7)
    q = quantize_int8(torch.randn(100, 256, generator=gen))
    codes_il, scales_il = interleave_outputs(q)
    assert codes_il.shape == (7, 128, 16, 2) and scales_il.shape == (7, 8, 16)
    back = deinterleave_outputs(codes_il, scales_il, 100)
    assert torch.equal(back.codes, q.codes) and torch.equal(back.scales, q.scales)
    weight = torch.randn(96, 256, generator=gen)
    linear = Int8Linear(quantize_int8(weight), torch.device("cpu"), bias=torch.randn(96, generator=gen))
    x = torch.randn(70, 256, generator=gen)
    want = x @ dequantize_int8(quantize_int8(weight)).T + linear.bias
    got = linear(x)
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    if linear.native:
        alone = torch.cat([linear(x[i : i + 1]) for i in range(70)])
        for rows in (2, 5, 16, 17, 70):
            assert torch.equal(linear(x[:rows]), alone[:rows])


def test_int8_weights_run_the_native_stack_and_match_the_eager_model(tiny_model_dir: Path) -> None:
    """weight_dtype="int8": Q8_0 decoder linears, run by the native decoder stack where it runs,
    whose logprobs equal the eager INT8 model's up to float32 summation order."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    options = {"weight_dtype": "int8", "kv_cache_memory": 4 << 20, "speculative": None}
    native = LLM(str(tiny_model_dir), **options)
    if not native.stats()["native_decoder"]:
        pytest.skip("the native library is unavailable here")
    eager = LLM(str(tiny_model_dir), native_decoder=False, **options)
    for prompt in PROMPTS[:2]:
        a = native.generate([prompt], params)[0].outputs[0]
        b = eager.generate([prompt], params)[0].outputs[0]
        first = a.token_ids[0]
        assert first == b.token_ids[0]
        assert a.logprobs[0][first] == pytest.approx(b.logprobs[0][first], abs=1e-3)
    assert native.stats()["num_native_decoder_steps"] > 0


def test_int8_kernel_gives_the_same_bits_built_for_avx2(tmp_path: Path) -> None:
    """`tandem_q8_mm`'s arithmetic is per (row, output), not per instruction set: the library built
    for AVX2 only (`TANDEM_NATIVE_MARCH=haswell`, 8 outputs per register) gives this machine's
    build's bits (16 per register with AVX-512), so replicas on different CPUs answer alike."""
    import subprocess
    import sys

    from tandem.kernels.int8 import Int8Linear, quantize_int8
    from tandem.platform.cpu import cpu_flags

    if int4_native.load() is None or "avx512f" not in cpu_flags():
        pytest.skip("compares an AVX-512 build with an AVX2 one")
    script = (
        "import sys, torch\n"
        "from tandem.kernels.int8 import Int8Linear, quantize_int8\n"
        "g = torch.Generator().manual_seed(11)\n"
        "w, x = torch.randn(40, 320, generator=g), torch.randn(9, 320, generator=g)\n"
        "torch.save(Int8Linear(quantize_int8(w), torch.device('cpu'))(x), sys.argv[1])\n"
    )
    out = tmp_path / "avx2.pt"
    env = {**os.environ, "TANDEM_NATIVE_MARCH": "haswell", "TANDEM_CACHE_DIR": str(tmp_path / "cache")}
    subprocess.run([sys.executable, "-c", script, str(out)], env=env, check=True, timeout=300)
    g = torch.Generator().manual_seed(11)
    w, x = torch.randn(40, 320, generator=g), torch.randn(9, 320, generator=g)
    assert torch.equal(torch.load(out), Int8Linear(quantize_int8(w), torch.device("cpu"))(x))


@pytest.fixture
def amx() -> Iterator[None]:
    """The AMX paths on for the test (skipped where the CPU, the build or Linux lacks them), and
    on again after it whatever it did."""
    if not int4_native.use_amx(True):
        pytest.skip("needs AMX-INT8 (csrc/amx_cpu.c): this CPU, its build or Linux lacks it")
    yield
    int4_native.use_amx(True)


def test_int8_kernel_on_amx_gives_the_vector_kernels_bits(amx: None) -> None:
    """`tandem_q8_mm`'s AMX path computes each run's integer dot product on the tile unit from the
    int16 activations' high and low bytes: the same integers, so the same bits as the vector kernel
    at every call size, whatever rows go to which (whole 16-row tiles, a padded last tile from 6
    rows, or from 1 where the weight passes 4 MB, the rest on the vector kernel) and with partial
    16-output blocks (the choice may depend on the call's size without breaking batch
    invariance)."""
    from tandem.kernels.int8 import interleave_outputs, quantize_int8

    g = torch.Generator().manual_seed(5)
    for rows, cols in ((40, 320), (1000, 640), (7000, 640)):  # the last one past 4 MB of codes
        codes_il, scales_il = interleave_outputs(quantize_int8(torch.randn(rows, cols, generator=g)))
        for num_tokens in (1, 3, 4, 5, 8, 9, 16, 17, 22, 33, 130):
            x = torch.randn(num_tokens, cols, generator=g) * 4
            x[0, :32] = 0.0  # a run of zeros (step 0) and a run with one value far above the rest
            x[-1, 32:64] = torch.linspace(-1e-3, 1e-3, 32)
            x[-1, 40] = 300.0
            assert int4_native.use_amx(False) is False
            vector = q8_mm(x, codes_il, scales_il, rows)
            assert int4_native.use_amx(True) is True
            assert torch.equal(q8_mm(x, codes_il, scales_il, rows), vector), (rows, num_tokens)


def test_gguf_blocks_on_amx_keep_each_rows_bits_at_any_call_size(amx: None) -> None:
    """GGUF 4-bit blocks as stored (mode 3) on an AMX CPU: tiles for 16-row blocks from 12 real
    rows, AVX512-VNNI below, one float32 order per (row, output): a row alone, in a call of 37 or in
    other splits has the same bits (batch invariance), equal to the product of the dequantised weight
    to int16-activation rounding; with AMX turned off (vpdpbusd only, as on a CPU without AMX) every
    call size gives the same bits, and the tile unit really ran when on."""
    g = torch.Generator().manual_seed(9)
    for rows, cols in ((50, 512), (20, 32)):  # 4 output blocks, the last one partial; one run a row
        packed = int4_native.pack_rows(torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8))
        codes = torch.randint(-63, 64, (rows, cols // 32, 2), generator=g, dtype=torch.int8)
        superblocks = max(1, cols // 256)  # Q4_K-like: 8 runs a super-block
        block_scales = (torch.rand(rows, superblocks, 2, generator=g) * 0.02).to(torch.float16)
        x = torch.randn(37, cols, generator=g)

        def mm(
            rows_of_x: torch.Tensor, packed: torch.Tensor = packed, codes: torch.Tensor = codes,
            block_scales: torch.Tensor = block_scales,
        ) -> torch.Tensor:  # fmt: skip
            return int4_native.int4_mm(rows_of_x.contiguous(), packed, codes, block_scales, 32)

        tile_calls = int4_native.amx_tile_calls()
        whole = mm(x)
        assert int4_native.amx_tile_calls() == tile_calls + 1
        assert torch.equal(torch.cat([mm(x[i : i + 1]) for i in range(37)]), whole)
        for split in (3, 7, 12, 16, 21):
            assert torch.equal(torch.cat([mm(x[:split]), mm(x[split:])]), whole), (cols, split)
        weight = int4_native.int4_dequantize(packed, codes, block_scales, 32).double()
        exact = x.double() @ weight.T
        assert (whole.double() - exact).abs().max() <= 1e-4 * exact.abs().max()
        assert int4_native.use_amx(False) is False
        assert torch.equal(mm(x), whole)
        assert torch.equal(torch.cat([mm(x[i : i + 1]) for i in range(37)]), whole)
        for split in (5, 8, 9):  # a few rows' calls gather their codes, the rest read them regrouped
            assert torch.equal(torch.cat([mm(x[:split]), mm(x[split:])]), whole), (cols, split)
        assert int4_native.use_amx(True) is True
        tiled = int4_native.tile_blocks(packed[:16], codes[:16].contiguous(), block_scales[:16].contiguous())
        assert torch.equal(mm(x, *tiled), whole[:, :16])  # mode 4 on the tile unit


@pytest.mark.skipif(
    not int4_native.block_tiles_available(), reason="the tile order needs an AVX512-VNNI build"
)
@pytest.mark.parametrize("superblocks", [3, 24])  # Q4_K-like (8 runs a super-block), Q4_0 / Q4_1-like
def test_gguf_blocks_in_tile_order_give_the_row_major_bits(superblocks: int) -> None:
    """Mode 4 (the tile order a decode step reads with plain loads) is mode 3's bytes reordered: at
    every call size (gathered few-row calls, regrouped larger ones) and dequantised, the same bits;
    a GGUF block weight in `Int4Linear` is held in it, and its calls keep those bits."""
    g = torch.Generator().manual_seed(21)
    rows, cols = 48, 768
    q = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    packed = int4_native.pack_rows(q)
    codes = torch.randint(-63, 64, (rows, cols // 32, 2), generator=g, dtype=torch.int8)
    block_scales = (torch.rand(rows, superblocks, 2, generator=g) * 0.02).to(torch.float16)
    tiled = int4_native.tile_blocks(packed, codes, block_scales)
    assert tiled[0].shape == (rows // 16, 16, cols // 2) and not torch.equal(tiled[1], codes)
    x = torch.randn(37, cols, generator=g)
    for num_rows in (1, 2, 5, 8, 9, 16, 37):
        want = int4_native.int4_mm(x[:num_rows].contiguous(), packed, codes, block_scales, 32)
        assert torch.equal(int4_native.int4_mm(x[:num_rows].contiguous(), *tiled, 32), want), num_rows
    weight = int4_native.int4_dequantize(packed, codes, block_scales, 32)
    assert torch.equal(int4_native.int4_dequantize(*tiled, 32), weight)

    from tandem.kernels.int4 import BlockParams, Int4Weight

    stored = Int4Weight.from_block_params(q, BlockParams(codes, block_scales, (cols // 32) // superblocks))
    linear = Int4Linear(stored, torch.device("cpu"), kernel="native")
    assert linear.packed.dim() == 3  # held in tile order
    assert torch.equal(
        linear(x[:3]), int4_native.int4_mm(x[:3].contiguous(), packed, codes, block_scales, 32)
    )


_GGUF_BLOCKS_SCRIPT = """
import sys, torch
from tandem.kernels import int4_native
g = torch.Generator().manual_seed(13)
results = {}
for superblocks in (3, 24):  # Q4_K-like (8 runs a super-block), Q4_0 / Q4_1-like (one each)
    packed = int4_native.pack_rows(torch.randint(0, 16, (40, 768), generator=g, dtype=torch.uint8))
    codes = torch.randint(-63, 64, (40, 24, 2), generator=g, dtype=torch.int8)
    block_scales = (torch.rand(40, superblocks, 2, generator=g) * 0.02).to(torch.float16)
    x = torch.randn(21, 768, generator=g)
    mm = lambda rows: int4_native.int4_mm(rows.contiguous(), packed, codes, block_scales, 32)
    results[f"whole{superblocks}"] = mm(x)
    results[f"alone{superblocks}"] = torch.cat([mm(x[i : i + 1]) for i in range(21)])
    weight = int4_native.int4_dequantize(packed, codes, block_scales, 32).double()
    results[f"exact{superblocks}"] = x.double() @ weight.T
    if int4_native.block_tiles_available():  # mode 4: the first 32 rows in tile order
        tiled = int4_native.tile_blocks(packed[:32], codes[:32].contiguous(), block_scales[:32].contiguous())
        results[f"tiled{superblocks}"] = torch.cat([int4_native.int4_mm(x[i : i + 1], *tiled, 32) for i in range(21)])
torch.save(results, sys.argv[1])
"""


def test_gguf_blocks_give_one_cpus_bits_on_another(tmp_path: Path) -> None:
    """Mode 3's arithmetic is per (row, output), not per instruction set: a build for a CPU with
    AVX512-VNNI and no AMX (`TANDEM_NATIVE_MARCH=icelake-server`, as AMD Zen 4 runs it) and one
    for AVX2 only (`haswell`: vpmaddubsw, 8 outputs a register) give this machine's bits, each
    batch invariant and within int16-activation rounding of the exact product."""
    import subprocess
    import sys

    from tandem.platform.cpu import cpu_flags

    if int4_native.load() is None or not {"avx512f", "avx512bw", "avx512_vnni"} <= cpu_flags():
        pytest.skip("runs builds for AVX512-VNNI and AVX2 on a CPU with both")
    results = {}
    for march in ("native", "icelake-server", "haswell"):
        out = tmp_path / f"{march}.pt"
        env = {**os.environ, "TANDEM_NATIVE_MARCH": march, "TANDEM_CACHE_DIR": str(tmp_path / "cache")}
        subprocess.run(
            [sys.executable, "-c", _GGUF_BLOCKS_SCRIPT, str(out)], env=env, check=True, timeout=300
        )
        results[march] = torch.load(out)
    for superblocks in (3, 24):
        whole = f"whole{superblocks}"
        for got in results.values():
            assert torch.equal(got[whole], got[f"alone{superblocks}"])
            exact = got[f"exact{superblocks}"]
            assert (got[whole].double() - exact).abs().max() <= 1e-4 * exact.abs().max()
        assert torch.equal(results["icelake-server"][whole], results["native"][whole])
        assert torch.equal(results["haswell"][whole], results["native"][whole])
        for march in ("native", "icelake-server"):  # builds with AVX512-VNNI read the tile order too
            assert torch.equal(results[march][f"tiled{superblocks}"], results["native"][whole][:, :32])
        assert f"tiled{superblocks}" not in results["haswell"]
