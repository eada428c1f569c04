"""A GGUF file's quantised linears in the engine's kernels as the file stores them
(`weight_dtype="gguf"`), and its 4-bit tensors as exact INT4 weights (`weight_dtype="int4"`).

Per decoder linear (a fused q/k/v or gate/up takes its sources' rows in order):
- every source of one 4-bit type (Q4_0, Q4_1, Q4_K) -> `Int4Linear` with its block parameters as
  stored (native kernel mode 3): the file's values exactly;
- otherwise, any quantised source -> `Int8Linear` (Q8_0 runs): Q8_0 and Q5_0 sources as stored
  (exact), others (Q5_1, Q5_K, Q6_K, a 4-bit source fused with another type, float) rounded once
  to Q8_0 from their exact values;
- every source float (F32 / F16 / BF16) -> the dense linear, unchanged.
The LM head becomes the INT8 head and the embedding bfloat16, as for INT4 models, when any
linear is quantised.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tandem.engine.models.gguf_blocks import (
    FOUR_BIT_TYPES,
    INT8_TYPES,
    FourBit,
    Int8Runs,
    read_four_bit,
    read_int8,
)
from tandem.engine.models.gguf_file import open_gguf
from tandem.engine.models.gguf_names import unpermute_rope
from tandem.engine.models.interface import CausalLM
from tandem.kernels.int4 import BlockParams, Int4Kernel, Int4Linear, Int4Weight
from tandem.kernels.int8 import Int8HeadLinear, Int8Linear, Int8Weight, quantize_int8

Stored = FourBit | Int8Runs | str  # str: any other type, by name ("Q6_K", "F16", ...)


def read_stored(path: Path) -> dict[str, Stored]:
    """HF name -> the file's tensor: 4-bit and int8-run types decoded as stored (rows in the HF
    layout: llama.cpp's q/k row permutation undone on codes and parameters alike), others by name."""
    file = open_gguf(path)
    out: dict[str, Stored] = {}
    for tensor in file.tensors:
        if len(tensor.shape) != 2:
            continue
        rows, cols = tensor.shape
        raw = np.asarray(tensor.raw)
        heads = file.model.permuted_heads(tensor.hf_name)
        if tensor.type_name in FOUR_BIT_TYPES:
            block = read_four_bit(raw, tensor.type_name, rows, cols)
            if heads is not None:
                q, codes, scales = (_unpermute(a, heads) for a in (block.q, block.codes, block.block_scales))
                block = FourBit(q, codes, scales, block.runs_per_block)
            out[tensor.hf_name] = block
        elif tensor.type_name in INT8_TYPES:
            runs = read_int8(raw, tensor.type_name, rows, cols)
            if heads is not None:
                runs = Int8Runs(_unpermute(runs.codes, heads), _unpermute(runs.scales, heads))
            out[tensor.hf_name] = runs
        else:
            out[tensor.hf_name] = tensor.type_name
    return out


def _unpermute(array: np.ndarray, num_heads: int) -> np.ndarray:
    return np.ascontiguousarray(unpermute_rope(array, num_heads))


def four_bit_weight(parts: list[FourBit]) -> Int4Weight:
    """Row-concatenated 4-bit parts (one type, one block size) as an exact INT4 weight."""
    params = BlockParams(
        torch.from_numpy(np.concatenate([p.codes for p in parts])),
        torch.from_numpy(np.concatenate([p.block_scales for p in parts])),
        parts[0].runs_per_block,
    )
    return Int4Weight.from_block_params(torch.from_numpy(np.concatenate([p.q for p in parts])), params)


def stored_int4(stored: dict[str, Stored]) -> dict[str, Int4Weight]:
    """The file's 4-bit tensors as exact INT4 weights (HF names), for `apply_int4`."""
    return {name: four_bit_weight([s]) for name, s in stored.items() if isinstance(s, FourBit)}


def apply_stored(
    model: CausalLM,
    stored: dict[str, Stored],
    weights: dict[str, torch.Tensor],
    device: torch.device,
    kernel: Int4Kernel = "auto",
) -> None:
    """Swap the decoder linears as the module docstring says. `weights`: the float checkpoint
    (each source's rows, for the parts rounded to Q8_0)."""
    quantised = False
    for target in model.int4_targets():
        names = [f"{name}.weight" for name in target.source_names]
        parts = [stored.get(name) for name in names]
        linear = getattr(target.parent, target.attr)
        kinds = {_kind(p) for p in parts}
        if all(isinstance(p, FourBit) for p in parts) and len(kinds) == 1:
            four = [p for p in parts if isinstance(p, FourBit)]
            new: torch.nn.Module = Int4Linear(four_bit_weight(four), device, kernel, bias=linear.bias)
        elif any(isinstance(p, FourBit | Int8Runs) for p in parts) or kinds & {"Q5_1", "Q5_K", "Q6_K"}:
            runs = [_int8_part(p, weights[name]) for p, name in zip(parts, names, strict=True)]
            codes = torch.cat([r.codes for r in runs])
            scales = torch.cat([r.scales for r in runs])
            new = Int8Linear(Int8Weight(codes.contiguous(), scales.contiguous()), device, linear.bias)
        else:
            continue
        setattr(target.parent, target.attr, new)
        quantised = True
    if quantised:
        model.lm_head = Int8HeadLinear(model.lm_head.weight)
        model.embed_tokens.to(torch.bfloat16)


def _kind(part: Stored | None) -> str:
    if isinstance(part, FourBit):
        return f"four-bit/{part.runs_per_block}"  # Q4_0 and Q4_1 rows concatenate; Q4_K with Q4_K
    if isinstance(part, Int8Runs):
        return "int8"
    return part or "float"


def _int8_part(part: Stored | None, weight: torch.Tensor) -> Int8Weight:
    if isinstance(part, Int8Runs):
        return Int8Weight(torch.from_numpy(part.codes), torch.from_numpy(part.scales))
    return quantize_int8(weight.float())
