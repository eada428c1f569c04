"""The precision probe: which compute dtype and whether INT4 decode steps are fastest on this
CPU for this model, by timing the model's own GEMM shapes (`dtype="auto"` and
`weight_dtype="auto"` on CPU; `precision.choose_precision` applies the result).

CPU flags mislead here: AVX512-BF16 without AMX is slower than float32 on one Xeon and about
twice as fast on a Zen 4 (docs/performance.md). So at the first start on a machine the probe
builds random weights with the shapes of one decoder layer's linears (fused q/k/v, o, fused
gate/up, down; an MoE layer's expert), as many copies as stream from memory the way a step's
weights do (up to the model's layer count), and times one pass over them:

- in each candidate compute dtype (float32; bfloat16 where oneDNN has bfloat16 GEMMs), through
  the kernels the engine runs (`kernels.linear.PackedLinear`), at decode row counts
  (`DECODE_ROWS`) and a prompt chunk (`PREFILL_ROWS`);
- with INT4 weights through the native kernel (`kernels.int4.Int4Linear`), and INT8 (Q8_0,
  `kernels.int8.Int8Linear`), at the decode row counts the native stack serves.

Contract of the choice (`ProbeResult`): `dtype` is the candidate with the smallest geometric
mean of its time over the fastest one's at `COMPUTE_ROWS` (large decode batches and prompt
chunks); `int4_decode` is whether INT4 weights beat that dtype at one row (a lone request's
decode step, memory-bound: what a user waits on at low load): then INT4 weights are speed's
candidate for the whole model (one precision for every step; larger batches then run INT4 too,
slower than the dense dtype there), kept only within the quality probe's bound
(`quality_probe.py`); `int8_decode` the same for INT8, the candidate where INT4 falls outside it. float16 is not a candidate.
The result is cached per machine as JSON under `$TANDEM_CACHE_DIR/precision/`, keyed by the CPU
model name, its flags, the CPUs this process may use, the torch version, the GEMM shapes and the
probe version; a second start reads it (`source="cache"`). A table timed while the CPU was
held elsewhere (`stalled_pass_ms`) is measured again, keeping each cell's fastest time, up to
`MAX_ATTEMPTS` times; one that stays stalled is neither used nor cached.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.engine.models.interface import ModelConfig
from tandem.kernels import int4_native
from tandem.kernels.int4 import NATIVE_GEMV_MAX_ROWS, Int4Linear, fit_group_size, quantize_int4
from tandem.kernels.int8 import Int8Linear, quantize_int8
from tandem.kernels.linear import PackedLinear, onednn_available
from tandem.platform.cpu import cpu_flags, cpu_model_name, usable_cpus

logger = logging.getLogger("tandem.engine")

PROBE_VERSION = 5  # 4: INT8 (Q8_0) weights timed too; 5: its output-interleaved kernel
DECODE_ROWS = (1, 4, 16, 64)
PREFILL_ROWS = 256
COMPUTE_ROWS = (16, 64, PREFILL_ROWS)
INT4_GROUP_SIZE = 32
PROBE_WEIGHT_BYTES = 256 << 20  # float32 bytes of the layer copies: beyond the last-level cache
CELL_BUDGET_S = 0.3  # repeats of one (candidate, rows) cell stop once they took this long
# A float32 one-row pass slower than reading its weights at this rate plus this much per linear
# call was timed while something else held the CPU (an oversubscribed OpenMP barrier waits a
# scheduler slice per call): the table is measured again rather than trusted or cached.
MIN_WEIGHT_READ_BYTES_PER_S = 4e9
MAX_CALL_OVERHEAD_S = 0.5e-3
MAX_ATTEMPTS = 3

Shape = tuple[int, int]  # (out_features, in_features)
# measure(candidate, shapes, num_copies, rows) -> seconds for one pass over the copies
Measure = Callable[[str, Sequence[Shape], int, int], float]


@dataclass(frozen=True)
class ProbeResult:
    """What the probe measured and chose (module docstring). `timings_ms[candidate][rows]`: the
    estimated milliseconds of one pass of that many rows through every layer's linears."""

    dtype: str
    int4_decode: bool
    timings_ms: dict[str, dict[int, float]]
    seconds: float  # how long the probe took when it ran
    key: str
    source: str = "measured"  # "measured" | "cache"
    machine: dict[str, Any] = field(default_factory=dict)
    int8_decode: bool = (
        False  # INT8 (Q8_0) weights beat `dtype` at one row (the fallback when INT4 loses quality)
    )

    def faster_weights(self) -> list[str]:
        """The quantised weight formats ("int4", "int8") measured faster than `dtype` at one row,
        fastest first: speed's candidates, in the order the quality bound tries them."""
        found = [w for w, fast in (("int4", self.int4_decode), ("int8", self.int8_decode)) if fast]
        return sorted(found, key=lambda w: self.timings_ms[w][1])

    def speedup(self, slow: str, fast: str, rows: int) -> float:
        return self.timings_ms[slow][rows] / self.timings_ms[fast][rows]

    def describe(self) -> str:
        """The choice in words, for the start-up log and `stats()["precision_reason"]`."""
        others = [c for c in self.timings_ms if c not in (self.dtype, "int4", "int8")]
        words = [f"dtype {self.dtype} measured fastest"]
        words += [
            f"{self.speedup(o, self.dtype, PREFILL_ROWS):.2f}x {o} at {PREFILL_ROWS} rows" for o in others
        ]
        if "int4" in self.timings_ms:
            ratio = self.speedup(self.dtype, "int4", 1)
            words.append(f"INT4 {ratio:.2f}x {self.dtype} at 1 row")
        if "int8" in self.timings_ms:
            words.append(f"INT8 {self.speedup(self.dtype, 'int8', 1):.2f}x {self.dtype} at 1 row")
        return f"{', '.join(words)} (precision probe, {self.source})"

    def as_stats(self) -> dict[str, object]:
        return {
            "source": self.source, "seconds": round(self.seconds, 3), "key": self.key,
            "dtype": self.dtype, "int4_decode": self.int4_decode, "int8_decode": self.int8_decode,
            "timings_ms": {c: {str(r): round(t, 4) for r, t in by_rows.items()} for c, by_rows in self.timings_ms.items()},
        }  # fmt: skip


