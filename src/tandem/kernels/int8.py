"""Symmetric INT8 weights with a float16 scale per run of 32 inputs (llama.cpp's Q8_0), and the
native matmul over them (`csrc/decoder_cpu.c`, `tandem_q8_mm`).

Semantics: W ~= codes * scales.repeat_interleave(32, dim=1), codes in -127..127; `q8_mm(x, ...)`
= x @ W.T computed with x rounded to int16 per run of 32 (as the INT4 kernel does), exact integer
dot products per run, then one float32 multiply-add per run in order, for each (row, output)
alike (the weight in the kernel's output-interleaved layout: `interleave_outputs`). Used for the
linears of `weight_dtype="int8"` and for INT4/INT8 models' LM head: 1.06 bytes per weight instead
of bfloat16's 2, and its rounding (half a step of max|w|/127 per run) is finer than the INT4 that
moved the default model's greedy tokens there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import int4_native

RUN = 32


@dataclass(frozen=True)
class Int8Weight:
    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, K / 32] float16

    @property
    def num_bytes(self) -> int:
        return self.codes.numel() + 2 * self.scales.numel()


def quantize_int8(weight: torch.Tensor) -> Int8Weight:  # [N, K], K % 32 == 0
    rows, cols = weight.shape
    if cols % RUN:
        raise ValueError(f"INT8 weights need in_features % {RUN} == 0, got {cols}")
    runs = weight.detach().float().reshape(rows, cols // RUN, RUN)
    scales = (runs.abs().amax(dim=-1) / 127.0).to(torch.float16)  # [N, K/32]
    safe = scales.float().clamp(min=torch.finfo(torch.float16).tiny).unsqueeze(-1)
    codes = (runs / safe).round().clamp(-127, 127).to(torch.int8).reshape(rows, cols)
    return Int8Weight(codes.contiguous(), scales.contiguous())


def dequantize_int8(w: Int8Weight) -> torch.Tensor:  # -> [N, K] float32
    return (w.codes.float().view(w.codes.shape[0], -1, RUN) * w.scales.float().unsqueeze(-1)).view(
        w.codes.shape
    )


def int8_linear_reference(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    return x.float() @ dequantize_int8(w).T


def interleave_outputs(w: Int8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` in the layout of the native `tandem_q8_mm`: (codes [Np / 16, K / 2, 16, 2] int8, scales
    [Np / 16, K / 32, 16] float32), Np = N rounded up to 16 with zero rows."""
    rows, cols = w.codes.shape
    padded = -rows % 16
    codes = torch.cat([w.codes, w.codes.new_zeros(padded, cols)]) if padded else w.codes
    scales = w.scales.float()
    scales = torch.cat([scales, scales.new_zeros(padded, cols // RUN)]) if padded else scales
    blocks = codes.shape[0] // 16
    codes_il = codes.view(blocks, 16, cols // 2, 2).permute(0, 2, 1, 3).contiguous()
    scales_il = scales.view(blocks, 16, cols // RUN).permute(0, 2, 1).contiguous()
    return codes_il, scales_il


def deinterleave_outputs(codes_il: torch.Tensor, scales_il: torch.Tensor, rows: int) -> Int8Weight:
    """The inverse of `interleave_outputs` (padding rows dropped)."""
    blocks, pairs = codes_il.shape[:2]
    codes = codes_il.permute(0, 2, 1, 3).reshape(blocks * 16, 2 * pairs)[:rows]
    scales = scales_il.permute(0, 2, 1).reshape(blocks * 16, -1)[:rows]
    return Int8Weight(codes.contiguous(), scales.to(torch.float16).contiguous())


def q8_mm(x: torch.Tensor, codes_il: torch.Tensor, scales_il: torch.Tensor, rows: int) -> torch.Tensor:
    """[M, K] float32 @ the interleaved Q8_0 weight's transpose -> [M, rows] float32 (native)."""
    lib = int4_native.load()
    assert lib is not None, "the native INT8 kernel needs the native library"
    x32 = x.float().contiguous()
    cols = 2 * codes_il.shape[1]
    assert x32.shape[1] == cols
    y = torch.empty(x32.shape[0], rows, dtype=torch.float32)
    status = lib.tandem_q8_mm(
        x32.data_ptr(), codes_il.data_ptr(), scales_il.data_ptr(), x32.shape[0], rows, cols, y.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"native INT8 kernel could not allocate scratch for {x32.shape[0]} rows")
    return y


class Int8Linear(nn.Module):
    """`y = x @ W.T (+ bias)` with W stored as Q8_0 (`Int8Weight`): the decoder linears of
    `weight_dtype="int8"`. Where the native library runs (CPU, `int4_native.load()`), the codes are
    kept in `tandem_q8_mm`'s output-interleaved layout and every call goes through it: an
    arithmetic per (row, output) that no other row changes (batch invariance), fast at one row and
    at many (the native decoder stack reads the same tensors). Elsewhere the weight is dequantised
    per call and multiplied in the input's dtype (the reference)."""

    def __init__(self, w: Int8Weight, device: torch.device, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = w.codes.shape
        self.native = device.type == "cpu" and int4_native.load() is not None
        self.codes: torch.Tensor  # native: [Np / 16, K / 2, 16, 2]; else [N, K]
        self.scales: torch.Tensor  # native: [Np / 16, K / 32, 16] float32; else [N, K / 32] float16
        self.bias: torch.Tensor | None
        codes, scales = interleave_outputs(w) if self.native else (w.codes, w.scales)
        self.register_buffer("codes", codes.contiguous().to(device))
        self.register_buffer("scales", scales.contiguous().to(device))
        self.register_buffer("bias", None if bias is None else bias.detach().float().to(device))
        self.num_weight_bytes = w.num_bytes

    def compute_every_row_natively(self) -> None:
        """Batch invariance: the native kernel already computes every call row by row."""

    @property
    def int8_weight(self) -> Int8Weight:
        if self.native:
            return deinterleave_outputs(self.codes, self.scales, self.out_features)
        return Int8Weight(self.codes, self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if self.native:
            y = q8_mm(x, self.codes, self.scales, self.out_features).to(x.dtype)
        else:
            y = F.linear(x, dequantize_int8(self.int8_weight).to(x.dtype))
        return y if self.bias is None else y + self.bias.to(y.dtype)


# Most rows a hybrid engine's INT8 head takes: at few rows it reads about half the bytes of a
# 16-bit weight and is faster; at many rows the 16-bit and float32 GEMMs win (docs/performance.md).
INT8_GEMV_MAX_ROWS = 4


class Int8HeadLinear(nn.Module):
    """`y = x @ weight.T` for an LM head: one precision for every step, the INT8 copy
    (`quantize_int8`, computed by `q8_mm`) where the native kernel runs, else a bfloat16 copy of the weight,
    so that a request's logits never depend on how many rows its step has. Only a hybrid engine
    (explicit `weight_dtype="hybrid"`) mixes: steps of more than `INT8_GEMV_MAX_ROWS` rows go to the
    dense model's head (`use_dense_head`; the decode model then keeps no 16-bit copy of its own)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight: torch.Tensor
        self.register_buffer("weight", weight.detach().to(torch.bfloat16), persistent=False)
        # the INT8 copy in `tandem_q8_mm`'s layout (codes, scales), where the native kernel runs
        self.interleaved: tuple[torch.Tensor, torch.Tensor] | None = None
        # (module, its input dtype): not registered as a submodule, it belongs to the dense model.
        self.dense_head: tuple[nn.Module, torch.dtype] | None = None
        if weight.device.type == "cpu" and self.in_features % RUN == 0 and int4_native.load() is not None:
            self.interleaved = interleave_outputs(quantize_int8(weight))

    @property
    def int8(self) -> Int8Weight | None:
        """The INT8 copy in the plain layout (`quantize_int8`'s), for references and tests."""
        if self.interleaved is None:
            return None
        return deinterleave_outputs(*self.interleaved, self.out_features)

    def use_dense_head(self, head: nn.Module, dtype: torch.dtype) -> None:
        """Serve steps of more than `INT8_GEMV_MAX_ROWS` rows with `head` (same weight, computing
        in `dtype`; oneDNN's prepacked GEMM where the dense model has one) and drop the bfloat16
        copy."""
        self.dense_head = (head, dtype)
        self.weight = torch.empty(0, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        if self.dense_head is not None and (self.interleaved is None or x.shape[0] > INT8_GEMV_MAX_ROWS):
            head, dtype = self.dense_head
            return _dense_head_forward(head, x, dtype)
        if self.interleaved is not None:
            return q8_mm(x, *self.interleaved, self.out_features).to(x.dtype)
        return F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)


@torch.compiler.disable  # oneDNN's prepacked weight is opaque to inductor: a compiled decode graph calls out
def _dense_head_forward(head: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return head(x.to(dtype)).to(x.dtype)
