"""Quantised linears of a loaded model: INT4 (`apply_int4`: a GGUF's own 4-bit blocks, calibrated
weights, or round-to-nearest) and INT8 (`apply_int8`, Q8_0), each with the INT8 LM head."""

from __future__ import annotations

import torch

from tandem.engine.models.interface import CausalLM
from tandem.kernels.int4 import (
    BlockParams,
    Int4Kernel,
    Int4Linear,
    Int4Weight,
    double_quantize_int4,
    fit_group_size,
    quantize_int4,
)
from tandem.kernels.int8 import Int8HeadLinear, Int8Linear, quantize_int8

# For weights without native INT4 tensors: the best of 32, 64 and 128 on Gemma 3 270M
# (docs/performance.md: the issue-59 section, its INT4 variants g32 / g64 / g128).
DEFAULT_INT4_GROUP_SIZE = 32


def apply_int8(model: CausalLM, device: torch.device) -> None:
    """Swap every INT4 target (fused q/k/v and gate/up, o, down) for a Q8_0 `Int8Linear`
    quantised from the loaded weights; the LM head and the input embedding as with INT4."""
    for target in model.int4_targets():
        linear = getattr(target.parent, target.attr)
        setattr(
            target.parent, target.attr, Int8Linear(quantize_int8(linear.weight.detach()), device, linear.bias)
        )
    model.lm_head = Int8HeadLinear(model.lm_head.weight)
    model.embed_tokens.to(torch.bfloat16)


def _concat_int4(parts: list[Int4Weight]) -> Int4Weight | None:
    """Row-concatenated parts, or None where their layouts differ (then the target is quantised)."""
    first = parts[0]
    if any(p.group_size != first.group_size for p in parts):
        return None
    blocks = [p.block_params for p in parts]
    if any(b is not None for b in blocks):
        if any(b is None or b.groups_per_block != blocks[0].groups_per_block for b in blocks):  # type: ignore[union-attr]
            return None
        params = BlockParams(
            torch.cat([b.codes for b in blocks if b is not None]),
            torch.cat([b.block_scales for b in blocks if b is not None]),
            first.block_params.groups_per_block,  # type: ignore[union-attr]
        )
        return Int4Weight.from_block_params(torch.cat([p.q for p in parts]), params)
    return Int4Weight(
        torch.cat([p.q for p in parts]),
        torch.cat([p.scale for p in parts]),
        torch.cat([p.zero for p in parts]),
        first.group_size,
    )


def apply_int4(
    model: CausalLM,
    native: dict[str, Int4Weight],
    group_size: int,
    device: torch.device,
    double_quant: bool = False,
    kernel: Int4Kernel = "auto",
    calibrated: dict[str, Int4Weight] | None = None,
) -> None:
    """Swap every decoder linear (fused q/k/v and gate/up, o, down) for an `Int4Linear`: from
    `native` INT4 weights where the file had them, else quantised from the loaded weights; with
    `double_quant`, their group scales and zeros then become int8 codes (`double_quantize_int4`);
    `kernel` picks the INT4 matmul (`Int4Linear`). The norms keep the model dtype; the LM head and
    the input embedding become bfloat16."""
    for target in model.int4_targets():
        names = [f"{name}.weight" for name in target.source_names]
        weight = _concat_int4([native[n] for n in names]) if all(n in native for n in names) else None
        weight = (calibrated or {}).get("|".join(target.source_names), weight)
        linear = getattr(target.parent, target.attr)
        if weight is None:
            weight = quantize_int4(linear.weight.detach(), fit_group_size(linear.in_features, group_size))
        if double_quant:
            weight = double_quantize_int4(weight)
        setattr(target.parent, target.attr, Int4Linear(weight, device, kernel, bias=linear.bias))
    # The LM head (often the tied embedding) is not INT4: INT4 there moved the default model's
    # greedy tokens within a few steps, while INT4 everywhere else keeps most of them. It is INT8
    # (Q8_0-style) for every step where the native kernel runs, bfloat16 otherwise (a hybrid
    # engine hands it the dense model's head for its larger steps: `Int8HeadLinear.use_dense_head`).
    model.lm_head = Int8HeadLinear(model.lm_head.weight)
    model.embed_tokens.to(torch.bfloat16)  # rows are looked up, then cast to the compute dtype
