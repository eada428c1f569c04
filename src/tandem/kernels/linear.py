"""Dense linear layer with a weight layout prepared once for the device's fastest GEMM.

Semantics: `y = x @ weight.T` for x: [M, in_features], weight: [out_features, in_features].

On CPU with oneDNN (float32/bfloat16) the weight is reordered once into oneDNN's blocked
layout, which at decode-sized M beats `F.linear` on MKL (docs/performance.md).
Elsewhere (CUDA, no oneDNN) it is `F.linear`, which is also the reference.
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
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
