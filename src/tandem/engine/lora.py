"""LoRA adapters: PEFT parsing and validation, a CPU cache, and a fixed number of device slots.

An adapter is a PEFT LoRA checkpoint (`adapter_config.json` + `adapter_model.safetensors`, never
pickle). `parse_peft_adapter` validates it against the base model (`LoRAModelShape`) and limits
and converts it to our fused layout: per layer, one (A, B) pair for each fused linear (`qkv`, `o`,
`gate_up`, `down`), sub-modules' A stacked along the rank, B block-diagonal with the LoRA scaling
folded in (see `kernels/lora.py`).

`LoRAManager` keeps up to `max_cpu_loras` parsed adapters (LRU, adapters with live requests are
never evicted) and `max_loras` device slots. The scheduler never runs more than `max_loras`
distinct adapters at once, so `slots_for_step` always finds room by evicting the least recently
used slot that the step does not need.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.kernels.lora import LoRAGroups, lora_apply
from tandem.platform.errors import InvalidRequestError

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
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

    @classmethod
    def from_config(cls, cfg: Any) -> LoRAModelShape:  # cfg: LlamaConfig
        return cls(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            q_size=cfg.num_attention_heads * cfg.head_dim,
            kv_size=cfg.num_key_value_heads * cfg.head_dim,
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
class LoRAAdapter:
    name: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    # (layer, fused module) -> (A [R_f, in], B [out_f, R_f] with scaling folded in); R_f = rank x subs
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def num_bytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values()
        )


def parse_peft_adapter(
    name: str,
    config: dict[str, Any] | bytes,
    tensors: dict[str, torch.Tensor] | bytes,
    shape: LoRAModelShape,
    limits: LoRALimits | None = None,
) -> LoRAAdapter:
    """Validate a PEFT LoRA checkpoint against the base model and convert it to the fused layout.
    `tensors` is a safetensors file's bytes (or its loaded dict); nothing is ever unpickled."""
    limits = limits or LoRALimits()
    if isinstance(config, bytes | bytearray):
        try:
            config = json.loads(config)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise AdapterError(f"adapter_config is not valid JSON: {exc}", param="adapter_config") from exc
    if not isinstance(config, dict):
        raise AdapterError("adapter_config must be a JSON object", param="adapter_config")
    rank, scaling, targets = _check_config(config, limits)
    if isinstance(tensors, bytes | bytearray):
        if len(tensors) > limits.max_adapter_bytes:
            raise AdapterError(
                f"adapter_model is {len(tensors)} bytes; the limit is {limits.max_adapter_bytes}",
                param="adapter_model",
                code="adapter_too_large",
            )
        from safetensors.torch import load as load_safetensors

        try:
            tensors = load_safetensors(bytes(tensors))
        except Exception as exc:  # safetensors raises its own error types
            raise AdapterError(
                f"adapter_model is not a valid safetensors file: {exc}", param="adapter_model"
            ) from exc
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(
                f"unexpected tensor {key!r}: only LoRA A/B weights of {list(SUPPORTED_TARGETS)} are supported",
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
        found.setdefault((layer, module), {})[which] = tensor.float()
    for (layer, module), pair in found.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"layer {layer} {module}: lora_A and lora_B must both be present")
        _check_numbers(layer, module, pair["A"], pair["B"] * scaling, limits)
    if not found:
        raise AdapterError("adapter_model holds no LoRA weights", param="adapter_model")
    return LoRAAdapter(name, rank, scaling, tuple(sorted(targets)), _fuse(found, rank, scaling, shape))


