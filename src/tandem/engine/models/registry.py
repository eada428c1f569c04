"""The architectures the engine computes, found by a checkpoint's `model_type` / `architectures`.

An architecture module (`llama.py`, ...) describes itself as an `Architecture` and registers it;
the loader asks `architecture_for(config)` and uses nothing else of the module. A config whose
`model_type` no entry claims is refused with a `ModelLoadError` listing the supported ones. The
entry's `check_config` refuses config keys that change the maths and are not implemented, and
`tensor_names` lists every checkpoint tensor the module consumes (any other is refused by name).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.engine.lora.checkpoint import SUPPORTED_TARGETS
from tandem.engine.models.hf_config import HFConfig
from tandem.platform.errors import ModelLoadError

if TYPE_CHECKING:
    from tandem.engine.models.interface import CausalLM, LayerKV, ModelConfig

# Modules that register the built-in architectures (imported on first lookup).
BUILTIN_MODULES = (
    "tandem.engine.models.llama",
    "tandem.engine.models.mistral",
    "tandem.engine.models.qwen",
    "tandem.engine.models.gemma",
    "tandem.engine.models.phi3",
    "tandem.engine.models.moe",
    "tandem.engine.models.deepseek",
    "tandem.engine.models.bert",
)


@dataclass(frozen=True)
class Architecture:
    name: str
    model_types: tuple[str, ...]  # config.json `model_type` values it computes
    hf_classes: tuple[str, ...]  # config.json `architectures` entries it computes whatever the type
    check_config: Callable[[HFConfig], None]  # raises ModelLoadError naming a key it cannot compute
    parse_config: Callable[[HFConfig], ModelConfig]  # from an HF config dict (checked)
    model_class: Callable[[Any, int], CausalLM]  # (config, max_positions) -> the module (built on 'meta')
    tensor_names: Callable[[Any, str], set[str]]  # (config, prefix) -> every tensor name it consumes
    kv_layers: Callable[[Any], list[LayerKV]]  # config -> each layer's KV (what the cache is sized by)
    # The HF module names of its linears that PEFT LoRA adapters target (`lora_checkpoint`):
    # Llama's separate projections unless the architecture stores some fused (Phi-3's qkv_proj).
    lora_targets: tuple[str, ...] = SUPPORTED_TARGETS
    # Checkpoint tensors the architecture knowingly leaves unread (config, name) -> bool: parts
    # that are not in the model's forward pass (GLM-4.5's and DeepSeek-V3's multi-token-prediction
    # layers, for speculation). None: every tensor must be consumed.
    unused_tensors: Callable[[Any, str], bool] | None = None
    # A bidirectional encoder (BERT): it embeds and does not generate (`encoder_setup.py`)
    encoder: bool = False

    def unused_for(self, config: Any) -> Callable[[str], bool] | None:
        """`unused_tensors` bound to a parsed config (None: every tensor must be consumed)."""
        rule = self.unused_tensors
        return None if rule is None else (lambda name: rule(config, name))


_ARCHITECTURES: dict[str, Architecture] = {}


def register(architecture: Architecture, *, replace: bool = False) -> None:
    """Add an architecture. A model type another entry already claims is an error unless
    `replace` (then that entry is dropped)."""
    for other in list(_ARCHITECTURES.values()):
        if other.name == architecture.name or set(other.model_types) & set(architecture.model_types):
            if not replace:
                raise ValueError(f"architecture {architecture.name!r} overlaps registered {other.name!r}")
            del _ARCHITECTURES[other.name]
    _ARCHITECTURES[architecture.name] = architecture


def unregister(name: str) -> None:
    _ARCHITECTURES.pop(name, None)


def registered() -> list[Architecture]:
    _load_builtins()
    return list(_ARCHITECTURES.values())


def architecture_for(config: HFConfig) -> Architecture:
    """The entry that computes an HF config: by `model_type` (default "llama"), else by a class
    named in `architectures`. Raises `ModelLoadError` when none does."""
    _load_builtins()
    model_type = config.get("model_type", "llama")
    for architecture in _ARCHITECTURES.values():
        if model_type in architecture.model_types:
            return architecture
    classes = set(config.get("architectures") or [])
    for architecture in _ARCHITECTURES.values():
        if classes & set(architecture.hf_classes):
            return architecture
    supported = sorted(t for a in _ARCHITECTURES.values() for t in a.model_types)
    raise ModelLoadError(
        f"model_type {model_type!r} is not supported; supported: {', '.join(supported)} "
        "(not implemented: refused rather than answered inexactly)",
        param="model",
    )


def _load_builtins() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
