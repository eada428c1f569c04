"""PEFT LoRA checkpoints, read and validated without torch (the API processes validate uploads
with this; the engine converts what it returns to its fused layout, lora.py).

A checkpoint is `adapter_config.json` + `adapter_model.safetensors` (never pickle). `check_peft_adapter`
checks the config (LoRA only, no DoRA, bias or per-layer patterns; rank and scaling within
`LoRALimits`), every tensor's name and shape against the base model (`LoRAModelShape`), and every
weight's numbers (finite, bounded entries and update norm), and returns the weights as float32
arrays. Tensors may be stored in F32, F16, BF16 or F64.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import safetensors

from tandem.platform.errors import InvalidRequestError

# The linears adapters may target, by the HF module names of the base architecture: separate
# projections (Llama, Mistral, Qwen, Gemma) or the ones a checkpoint stores fused (Phi-3).
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_CHECKPOINT_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
# A fused linear's module name where the checkpoint stores it whole (its adapter is one A/B pair).
FUSED_AS_STORED = {"qkv": "qkv_proj", "gate_up": "gate_up_proj"}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(InvalidRequestError):
    """An adapter that cannot be used (HTTP 400); the message names the problem."""


@dataclass(frozen=True)
class LoRAModelShape:
    """What adapter validation needs to know about the base model."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_size: int
    kv_size: int
    target_modules: tuple[str, ...] = SUPPORTED_TARGETS  # the base model's linears, by HF name

    @classmethod
    def from_config(cls, cfg: Any, target_modules: tuple[str, ...] = SUPPORTED_TARGETS) -> LoRAModelShape:
        return cls(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            q_size=cfg.num_attention_heads * cfg.head_dim,
            kv_size=cfg.num_key_value_heads * cfg.head_dim,
            target_modules=tuple(target_modules),
        )

    def in_out(self, module: str) -> tuple[int, int]:
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
            "qkv_proj": (h, q + 2 * kv),
            "gate_up_proj": (h, 2 * i),
        }[module]

    def fused_in_out(self, fused: str) -> tuple[int, int]:
        subs = FUSED_MODULES[fused]
        return self.in_out(subs[0])[0], sum(self.in_out(s)[1] for s in subs)


@dataclass(frozen=True)
class LoRALimits:
    """What an adapter must stay within to be accepted (checked on upload and on load).

    The numeric limits keep a tenant's adapter from producing non-finite or overflowing
    activations: PEFT adapters have scalings (`lora_alpha / r`, or `/ sqrt(r)` with rsLoRA) of
    about 0.5-4 and weights well under 1, so these bounds are orders of magnitude above any
    trained adapter and far below float16's range (65504)."""

    max_lora_rank: int = 16
    max_adapter_bytes: int = 256 << 20
    max_lora_scaling: float = 64.0  # lora_alpha / r (rsLoRA: / sqrt(r))
    max_weight_abs: float = 100.0  # any entry of lora_A, or of lora_B times the scaling
    max_update_norm: float = 1000.0  # ||scaling * B||_F * ||A||_F per module (bounds ||delta W||_2)


@dataclass
class CheckedAdapter:
    """A validated checkpoint: float32 weights as stored (the scaling is not folded in)."""

    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    # (layer, module) -> (A [r, in], B [out, r])
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(repr=False)


def check_peft_adapter(
    config: dict[str, Any] | bytes, tensors: bytes, shape: LoRAModelShape, limits: LoRALimits | None = None
) -> CheckedAdapter:
    """Validate a PEFT LoRA checkpoint against the base model and `limits` (AdapterError, a 400
    naming the problem, otherwise)."""
    limits = limits or LoRALimits()
    if isinstance(config, bytes | bytearray):
        try:
            config = json.loads(config)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise AdapterError(f"adapter_config is not valid JSON: {exc}", param="adapter_config") from exc
    if not isinstance(config, dict):
        raise AdapterError("adapter_config must be a JSON object", param="adapter_config")
    rank, scaling, targets = _check_config(config, limits, tuple(shape.target_modules))
    if len(tensors) > limits.max_adapter_bytes:
        raise AdapterError(
            f"adapter_model is {len(tensors)} bytes; the limit is {limits.max_adapter_bytes}",
            param="adapter_model",
            code="adapter_too_large",
        )
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in read_safetensors(bytes(tensors)).items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(
                f"unexpected tensor {key!r}: only LoRA A/B weights of {list(shape.target_modules)} are supported",
                param="adapter_model",
            )
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in targets:
            raise AdapterError(f"tensor {key!r} is for {module!r}, which target_modules does not list")
        if not 0 <= layer < shape.num_layers:
            raise AdapterError(f"tensor {key!r}: the base model has {shape.num_layers} layers")
        fan_in, fan_out = shape.in_out(module)
        want = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(tensor.shape) != want:
            raise AdapterError(
                f"tensor {key!r} has shape {list(tensor.shape)}; the base model needs {list(want)} (r={rank})",
                param="adapter_model",
                code="adapter_shape_mismatch",
            )
        found.setdefault((layer, module), {})[which] = tensor
    weights = {}
    for (layer, module), pair in found.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"layer {layer} {module}: lora_A and lora_B must both be present")
        _check_numbers(layer, module, pair["A"], pair["B"] * np.float32(scaling), limits)
        weights[(layer, module)] = (pair["A"], pair["B"])
    if not weights:
        raise AdapterError("adapter_model holds no LoRA weights", param="adapter_model")
    return CheckedAdapter(rank, scaling, tuple(sorted(targets)), weights)


