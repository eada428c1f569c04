"""The quality probe and its bound (engine/host/quality_probe.py, engine/host/quality_gate.py): a precision
chosen for speed is kept only within a measured bound on the checkpoint; an explicit one outside
it starts with a warning that gives the figures. Real checkpoints: tests/test_real_checkpoints.py."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pytest
import torch

from tandem import LLM
from tandem.engine.builder import build_models, kv_cache_spec
from tandem.engine.host.precision import PIN_ENV, PrecisionChoice
from tandem.engine.host.precision_probe import ProbeResult
from tandem.engine.host.quality_gate import hold_to_bound
from tandem.engine.host.quality_probe import MAX_MEAN_KL, compare
from tandem.engine.models.loader import load_model
from tandem.platform.config import EngineConfig

CPU = torch.device("cpu")


def test_compare_measures_kl_and_top1_agreement() -> None:
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 3.0, 1.0]])
    assert compare(logits, logits) == (0.0, 1.0)
    swapped = torch.tensor([[0.0, 2.0, -1.0], [0.0, 3.0, 1.0]])  # the first row's top token changes
    kl, agreement = compare(logits, swapped)
    p = torch.softmax(logits[0], dim=-1)
    want = float((p * (torch.log_softmax(logits[0], -1) - torch.log_softmax(swapped[0], -1))).sum()) / 2
    assert agreement == 0.5 and kl == pytest.approx(want, rel=1e-5)


def _hold(folder: Path, precision: PrecisionChoice, cache: Path, **options: object) -> PrecisionChoice:
    loaded = load_model(str(folder))
    config = EngineConfig(model=str(folder), **options)
    build = functools.partial(build_models, config, loaded, device=CPU)
    return hold_to_bound(
        config, loaded, precision, kv_cache_spec(loaded, 16, torch.float32), CPU, cache, build
    )


def test_an_automatic_choice_outside_the_bound_falls_back(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Random tiny weights: INT4 moves most next tokens, so speed's INT4 falls back to dense
    float32 (the checkpoint's own weights); bfloat16 is measured too and, outside, falls back."""
    int4 = _hold(tiny_model_dir, PrecisionChoice("float32", "int4", "speed", automatic=True), tmp_path)
    assert int4.name == "float32/dense"
    (verdict,) = int4.quality
    assert verdict.candidate.startswith("float32/int4") and not verdict.within_bound
    assert verdict.mean_kl > MAX_MEAN_KL and verdict.num_positions > 64
    assert "outside the bound" in int4.reason and "float32 dense" in int4.reason

    bf16 = _hold(tiny_model_dir, PrecisionChoice("bfloat16", "int4", "speed", automatic=True), tmp_path)
    # two decisions: the 16-bit dtype on its own (dense weights), then INT4 in the dtype kept
    dtype_verdict, int4_verdict = bf16.quality
    dtype = "bfloat16" if dtype_verdict.within_bound else "float32"
    assert dtype_verdict.candidate.startswith("bfloat16/dense") and int4_verdict.candidate.startswith(
        f"{dtype}/int4"
    )
    assert bf16.name == f"{dtype}/{'int4' if int4_verdict.within_bound else 'dense'}"

    again = _hold(tiny_model_dir, PrecisionChoice("float32", "int4", "speed", automatic=True), tmp_path)
    assert again.quality[0].source == "cache" and again.quality[0].mean_kl == verdict.mean_kl


def _probe(int8_decode: bool) -> ProbeResult:
    return ProbeResult("float32", True, {"float32": {1: 2.0}, "int4": {1: 0.5}, "int8": {1: 0.8}}, 0.0, "k",
                       int8_decode=int8_decode)  # fmt: skip


