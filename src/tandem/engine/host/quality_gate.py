"""Holding a precision to the quality probe's bound on the checkpoint being loaded.

`hold_to_bound` takes what speed (or the operator) chose (`precision.PrecisionChoice`) and:
- float32 dense, a device other than the CPU, or `quality_probe=False`: returns it unchanged;
- an explicit dtype with dense weights: unchanged too (the unquantised model, asked for);
- otherwise measures it (`quality_probe.probe_quality`, cached) in two decisions, each on its
  own: first an automatic 16-bit compute dtype, with dense weights (outside the bound: float32,
  the reference); then speed's INT4 or INT8 (or an explicit hybrid) weights in the dtype so decided
  (outside the bound and chosen automatically: the other of the two where the precision probe
  measured it faster than the dtype at one row too and it is within the bound; else dense). A 16-bit dtype that moves answers beyond the bound by
  itself is not kept because some INT4 mix happens to land within it. An explicit choice outside
  the bound is kept, with a warning in the log that gives the figures.
The result carries the verdict (`PrecisionChoice.quality`) and says why in its `reason`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tandem.engine.host.int4_calibration import int4_source
from tandem.engine.host.precision import PrecisionChoice
from tandem.engine.host.quality_probe import QualityResult, Scorer, calibration_token_ids, probe_quality
from tandem.engine.models.interface import CausalLM
from tandem.engine.models.loader import LoadedModel
from tandem.engine.runner import ModelRunner
from tandem.engine.runner.kv_tensors import KVCacheSpec
from tandem.engine.runner.teacher_forcing import teacher_forced_logits

if TYPE_CHECKING:
    from pathlib import Path

    from tandem.platform.config import EngineConfig

logger = logging.getLogger("tandem.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# (precision, max_positions) -> the model and, for hybrid weights, its INT4 decode copy, built as
# the engine builds them (`builder.build_models`).
BuildModels = Callable[[PrecisionChoice, int], tuple[CausalLM, CausalLM | None]]


def hold_to_bound(
    config: EngineConfig, loaded: LoadedModel, precision: PrecisionChoice, kv_spec: KVCacheSpec,
    device: torch.device, cache_dir: Path, build_models: BuildModels,
) -> PrecisionChoice:  # fmt: skip
    """The precision to serve (module docstring). `kv_spec`: the engine's cache shape (each
    candidate's runner stores its own `kv_cache_dtype`)."""
    auto_weights = config.weight_dtype == "auto" or "weight_dtype" not in config.model_fields_set
    auto_dtype = config.dtype == "auto" and precision.automatic
    explicit_dense = not auto_dtype and precision.weight_dtype == "dense"
    if device.type != "cpu" or not config.quality_probe or precision.is_reference or explicit_dense:
        return precision
    token_ids = calibration_token_ids(loaded.tokenizer.encode)
    reference = _scorer(
        config, PrecisionChoice("float32", "dense", ""), kv_spec, torch.float32, device, build_models
    )
    verdicts: list[QualityResult] = []

    def verdict(candidate: PrecisionChoice) -> QualityResult:
        kv_dtype = kv_cache_dtype(config, candidate.dtype)
        weights = ""  # INT4 weights differ by their source: the verdict (and its cache entry) names it
        if candidate.weight_dtype in ("int4", "hybrid"):
            weights = f" ({int4_source(config.int4_method, config.int4_group_size, loaded)})"
        name = f"{candidate.name}{weights}, KV {str(kv_dtype).removeprefix('torch.')}"
        scorer = _scorer(config, candidate, kv_spec, kv_dtype, device, build_models)
        verdicts.append(probe_quality(loaded.path, name, token_ids, reference, scorer, cache_dir))
        return verdicts[-1]

    chosen = precision
    dense = dataclasses.replace(chosen, weight_dtype="dense")
    if auto_dtype and chosen.dtype != "float32" and not verdict(dense).within_bound:
        chosen = dataclasses.replace(chosen, dtype="float32")  # the dtype alone moves answers
    if chosen.weight_dtype != "dense" and not verdict(chosen).within_bound:
        if auto_weights:
            # speed's other quantised format, where it too beat the dtype at one row: INT8 rounds
            # less than a requantised INT4, but a file's own INT4 codes are its weights exactly
            others = [
                w for w in (chosen.probe.faster_weights() if chosen.probe else []) if w != chosen.weight_dtype
            ]
            fallback = dataclasses.replace(chosen, weight_dtype="dense")
            for weights in others:
                candidate = dataclasses.replace(chosen, weight_dtype=weights)
                if verdict(candidate).within_bound:
                    fallback = candidate
                    break
            chosen = fallback
        else:
            logger.warning(
                "the configured precision is outside the quality bound on this checkpoint",
                extra={"precision": chosen.name, "quality": verdicts[-1].describe()},
            )
    last = "float32 dense: the checkpoint's own weights" if chosen.is_reference else ""
    return _verdict(chosen, verdicts, last)


def _verdict(precision: PrecisionChoice, verdicts: list[QualityResult], last: str) -> PrecisionChoice:
    words = [precision.reason, *(v.describe() for v in verdicts), *([last] if last else [])]
    return dataclasses.replace(precision, quality=tuple(verdicts), reason="; ".join(words))


def kv_cache_dtype(config: EngineConfig, compute_dtype: str) -> torch.dtype:
    """What the KV cache stores: the configured `kv_cache_dtype`, or the compute dtype for "auto"."""
    return {"auto": DTYPES[compute_dtype], "fp8_e4m3": torch.float8_e4m3fn, **DTYPES}[config.kv_cache_dtype]


def _scorer(
    config: EngineConfig, precision: PrecisionChoice, kv_spec: KVCacheSpec, kv_dtype: torch.dtype,
    device: torch.device, build_models: BuildModels,
) -> Scorer:  # fmt: skip
    """Teacher-forced logits through a runner of `precision` whose models `build_models` builds
    as the engine's (when called; freed after)."""

    def score(token_ids: list[int], num_prompt_tokens: int) -> torch.Tensor:
        model, decode_model = build_models(precision, len(token_ids) + 1)
        spec = dataclasses.replace(kv_spec, dtype=kv_dtype)
        num_blocks = -(-len(token_ids) // spec.block_size) + 1
        runner = ModelRunner(
            model, spec, num_blocks, device, decode_model=decode_model,
            decode_model_max_batch=config.hybrid_int4_max_batch, native_decoder=config.native_decoder,
        )  # fmt: skip
        return teacher_forced_logits(runner, token_ids, num_prompt_tokens)

    return score
