"""GGUF quantisation blocks read as stored (ggml's `ggml-common.h` layouts), without a second
rounding.

- `FourBit` (Q4_0, Q4_1, Q4_K): 4-bit codes q and, per run of 32 inputs, w = q * scale - offset
  with scale = scale_code * D and offset = offset_code * M, where (D, M) are float16 per block
  (one run for Q4_0 / Q4_1; a super-block of 8 runs for Q4_K, whose codes are its 6-bit sub-block
  scales and mins). Q4_0: codes (1, 8), D = M = d; Q4_1: codes (1, -1), D = d, M = m. This is the
  native INT4 kernel's "block parameters" layout (`kernels/int4.py`, `BlockParams`).
- `Int8Runs` (Q8_0, Q5_0): int8 codes times a float16 scale per run of 32 (Q5_0's codes are its
  5-bit values less 16): the native INT8 (Q8_0) kernel's layout as stored.
- Q5_1, Q5_K, Q6_K (and Q4_0 / Q4_1 / Q4_K where a fused linear mixes types) become Q8_0 from
  their exact values (`requantize_to_q8`: a second rounding, at 8 bits).

Contract: `dequantize(raw, type_name, shape)` and each reader's `dequantize()` equal the `gguf`
package's `dequantize` of the same bytes: equal floats, and the same bits but for the sign of a
zero (Q4_0's code 8 under a negative scale: -0.0 there, +0.0 here). Each product here is exact,
so at most the final add rounds, as there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q8_0", "Q5_0")  # int8 runs as stored
FLOAT_TYPES = ("F32", "F16", "BF16")
RUN = 32
_TYPE_SIZE = {
    "Q8_0": 34,
    "Q4_0": 18,
    "Q4_1": 20,
    "Q5_0": 22,
    "Q5_1": 24,
    "Q4_K": 144,
    "Q5_K": 176,
    "Q6_K": 210,
}
_BLOCK = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}


def type_name(tensor_type: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(int(tensor_type)).name


@dataclass(frozen=True)
class FourBit:
    q: np.ndarray  # [rows, cols] uint8 in 0..15
    codes: np.ndarray  # [rows, cols / 32, 2] int8: (scale code, offset code) per run
    block_scales: np.ndarray  # [rows, cols / 32 / runs_per_block, 2] float16: (D, M)
    runs_per_block: int

    def scales_and_offsets(self) -> tuple[np.ndarray, np.ndarray]:  # -> 2 x [rows, cols / 32] float32, exact
        rows, runs, _ = self.codes.shape
        blocks = np.repeat(self.block_scales.astype(np.float32), self.runs_per_block, axis=1)
        codes = self.codes.astype(np.float32)
        return codes[..., 0] * blocks[..., 0], codes[..., 1] * blocks[..., 1]

    def dequantize(self) -> np.ndarray:  # -> [rows, cols] float32
        scale, offset = self.scales_and_offsets()
        rows, cols = self.q.shape
        runs = self.q.reshape(rows, cols // RUN, RUN).astype(np.float32)
        return (scale[..., None] * runs - offset[..., None]).reshape(rows, cols)


@dataclass(frozen=True)
class Int8Runs:
    codes: np.ndarray  # [rows, cols] int8
    scales: np.ndarray  # [rows, cols / 32] float16

    def dequantize(self) -> np.ndarray:  # -> [rows, cols] float32
        rows, cols = self.codes.shape
        runs = self.codes.reshape(rows, cols // RUN, RUN).astype(np.float32)
        return (runs * self.scales.astype(np.float32)[..., None]).reshape(rows, cols)


def _blocks(raw: np.ndarray, kind: str) -> np.ndarray:  # -> [num_blocks, type_size] uint8
    return np.ascontiguousarray(raw).view(np.uint8).reshape(-1, _TYPE_SIZE[kind])


def _f16(b: np.ndarray) -> np.ndarray:  # [n, 2] uint8 -> [n] float16
    return np.ascontiguousarray(b).view(np.float16)[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:  # [n, 16 * k] uint8 -> [n, 32 * k]: per 16 bytes, low then high
    n, size = qs.shape
    chunks = qs.reshape(n, size // 16, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(n, size * 2)


def _high_bits(qh: np.ndarray) -> np.ndarray:  # [n, 4] uint8 -> [n, 32]: bit j of the uint32
    bits = np.ascontiguousarray(qh).view(np.uint32)[:, :1] >> np.arange(32, dtype=np.uint32)
    return (bits & 1).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # [n, 12] -> 2 x [n, 8] 6-bit
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mins


def _k_nibbles(qs: np.ndarray) -> np.ndarray:  # [n, 128] -> [n, 256]: per 32 bytes, low then high
    n = qs.shape[0]
    chunks = qs.reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(n, 256)


def read_four_bit(raw: np.ndarray, kind: str, rows: int, cols: int) -> FourBit:
    b = _blocks(raw, kind)
    n = b.shape[0]
    if kind == "Q4_K":
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mins = _k_scales(b[:, 4:16])
        q = _k_nibbles(b[:, 16:144])
        codes = np.stack([sc, mins], axis=-1).astype(np.int8)  # [n, 8, 2]
        block_scales = np.stack([d, dmin], axis=-1)  # [n, 2]
        per_block = 8
    else:
        d = _f16(b[:, 0:2])
        if kind == "Q4_0":
            q, second, codes_row = _nibbles(b[:, 2:18]), d, (1, 8)
        else:  # Q4_1: w = d * q + m = q * d - (-1) * m
            q, second, codes_row = _nibbles(b[:, 4:20]), _f16(b[:, 2:4]), (1, -1)
        codes = np.broadcast_to(np.array(codes_row, dtype=np.int8), (n, 1, 2))
        block_scales = np.stack([d, second], axis=-1)
        per_block = 1
    runs = cols // RUN
    return FourBit(
        np.ascontiguousarray(q.reshape(rows, cols)),
        np.ascontiguousarray(codes.reshape(rows, runs, 2)),
        np.ascontiguousarray(block_scales.reshape(rows, runs // per_block, 2)),
        per_block,
    )


def read_int8(raw: np.ndarray, kind: str, rows: int, cols: int) -> Int8Runs:
    """Q8_0 or Q5_0 as int8 runs (exact)."""
    b = _blocks(raw, kind)
    d = _f16(b[:, 0:2])
    if kind == "Q8_0":
        codes = b[:, 2:34].view(np.int8)
    else:
        q = _nibbles(b[:, 6:22]) | (_high_bits(b[:, 2:6]) << 4)
        codes = q.astype(np.int8) - np.int8(16)
    return Int8Runs(
        np.ascontiguousarray(codes.reshape(rows, cols)), np.ascontiguousarray(d.reshape(rows, -1))
    )


def _q5_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b[:, 0:2]).astype(np.float32), _f16(b[:, 2:4]).astype(np.float32)
    q = (_nibbles(b[:, 8:24]) | (_high_bits(b[:, 4:8]) << 4)).astype(np.float32)
    return d[:, None] * q + m[:, None]


def _q5_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]).astype(np.float32), _f16(b[:, 2:4]).astype(np.float32)
    sc, mins = _k_scales(b[:, 4:16])
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # bit j: run j
    q = (_k_nibbles(b[:, 48:176]).reshape(n, 8, 32) | ((qh & 1) << 4)).astype(np.float32)
    scale = (d[:, None] * sc.astype(np.float32))[..., None]
    offset = (dmin[:, None] * mins.astype(np.float32))[..., None]
    return (scale * q - offset).reshape(n, 256)


def _q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql, qh = b[:, 0:128], b[:, 128:192]
    scales = b[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16], one per 16 values
    d = _f16(b[:, 208:210]).astype(np.float32)
    low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << 4)).astype(np.int8) - np.int8(32)
    scale = (d[:, None] * scales).reshape(n, 16, 1)
    return (scale * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, 256)


def dequantize(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """The stored tensor as float32 in `shape` (numpy order), decoded here (module docstring)."""
    count = int(np.prod(shape))
    if kind == "F32":
        return np.asarray(raw).view(np.float32).reshape(shape).copy()
    if kind == "F16":
        return np.asarray(raw).view(np.float16).astype(np.float32).reshape(shape)
    if kind == "BF16":
        bits = np.asarray(raw).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    cols = shape[-1]
    rows = count // cols
    if kind in FOUR_BIT_TYPES:
        return read_four_bit(raw, kind, rows, cols).dequantize().reshape(shape)
    if kind in INT8_TYPES:
        return read_int8(raw, kind, rows, cols).dequantize().reshape(shape)
    decode = {"Q5_1": _q5_1, "Q5_K": _q5_k, "Q6_K": _q6_k}.get(kind)
    if decode is None:
        raise ValueError(f"GGUF type {kind} is not supported (supported: {', '.join(SUPPORTED_TYPES)})")
    return decode(_blocks(raw, kind)).reshape(shape)