def model_gemm_shapes(config: ModelConfig) -> tuple[Shape, ...]:
    """(out, in) of one decoder layer's linears as the engine runs them: fused q/k/v, o, fused
    gate/up, down (an MoE layer: one expert's; latent attention: its projections' sizes)."""
    hidden = config.hidden_size
    mla = getattr(config, "mla", None)
    if mla is not None:
        heads = config.num_attention_heads
        q_in = mla.q_lora_rank or hidden
        attention = [(mla.kv_lora_rank + mla.qk_rope_head_dim, hidden), (heads * mla.qk_head_dim, q_in)]
        attention.append((hidden, heads * mla.v_head_dim))
    else:
        q_out = config.num_attention_heads * config.head_dim
        kv_out = 2 * config.num_key_value_heads * config.head_dim
        attention = [(q_out + kv_out, hidden), (hidden, q_out)]
    moe = getattr(config, "moe", None)
    intermediate = moe.intermediate_size if moe is not None else config.intermediate_size
    return (*attention, (2 * intermediate, hidden), (hidden, intermediate))


def candidates(device: torch.device) -> list[str]:
    """Compute dtypes worth timing here: float32, and bfloat16 where oneDNN has bfloat16 GEMMs
    (elsewhere it is emulated: slower by construction, and slow to time)."""
    return ["float32"] + (["bfloat16"] if onednn_available(device, torch.bfloat16) else [])


