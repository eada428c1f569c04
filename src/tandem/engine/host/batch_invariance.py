"""Batch invariance: a request's tokens at temperature 0 (or with a seed) do not depend on what
else runs, on how its prompt is chunked or cached, on speculation, or on the thread count.

Contract of `make_batch_invariant(model, decode_model, thread_counts)` (called by the builder
before the runner is built, when `EngineConfig.batch_invariant` is on, the default): every row of
a step is computed with one summation order whatever the step's size and rows:
- INT4 and INT8 linears with the native kernels compute every call row by row (`Int4Linear.
  compute_every_row_natively`, `Int8Linear`'s; exact integer dot products per run of 32, then
  float32 in a fixed order), and the runner sends every LoRA-free step through the native decoder stack
  (`forward_path`), whose norms, activations and attention are row-wise too;
- dense linears (oneDNN, `PackedLinear`) pad calls to the floor measured on this machine at which
  each row's bits are the same at every call size and under each thread count the engine may use
  (`linear.measure_row_floor`);
- attention: every row over its own keys through the native paged kernel (fixed order, key 0
  first), never the batched or flash paths whose reductions depend on the padded length or chunk
  (`attention.build_attention_metadata(every_row_native=True)`);
- sampling is already per request (argmax; seeded draws from each request's own generator).

Where a part cannot be made invariant (a dense linear for which no floor holds, INT4 through
torch's kernel, no native library, CUDA, where Tandem's Triton kernels have not been checked) the
result says so (`BatchInvariance.holds` false, with the reason) and the engine still serves:
`stats()` and the start-up log report it. Not covered: steps that mix LoRA rows with base rows
(the eager model serves the whole step) and compressed (per-head) KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.kernels import int4_native
from tandem.kernels.int4 import Int4Linear
from tandem.kernels.int8 import Int8Linear
from tandem.kernels.linear import make_rows_invariant


@dataclass(frozen=True)
class BatchInvariance:
    requested: bool  # EngineConfig.batch_invariant
    holds: bool  # every part was made row-invariant (module docstring)
    reason: str  # in words, for the log and stats()


def make_batch_invariant(
    device: torch.device, thread_counts: tuple[int, ...], *models: object
) -> BatchInvariance:
    """Make the linears of `models` row-invariant (module docstring) and say whether the whole
    forward is. `thread_counts`: the intra-op thread counts the engine may run a step with."""
    if device.type != "cpu":
        return BatchInvariance(
            True, False, f"not verified on {device.type}: rows may depend on the batch there"
        )
    if int4_native.load() is None:
        return BatchInvariance(
            True, False, f"the native kernels are unavailable ({int4_native.unavailable_reason()}): attention "
            "of large steps takes the batched torch path"
        )  # fmt: skip
    problems: list[str] = []
    for model in models:
        if not isinstance(model, nn.Module):
            continue
        for name, module in model.named_modules():
            if isinstance(module, Int4Linear):
                if module.kernel == "native":
                    module.compute_every_row_natively()
                else:
                    problems.append(f"{name}: INT4 through torch's kernel")
            elif isinstance(module, Int8Linear):
                module.compute_every_row_natively()  # row-wise at every size where the library loaded
        problems.extend(
            f"{name}: no padding floor makes its rows invariant"
            for name in make_rows_invariant(model, thread_counts)
        )
    if problems:
        shown = "; ".join(problems[:3]) + (f" and {len(problems) - 3} more" if len(problems) > 3 else "")
        return BatchInvariance(True, False, f"not row-invariant here: {shown}")
    return BatchInvariance(
        True, True, "every row computed in one order whatever the batch (measured floors for dense linears)"
    )


DISABLED = BatchInvariance(
    False, False, "off (batch_invariant=False): a row's last bits may depend on the batch"
)
