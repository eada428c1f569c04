"""Group-wise INT4 weights: quantisation, packing (two values per byte) and the matmul.

Semantics, for weight W [N, K] split along K into groups of `group_size`:

    q[n, k] in 0..15,   W[n, k] ~= (q[n, k] - 8) * scale[n, g] + zero[n, g],   g = k // group_size

(asymmetric: `zero` is the group's midpoint, so min..max maps onto 0..15). This is torch's
int4-pack convention and, with `zero = m + 8 * d`, exactly GGUF's Q4_1 (`w = d * q + m`, groups
of 32), so a Q4_1 tensor loads without a dequantise/requantise round trip.

`Int4Linear` has two kernels, chosen at construction (`kernel="auto"` takes the first that works):
- "native" (CPU with AVX2, FMA, F16C and a C compiler; `int4_native`): q packed two per byte in
  row runs of 32, the group parameters read as stored (float16, or int8 codes), float32 activations
  scaled to int16 per run of 32 for an exact integer dot product. Up to `NATIVE_GEMV_MAX_ROWS`
  rows it is a GEMV-style kernel that reads each weight once per 4 rows; above that it dequantises
  the weight to float32 once and calls torch's GEMM.
- "triton" (where `triton_support.uses_triton`: CUDA): Tandem's W4A16 kernel (`triton_int4`),
  q packed two per byte down K, [K / 2, N], the group parameters [G, N] in float16 (float32 for
  double-quantised ones, whose products float16 would round), activations in their own dtype.
- "torch": q in the layout of torch's int4 matmul for the device
  (`_convert_weight_to_int4pack_for_cpu` / `_convert_weight_to_int4pack`), called with bfloat16
  activations and bfloat16 (scale, zero) (`_weight_int4pack_mm_for_cpu` / `_weight_int4pack_mm`).
`int4_linear_reference` dequantises and uses `F.linear`.

Double quantisation (`double_quantize_int4`, as in llama.cpp's K-quant super-blocks and QLoRA):
a bfloat16 scale and zero per group of 32 cost 1 bit per weight (Q4_1: 5 bits, 0.3125x of 16-bit).
Storing each group's (scale, zero) as int8 codes times a bfloat16 scale per super-block of up to 8
consecutive groups of a row brings that to about 0.6 bit (0.29x). Scale and zero are then exactly
code x super-block scale in float32 (8-bit times 8-bit significands), and the codes are re-rounded
against those values. The native kernel reads the int8 codes directly; the torch kernel needs
bfloat16 (scale, zero), so `Int4Linear` multiplies them out at each forward (rounding them to
bfloat16, as it does its activations). Either way resident memory holds only the codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import int4_native
from tandem.kernels.triton_support import triton_unavailable_reason, uses_triton

Int4Kernel = Literal["auto", "native", "triton", "torch"]
# Above this many rows (tokens) the native kernel dequantises the weight once and runs torch's
# float32 GEMM, which reuses each weight across rows better than a GEMV does (where each wins:
# docs/performance.md, "Design measurements").
NATIVE_GEMV_MAX_ROWS = 16


@dataclass
class Int8GroupParams:
    """Each group's (scale, zero) as int8 codes times a bfloat16 scale per super-block.

    Invariant: `expand()` equals the owning `Int4Weight`'s (scale, zero) exactly, so the reference
    and the native kernel dequantise to the same values."""

    codes: torch.Tensor  # [N, G, 2] int8; scale codes in 1..127, zero codes in -127..127
    superblock_scales: torch.Tensor  # [N, G // groups_per_superblock, 2] bfloat16
    groups_per_superblock: int

    def expand(self) -> torch.Tensor:  # -> [N, G, 2] float32, exact
        rows, num_groups, _ = self.codes.shape
        codes = self.codes.view(rows, -1, self.groups_per_superblock, 2).float()
        return (codes * self.superblock_scales.float().unsqueeze(2)).view(rows, num_groups, 2)

    @property
    def num_bytes(self) -> int:
        return self.codes.numel() + 2 * self.superblock_scales.numel()


@dataclass(frozen=True)
class BlockParams:
    """GGUF's 4-bit parameters as stored (`engine/models/gguf_blocks.FourBit`): per group of 32,
    w = q * scale - offset, scale = code_s * D and offset = code_o * M, (D, M) float16 per block of
    `groups_per_block` groups. Invariant: `expand()` is exact, and the native kernel (mode 3)
    dequantises to the gguf package's values bit for bit."""

    codes: torch.Tensor  # [N, G, 2] int8: (scale code, offset code)
    block_scales: torch.Tensor  # [N, G // groups_per_block, 2] float16: (D, M)
    groups_per_block: int

    def expand(self) -> tuple[torch.Tensor, torch.Tensor]:  # -> (scale, offset), each [N, G] float32
        blocks = self.block_scales.float().repeat_interleave(self.groups_per_block, dim=1)
        codes = self.codes.float()
        return codes[..., 0] * blocks[..., 0], codes[..., 1] * blocks[..., 1]

    @property
    def num_bytes(self) -> int:
        return self.codes.numel() + 2 * self.block_scales.numel()


