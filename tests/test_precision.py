"""The automatic precision choice (`dtype="auto"`, `weight_dtype="auto"`): by the precision
probe's measurements (cached per machine), or by CPU features without it; reproducible, recorded
in stats(); an explicit float32 is still the whole float32 model (HF's greedy tokens)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.host.precision import PIN_ENV, choose_precision
from tandem.engine.host.precision_probe import (
    COMPUTE_ROWS,
    MAX_ATTEMPTS,
    ProbeResult,
    cache_path,
    measure_pass,
    model_gemm_shapes,
    probe_precision,
    run_probe,
    stalled_pass_ms,
)
from tandem.kernels import int4_native
from tandem.kernels.int8 import Int8HeadLinear
from tandem.platform.cpu import cpu_flags
from tests.test_hf_parity import PROMPTS, check_parity

AMX = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8"})
AVX512_BF16 = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512_bf16"})
AVX2_ONLY = frozenset({"avx2", "fma", "f16c"})
# More requests than the INT8 LM head takes in one step (INT8_GEMV_MAX_ROWS).
SIX_PROMPTS = ["The quick brown fox", "Paged attention", "Hello there", "Numbers 1 2 3", "A B C", "Once upon"]


@pytest.mark.parametrize(
    ("flags", "native_int4", "want"),
    [
        (AMX, True, ("bfloat16", "dense")),  # never hybrid: one set of weights per served name
        (AVX512_BF16, True, ("float32", "dense")),  # no AMX: oneDNN's bfloat16 GEMMs lose to float32
        (AVX2_ONLY, True, ("float32", "dense")),  # EPYC-like: bfloat16 would be emulated
        (frozenset(), False, ("float32", "dense")),  # no AVX2: no native INT4 kernel either
        (AMX, False, ("bfloat16", "dense")),
    ],
)
def test_auto_follows_the_cpu_features(
    flags: frozenset[str], native_int4: bool, want: tuple[str, str]
) -> None:
    choice = choose_precision(
        device_type="cpu", dtype="auto", weight_dtype="auto", flags=flags, native_int4=native_int4
    )
    assert (choice.dtype, choice.weight_dtype) == want
    assert choice.dtype in choice.reason and choice.weight_dtype in choice.reason
    again = choose_precision(
        device_type="cpu", dtype="auto", weight_dtype="auto", flags=flags, native_int4=native_int4
    )
    assert again == choice  # a pure function of its inputs


def test_explicit_choices_and_the_pin_win() -> None:
    def choose(**kw: object) -> tuple[str, str]:
        args: dict = {
            "device_type": "cpu",
            "dtype": "auto",
            "weight_dtype": "auto",
            "flags": AMX,
            "native_int4": True,
        }
        choice = choose_precision(**{**args, **kw})
        return choice.dtype, choice.weight_dtype

    assert choose(dtype="float32") == ("float32", "dense")  # the whole unquantised model
    assert choose(dtype="bfloat16") == ("bfloat16", "dense")
    assert choose(weight_dtype="int4") == ("bfloat16", "int4")
    assert choose(dtype="float32", weight_dtype="hybrid") == ("float32", "hybrid")
    assert choose(pin="float32") == ("float32", "dense")
    assert choose(pin="float32", weight_dtype="int4") == ("float32", "int4")
    assert choose(device_type="cuda") == ("bfloat16", "dense")
    with pytest.raises(ValueError, match=PIN_ENV):
        choose(pin="bfloat16")


def test_engine_records_the_automatic_choice(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the probe, the CPU flags decide."""
    monkeypatch.delenv(PIN_ENV, raising=False)
    llm = LLM(
        str(tiny_model_dir),
        kv_cache_memory=4 << 20,
        speculative=None,
        precision_probe=False,
        quality_probe=False,
    )
    assert llm.stats()["precision_probe"] is None
    stats = llm.stats()
    want = choose_precision(
        device_type="cpu",
        dtype="auto",
        weight_dtype="auto",
        flags=cpu_flags(),
        native_int4=int4_native.load() is not None,
    )
    assert (stats["dtype"], stats["weight_dtype"], stats["precision_reason"]) == (
        want.dtype,
        want.weight_dtype,
        want.reason,
    )
    assert llm.engine.runner.model.norm.dtype == getattr(torch, want.dtype)
    assert llm.engine.runner.decode_model is llm.engine.runner.model  # one set of weights for every step


