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

Double quantisation (`double_quantize_int4`, as in llama.cpp's K-quant super-blocks and QLoRA):
a bfloat16 scale and zero per group of 32 cost 1 bit per weight (Q4_1: 5 bits, 0.3125x of 16-bit).
Storing each group's (scale, zero) as int8 codes times a bfloat16 scale per super-block of up to 8
consecutive groups of a row brings that to about 0.6 bit (0.29x). The codes are re-rounded against
the quantised (scale, zero), and `Int4Linear` expands them to the kernel's bfloat16 layout inside
`forward` (one int8 x bfloat16 multiply per linear), so resident memory holds only the codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Int8GroupParams:
    """Each group's (scale, zero) as int8 codes times a bfloat16 scale per super-block.

    Invariant: `expand()` equals the owning `Int4Weight`'s (scale, zero) exactly, so the reference
    and the kernel dequantise to the same values."""

    codes: torch.Tensor  # [N, G, 2] int8; scale codes in 1..127, zero codes in -127..127
    superblock_scales: torch.Tensor  # [N, G // groups_per_superblock, 2] bfloat16
    groups_per_superblock: int

    def expand(self) -> torch.Tensor:  # -> [N, G, 2] bfloat16
        rows, num_groups, _ = self.codes.shape
        codes = self.codes.view(rows, -1, self.groups_per_superblock, 2)
        return (codes * self.superblock_scales.unsqueeze(2)).view(rows, num_groups, 2)  # -> bf16

    @property
    def num_bytes(self) -> int:
        return self.codes.numel() + 2 * self.superblock_scales.numel()


@dataclass
class Int4Weight:
    q: torch.Tensor  # [N, K] uint8 in 0..15
    scale: torch.Tensor  # [N, K // group_size] float32
    zero: torch.Tensor  # [N, K // group_size] float32
    group_size: int
    int8_params: Int8GroupParams | None = None  # set by double_quantize_int4

    @property
    def num_bytes(self) -> int:
        """Stored size: packed nibbles plus the group parameters (a bfloat16 scale and zero per
        group, or their int8 codes and super-block scales)."""
        params = self.int8_params.num_bytes if self.int8_params is not None else 2 * 2 * self.scale.numel()
        return self.q.numel() // 2 + params


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


def double_quantize_int4(w: Int4Weight, groups_per_superblock: int = 8) -> Int4Weight:
    """`w` with its (scale, zero) stored as int8 codes (see `Int8GroupParams`), the 4-bit codes
    re-rounded to fit `w`'s dequantised values under the quantised parameters. A super-block is
    the largest divisor of the groups per row not above `groups_per_superblock` (18 groups of 32
    for 576 inputs: 6). Each super-block's bfloat16 scale maps its largest |scale| or |zero| to 127.
    Scale codes are at least 1, so no group collapses to a single value."""
    target = dequantize_int4(w)  # [N, K]: the values to keep
    rows, num_groups = w.scale.shape
    per_block = max(k for k in range(1, groups_per_superblock + 1) if num_groups % k == 0)
    params = torch.stack([w.scale, w.zero], dim=-1).view(rows, num_groups // per_block, per_block, 2)
    superblock_scales = (params.abs().amax(2) / 127).clamp(min=1e-30).to(torch.bfloat16)  # [N, S, 2]
    codes = torch.round(params / superblock_scales.float().unsqueeze(2)).clamp(-127, 127)
    codes[..., 0].clamp_(min=1)
    int8_params = Int8GroupParams(
        codes.to(torch.int8).view(rows, num_groups, 2).contiguous(), superblock_scales, per_block
    )
    expanded = int8_params.expand().float()  # [N, G, 2]
    scale, zero = expanded[..., 0], expanded[..., 1]
    groups = target.view(rows, num_groups, w.group_size)
    q = torch.round((groups - zero.unsqueeze(-1)) / scale.unsqueeze(-1) + 8).clamp(0, 15)
    return Int4Weight(q.to(torch.uint8).view_as(w.q), scale, zero, w.group_size, int8_params)


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

        def pad(t: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [N + padded_rows, ...]
            return torch.cat([t, t.new_zeros(padded_rows, *t.shape[1:])]) if padded_rows else t

        q = pad(w.q).to(device)
        if device.type == "cpu":
            packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        else:
            packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), 8)
        self.packed: torch.Tensor
        self.register_buffer("packed", packed)
        # The kernel takes (scale, zero) as [G, N, 2] bfloat16. Without int8 params that tensor is
        # stored; with them, the int8 codes [G, N, 2] and super-block scales [S, 1, N, 2] are, and
        # forward multiplies them out (exactly `Int8GroupParams.expand`, transposed).
        self.scales_and_zeros: torch.Tensor | None
        self.param_codes: torch.Tensor | None
        self.superblock_scales: torch.Tensor | None
        for name in ("scales_and_zeros", "param_codes", "superblock_scales"):
            self.register_buffer(name, None)
        if w.int8_params is None:
            scales_and_zeros = pad(torch.stack([w.scale, w.zero], dim=-1)).transpose(0, 1).contiguous()
            self.register_buffer("scales_and_zeros", scales_and_zeros.to(device=device, dtype=torch.bfloat16))
        else:
            p = w.int8_params
            self.register_buffer("param_codes", pad(p.codes).transpose(0, 1).contiguous().to(device))
            superblock_scales = pad(p.superblock_scales).transpose(0, 1).unsqueeze(1).contiguous()
            self.register_buffer("superblock_scales", superblock_scales.to(device))

    def group_params(self) -> torch.Tensor:  # -> [G, N, 2] bfloat16, the kernel's layout
        if self.scales_and_zeros is not None:
            return self.scales_and_zeros
        assert self.param_codes is not None and self.superblock_scales is not None
        num_groups, rows, _ = self.param_codes.shape
        codes = self.param_codes.view(self.superblock_scales.shape[0], -1, rows, 2)
        return (codes * self.superblock_scales).view(num_groups, rows, 2)  # int8 * bf16 -> bf16

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        x16 = x.to(torch.bfloat16)
        params = self.group_params()
        if x.device.type == "cpu":
            y = torch._weight_int4pack_mm_for_cpu(x16, self.packed, self.group_size, params)
        else:
            y = torch._weight_int4pack_mm(x16, self.packed, self.group_size, params)
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
