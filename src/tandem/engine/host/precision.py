"""The automatic choice of compute dtype and weight format (`dtype="auto"`, `weight_dtype="auto"`).

Contract (`choose_precision`, a pure function of its arguments, so a choice is reproducible and
testable with forced CPU features):

- An explicit `dtype` is the whole model in that dtype: `weight_dtype="auto"` then means dense
  weights (the unquantised model the HF identity checks compare against).
- On CUDA, `auto` is bfloat16, dense.
- On CPU with a precision probe (`precision_probe.py`, the default), both autos follow what it
  measured on this machine for this model: `dtype` the fastest compute dtype for prompt chunks
  and large batches, `weight_dtype` the fastest at one row (a lone request's decode step) of INT4
  and INT8 (Q8_0) weights where it beats that dtype there, else dense. One precision serves every step: `weight_dtype="auto"` is never
  "hybrid" (two sets of weights picked by step size would make one served name two models).
- On CPU without a probe (`precision_probe=False`), by CPU flags: `dtype="auto"` is bfloat16
  where the CPU has AMX-BF16 (oneDNN's bfloat16 GEMMs run on the tile units there, about twice
  float32's rate at large batches) and float32 elsewhere (with AVX512-BF16 alone oneDNN's
  bfloat16 GEMMs measured slower than float32 on one Xeon and faster on a Zen 4, which is why the
  probe exists; AVX2-only CPUs emulate bfloat16); `weight_dtype="auto"` is dense.
- Whatever speed chose is then held to the quality probe's bound on the checkpoint
  (`quality_probe.py`, applied by `builder.build_parts`): an automatic choice outside it falls
  back (INT4 to dense, bfloat16 to float32); an explicit one starts with a warning.
- `TANDEM_AUTO_PRECISION=float32` (an operator's pin, also used by the test suite so that its
  comparisons keep one precision on every CPU) makes both autos mean dense float32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.engine.host.precision_probe import ProbeResult
    from tandem.engine.host.quality_probe import QualityResult

FAST_BF16_FLAGS = frozenset({"amx_bf16"})  # where bfloat16 GEMMs beat float32
PIN_ENV = "TANDEM_AUTO_PRECISION"


@dataclass(frozen=True)
class PrecisionChoice:
    dtype: str  # compute dtype: "float32" | "bfloat16" | "float16"
    weight_dtype: str  # "dense" | "int4" | "int8" | "hybrid" | "gguf"
    reason: str  # why, in words, for the log and stats()
    probe: ProbeResult | None = None  # what the precision probe measured, where it chose
    automatic: bool = False  # dtype or weight_dtype came from "auto" (a quality probe may overrule it)
    quality: tuple[QualityResult, ...] = ()  # the quality probe's verdicts, rejected ones first, where it ran

    @property
    def name(self) -> str:
        """ "<dtype>/<weight_dtype>", e.g. "bfloat16/dense"."""
        return f"{self.dtype}/{self.weight_dtype}"

    @property
    def is_reference(self) -> bool:
        """The checkpoint's own weights in float32: what the quality probe compares against."""
        return self.dtype == "float32" and self.weight_dtype == "dense"


def choose_precision(
    *,
    device_type: str,
    dtype: str,
    weight_dtype: str,
    flags: frozenset[str],
    native_int4: bool,
    pin: str | None = None,
    probe: ProbeResult | None = None,
    stored_quant_types: tuple[str, ...] = (),
) -> PrecisionChoice:
    """Resolve `dtype` and `weight_dtype` ("auto" or explicit) for a device and CPU (see the
    module docstring). `native_int4`: whether the native INT4 kernel can be used here; `pin`: the
    value of `TANDEM_AUTO_PRECISION`, if set; `probe`: the precision probe's result on this CPU;
    `stored_quant_types`: a GGUF file's quantised types (its weights as stored win `auto`)."""
    if pin not in (None, "", "float32"):
        raise ValueError(f"{PIN_ENV}={pin!r}: the only supported pin is 'float32'")
    chosen_dtype, dtype_reason = _choose_dtype(device_type, dtype, flags, pin, probe)
    chosen_weights, weights_reason = _choose_weights(
        device_type, dtype, weight_dtype, chosen_dtype, native_int4, pin, probe, stored_quant_types
    )
    reasons = [dtype_reason, weights_reason]
    used = probe if probe is not None and dtype == "auto" and pin is None and device_type == "cpu" else None
    automatic = pin != "float32" and (dtype == "auto" or weight_dtype == "auto")
    return PrecisionChoice(chosen_dtype, chosen_weights, "; ".join(reasons), used, automatic)


def _choose_dtype(
    device_type: str, dtype: str, flags: frozenset[str], pin: str | None, probe: ProbeResult | None
) -> tuple[str, str]:
    """The compute dtype and why."""
    if dtype != "auto":
        chosen_dtype = dtype
        reason = f"dtype {dtype} as configured"
    elif pin == "float32":
        chosen_dtype = "float32"
        reason = f"dtype float32 pinned by {PIN_ENV}"
    elif device_type == "cuda":
        chosen_dtype = "bfloat16"
        reason = "dtype bfloat16 on CUDA"
    elif probe is not None:
        chosen_dtype = probe.dtype
        reason = probe.describe()
    elif fast := sorted(flags & FAST_BF16_FLAGS):
        chosen_dtype = "bfloat16"
        reason = f"dtype bfloat16: the CPU has bfloat16 matrix units ({', '.join(fast)})"
    elif "avx512_bf16" in flags:
        chosen_dtype = "float32"
        reason = "dtype float32: AVX512-BF16 without AMX, where bfloat16 GEMMs are slower than float32"
    else:
        chosen_dtype = "float32"
        reason = "dtype float32: the CPU has no bfloat16 matrix units (AMX-BF16)"
    return chosen_dtype, reason


def _choose_weights(
    device_type: str,
    dtype: str,
    weight_dtype: str,
    chosen_dtype: str,
    native_int4: bool,
    pin: str | None,
    probe: ProbeResult | None,
    stored_quant_types: tuple[str, ...] = (),
) -> tuple[str, str]:
    """The weights' format and why."""
    if weight_dtype != "auto":
        chosen_weights = weight_dtype
        reason = f"weights {weight_dtype} as configured"
    elif dtype != "auto" or pin == "float32":
        chosen_weights = "dense"
        reason = "dense weights (an explicit or pinned dtype is the whole unquantised model)"
    elif device_type != "cpu":
        chosen_weights = "dense"
        reason = f"dense weights on {device_type}"
    elif stored_quant_types and native_int4:
        chosen_weights = "gguf"
        reason = f"weights as the GGUF file stores them ({', '.join(stored_quant_types)})"
    elif probe is not None and native_int4:
        faster = probe.faster_weights()
        chosen_weights = faster[0] if faster else "dense"
        reason = (
            f"{chosen_weights.upper()} weights (native kernel) for every step: measured fastest at one row, "
            f"ahead of {', '.join([*faster[1:], chosen_dtype])}"
            if faster else f"dense weights: INT4 and INT8 measured slower than {chosen_dtype} at one row"
        )  # fmt: skip
    elif native_int4:
        chosen_weights = "dense"
        reason = "dense weights: no precision probe measured INT4 faster here"
    else:
        chosen_weights = "dense"
        reason = "dense weights: the native INT4 kernel cannot run here"
    return chosen_weights, reason


def pinned() -> str | None:
    return os.environ.get(PIN_ENV) or None
