"""Rotary position embeddings (HF "rotate_half" layout) with Llama rope-scaling variants."""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    *,
    max_position_embeddings: int | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the attention scaling factor for cos/sin, as HF's
    `ROPE_INIT_FUNCTIONS` compute them for the `rope_scaling` / `rope_parameters` dict.

    Types: default; linear; dynamic (the default within the original context: the loader refuses
    a dynamic model whose context is longer); llama3; yarn (static: position-independent);
    longrope (the short factors, HF's choice within `original_max_position_embeddings`; the loader
    caps such a model's context there). Others raise ValueError naming the type.
    `max_position_embeddings` supplies yarn's and longrope's default `factor` (context / original).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling, max_position_embeddings)
    if rope_type == "longrope":
        return _longrope(head_dim, theta, scaling, max_position_embeddings)
    raise ValueError(
        f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _yarn(
    dim: int, base: float, scaling: dict[str, Any], max_position_embeddings: int | None
) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): interpolated low frequencies, extrapolated high ones, a linear ramp
    between the correction dims of `beta_fast` / `beta_slow` rotations; cos/sin scaled by
    0.1 ln(factor) + 1 (or mscale / mscale_all_dim's ratio, or `attention_factor`)."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise ValueError("yarn needs factor or max_position_embeddings")
        factor = max_position_embeddings / original
    factor = float(factor)

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, float(mscale)) / get_mscale(factor, float(mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def _longrope(
    dim: int, base: float, scaling: dict[str, Any], max_position_embeddings: int | None
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-frequency `short_factor` divisors (the long ones apply past the
    original context, which the loader does not serve), cos/sin scaled by
    sqrt(1 + ln(factor) / ln(original)) where factor = context / original."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    if factor is None:
        factor = (max_position_embeddings or original) / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
    if short.numel() != dim // 2:
        raise ValueError(
            f"longrope short_factor has {short.numel()} entries, expected head_dim / 2 = {dim // 2}"
        )
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (short * base**shape), float(attention_factor)


def rope_cos_sin(
    inv_freq: torch.Tensor, max_positions: int, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_positions, head_dim] in float32."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def apply_rope(
    x: torch.Tensor,  # [T, H, D]
    cos: torch.Tensor,  # [T, 1, D] (already gathered at the tokens' positions)
    sin: torch.Tensor,  # [T, 1, D]
) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
