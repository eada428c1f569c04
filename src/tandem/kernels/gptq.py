"""Calibrated INT4: GPTQ's error feedback (Frantar et al., 2022) with a clipping search, into
Tandem's group-wise INT4 format (`int4.Int4Weight`: w ~= (q - 8) * scale + zero, q in 0..15,
scale and zero per row and group, stored as float16 by the native kernel).

Semantics of `gptq_quantize(weight, hessian, group_size)`: the columns (inputs) of `weight` [N, K]
are quantised left to right; each column's rounding error, scaled by the inverse Hessian of the
layer's inputs (`hessian` = sum of x x^T over calibration tokens, [K, K]), is pushed onto the
columns not yet quantised, so that the layer's *outputs* on inputs like the calibration's stay
close rather than each weight on its own (round-to-nearest). A group's (scale, zero) are chosen
when its first column is reached, from the columns as updated so far, by searching how far to
clip its range (the shrink of `CLIP_GRID` with the least output-weighted squared error, the
Hessian's diagonal as weights). Rows are independent; K % group_size == 0. The Hessian is damped
by `DAMPING` of its mean diagonal (dead inputs, with a zero diagonal, get weight 0).
"""

from __future__ import annotations

import torch

from tandem.kernels.int4 import Int4Weight

DAMPING = 0.01
BLOCK = 128  # columns updated together (lazy batch updates)
CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def _group_params(w: torch.Tensor, importance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) [N] for the columns w [N, g], the clip shrink with the least error weighted by
    `importance` [g] (the Hessian's diagonal); float16-rounded as the kernel stores them."""
    low, high = w.amin(dim=1), w.amax(dim=1)
    best_err = torch.full_like(low, float("inf"))
    best_scale, best_zero = torch.zeros_like(low), torch.zeros_like(low)
    for shrink in CLIP_GRID:
        lo, hi = low * shrink, high * shrink
        scale = ((hi - lo) / 15).clamp(min=1e-8).half().float()
        zero = (lo + 8 * scale).half().float()
        q = torch.round((w - zero[:, None]) / scale[:, None] + 8).clamp(0, 15)
        err = (((q - 8) * scale[:, None] + zero[:, None] - w) ** 2 * importance[None, :]).sum(dim=1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, group_size: int) -> Int4Weight:
    """`weight` [N, K], `hessian` [K, K] (float32 or float64) -> INT4 (module docstring)."""
    rows, cols = weight.shape
    assert cols % group_size == 0 and BLOCK % group_size == 0 or group_size % BLOCK == 0
    w = weight.detach().double().clone()
    h = hessian.detach().double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += DAMPING * torch.mean(torch.diag(h)) * torch.eye(cols, dtype=h.dtype)
    importance = torch.diag(h).clone()
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)  # [K, K]
    q_all = torch.zeros(rows, cols, dtype=torch.uint8)
    num_groups = cols // group_size
    scales = torch.zeros(rows, num_groups, dtype=torch.float64)
    zeros = torch.zeros(rows, num_groups, dtype=torch.float64)
    for start in range(0, cols, BLOCK):
        end = min(start + BLOCK, cols)
        block = w[:, start:end].clone()
        errors = torch.zeros_like(block)
        h_block = h_inv[start:end, start:end]
        for i in range(end - start):
            col = start + i
            if col % group_size == 0:
                g = col // group_size
                span = (
                    block[:, i : i + group_size]
                    if i + group_size <= end - start
                    else w[:, col : col + group_size]
                )
                scale, zero = _group_params(span, importance[col : col + group_size])
                scales[:, g], zeros[:, g] = scale, zero
            g = col // group_size
            scale, zero = scales[:, g], zeros[:, g]
            column = block[:, i]
            q = torch.round((column - zero) / scale + 8).clamp(0, 15)
            q_all[:, col] = q.to(torch.uint8)
            error = (column - ((q - 8) * scale + zero)) / h_block[i, i]
            block[:, i:] -= error[:, None] * h_block[i, i:][None, :]
            errors[:, i] = error
        w[:, end:] -= errors @ h_inv[start:end, end:]
    return Int4Weight(q_all, scales.float(), zeros.float(), group_size)
