"""Quantised linears of a loaded model: INT4 (`apply_int4`: a Q4_1 GGUF's own codes, calibrated
weights, or round-to-nearest) and INT8 (`apply_int8`, Q8_0), each with the INT8 LM head."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tandem.engine.models.gguf_names import gguf_to_hf_name, unpermute_rope
from tandem.engine.models.interface import CausalLM
from tandem.engine.models.llama import LlamaConfig
from tandem.kernels.int4 import (
    Int4Kernel,
    Int4Linear,
    Int4Weight,
    double_quantize_int4,
    fit_group_size,
    quantize_int4,
)
from tandem.kernels.int8 import Int8HeadLinear, Int8Linear, quantize_int8

# For weights without native INT4 tensors: the best of 32, 64 and 128 on Gemma 3 270M
# (docs/performance.md, "2026-12-05 (later)").
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


def read_gguf_int4(path: Path, config: LlamaConfig) -> dict[str, Int4Weight]:
    """The Q4_1 tensors of a GGUF file as INT4 weights (HF names), without dequantising: a Q4_1
    block is fp16 d, fp16 m and 16 bytes of nibbles (low nibbles = elements 0-15, high = 16-31),
    w = d * q + m, which is `Int4Weight` with group 32 and zero = m + 8d."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out: dict[str, Int4Weight] = {}
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        if tensor.tensor_type != gguf.GGMLQuantizationType.Q4_1 or hf_name is None:
            continue
        rows = int(tensor.shape[1]) if len(tensor.shape) > 1 else 1
        cols = int(tensor.shape[0])
        raw = np.asarray(tensor.data).view(np.uint8).reshape(rows, cols // 32, 20)
        d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = raw[..., 4:20]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)
        scale, zero = d, m + 8 * d
        if hf_name.endswith("q_proj.weight") or hf_name.endswith("k_proj.weight"):
            heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            q, scale, zero = (unpermute_rope(a, heads) for a in (q, scale, zero))
        out[hf_name] = Int4Weight(
            torch.from_numpy(np.ascontiguousarray(q)),
            torch.from_numpy(np.ascontiguousarray(scale)),
            torch.from_numpy(np.ascontiguousarray(zero)),
            32,
        )
    return out


def _concat_int4(parts: list[Int4Weight]) -> Int4Weight | None:
    if any(p.group_size != parts[0].group_size for p in parts):
        return None
    return Int4Weight(
        torch.cat([p.q for p in parts]),
        torch.cat([p.scale for p in parts]),
        torch.cat([p.zero for p in parts]),
        parts[0].group_size,
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
