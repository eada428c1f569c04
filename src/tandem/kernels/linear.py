"""Dense linear layer with a weight layout prepared once for the device's fastest GEMM.

Semantics: `y = x @ weight.T` for x: [M, in_features], weight: [out_features, in_features].

On CPU with oneDNN (float32/bfloat16) the weight is reordered once into oneDNN's blocked
layout, which at decode-sized M beats `F.linear` on MKL (docs/performance.md).
Elsewhere (CUDA, no oneDNN) it is `F.linear`, which is also the reference.

Row invariance (`measure_row_floor`, `make_rows_invariant`): a batch-invariant engine needs each
output row to be the same bits whatever other rows share the call. oneDNN computes a row's K
reduction in one order for every M of at least some floor, but may pick another kernel (another
order) below it: on a Zen 4, M = 1 differs from M >= 2 once K passes about 1,000. Which floor (if
any) holds is a property of the CPU, the library and the shape, so it is measured per linear on
the machine at load, never assumed; a `PackedLinear` pads calls with fewer rows up to its floor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_PACK_BATCH_HINT = 32  # oneDNN picks its blocking for this M; any M works at run time


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False  # oneDNN's bf16 prepack needs AVX-512 or AVX-NE-CONVERT
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    """Replaces an `nn.Linear` without bias after its weights are loaded (see `pack_linears`)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
        self.min_rows = 1  # calls with fewer rows are padded with zero rows up to this (`pad_rows_to`)

    def pad_rows_to(self, min_rows: int) -> None:
        """Compute every call with at least `min_rows` rows (zero rows appended, their outputs
        dropped): what makes a row's result independent of the call's size (`measure_row_floor`)."""
        self.min_rows = min_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        rows = x.shape[0]
        if rows < self.min_rows:
            padded = torch.cat([x, x.new_zeros(self.min_rows - rows, *x.shape[1:])])
            return torch.ops.mkldnn._linear_pointwise(padded, self.packed, None, "none", [], "")[:rows]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def reference_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def pack_linears(module: nn.Module) -> int:
    """Swap every bias-free `nn.Linear` under `module` for a `PackedLinear` where supported.

    Returns how many were swapped. Call after weights are final (tied weights are copied).
    """
    swapped = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.bias is None:
            weight = child.weight
            if onednn_available(weight.device, weight.dtype):
                setattr(module, name, PackedLinear(weight))
                swapped += 1
        else:
            swapped += pack_linears(child)
    return swapped


class Bf16Linear(nn.Module):
    """`y = x @ weight.T` with the weight stored in bfloat16 and computed in bfloat16 (half the
    bytes of float32, and faster for memory-bound shapes such as an LM head at decode)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight: torch.Tensor
        self.register_buffer("weight", weight.detach().to(torch.bfloat16).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        return F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)


# Row counts the row-invariance measurement calls a linear with: decode batches, verification
# steps and prompt chunks of every size class oneDNN distinguishes on the CPUs measured so far.
INVARIANCE_ROWS = (1, 2, 3, 4, 5, 8, 16, 17, 33, 64, 128, 256)
FLOOR_CANDIDATES = (1, 2, 4, 8, 16)


def measure_row_floor(linear: PackedLinear, thread_counts: tuple[int, ...]) -> int | None:
    """The smallest padding floor (of `FLOOR_CANDIDATES`) at which `linear` gives every row the
    same bits at every call size of `INVARIANCE_ROWS` (the row first, last or in the middle of
    the call) as alone, under each of `thread_counts`; None when no candidate holds. Random
    activations (fixed seed) of the linear's width and dtype; a few milliseconds per shape."""
    dtype = linear.packed.dtype
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(max(INVARIANCE_ROWS), linear.in_features, generator=generator).to(dtype)
    saved_threads, saved_floor = torch.get_num_threads(), linear.min_rows
    try:
        for floor in FLOOR_CANDIDATES:
            linear.pad_rows_to(floor)
            if all(_rows_agree(linear, x, threads) for threads in thread_counts):
                return floor
        return None
    finally:
        torch.set_num_threads(saved_threads)
        linear.pad_rows_to(saved_floor)


def _rows_agree(linear: PackedLinear, x: torch.Tensor, threads: int) -> bool:
    torch.set_num_threads(threads)
    for rows in INVARIANCE_ROWS:
        y = linear(x[:rows])
        for i in {0, rows // 2, rows - 1}:
            if not torch.equal(y[i], linear(x[i : i + 1])[0]):
                return False
    return True


def make_rows_invariant(module: nn.Module, thread_counts: tuple[int, ...]) -> list[str]:
    """Pad every `PackedLinear` under `module` to its measured floor (`measure_row_floor`, once per
    distinct shape and dtype). Returns the names of those for which no floor holds (their rows may
    then depend on the call's size); empty when every one is row-invariant."""
    floors: dict[tuple[int, int, torch.dtype], int | None] = {}
    variant: list[str] = []
    for name, child in module.named_modules():
        if not isinstance(child, PackedLinear):
            continue
        key = (child.in_features, child.out_features, child.packed.dtype)
        if key not in floors:
            floors[key] = measure_row_floor(child, thread_counts)
        floor = floors[key]
        if floor is None:
            variant.append(name)
        else:
            child.pad_rows_to(floor)
    return variant
