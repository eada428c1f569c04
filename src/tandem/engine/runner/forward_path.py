"""The one place that chooses how a step's rows are computed.

Paths, fastest first where they apply:
- `GRAPH`: a CUDA graph of the model's decode step (`decode_graphs`), on CUDA: decode steps of
  one token per request, no LoRA rows, at most the largest captured batch.
- `NATIVE`: the native CPU decoder stack over the decode model's INT4 linears (`NativeLlama`):
  decode steps (each request computes its last token and its drafts) with no LoRA rows and at
  most `NATIVE_MAX_ROWS` rows. At small batch the eager step is dominated by per-op dispatch,
  not by the matmuls; beyond a few dozen rows the dequantise-then-GEMM path of the model wins.
- `COMPILED`: one `torch.compile`d graph of the decode model (decode steps without LoRA or drafts).
- `DECODE_MODEL`: the decode model (an INT4 copy with `weight_dtype="hybrid"`) eagerly, for
  decode steps of at most `decode_model_max_batch` requests; but when the native stack exists, a
  LoRA-free decode step too large for it runs the dense model instead (it is faster there).
- `MODEL`: the model, eagerly (prompt chunks, large batches, everything else).
A batch-invariant runner (`EngineConfig.batch_invariant`, the default) gives a row one arithmetic
whatever step it is in: where the native stack exists, every LoRA-free step of the shared layout,
prompt chunks and large batches included, goes through it (its kernels are row-wise), never the
eager model, whose summation order differs; without the native stack every step is `MODEL`'s.
Compressed requests (per-head layout) have two: `NATIVE_HEADS` (the native stack over the
head-block pool, for unobserved decode rows within the same limits) and `HEAD_MODEL`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# Most token rows a step may have to go through the native decoder stack.
NATIVE_MAX_ROWS = 16


class ForwardPath(Enum):
    GRAPH = "graph"
    NATIVE = "native"
    COMPILED = "compiled"
    DECODE_MODEL = "decode_model"
    MODEL = "model"
    NATIVE_HEADS = "native_heads"
    HEAD_MODEL = "head_model"


@dataclass(frozen=True)
class StepShape:
    """What a step's rows look like (computed from its `ScheduledRequest`s)."""

    num_requests: int
    num_rows: int  # token rows, drafts included
    decoding: bool  # every request computes only its last token (and its drafts), and samples
    has_lora: bool = False  # some row runs an adapter
    has_multi_row: bool = False  # some request has more than one row (a prompt chunk or drafts)
    compressed: bool = False  # the rows are compressed requests' (head-block pool)


@dataclass(frozen=True)
class RunnerPaths:
    """What a runner has built: the options `choose_path` picks from."""

    native: bool  # the native decoder stack over the shared cache
    native_heads: bool  # ... and over the head-block pool
    compiled: bool  # a compiled decode graph
    separate_decode_model: bool  # the decode model is not the model (a hybrid's INT4 copy)
    decode_model_max_batch: int  # most requests of a step the decode model serves
    graph_max_batch: int = 0  # most requests of a step the captured decode graphs serve (0: none)
    batch_invariant: bool = False  # one path per row whatever the step (module docstring)


def choose_path(shape: StepShape, paths: RunnerPaths) -> ForwardPath:
    """The forward path for a step of `shape` on a runner with `paths` (module docstring)."""
    if (
        shape.decoding and not shape.compressed and not shape.has_lora and not shape.has_multi_row
        and shape.num_requests <= paths.graph_max_batch
    ):  # fmt: skip
        return ForwardPath.GRAPH
    if paths.batch_invariant and paths.native and not shape.has_lora and not shape.compressed:
        return ForwardPath.NATIVE
    small = shape.decoding and shape.num_requests <= paths.decode_model_max_batch
    if shape.compressed:
        native_fits = shape.num_requests <= min(NATIVE_MAX_ROWS, paths.decode_model_max_batch)
        return (
            ForwardPath.NATIVE_HEADS
            if paths.native_heads and shape.decoding and native_fits
            else ForwardPath.HEAD_MODEL
        )
    if small and paths.native and not shape.has_lora and shape.num_rows <= NATIVE_MAX_ROWS:
        return ForwardPath.NATIVE
    dense_is_faster = paths.native and not shape.has_lora and paths.separate_decode_model
    if not small or dense_is_faster:
        return ForwardPath.MODEL
    if paths.compiled and not shape.has_lora and not shape.has_multi_row:
        return ForwardPath.COMPILED
    return ForwardPath.DECODE_MODEL