def _check_numbers(layer: int, module: str, a: torch.Tensor, b_scaled: torch.Tensor, limits: LoRALimits) -> None:
    """A: [r, in], B * scaling: [out, r] (float32): finite, and within `limits`."""
    where = f"layer {layer} {module}"
    for name, tensor in (("lora_A", a), ("lora_B", b_scaled)):
        if not bool(torch.isfinite(tensor).all()):
            raise AdapterError(
                f"{where}: {name} holds NaN or infinite values", param="adapter_model", code="adapter_not_finite"
            )
        largest = float(tensor.abs().max())
        if largest > limits.max_weight_abs:
            raise AdapterError(
                f"{where}: {name} has an entry of magnitude {largest:.4g} (scaling included); the limit "
                f"is {limits.max_weight_abs:g}",
                param="adapter_model",
                code="adapter_weights_too_large",
            )
    norm = float(torch.linalg.matrix_norm(a)) * float(torch.linalg.matrix_norm(b_scaled))
    if not norm <= limits.max_update_norm:
        raise AdapterError(
            f"{where}: the update's norm bound ||scaling*B||*||A|| is {norm:.4g}; the limit is "
            f"{limits.max_update_norm:g}",
            param="adapter_model",
            code="adapter_weights_too_large",
        )


def _check_config(config: dict[str, Any], limits: LoRALimits) -> tuple[int, float, set[str]]:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(
            f"peft_type {config.get('peft_type')!r} is not supported; only LORA", param="peft_type"
        )
    for flag in ("use_dora", "fan_in_fan_out"):
        if config.get(flag):
            raise AdapterError(f"{flag}=true is not supported", param=flag)
    if config.get("bias", "none") != "none":
        raise AdapterError("bias must be 'none' (LoRA bias terms are not supported)", param="bias")
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
        targets = set(SUPPORTED_TARGETS)
    elif isinstance(targets_raw, list) and targets_raw and all(isinstance(t, str) for t in targets_raw):
        targets = {t.rsplit(".", 1)[-1] for t in targets_raw}
    else:
        raise AdapterError(
            "target_modules must be a list of module names (or 'all-linear')", param="target_modules"
        )
    unsupported = targets - set(SUPPORTED_TARGETS)
    if unsupported:
        raise AdapterError(
            f"target_modules {sorted(unsupported)} are not supported; use {list(SUPPORTED_TARGETS)}",
            param="target_modules",
        )
    return rank, float(scaling), targets