@pytest.mark.parametrize("int8_decode", [True, False])
def test_int4_outside_the_bound_falls_back_to_int8_where_it_is_faster_and_within(
    tiny_model_dir: Path, tmp_path: Path, int8_decode: bool
) -> None:
    """Speed's INT4 outside the bound: INT8 (Q8_0) is measured next where the precision probe
    found it faster than the dtype at one row, and served if within the bound; otherwise (or
    without that speed) dense float32."""
    chosen = PrecisionChoice("float32", "int4", "speed", probe=_probe(int8_decode), automatic=True)
    held = _hold(tiny_model_dir, chosen, tmp_path)
    candidates = [v.candidate.split(",")[0].split(" (")[0] for v in held.quality]
    assert candidates == (["float32/int4", "float32/int8"] if int8_decode else ["float32/int4"])
    assert "(GPTQ, group 32)" in held.quality[0].candidate  # the INT4 source is part of the verdict's key
    int8_within = int8_decode and held.quality[1].within_bound
    print(f"\n{[v.describe() for v in held.quality]}")
    assert held.name == ("float32/int8" if int8_within else "float32/dense")


def test_a_choice_within_the_bound_is_kept(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A candidate whose distributions equal the reference's (its models built as float32 dense
    whatever it names) is within the bound and kept as chosen."""
    loaded = load_model(str(tiny_model_dir))
    config = EngineConfig(model=str(tiny_model_dir), kv_cache_dtype="float32")
    reference = PrecisionChoice("float32", "dense", "")

    def same_as_reference(precision: PrecisionChoice, max_positions: int):  # type: ignore[no-untyped-def]
        return build_models(config, loaded, reference, max_positions, device=CPU)

    chosen = PrecisionChoice("bfloat16", "dense", "speed", automatic=True)
    spec = kv_cache_spec(loaded, 16, torch.float32)
    kept = hold_to_bound(config, loaded, chosen, spec, CPU, tmp_path, same_as_reference)
    assert kept.name == "bfloat16/dense" and kept.quality[0].within_bound
    assert kept.quality[0].mean_kl == pytest.approx(0.0, abs=1e-6) and kept.quality[0].top1_agreement == 1.0


def test_an_explicit_int4_outside_the_bound_starts_with_a_warning(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="tandem.engine"):
        llm = LLM(
            str(tiny_model_dir),
            dtype="float32",
            weight_dtype="int4",
            kv_cache_memory=4 << 20,
            speculative=None,
        )
    stats = llm.stats()
    assert stats["weight_dtype"] == "int4"  # as configured
    (verdict,) = stats["quality_probe"]
    assert not verdict["within_bound"] and verdict["mean_kl"] > MAX_MEAN_KL
    warnings = [r for r in caplog.records if "outside the quality bound" in r.getMessage()]
    assert warnings and "mean KL" in warnings[0].__dict__["quality"]


def test_defaults_serve_one_precision_held_to_the_bound(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unpinned defaults: speed's choice, then the bound; never two weight precisions."""
    monkeypatch.delenv(PIN_ENV, raising=False)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    llm = LLM(str(tiny_model_dir), kv_cache_memory=4 << 20)
    stats = llm.stats()
    assert stats["weight_dtype"] in ("dense", "int4", "int8")
    assert llm.engine.runner.decode_model is llm.engine.runner.model
    if (stats["dtype"], stats["weight_dtype"]) != ("float32", "dense"):
        assert stats["quality_probe"] and stats["quality_probe"][-1]["within_bound"]
    else:
        assert all(not q["within_bound"] for q in stats["quality_probe"])


def test_a_verdict_is_kept_for_one_build_of_the_native_kernels(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cached verdict (and a speed measurement) names the native library's C sources: after a
    change to a kernel's arithmetic the candidate is measured again, not read from the cache of
    another build's answers."""
    from tandem.engine.host import precision_probe, quality_probe
    from tandem.kernels import int4_native

    before = quality_probe.quality_key(tiny_model_dir, "float32/int8")
    shapes = [(576, 576)]
    speed_before = precision_probe.probe_key(shapes, 2, True)[0]
    changed = tmp_path / "kernel.c"
    changed.write_text("/* another arithmetic */\n")
    monkeypatch.setattr(int4_native, "SOURCES", (*int4_native.SOURCES, changed))
    assert quality_probe.quality_key(tiny_model_dir, "float32/int8") != before
    assert precision_probe.probe_key(shapes, 2, True)[0] != speed_before
    monkeypatch.undo()
    assert quality_probe.quality_key(tiny_model_dir, "float32/int8") == before
