"""How a model turns a prompt's hidden states into one embedding, as its checkpoint declares it.

A sentence-transformers folder says so in `modules.json` and its pooling module's
`config.json` (`pooling_mode_lasttoken`, `pooling_mode_mean_tokens`, `pooling_mode_cls_token`);
without one, a decoder pools its last token (the Qwen3-Embedding / e5-mistral kind) and an
encoder its first ([CLS], BERT's own pooling position). Mean and CLS pooling read the whole
prompt, which then runs in one step (`whole_prompt`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

POOLING_MODES = ("last", "mean", "cls")


@dataclass(frozen=True)
class Pooling:
    mode: str = "last"  # one of POOLING_MODES
    source: str = "default"  # where it was read: "default" or the pooling module's config path

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling mode {self.mode!r} is not one of {POOLING_MODES}")

    @property
    def whole_prompt(self) -> bool:
        """The pooled state reads every prompt row: the prompt runs in one step."""
        return self.mode != "last"


def read_pooling(folder: str | Path, *, encoder: bool) -> Pooling:
    """The pooling a checkpoint folder declares (sentence-transformers' modules), else the
    default for its kind. A declared mode this engine does not have raises `ValueError`."""
    root = Path(folder)
    modules_path = root / "modules.json"
    if modules_path.is_file():
        for module in json.loads(modules_path.read_text()):
            if str(module.get("type", "")).endswith("Pooling"):
                config_path = root / module.get("path", "") / "config.json"
                if config_path.is_file():
                    return Pooling(_mode_of(json.loads(config_path.read_text())), str(config_path))
    return Pooling("cls" if encoder else "last")


def _mode_of(config: dict[str, object]) -> str:
    modes = {
        "pooling_mode_lasttoken": "last",
        "pooling_mode_mean_tokens": "mean",
        "pooling_mode_cls_token": "cls",
    }
    chosen = [mode for key, mode in modes.items() if config.get(key)]
    if len(chosen) != 1:
        others = [key for key, value in config.items() if key.startswith("pooling_mode") and value]
        raise ValueError(f"pooling {others} is not supported: one of {list(modes)} is")
    return chosen[0]
