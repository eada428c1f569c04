"""The FP8 (e4m3) KV cache's numbers: per-vector dynamic quantisation and the e4m3 bit pattern
widened to float (for the Triton kernels' reference and the cache's readers)."""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
_MIN_SCALE = 2.0**-24  # float16's smallest subnormal: a smaller scale would round to 0 (0 / 0 = NaN codes)
_MAX_SCALE = float(torch.finfo(torch.float16).max)  # scales are stored as float16: keep them finite


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) dynamic e4m3 quantisation: x ~= q.float() * scale[..., None].
    x: [..., D] -> (q [..., D] float8_e4m3fn, scale [...] float16)."""
    amax = x.abs().amax(dim=-1).float()
    scale = (amax / FP8_E4M3_MAX).clamp(min=_MIN_SCALE, max=_MAX_SCALE).to(torch.float16)
    q = (x.float() / scale.float().unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


# e4m3 bits placed in a float32's (or bfloat16's) sign, exponent and mantissa fields read as the same
# value times 2^-120 (exponent bias 127 instead of 7), subnormals included; the factor is folded
# into the scale.
E4M3_AS_WIDE_FACTOR = 2.0**120


def e4m3_to_float(raw: torch.Tensor) -> torch.Tensor:
    """[...] uint8 e4m3 codes -> [...] float32 values, exactly `raw.view(float8_e4m3fn).float()`
    for every code but NaN (0x7f/0xff, never written: `quantize_fp8` clamps to +-448).

    CPU torch converts float8 element by element, much slower than this (docs/performance.md)."""
    return e4m3_bits_as(raw, torch.float32).mul_(E4M3_AS_WIDE_FACTOR)


def e4m3_bits_as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[...] uint8 e4m3 codes -> [...] float32 or bfloat16 holding value / 2^120: the code,
    sign-extended to the width, shifted so that its 4 exponent and 3 mantissa bits land on the wide
    type's lowest exponent and highest mantissa bits (bits 20..26 of a float32, 4..10 of a
    bfloat16), then masked to those bits and the sign (the sign-extension fills bit 31/15). Three
    passes, the last two in place (its cost against a 16-bit cache's gather: docs/performance.md)."""
    if dtype == torch.float32:
        bits = raw.view(torch.int8).to(torch.int32)
        bits.bitwise_left_shift_(20).bitwise_and_(-0x78100000)  # 0x87F00000: sign | exp+mantissa
    else:
        bits = raw.view(torch.int8).to(torch.int16)
        bits.bitwise_left_shift_(4).bitwise_and_(-0x7810)  # 0x87F0
    return bits.view(dtype)