@dataclass
class Int4Weight:
    q: torch.Tensor  # [N, K] uint8 in 0..15
    scale: torch.Tensor  # [N, K // group_size] float32
    zero: torch.Tensor  # [N, K // group_size] float32
    group_size: int
    int8_params: Int8GroupParams | None = None  # set by double_quantize_int4
    # GGUF's parameters as stored (`from_block_params`); `scale` / `zero` then approximate them
    # for the torch and Triton kernels (zero = 8 * scale - offset, rounded once)
    block_params: BlockParams | None = None

    @classmethod
    def from_block_params(cls, q: torch.Tensor, params: BlockParams) -> Int4Weight:
        scale, offset = params.expand()
        return cls(q, scale, 8 * scale - offset, 32, block_params=params)

    @property
    def num_bytes(self) -> int:
        """Stored size: packed nibbles plus the group parameters (a bfloat16 scale and zero per
        group, or their int8 codes and super-block scales)."""
        if self.block_params is not None:
            return self.q.numel() // 2 + self.block_params.num_bytes
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
    if w.block_params is not None:  # q * scale - offset, as stored (exact but for the final add)
        scale, offset = w.block_params.expand()
        runs = w.q.reshape(out_features, -1, 32).float()
        return (scale.unsqueeze(-1) * runs - offset.unsqueeze(-1)).reshape(out_features, in_features)
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
    expanded = int8_params.expand()  # [N, G, 2]
    scale, zero = expanded[..., 0], expanded[..., 1]
    groups = target.view(rows, num_groups, w.group_size)
    q = torch.round((groups - zero.unsqueeze(-1)) / scale.unsqueeze(-1) + 8).clamp(0, 15)
    return Int4Weight(q.to(torch.uint8).view_as(w.q), scale, zero, w.group_size, int8_params)


