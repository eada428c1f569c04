"""`EngineAdapters`: the LoRA adapters one engine serves, by name, over its `LoRAManager`.

Registration validates a PEFT checkpoint (safetensors only) against the model's shape and
limits; a request holds its adapter from admission to finish (`acquire` / `release`). With
LoRA off (no manager) every call that needs an adapter is refused naming the parameter.
"""

from __future__ import annotations

from pathlib import Path

from tandem.engine.lora.manager import LoRAAdapter, LoRAManager, parse_peft_adapter
from tandem.platform.errors import InvalidRequestError, NotFoundError


class EngineAdapters:
    def __init__(self, manager: LoRAManager | None) -> None:
        self.manager = manager

    @property
    def enabled(self) -> bool:
        return self.manager is not None

    def has(self, name: str) -> bool:
        return self.manager is not None and self.manager.has(name)

    def check(self, name: str) -> None:
        """Raise unless adapter `name` is loaded (an `InvalidRequestError` when LoRA is off)."""
        if self.manager is None:
            raise InvalidRequestError(
                "this engine serves no LoRA adapters; start it with enable_lora=True", param="model"
            )
        if not self.manager.has(name):
            raise NotFoundError(f"LoRA adapter {name!r} is not loaded", param="model", code="model_not_found")

    def acquire(self, name: str) -> None:
        """Hold adapter `name` for a request (checked first); `release` gives it back."""
        self.check(name)
        assert self.manager is not None
        self.manager.acquire(name)

    def release(self, name: str) -> None:
        if self.manager is not None:
            self.manager.release(name)

    def add(self, name: str, source: str | LoRAAdapter) -> LoRAAdapter:
        """Register an adapter by name: a PEFT folder (adapter_config.json +
        adapter_model.safetensors) or an already parsed `LoRAAdapter`. Thread-safe."""
        manager = self._enabled()
        if isinstance(source, LoRAAdapter):
            manager.add(source)
            return source
        folder = Path(source)
        config_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
        if not config_path.is_file() or not weights_path.is_file():
            raise NotFoundError(
                f"{folder} must hold adapter_config.json and adapter_model.safetensors "
                "(PEFT save_pretrained output; .bin checkpoints are refused)",
                param="lora",
            )
        return self.add_checkpoint(name, config_path.read_bytes(), weights_path.read_bytes())

    def add_checkpoint(self, name: str, config: bytes, weights: bytes) -> LoRAAdapter:
        """Register an adapter from a PEFT checkpoint's two files' bytes (validated). Thread-safe."""
        manager = self._enabled()
        adapter = parse_peft_adapter(name, config, weights, manager.shape, manager.limits)
        manager.add(adapter)
        return adapter

    def remove(self, name: str) -> bool:
        return self.manager.remove(name) if self.manager is not None else False

    def names(self) -> list[str]:
        return list(self.manager.adapters) if self.manager is not None else []

    def info(self) -> dict[str, object]:
        """What an API needs to validate adapter uploads for this engine."""
        if self.manager is None:
            return {"enabled": False}
        return {
            "enabled": True,
            "max_lora_rank": self.manager.limits.max_lora_rank,
            "shape": dict(self.manager.shape.__dict__),
        }

    def _enabled(self) -> LoRAManager:
        if self.manager is None:
            raise InvalidRequestError("LoRA is not enabled; pass enable_lora=True", param="enable_lora")
        return self.manager
