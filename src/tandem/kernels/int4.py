"""Group-wise INT4 weights: quantisation, packing (two values per byte) and the matmul.

Semantics, for weight W [N, K] split along K into groups of `group_size`:

    q[n, k] in 0..15,   W[n, k] ~= (q[n, k] - 8) * scale[n, g] + zero[n, g],   g = k // group_size

(asymmetric: `zero` is the group's midpoint, so min..max maps onto 0..15). This is torch's
int4-pack convention and, with `zero = m + 8 * d`, exactly GGUF's Q4_1 (`w = d * q + m`, groups
of 32), so a Q4_1 tensor loads without a dequantise/requantise round trip.

`Int4Linear` stores q packed two per byte in the layout of torch's int4 matmul for the device
(`_convert_weight_to_int4pack_for_cpu` / `_convert_weight_to_int4pack`) and calls
`_weight_int4pack_mm_for_cpu` / `_weight_int4pack_mm` with bfloat16 activations (the CPU kernel
is an order of magnitude faster in bfloat16 than in float32 on AVX2). `int4_linear_reference`
dequantises and uses `F.linear`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Int4Weight:
    q: torch.Tensor  # [N, K] uint8 in 0..15
    scale: torch.Tensor  # [N, K // group_size] float32
    zero: torch.Tensor  # [N, K // group_size] float32
    group_size: int

    @property
    def num_bytes(self) -> int:
        """Stored size: packed nibbles plus one bfloat16 scale and zero per group."""
        return self.q.numel() // 2 + 2 * 2 * self.scale.numel()


def fit_group_size(in_features: int, group_size: int) -> int:
    """`group_size` if it divides `in_features`, else the largest power of two below it that does
    (torch's kernels take 32, 64, 128 or 256)."""
    size = group_size
    while size >= 32:
        if in_features % size == 0:
            return size
        size //= 2
    raise ValueError(f"no INT4 group size in 32..{group_size} divides in_features={in_features}")


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Weight:  # weight: [N, K]
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    zero = low + 8 * scale
    q = torch.round((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    return Int4Weight(q.reshape(out_features, in_features), scale, zero, group_size)


def dequantize_int4(w: Int4Weight) -> torch.Tensor:  # -> [N, K] float32
    out_features, in_features = w.q.shape
    groups = w.q.reshape(out_features, in_features // w.group_size, w.group_size).float() - 8
    return (groups * w.scale.unsqueeze(-1) + w.zero.unsqueeze(-1)).reshape(out_features, in_features)


def int4_linear_reference(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    return F.linear(x, dequantize_int4(w).to(x.dtype))


class Int4Linear(nn.Module):
    """`y = x @ W.T` with W stored as group-wise INT4 (see the module docstring)."""

    def __init__(self, w: Int4Weight, device: torch.device) -> None:
        super().__init__()
        self.out_features, self.in_features = w.q.shape
        self.group_size = w.group_size
        self.num_weight_bytes = w.num_bytes
        padded_rows = -self.out_features % 16  # the int4 kernels need N % 16 == 0: zero rows pad it
        q, scale, zero = w.q, w.scale, w.zero
        if padded_rows:
            q = torch.cat([q, q.new_zeros(padded_rows, q.shape[1])])
            scale = torch.cat([scale, scale.new_zeros(padded_rows, scale.shape[1])])
            zero = torch.cat([zero, zero.new_zeros(padded_rows, zero.shape[1])])
        q = q.to(device)
        if device.type == "cpu":
            packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        else:
            packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), 8)
        self.packed: torch.Tensor
        self.scales_and_zeros: torch.Tensor
        self.register_buffer("packed", packed)
        scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [G, N, 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(device=device, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        x16 = x.to(torch.bfloat16)
        if x.device.type == "cpu":
            y = torch._weight_int4pack_mm_for_cpu(x16, self.packed, self.group_size, self.scales_and_zeros)
        else:
            y = torch._weight_int4pack_mm(x16, self.packed, self.group_size, self.scales_and_zeros)
        return y[:, : self.out_features].to(x.dtype)


def quantize_linears(
    module: nn.Module, group_size: int, device: torch.device, skip: tuple[str, ...] = ()
) -> int:
    """Replace every bias-free `nn.Linear` under `module` (names in `skip` excepted) by an
    `Int4Linear` quantised from its weights. Returns how many were replaced."""
    replaced = 0
    for name, child in list(module.named_children()):
        if name in skip:
            continue
        if isinstance(child, nn.Linear) and child.bias is None:
            weight = child.weight.detach()
            size = fit_group_size(weight.shape[1], group_size)
            setattr(module, name, Int4Linear(quantize_int4(weight, size), device))
            replaced += 1
        elif not isinstance(child, Int4Linear):
            replaced += quantize_linears(child, group_size, device, skip)
    return replaced