def _fuse(
    found: dict[tuple[int, str], dict[str, torch.Tensor]], rank: int, scaling: float, shape: LoRAModelShape
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    fused_weights = {}
    for layer in range(shape.num_layers):
        for fused, subs in FUSED_MODULES.items():
            present = [s for s in subs if (layer, s) in found]
            if not present:
                continue
            fan_in, fan_out = shape.fused_in_out(fused)
            a = torch.zeros(rank * len(subs), fan_in)
            b = torch.zeros(fan_out, rank * len(subs))
            row = 0
            for index, sub in enumerate(subs):
                sub_out = shape.in_out(sub)[1]
                if sub in present:
                    cols = slice(index * rank, (index + 1) * rank)
                    a[cols] = found[(layer, sub)]["A"]
                    b[row : row + sub_out, cols] = found[(layer, sub)]["B"] * scaling
                row += sub_out
            fused_weights[(layer, fused)] = (a, b)
    return fused_weights


class LoRASlots:
    """Device tensors holding `max_loras` adapters per fused linear, zero-padded to the max rank."""

    def __init__(
        self, shape: LoRAModelShape, max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.max_loras = max_loras
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(shape.num_layers):
            for fused, subs in FUSED_MODULES.items():
                fan_in, fan_out = shape.fused_in_out(fused)
                ranks = max_rank * len(subs)
                self.a[(layer, fused)] = torch.zeros(max_loras, ranks, fan_in, device=device, dtype=dtype)
                self.b[(layer, fused)] = torch.zeros(max_loras, fan_out, ranks, device=device, dtype=dtype)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        for key, a_slots in self.a.items():
            b_slots = self.b[key]
            a_slots[slot].zero_()
            b_slots[slot].zero_()
            weights = adapter.weights.get(key)
            if weights is None:
                continue
            a, b = weights
            a_slots[slot, : a.shape[0]] = a.to(a_slots.dtype)
            b_slots[slot, :, : b.shape[1]] = b.to(b_slots.dtype)


class LoRAManager:
    def __init__(
        self,
        shape: LoRAModelShape,
        *,
        max_loras: int,
        max_cpu_loras: int,
        limits: LoRALimits,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.shape = shape
        self.limits = limits
        self.max_cpu_loras = max_cpu_loras
        self.slots = LoRASlots(shape, max_loras, limits.max_lora_rank, device, dtype)
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()  # CPU cache, LRU order
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # device slots, LRU order
        self.num_live_requests: dict[str, int] = {}
        self.num_slot_loads = 0
        self._lock = threading.RLock()  # callers' threads add/remove; the engine thread runs steps

    def add(self, adapter: LoRAAdapter) -> None:
        """Register `adapter` (replacing one of the same name that no request uses)."""
        with self._lock:
            if adapter.name in self.adapters and self.num_live_requests.get(adapter.name):
                raise AdapterError(f"adapter {adapter.name!r} is in use; use a new name to replace it")
            self._drop_slot(adapter.name)
            self.adapters[adapter.name] = adapter
            self.adapters.move_to_end(adapter.name)
            while len(self.adapters) > self.max_cpu_loras:
                idle = next((n for n in self.adapters if not self.num_live_requests.get(n)), None)
                if idle is None:
                    break
                self.remove(idle)

    def remove(self, name: str) -> bool:
        """Forget `name` (False when requests still use it: the caller may retry later)."""
        with self._lock:
            if self.num_live_requests.get(name):
                return False
            self.adapters.pop(name, None)
            self._drop_slot(name)
            return True

    def _drop_slot(self, name: str) -> None:
        self.slot_of.pop(name, None)

    def has(self, name: str) -> bool:
        return name in self.adapters

    def acquire(self, name: str) -> None:
        with self._lock:
            if name not in self.adapters:
                raise AdapterError(
                    f"LoRA adapter {name!r} is not loaded", param="model", code="model_not_found"
                )
            self.num_live_requests[name] = self.num_live_requests.get(name, 0) + 1

    def release(self, name: str) -> None:
        with self._lock:
            count = self.num_live_requests.get(name, 0) - 1
            if count <= 0:
                self.num_live_requests.pop(name, None)
            else:
                self.num_live_requests[name] = count

    def slots_for_step(self, names: set[str]) -> dict[str, int]:
        """Device slot of each adapter a step uses, loading missing ones into the least recently
        used slots the step does not need. At most `max_loras` names (the scheduler's limit)."""
        with self._lock:
            if len(names) > self.slots.max_loras:
                raise RuntimeError(f"{len(names)} adapters in one step; max_loras is {self.slots.max_loras}")
            for name in names:
                if name in self.slot_of:
                    self.slot_of.move_to_end(name)
            for name in names:
                if name in self.slot_of:
                    continue
                used = set(self.slot_of.values())
                free = next((s for s in range(self.slots.max_loras) if s not in used), None)
                if free is None:
                    victim = next(n for n in self.slot_of if n not in names)
                    free = self.slot_of.pop(victim)
                self.slots.load(free, self.adapters[name])
                self.slot_of[name] = free
                self.num_slot_loads += 1
            return {name: self.slot_of[name] for name in names}


class LoRAStep:
    """The `LoRAContext` the model calls for one step: rows grouped by slot, and the slots."""

    def __init__(self, slots: LoRASlots, token_slots: torch.Tensor) -> None:  # token_slots: [T]
        self.slots = slots
        self.groups = LoRAGroups.from_token_slots(token_slots, num_slots=slots.max_loras)

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        key = (layer, module)
        return lora_apply(y, x, self.slots.a[key], self.slots.b[key], self.groups)