def test_hybrid_decode_model_shares_the_dense_lm_head(tiny_model_dir: Path) -> None:
    """With hybrid weights the INT4 decode model serves steps above the INT8 head's rows with the
    dense model's LM head (compute dtype), not a bfloat16 copy of its own."""
    llm = LLM(
        str(tiny_model_dir), dtype="float32", weight_dtype="hybrid", kv_cache_memory=4 << 20, speculative=None
    )
    runner = llm.engine.runner
    head = runner.decode_model.lm_head
    assert isinstance(head, Int8HeadLinear)
    assert head.dense_head is not None and head.dense_head[0] is runner.model.lm_head
    assert head.dense_head[1] == torch.float32 and head.weight.numel() == 0
    outputs = llm.generate(
        SIX_PROMPTS,
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)


@pytest.mark.slow
def test_hybrid_compiled_decode_calls_the_shared_head_eagerly(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`compile_decode` over the INT4 decode model: a step of more rows than the INT8 head takes
    reaches the dense model's prepacked head, which inductor cannot lower; it runs outside the
    graph, so every step stays whole (no rerun one request at a time) and the tokens are the eager
    decode model's."""
    prompts = SIX_PROMPTS
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    options: dict = {
        "dtype": "float32",
        "weight_dtype": "hybrid",
        "native_decoder": False,
        "speculative": None,
    }
    eager = LLM(str(tiny_model_dir), kv_cache_memory=4 << 20, **options)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    compiled = LLM(str(tiny_model_dir), kv_cache_memory=4 << 20, compile_decode=True, **options)
    assert compiled.engine.runner.compiles_decode
    with caplog.at_level("WARNING"):
        got = [o.outputs[0].token_ids for o in compiled.generate(prompts, params)]
    assert not [r for r in caplog.records if "step failed" in r.getMessage()]
    runner = compiled.engine.runner
    assert 0 < runner.num_compiled_steps <= compiled.stats()["num_steps"]  # whole steps, compiled
    assert got == want


def test_explicit_float32_is_the_float32_model_and_matches_hf(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import LlamaForCausalLM

    monkeypatch.delenv(PIN_ENV, raising=False)
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=4 << 20, block_size=4)
    stats = llm.stats()
    assert (stats["dtype"], stats["weight_dtype"]) == ("float32", "dense")
    assert llm.engine.runner.decode_model is llm.engine.runner.model
    hf_model = LlamaForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    prompts = [p for p in PROMPTS if len(llm.tokenizer.encode(p)) > 1]
    check_parity(llm, hf_model, prompts, max_new=16)


def slowed(factors: dict[str, float]):  # type: ignore[no-untyped-def]
    """The real measurement, with some candidates' times multiplied: a CPU we cannot reach."""

    def measure(candidate: str, shapes, num_copies: int, rows: int) -> float:  # type: ignore[no-untyped-def]
        return factors.get(candidate, 1.0) * measure_pass(candidate, shapes, num_copies, rows)

    return measure


SHAPES = ((3 * 128, 128), (128, 128), (2 * 256, 128), (128, 256))  # a small layer: q/k/v, o, gate/up, down


@pytest.mark.parametrize(
    ("factors", "want_dtype"), [({"bfloat16": 50.0}, "float32"), ({"float32": 50.0}, "bfloat16")]
)
def test_the_probe_chooses_the_dtype_it_measured_fastest(factors: dict[str, float], want_dtype: str) -> None:
    """A forced slow bfloat16 (a Xeon whose AVX512-BF16 GEMMs lose to float32) makes the probe
    choose float32, a slow float32 bfloat16: the choice follows the timings, not the flags."""
    int4 = int4_native.load() is not None
    result = run_probe(SHAPES, 4, ["float32", "bfloat16"], int4=int4, measure=slowed(factors))
    assert result.dtype == want_dtype
    slow = next(iter(factors))
    assert all(result.speedup(slow, want_dtype, rows) > 5 for rows in COMPUTE_ROWS), result.timings_ms
    choice = choose_precision(
        device_type="cpu", dtype="auto", weight_dtype="auto", flags=AMX if want_dtype == "float32" else AVX2_ONLY,
        native_int4=int4, probe=result,
    )  # fmt: skip
    assert choice.dtype == want_dtype and "measured" in choice.reason  # the flags would say otherwise
    assert choice.weight_dtype == (result.faster_weights() or ["dense"])[0]


@pytest.mark.skipif(int4_native.load() is None, reason="the native INT4 kernel cannot be built here")
def test_the_probe_chooses_int4_weights_for_every_step_where_they_measured_faster_at_one_row() -> None:
    fast = run_probe(SHAPES, 4, ["float32"], int4=True, measure=slowed({"float32": 50.0}))
    slow = run_probe(SHAPES, 4, ["float32"], int4=True, measure=slowed({"int4": 50.0, "int8": 50.0}))
    int8_only = run_probe(SHAPES, 4, ["float32"], int4=True, measure=slowed({"int4": 50.0}))
    assert fast.int4_decode and not slow.int4_decode and not slow.int8_decode
    assert not int8_only.int4_decode and int8_only.int8_decode
    choose = functools.partial(
        choose_precision, device_type="cpu", dtype="auto", weight_dtype="auto", flags=AVX2_ONLY
    )
    assert set(fast.faster_weights()) == {"int4", "int8"}  # both beat a 50x slower float32
    assert (
        choose(native_int4=True, probe=fast).weight_dtype == fast.faster_weights()[0]
    )  # the faster; never hybrid
    assert choose(native_int4=True, probe=slow).weight_dtype == "dense"
    assert choose(native_int4=True, probe=int8_only).weight_dtype == "int8"


def test_the_engine_probes_once_per_machine_and_reads_the_cache_after(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """First start: measured, cached, applied, in stats(); second start: the same choice from the
    cache; a model with other shapes is probed anew."""
    monkeypatch.delenv(PIN_ENV, raising=False)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    # the speed probe alone here (the quality probe's bound has tests of its own)
    first = LLM(str(tiny_model_dir), kv_cache_memory=4 << 20, speculative=None, quality_probe=False)
    probe = first.stats()["precision_probe"]
    assert probe["source"] == "measured" and probe["seconds"] > 0
    assert cache_path(probe["key"], tmp_path).exists()
    timings = {c: {int(r): t for r, t in rows.items()} for c, rows in probe["timings_ms"].items()}
    result = ProbeResult(
        probe["dtype"],
        probe["int4_decode"],
        timings,
        probe["seconds"],
        probe["key"],
        int8_decode=probe["int8_decode"],
    )
    want = choose_precision(
        device_type="cpu", dtype="auto", weight_dtype="auto", flags=cpu_flags(),
        native_int4=int4_native.load() is not None, probe=result,
    )  # fmt: skip
    stats = first.stats()
    assert (stats["dtype"], stats["weight_dtype"]) == (want.dtype, want.weight_dtype)
    assert first.engine.runner.model.norm.dtype == getattr(torch, want.dtype)
    assert "measured" in stats["precision_reason"]
    del first

    second = LLM(str(tiny_model_dir), kv_cache_memory=4 << 20, speculative=None, quality_probe=False).stats()
    assert second["precision_probe"]["source"] == "cache"
    assert second["precision_probe"]["key"] == probe["key"]
    assert (second["dtype"], second["weight_dtype"]) == (stats["dtype"], stats["weight_dtype"])
    assert second["precision_probe"]["timings_ms"] == probe["timings_ms"]

    explicit = LLM(str(tiny_model_dir), kv_cache_memory=4 << 20, speculative=None, dtype="float32").stats()
    assert explicit["precision_probe"] is None and explicit["dtype"] == "float32"


def test_gemm_shapes_follow_the_model(tiny_model_dir: Path) -> None:
    from tandem.engine.models.loader import load_model

    cfg = load_model(str(tiny_model_dir)).config
    q, kv = cfg.num_attention_heads * cfg.head_dim, 2 * cfg.num_key_value_heads * cfg.head_dim
    assert model_gemm_shapes(cfg) == (
        (q + kv, cfg.hidden_size), (cfg.hidden_size, q),
        (2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size),
    )  # fmt: skip


def test_engines_starting_together_probe_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Replicas starting at once on one machine: one measures, the others wait and read its result
    (GEMMs timed against each other would be noise)."""
    from concurrent.futures import ThreadPoolExecutor

    from tandem.engine.models.loader import load_model

    cfg = load_model(str(tiny_model_dir)).config

    def start(_: int) -> ProbeResult | None:
        return probe_precision(cfg, torch.device("cpu"), tmp_path, int4=True)

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(start, range(3)))
    assert all(r is not None for r in results)
    assert sorted(r.source for r in results if r is not None) == ["cache", "cache", "measured"]
    assert len({(r.dtype, r.int4_decode, r.key) for r in results if r is not None}) == 1


def stalled_for(num_attempts: int, calls: list[tuple[str, int]]):  # type: ignore[no-untyped-def]
    """The real measurement, except that during the first `num_attempts` probe tables every linear
    call also waits 5 ms (another process holding the CPU: an oversubscribed OpenMP barrier waits
    a scheduler slice). `calls` records every (candidate, rows) cell timed."""

    def measure(candidate: str, shapes, num_copies: int, rows: int) -> float:  # type: ignore[no-untyped-def]
        calls.append((candidate, rows))
        attempt = sum(1 for cell in calls if cell == ("float32", 1))
        stall_s = 5e-3 * num_copies * len(shapes) if attempt <= num_attempts else 0.0
        return measure_pass(candidate, shapes, num_copies, rows) + stall_s

    return measure


def test_a_probe_timed_on_a_stalled_cpu_is_measured_again_and_never_cached(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A table timed while another process held the CPU (every time inflated alike: the choice would
    be noise) is measured again; one that stays stalled is neither used nor cached, so the next
    start measures anew."""
    from tandem.engine.models.loader import load_model

    cfg = load_model(str(tiny_model_dir)).config
    shapes, num_layers = model_gemm_shapes(cfg), cfg.num_hidden_layers
    int4 = int4_native.load() is not None
    healthy = run_probe(shapes, num_layers, ["float32"], int4=int4)
    assert stalled_pass_ms(healthy, shapes, num_layers) is None, healthy.timings_ms

    calls: list[tuple[str, int]] = []
    recovered = probe_precision(
        cfg, torch.device("cpu"), tmp_path / "once", int4=True, measure=stalled_for(1, calls)
    )
    assert recovered is not None and recovered.source == "measured"
    assert calls.count(("float32", 1)) == 2  # the stalled table, then a healthy one
    assert stalled_pass_ms(recovered, shapes, num_layers) is None, recovered.timings_ms
    assert cache_path(recovered.key, tmp_path / "once").exists()

    calls.clear()
    stuck = probe_precision(
        cfg, torch.device("cpu"), tmp_path / "always", int4=True, measure=stalled_for(99, calls)
    )
    assert stuck is None and calls.count(("float32", 1)) == MAX_ATTEMPTS
    assert not list((tmp_path / "always" / "precision").glob("probe-*.json"))
