"""W4A16: `y = x @ W.T` with W group-wise INT4 (`int4.py`'s format), in Triton.

Semantics (reference: `int4.int4_linear_reference`):

    W[n, k] = (q[n, k] - 8) * scale[k // group_size, n] + zero[k // group_size, n]
    y[m, n] = sum_k x[m, k] * W[n, k]        (accumulated in float32, returned in x's dtype)

Layout, prepared once from an `Int4Weight` by `pack_int4_columns`:
- `packed` [K // 2, N] uint8: byte (j, n) holds q[n, 2j] in its low nibble and q[n, 2j + 1] in
  its high one, so a program reads a [BLOCK_K / 2, BLOCK_N] tile of whole bytes, N contiguous.
- `scales`, `zeros` [K // group_size, N] (float16, or float32 where float16 would round them:
  double-quantised parameters are products of 8-bit codes and bfloat16 scales).

A program computes a [BLOCK_M, BLOCK_N] tile of y, walking K in steps of BLOCK_K (a divisor of
the group size, so a step reads one group's parameters): it unpacks the low and high nibbles,
dequantises them to x's dtype (float32 under the interpreter, see `triton_attention`) and adds
two dots, the even and the odd columns of x against them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.triton_support import interpreting


@triton.jit
def _w4a16_kernel(
    x_ptr, packed_ptr, scales_ptr, zeros_ptr, out_ptr, M, N, K,
    stride_xm, stride_pk, stride_sg, stride_om,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, BLOCK_K // 2)
    m_ok = m < M
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        group = k0 // GROUP_SIZE
        scale = tl.load(scales_ptr + group * stride_sg + n, mask=n_ok, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + group * stride_sg + n, mask=n_ok, other=0.0).to(tl.float32)
        rows = k0 // 2 + half  # packed rows of this step
        codes = tl.load(packed_ptr + rows[:, None] * stride_pk + n[None, :], mask=n_ok[None, :], other=0)
        low = ((codes & 0xF).to(tl.float32) - 8.0) * scale[None, :] + zero[None, :]  # W[n, k0 + 2j]
        high = ((codes >> 4).to(tl.float32) - 8.0) * scale[None, :] + zero[None, :]  # W[n, k0 + 2j + 1]
        columns = k0 + 2 * half
        x_even = tl.load(x_ptr + m[:, None] * stride_xm + columns[None, :], mask=m_ok[:, None], other=0.0)
        x_odd = tl.load(x_ptr + m[:, None] * stride_xm + columns[None, :] + 1, mask=m_ok[:, None], other=0.0)
        acc += tl.dot(x_even.to(DOT_DTYPE), low.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        acc += tl.dot(x_odd.to(DOT_DTYPE), high.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    tl.store(
        out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )  # fmt: skip


def pack_int4_columns(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] uint8 codes 0..15 -> [K // 2, N] uint8 (module docstring). K must be even."""
    q_t = q.t().contiguous()  # [K, N]
    return (q_t[0::2] | (q_t[1::2] << 4)).contiguous()


def w4a16_matmul(
    x: torch.Tensor,  # [M, K] float32/bfloat16/float16
    packed: torch.Tensor,  # [K // 2, N] uint8 (`pack_int4_columns`)
    scales: torch.Tensor,  # [K // group_size, N]
    zeros: torch.Tensor,  # [K // group_size, N]
    group_size: int,
) -> torch.Tensor:  # [M, N] in x's dtype
    """The INT4 matmul (module docstring)."""
    num_rows, in_features = x.shape
    out_features = packed.shape[1]
    assert packed.shape[0] * 2 == in_features, (packed.shape, x.shape)
    x = x.contiguous()
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    block_k = min(64, group_size)
    assert group_size % block_k == 0 and block_k >= 32, f"group size {group_size} is not a multiple of 32"
    block_m = 16 if num_rows <= 16 else (32 if num_rows <= 32 else 64)
    # small M: narrower column tiles, so that a GPU has enough programs (N / 64) to fill its SMs
    block_n = 32 if x.device.type == "cpu" else (64 if num_rows <= 16 else 128)
    if interpreting() or x.dtype == torch.float32:
        dot_dtype, precision = tl.float32, "ieee"
    else:
        dot_dtype, precision = (tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16), "tf32"
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(out_features, block_n))
    _w4a16_kernel[grid](
        x, packed, scales, zeros, out, num_rows, out_features, in_features,
        x.stride(0), packed.stride(0), scales.stride(0), out.stride(0),
        GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
    )  # fmt: skip
    return out