def probe_key(shapes: Sequence[Shape], num_layers: int, int4: bool) -> tuple[str, dict[str, object]]:
    """The cache key of a probe on this machine for this model's shapes, and what it is made of."""
    machine = {
        "version": PROBE_VERSION, "cpu": cpu_model_name(), "flags": sorted(cpu_flags()),
        "cpus": usable_cpus(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "shapes": [list(s) for s in shapes], "num_layers": num_layers, "int4": int4,
        "kernels": int4_native.build_key(cpu_flags()),
    }  # fmt: skip
    digest = hashlib.sha256(json.dumps(machine, sort_keys=True).encode()).hexdigest()[:16]
    return digest, machine


def measure_pass(candidate: str, shapes: Sequence[Shape], num_copies: int, rows: int) -> float:
    """Seconds of one pass of `rows` rows through `num_copies` copies of the layer's linears in
    `candidate` ("float32", "bfloat16" or "int4"): the fastest of a few, after a warm-up pass."""
    layers = _layers(candidate, shapes, num_copies)
    dtype = torch.float32 if candidate in ("int4", "int8") else getattr(torch, candidate)
    inputs = {k: torch.randn(rows, k).to(dtype) for _, k in shapes}
    with torch.inference_mode():
        best, spent, repeats = math.inf, 0.0, 0
        while repeats < 2 or (repeats < 5 and spent < CELL_BUDGET_S):
            start = time.perf_counter()
            for layer, in_features in layers:
                layer(inputs[in_features])
            elapsed = time.perf_counter() - start
            if repeats:  # the first pass warms up (oneDNN primitive creation)
                best = min(best, elapsed)
            spent += elapsed
            repeats += 1
    return best


_LAYER_CACHE: dict[tuple[str, tuple[Shape, ...], int], list[tuple[nn.Module, int]]] = {}


def _layers(candidate: str, shapes: Sequence[Shape], num_copies: int) -> list[tuple[nn.Module, int]]:
    """The layer copies' linears in `candidate`, each with its input width (kept for the next row count)."""
    key = (candidate, tuple(shapes), num_copies)
    if key not in _LAYER_CACHE:
        _LAYER_CACHE.clear()  # one candidate's weights at a time
        generator = torch.Generator().manual_seed(0)
        layers: list[tuple[nn.Module, int]] = []
        for _ in range(num_copies):
            for out_features, in_features in shapes:
                weight = torch.randn(out_features, in_features, generator=generator) * 0.02
                layers.append((_linear(candidate, weight), in_features))
        _LAYER_CACHE[key] = layers
    return _LAYER_CACHE[key]


def _linear(candidate: str, weight: torch.Tensor) -> nn.Module:
    if candidate == "int4":
        group_size = fit_group_size(weight.shape[1], INT4_GROUP_SIZE)
        return Int4Linear(quantize_int4(weight, group_size), torch.device("cpu"), kernel="native")
    if candidate == "int8":
        return Int8Linear(quantize_int8(weight), torch.device("cpu"))
    dtype = getattr(torch, candidate)
    if onednn_available(torch.device("cpu"), dtype):
        return PackedLinear(weight.to(dtype))
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    return linear


def run_probe(
    shapes: Sequence[Shape], num_layers: int, dtypes: Sequence[str], *, int4: bool, key: str = "",
    measure: Measure = measure_pass,
) -> ProbeResult:  # fmt: skip
    """Time every candidate (module docstring) and choose. `measure` is injectable: a test
    stands in a CPU it cannot reach (a slow bfloat16) by scaling the real timings."""
    started = time.perf_counter()
    layer_bytes = 4 * sum(o * i for o, i in shapes)
    num_copies = max(1, min(num_layers, PROBE_WEIGHT_BYTES // max(1, layer_bytes)))
    scale_ms = 1000.0 * num_layers / num_copies  # one pass over the copies -> the whole model's linears
    timings: dict[str, dict[int, float]] = {}
    for candidate in dtypes:
        rows = sorted({*DECODE_ROWS, *COMPUTE_ROWS})
        timings[candidate] = {r: scale_ms * measure(candidate, shapes, num_copies, r) for r in rows}
    if int4:
        rows = [r for r in DECODE_ROWS if r <= NATIVE_GEMV_MAX_ROWS]
        timings["int4"] = {r: scale_ms * measure("int4", shapes, num_copies, r) for r in rows}
        timings["int8"] = {r: scale_ms * measure("int8", shapes, num_copies, r) for r in rows}
    _LAYER_CACHE.clear()

    def relative_cost(dtype: str) -> float:  # geometric mean of time / the fastest dtype's
        ratios = [timings[dtype][r] / min(timings[d][r] for d in dtypes) for r in COMPUTE_ROWS]
        return math.exp(sum(math.log(x) for x in ratios) / len(ratios))

    chosen = min(dtypes, key=relative_cost)
    int4_decode = int4 and timings["int4"][1] < timings[chosen][1]
    int8_decode = int4 and timings["int8"][1] < timings[chosen][1]
    return ProbeResult(
        chosen, int4_decode, timings, time.perf_counter() - started, key, int8_decode=int8_decode
    )


def stalled_pass_ms(result: ProbeResult, shapes: Sequence[Shape], num_layers: int) -> float | None:
    """The float32 one-row pass's time where it is too slow to have had the CPU to itself (the
    bound in the constants above: weights read at `MIN_WEIGHT_READ_BYTES_PER_S`, plus
    `MAX_CALL_OVERHEAD_S` per linear call; healthy passes run several times faster), else None."""
    if 1 not in result.timings_ms.get("float32", {}):
        return None
    weight_bytes = 4 * num_layers * sum(o * i for o, i in shapes)
    num_calls = num_layers * len(shapes)
    bound_ms = 1000.0 * (weight_bytes / MIN_WEIGHT_READ_BYTES_PER_S + num_calls * MAX_CALL_OVERHEAD_S)
    measured_ms = result.timings_ms["float32"][1]
    return measured_ms if measured_ms > bound_ms else None


def measure_until_plausible(
    shapes: Sequence[Shape], num_layers: int, dtypes: Sequence[str], *, int4: bool, key: str,
    measure: Measure = measure_pass,
) -> ProbeResult | None:  # fmt: skip
    """`run_probe` until its table is not stalled (`stalled_pass_ms`), each attempt keeping every
    cell's fastest time so far (a stall that held part of one attempt costs nothing); None where
    all `MAX_ATTEMPTS` stayed stalled."""
    fastest: dict[tuple[str, int], float] = {}

    def fastest_so_far(candidate: str, cell_shapes: Sequence[Shape], num_copies: int, rows: int) -> float:
        seconds = min(
            fastest.get((candidate, rows), math.inf), measure(candidate, cell_shapes, num_copies, rows)
        )
        fastest[(candidate, rows)] = seconds
        return seconds

    for attempt in range(1, MAX_ATTEMPTS + 1):
        result = run_probe(shapes, num_layers, dtypes, int4=int4, key=key, measure=fastest_so_far)
        stalled_ms = stalled_pass_ms(result, shapes, num_layers)
        if stalled_ms is None:
            return result
        logger.warning(
            "precision probe timed a stalled CPU",
            extra={"attempt": attempt, "float32_one_row_ms": round(stalled_ms, 3)},
        )
    return None


def cache_path(key: str, cache_dir: Path) -> Path:
    return cache_dir / "precision" / f"probe-{key}.json"


def probe_precision(
    config: ModelConfig, device: torch.device, cache_dir: Path, *, int4: bool, measure: Measure = measure_pass
) -> ProbeResult | None:
    """The probe's result for this machine and `config`'s shapes: from the cache, else measured
    (and cached). `int4`: whether the native INT4 kernel runs here (then it is timed too).

    Engines starting together on one machine (replicas of a node) probe one at a time, under a
    lock file beside the cache entry: the others then read what the first measured, instead of
    timing GEMMs against each other. None (the caller falls back to CPU flags, with a warning
    logged) where the probe itself fails; a cache that cannot be written only costs the next
    start another probe. A table that stays stalled (`measure_until_plausible`) is not cached:
    None, and the next start measures again. `measure` is injectable, as in `run_probe`."""
    shapes = model_gemm_shapes(config)
    int4 = int4 and int4_native.load() is not None
    key, machine = probe_key(shapes, config.num_hidden_layers, int4)
    path = cache_path(key, cache_dir)
    with probe_lock(path):
        result = _read_cached(path, key, machine)
        if result is None:
            try:
                result = measure_until_plausible(
                    shapes, config.num_hidden_layers, candidates(device), int4=int4, key=key, measure=measure
                )
            except Exception as exc:  # noqa: BLE001 - an engine starts on CPU flags rather than not at all
                logger.warning("precision probe failed; choosing by CPU flags", extra={"error": repr(exc)})
                return None
            if result is None:
                logger.warning("precision probe stalled on every attempt; choosing by CPU flags, not cached")
                return None
            result = replace(result, machine=machine)
            try:
                write_atomically(path, json.dumps(asdict(result), indent=1, sort_keys=True))
            except OSError as exc:
                logger.warning("precision probe not cached", extra={"path": str(path), "error": repr(exc)})
    logger.info("precision probe", extra=result.as_stats())
    return result


def _read_cached(path: Path, key: str, machine: dict[str, object]) -> ProbeResult | None:
    try:
        cached = json.loads(path.read_text())
        timings = {c: {int(r): float(t) for r, t in rows.items()} for c, rows in cached["timings_ms"].items()}
        seconds = float(cached["seconds"])
        return ProbeResult(
            cached["dtype"], bool(cached["int4_decode"]), timings, seconds, key, "cache", machine,
            bool(cached["int8_decode"]),
        )  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


@contextlib.contextmanager
def probe_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`'s lock file while held (none where it cannot be created)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_suffix(".lock"), "a")  # noqa: SIM115 - held across the yield
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_atomically(path: Path, text: str) -> None:
    """Another engine starting on this machine may probe at the same time: each writes whole files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)
