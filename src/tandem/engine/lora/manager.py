"""LoRA adapters in the engine: the fused layout, a CPU cache, and a fixed number of device slots.

An adapter is a PEFT LoRA checkpoint (`adapter_config.json` + `adapter_model.safetensors`, never
pickle). `parse_peft_adapter` validates it (lora_checkpoint.py, shared with the API processes)
and converts it to our fused layout: per layer, one (A, B) pair for each fused linear (`qkv`, `o`,
`gate_up`, `down`), sub-modules' A stacked along the rank, B block-diagonal with the LoRA scaling
folded in (see `kernels/lora.py`).

`LoRAManager` keeps up to `max_cpu_loras` parsed adapters (LRU, adapters with live requests are
never evicted) and `max_loras` device slots. The scheduler never runs more than `max_loras`
distinct adapters at once, so `slots_for_step` always finds room by evicting the least recently
used slot that the step does not need.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from tandem.engine.lora.checkpoint import (
    FUSED_AS_STORED,
    FUSED_MODULES,
    SUPPORTED_TARGETS,
    AdapterError,
    LoRALimits,
    LoRAModelShape,
    check_peft_adapter,
)
from tandem.kernels.lora import LoRAGroups, lora_apply

__all__ = [
    "SUPPORTED_TARGETS",
    "AdapterError",
    "LoRAAdapter",
    "LoRALimits",
    "LoRAManager",
    "LoRAModelShape",
    "parse_peft_adapter",
]


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
    config: dict[str, object] | bytes,
    tensors: bytes,
    shape: LoRAModelShape,
    limits: LoRALimits | None = None,
) -> LoRAAdapter:
    """Validate a PEFT LoRA checkpoint (`check_peft_adapter`) and convert it to the fused layout."""
    checked = check_peft_adapter(config, tensors, shape, limits)
    found = {key: (torch.from_numpy(a), torch.from_numpy(b)) for key, (a, b) in checked.weights.items()}
    fused = _fuse(found, checked.rank, checked.scaling, shape)
    return LoRAAdapter(name, checked.rank, checked.scaling, checked.target_modules, fused)


def _fuse(
    found: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
    rank: int,
    scaling: float,
    shape: LoRAModelShape,
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    fused_weights = {}
    for layer in range(shape.num_layers):
        for fused, subs in FUSED_MODULES.items():
            fan_in, fan_out = shape.fused_in_out(fused)
            a = torch.zeros(rank * len(subs), fan_in)
            b = torch.zeros(fan_out, rank * len(subs))
            stored = FUSED_AS_STORED.get(fused)
            if stored is not None and (layer, stored) in found:  # one pair for the whole fused linear
                whole_a, whole_b = found[(layer, stored)]
                a[:rank] = whole_a
                b[:, :rank] = whole_b * scaling
                fused_weights[(layer, fused)] = (a, b)
                continue
            present = [s for s in subs if (layer, s) in found]
            if not present:
                continue
            row = 0
            for index, sub in enumerate(subs):
                sub_out = shape.in_out(sub)[1]
                if sub in present:
                    cols = slice(index * rank, (index + 1) * rank)
                    sub_a, sub_b = found[(layer, sub)]
                    a[cols] = sub_a
                    b[row : row + sub_out, cols] = sub_b * scaling
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
