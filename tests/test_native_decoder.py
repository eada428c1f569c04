"""The native decoder stack (`kernels/csrc/decoder_cpu.c`, `engine/models/native.py`) against its
reference, the INT4 model's eager forward: logits, captured layer states and the KV it writes,
for float32, bfloat16, float16 and FP8 caches; steps that mix requests with one and several rows over
scattered blocks; and in the engine, the steps it takes and the tokens it gives."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.models.native import NativeLlama, NativeStep
from tandem.kernels import int4_native
from tandem.kernels.attention_metadata import build_attention_metadata
from tandem.kernels.fp8 import e4m3_to_float

pytestmark = pytest.mark.skipif(
    int4_native.load() is None, reason=f"native INT4 kernel unavailable: {int4_native.unavailable_reason()}"
)


def _cache_values(t: torch.Tensor) -> torch.Tensor:
    return e4m3_to_float(t.view(torch.uint8)) if t.dtype == torch.float8_e4m3fn else t.float()


def _snapshot(kv_caches: list) -> list:
    return [tuple(None if t is None else t.clone() for t in layer) for layer in kv_caches]


def _restore(kv_caches: list, saved: list) -> None:
    for layer, copy in zip(kv_caches, saved, strict=True):
        for t, c in zip(layer, copy, strict=True):
            if t is not None:
                t.copy_(c)


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16", "float16", "fp8_e4m3"])
def test_native_stack_matches_the_eager_int4_model(tiny_model_dir: Path, kv_cache_dtype: str) -> None:
    llm = LLM(
        str(tiny_model_dir),
        weight_dtype="int4",
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory=2 << 20,
        block_size=4,
        speculative=None,
    )
    runner = llm.engine.runner
    model, caches, block_size = runner.model, runner.kv_caches, runner.block_size
    native = NativeLlama.build(model, caches, block_size)
    assert native is not None, NativeLlama.unsupported_reason(model, caches)
    num_kv_heads = model.config.num_key_value_heads
    gen = torch.Generator().manual_seed(3)
    # Two requests over scattered blocks: A has 13 tokens cached, B 6.
    tables = [[7, 2, 9, 4, 11], [5, 1, 3]]
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (13, 6)]
    with torch.inference_mode():
        prefill = build_attention_metadata(
            tables, [13, 6], [13, 6], block_size, num_kv_heads, torch.device("cpu")
        )
        model(
            torch.tensor(prompts[0] + prompts[1]),
            torch.tensor([*range(13), *range(6)]),
            caches,
            prefill,
            torch.tensor([12, 18]),
        )
        before = _snapshot(caches)
        # A verifies three rows (its token and two drafts), B decodes one.
        rows = [[5, 9, 17], [23]]
        metadata = build_attention_metadata(
            tables, [3, 1], [16, 7], block_size, num_kv_heads, torch.device("cpu")
        )
        logits_rows = torch.tensor([0, 1, 2, 3])
        want, want_states = model(
            torch.tensor(rows[0] + rows[1]), torch.tensor([13, 14, 15, 6]), caches, metadata, logits_rows,
            return_hidden=True, hidden_layers=(0, 2),
        )  # fmt: skip
        want_caches = _snapshot(caches)
        _restore(caches, before)
        step = NativeStep.build(rows, [13, 6], tables, block_size)
        got, got_states = native.forward(step, logits_rows, return_hidden=True, hidden_layers=(0, 2))
    # Differences: float32 summation order and the 16-bit activation rounding of the INT4 kernel
    # it can flip; with a narrow cache, the eager path attends a prompt chunk's own new keys as
    # computed while the native one reads them back from the cache (rounded to its dtype). The
    # LM head is bfloat16 in both: a last-bit difference in its input moves a logit by a step.
    tolerance = {"float32": 1e-3, "bfloat16": 1e-2, "float16": 2e-3, "fp8_e4m3": 0.07}[kv_cache_dtype]
    assert (got_states - want_states).abs().max().item() < tolerance * want_states.abs().max().item()
    assert (got - want).abs().max().item() <= max(2**-7, tolerance) * want.abs().max().item()
    if kv_cache_dtype == "float32":
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    # The KV written: the same slots, the same values (up to the differences above; FP8 and
    # bfloat16 codes can round the other way)
    for layer, (got_layer, want_layer, old_layer) in enumerate(zip(caches, want_caches, before, strict=True)):
        for got_t, want_t, old_t in zip(got_layer, want_layer, old_layer, strict=True):
            if got_t is None:
                continue
            want_values = _cache_values(want_t)
            assert not torch.equal(want_values, _cache_values(old_t))  # the step wrote this tensor
            diff = (_cache_values(got_t) - want_values).abs().max().item()
            largest = want_values.abs().max().item()
            # A code rounding the other way moves a value by one step of its binade: for FP8
            # (3 mantissa bits) near the top of the range that step (32 at 448) is above 7%.
            one_code = 2.0 ** (math.floor(math.log2(largest)) - 3) if kv_cache_dtype == "fp8_e4m3" else 0.0
            assert diff <= max(tolerance * largest, one_code), (layer, diff)


def test_a_float16_cache_holds_values_past_its_range_clamped_as_the_eager_path_writes_them(
    tiny_model_dir: Path,
) -> None:
    """Keys and values beyond float16's range (the first layer's input norm scaled up) are written
    as +-65504 by the native stack, where the eager path's write (`finite_kv`) puts them, never
    as infinities that would turn attention into NaN; the logits stay finite."""
    llm = LLM(
        str(tiny_model_dir), weight_dtype="int4", kv_cache_dtype="float16", kv_cache_memory=2 << 20,
        block_size=4, speculative=None,
    )  # fmt: skip
    runner = llm.engine.runner
    model, caches = runner.model, runner.kv_caches
    with torch.no_grad():
        model.layers[0].input_layernorm.mul_(1e6)
    native = NativeLlama.build(model, caches, runner.block_size)
    assert native is not None
    limit = torch.finfo(torch.float16).max
    prompt = [5, 9, 17, 23, 31, 2]
    with torch.inference_mode():
        before = _snapshot(caches)
        meta = build_attention_metadata(
            [[3, 7]], [6], [6], 4, model.config.num_key_value_heads, torch.device("cpu")
        )
        want = model(torch.tensor(prompt), torch.arange(6), caches, meta, torch.tensor([5]))
        want_cache = caches[0][0].clone()
        _restore(caches, before)
        got = native.forward(NativeStep.build([prompt], [0], [[3, 7]], 4), torch.tensor([5]))
    got_cache = caches[0][0]
    clamped = want_cache.float().abs() == limit
    assert clamped.any(), "the scaled norm must push keys past float16's range"
    assert (
        torch.isfinite(got_cache.float()).all() and torch.isfinite(got).all() and torch.isfinite(want).all()
    )
    assert torch.equal(got_cache[clamped], want_cache[clamped])


def test_a_rows_result_does_not_depend_on_its_batch(tiny_model_dir: Path) -> None:
    """Row-wise arithmetic: a request computed alone and next to others gets the same bits
    (while the step's logits rows stay within the INT8 LM head's limit)."""
    llm = LLM(
        str(tiny_model_dir), weight_dtype="int4", kv_cache_memory=2 << 20, block_size=4, speculative=None
    )
    runner = llm.engine.runner
    native = NativeLlama.build(runner.model, runner.kv_caches, runner.block_size)
    assert native is not None
    with torch.inference_mode():
        alone = native.forward(NativeStep.build([[3]], [0], [[6]], 4), torch.tensor([0]))
        batch = native.forward(
            NativeStep.build([[8, 1], [3], [4, 4, 4]], [0, 0, 0], [[2], [6], [9]], 4),
            torch.tensor([1, 2, 4, 5]),
        )
    assert torch.equal(alone[0], batch[1])


def test_engine_decodes_through_the_native_stack(default_model_path: Path) -> None:
    """The default model in INT4: decode steps take the native stack (counted in stats) and give
    the eager INT4 engine's greedy tokens; with native_decoder=False it takes none. Speculative
    verification steps (several rows per request) go through it too."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    options = {"weight_dtype": "int4", "kv_cache_memory": 32 << 20, "enable_prefix_caching": False}
    eager = LLM(str(default_model_path), native_decoder=False, speculative=None, **options)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert eager.stats()["num_native_decoder_steps"] == 0
    native = LLM(str(default_model_path), speculative=None, **options)
    got = [o.outputs[0].token_ids for o in native.generate(prompts, params)]
    stats = native.stats()
    assert stats["native_decoder"] and stats["num_native_decoder_steps"] >= params.max_tokens - 1
    assert got == want

    speculating = LLM(
        str(default_model_path), speculative={"method": "ngram", "num_speculative_tokens": 3}, **options
    )
    # prompt lookup drafts only where the step cost model says it pays: make drafts look cheap
    speculating.engine.scheduler.speculation.always_draft()
    repeated = ["one two three four one two three four one two three four one two"]
    spec_out = speculating.generate(repeated, params)[0].outputs[0].token_ids
    spec_stats = speculating.stats()
    assert spec_stats["num_draft_tokens"] > 0 and spec_stats["num_native_decoder_steps"] > 0
    assert spec_out == eager.generate(repeated, params)[0].outputs[0].token_ids