def int4_linear_reference(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    return F.linear(x, dequantize_int4(w).to(x.dtype))


class Int4Linear(nn.Module):
    """`y = x @ W.T` with W stored as group-wise INT4 (see the module docstring for the kernels).

    `kernel`: "auto" (Triton's where Triton runs, native where it can be built for this CPU, else
    torch's), "native" or "triton" (each raises if it cannot be used) or "torch". `self.kernel`
    says which one runs."""

    def __init__(
        self,
        w: Int4Weight,
        device: torch.device,
        kernel: Int4Kernel = "auto",
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = w.q.shape
        self.bias: torch.Tensor | None  # [N] float32, added after the matmul (kept dense)
        self.register_buffer("bias", None if bias is None else bias.detach().float().to(device))
        self.group_size = w.group_size
        self.num_weight_bytes = w.num_bytes
        self.kernel = _choose_kernel(kernel, device, w.group_size)
        # Native kernel: calls of more rows dequantise the weight and leave the GEMM to torch
        # (faster at prompt-chunk sizes, but another summation order: `compute_every_row_natively`).
        self.native_max_rows = NATIVE_GEMV_MAX_ROWS
        self.packed: torch.Tensor
        # Group parameters: (scale, zero) as float16 (native) or bfloat16 (torch), or (with int8
        # params) the int8 codes and bfloat16 super-block scales; the unused ones are None.
        self.scales_and_zeros: torch.Tensor | None
        self.param_codes: torch.Tensor | None
        self.superblock_scales: torch.Tensor | None
        self.column_scales: torch.Tensor | None  # triton: [G, N]
        self.column_zeros: torch.Tensor | None
        for name in ("scales_and_zeros", "param_codes", "superblock_scales", "column_scales", "column_zeros"):
            self.register_buffer(name, None)
        if self.kernel == "triton":
            self._pack_for_triton(w, device)
        elif self.kernel == "native":
            self._pack_for_native(w, device)
        else:
            self._pack_for_torch(w, device)

    def _pack_for_triton(self, w: Int4Weight, device: torch.device) -> None:
        """Column-major codes and [G, N] parameters (`triton_int4`)."""
        params = w.int8_params
        from tandem.kernels.triton_int4 import pack_int4_columns

        param_dtype = torch.float16 if params is None else torch.float32
        self.register_buffer("packed", pack_int4_columns(w.q).to(device))
        self.register_buffer("column_scales", w.scale.t().contiguous().to(device=device, dtype=param_dtype))
        self.register_buffer("column_zeros", w.zero.t().contiguous().to(device=device, dtype=param_dtype))

    def _pack_for_native(self, w: Int4Weight, device: torch.device) -> None:
        """Row-major codes and parameters, [N, ...] (`int4_native`); GGUF 4-bit blocks in tile order
        where the library reads it (`int4_native.tile_blocks`: the same values, read without gathers)."""
        params = w.int8_params
        packed = int4_native.pack_rows(w.q)
        if w.block_params is not None:  # mode 3: the int8 codes and float16 block scales as stored
            codes, block_scales = w.block_params.codes.contiguous(), w.block_params.block_scales.contiguous()
            if self.out_features % 16 == 0 and int4_native.block_tiles_available():  # mode 4: tile order
                packed, codes, block_scales = int4_native.tile_blocks(packed, codes, block_scales)
            self.register_buffer("packed", packed.to(device))
            self.register_buffer("param_codes", codes.to(device))
            self.register_buffer("superblock_scales", block_scales.to(device))
            return
        self.register_buffer("packed", packed.to(device))
        if params is None:
            # float16, as GGUF's Q4_1 stores them: 3 more mantissa bits than bfloat16, the same bytes
            scales_and_zeros = torch.stack([w.scale, w.zero], dim=-1).to(torch.float16)  # [N, G, 2]
            self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous().to(device))
        else:
            self.register_buffer("param_codes", params.codes.contiguous().to(device))  # [N, G, 2]
            self.register_buffer("superblock_scales", params.superblock_scales.contiguous().to(device))

    def _pack_for_torch(self, w: Int4Weight, device: torch.device) -> None:
        """torch's int4 kernels' packing and [G, N, 2] parameters."""
        params = w.int8_params
        padded_rows = -self.out_features % 16  # torch's int4 kernels need N % 16 == 0: zero rows pad it

        def pad(t: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [N + padded_rows, ...]
            return torch.cat([t, t.new_zeros(padded_rows, *t.shape[1:])]) if padded_rows else t

        q = pad(w.q).to(device)
        if device.type == "cpu":
            packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        else:
            packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), 8)
        self.register_buffer("packed", packed)
        # torch's kernel takes (scale, zero) as [G, N, 2] bfloat16: stored as such, or as int8 codes
        # [G, N, 2] and super-block scales [S, 1, N, 2] that `group_params` multiplies out.
        if params is None:
            scales_and_zeros = pad(torch.stack([w.scale, w.zero], dim=-1)).transpose(0, 1).contiguous()
            self.register_buffer("scales_and_zeros", scales_and_zeros.to(device=device, dtype=torch.bfloat16))
        else:
            self.register_buffer("param_codes", pad(params.codes).transpose(0, 1).contiguous().to(device))
            superblock_scales = pad(params.superblock_scales).transpose(0, 1).unsqueeze(1).contiguous()
            self.register_buffer("superblock_scales", superblock_scales.to(device))

    def compute_every_row_natively(self) -> None:
        """Native kernel: every call through its row-wise integer kernel, whatever its size, so
        that a row's result never depends on the other rows of the call (batch invariance)."""
        self.native_max_rows = 1 << 62

    @property
    def rows_invariant(self) -> bool:
        """Whether a row's result is independent of the call's size: the native kernel at every size."""
        return self.kernel == "native" and self.native_max_rows > 1 << 40

    def group_params(self) -> torch.Tensor:  # torch kernel only: -> [G, N, 2] bfloat16
        if self.scales_and_zeros is not None:
            return self.scales_and_zeros
        assert self.param_codes is not None and self.superblock_scales is not None
        num_groups, rows, _ = self.param_codes.shape
        codes = self.param_codes.view(self.superblock_scales.shape[0], -1, rows, 2)
        return (codes * self.superblock_scales).view(num_groups, rows, 2)  # int8 * bf16 -> bf16

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        y = self._matmul(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if self.kernel == "native":
            return self._forward_native(x)
        if self.kernel == "triton":
            from tandem.kernels.triton_int4 import w4a16_matmul

            assert self.column_scales is not None and self.column_zeros is not None
            return w4a16_matmul(x, self.packed, self.column_scales, self.column_zeros, self.group_size)
        x16 = x.to(torch.bfloat16)
        group_params = self.group_params()
        if x.device.type == "cpu":
            y = torch._weight_int4pack_mm_for_cpu(x16, self.packed, self.group_size, group_params)
        else:
            y = torch._weight_int4pack_mm(x16, self.packed, self.group_size, group_params)
        return y[:, : self.out_features].to(x.dtype)

    def _forward_native(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        params = self.scales_and_zeros if self.param_codes is None else self.param_codes
        assert params is not None
        x32 = x.to(torch.float32).contiguous()
        # Eager calls go straight to the library; under torch.compile the same functions are custom
        # ops, opaque to inductor, so the graph does not break around them.
        compiling = torch.compiler.is_compiling()
        if x.shape[0] <= self.native_max_rows:
            mm = torch.ops.tandem.int4_mm if compiling else int4_native.int4_mm
            return mm(x32, self.packed, params, self.superblock_scales, self.group_size).to(x.dtype)
        dequantize = torch.ops.tandem.int4_dequantize if compiling else int4_native.int4_dequantize
        weight = dequantize(self.packed, params, self.superblock_scales, self.group_size)  # [N, K] float32
        return F.linear(x32, weight).to(x.dtype)


def _choose_kernel(
    kernel: Int4Kernel, device: torch.device, group_size: int
) -> Literal["native", "triton", "torch"]:
    """`kernel` resolved for `device` (class docstring); raises for an explicit one that cannot run."""
    if kernel == "torch":
        return "torch"
    if kernel == "triton" or (kernel == "auto" and uses_triton(device)):
        if uses_triton(device):
            return "triton"
        why = triton_unavailable_reason() or f"Triton kernels do not run on {device} here"
        raise RuntimeError(f"int4_kernel='triton' cannot be used: {why}; use 'auto' or 'torch'")
    why_not = None
    if device.type != "cpu":
        why_not = f"it runs on CPU only (device {device})"
    elif group_size not in int4_native.GROUP_SIZES:
        why_not = f"group size {group_size} is not one of {int4_native.GROUP_SIZES}"
    elif int4_native.load() is None:
        why_not = f"it could not be built or loaded here ({int4_native.unavailable_reason()})"
    if why_not is None:
        return "native"
    if kernel == "native":
        raise RuntimeError(f"int4_kernel='native' cannot be used: {why_not}; use 'auto' or 'torch'")
    return "torch"


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