def read_safetensors(data: bytes) -> dict[str, np.ndarray]:
    """A safetensors file's tensors as float32 arrays (safetensors' own parser checks the header)."""
    try:
        entries = safetensors.deserialize(data)
    except Exception as exc:  # safetensors raises its own error types
        raise AdapterError(
            f"adapter_model is not a valid safetensors file: {exc}", param="adapter_model"
        ) from exc
    tensors = {}
    for name, entry in entries:
        dtype, raw = entry["dtype"], entry["data"]
        if dtype == "BF16":  # numpy has no bfloat16: widen the 16 bits into a float32's top half
            values = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif dtype in _FLOAT_DTYPES:
            values = np.frombuffer(raw, dtype=_FLOAT_DTYPES[dtype]).astype(np.float32)
        else:
            raise AdapterError(
                f"tensor {name!r} is stored as {dtype}; adapters must be F32, F16, BF16 or F64",
                param="adapter_model",
            )
        tensors[name] = values.reshape(entry["shape"])
    return tensors


_FLOAT_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}


def _check_numbers(layer: int, module: str, a: np.ndarray, b_scaled: np.ndarray, limits: LoRALimits) -> None:
    """A: [r, in], B * scaling: [out, r] (float32): finite, and within `limits`."""
    where = f"layer {layer} {module}"
    for name, tensor in (("lora_A", a), ("lora_B", b_scaled)):
        if not bool(np.isfinite(tensor).all()):
            raise AdapterError(
                f"{where}: {name} holds NaN or infinite values",
                param="adapter_model",
                code="adapter_not_finite",
            )
        largest = float(np.abs(tensor).max())
        if largest > limits.max_weight_abs:
            raise AdapterError(
                f"{where}: {name} has an entry of magnitude {largest:.4g} (scaling included); the limit "
                f"is {limits.max_weight_abs:g}",
                param="adapter_model",
                code="adapter_weights_too_large",
            )
    norm = float(np.linalg.norm(a)) * float(np.linalg.norm(b_scaled))
    if not norm <= limits.max_update_norm:
        raise AdapterError(
            f"{where}: the update's norm bound ||scaling*B||*||A|| is {norm:.4g}; the limit is "
            f"{limits.max_update_norm:g}",
            param="adapter_model",
            code="adapter_weights_too_large",
        )


def _check_config(
    config: dict[str, Any], limits: LoRALimits, supported: tuple[str, ...] = SUPPORTED_TARGETS
) -> tuple[int, float, set[str]]:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(
            f"peft_type {config.get('peft_type')!r} is not supported; only LORA", param="peft_type"
        )
    for flag in ("use_dora", "fan_in_fan_out"):
        if config.get(flag):
            raise AdapterError(f"{flag}=true is not supported", param=flag)
    if config.get("bias", "none") != "none":
        raise AdapterError("bias must be 'none' (LoRA bias terms are not supported)", param="bias")
    if config.get("target_parameters"):  # PEFT's LoRA on parameters: a MoE model's stacked experts
        named = ", ".join(map(str, config["target_parameters"]))
        raise AdapterError(
            f"target_parameters ({named}) are not supported: adapters on expert weights are refused; "
            f"target the attention modules ({', '.join(supported)})",
            param="target_parameters",
        )
    for name in ("modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern"):
        if config.get(name):
            raise AdapterError(f"{name} is not supported", param=name)
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError("r must be a positive integer", param="r")
    if rank > limits.max_lora_rank:
        raise AdapterError(
            f"r={rank} is over this server's max_lora_rank={limits.max_lora_rank}",
            param="r",
            code="rank_too_large",
        )
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < math.inf:
        raise AdapterError("lora_alpha must be a finite positive number", param="lora_alpha")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    if scaling > limits.max_lora_scaling:
        raise AdapterError(
            f"lora_alpha={alpha} with r={rank} scales updates by {scaling:.4g}; the limit is "
            f"{limits.max_lora_scaling:g}",
            param="lora_alpha",
            code="adapter_scaling_too_large",
        )
    targets_raw = config.get("target_modules")
    if targets_raw == "all-linear":
        targets = set(supported)
    elif isinstance(targets_raw, list) and targets_raw and all(isinstance(t, str) for t in targets_raw):
        targets = {t.rsplit(".", 1)[-1] for t in targets_raw}
    else:
        raise AdapterError(
            "target_modules must be a list of module names (or 'all-linear')", param="target_modules"
        )
    unsupported = targets - set(supported)
    if unsupported:
        raise AdapterError(
            f"target_modules {sorted(unsupported)} are not supported for this base model; use {list(supported)}",
            param="target_modules",
        )
    return rank, float(scaling), targets
