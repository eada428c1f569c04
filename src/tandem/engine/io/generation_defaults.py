"""A checkpoint's own generation defaults: what a request's unset sampling fields become.

Read from an HF folder's `generation_config.json` (a GGUF file's `general.sampling.*` keys are
written there when it is converted, `models/loader.py`), the keys vLLM applies with
`--generation-config auto`: `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and
`max_new_tokens` (the default `max_tokens`). `do_sample` is not read (as in vLLM): a checkpoint
whose config says `do_sample: false` but sets no temperature samples at temperature 1.
Contract: a field the checkpoint does not set stays None and the request keeps the neutral value
(`SamplingParams`' own default); an out-of-range value is refused when the model loads.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from tandem.engine.sampling_params import SamplingParams
from tandem.platform.errors import InvalidRequestError, ModelLoadError

# generation_config.json key -> SamplingParams field
_HF_KEYS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
}  # fmt: skip
# GGUF metadata key (llama.cpp's `general.sampling.*`) -> generation_config.json key
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature", "general.sampling.top_p": "top_p", "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p", "general.sampling.penalty_repeat": "repetition_penalty",
}  # fmt: skip
# The SamplingParams fields a checkpoint's defaults fill when a request leaves them unset
# (`max_tokens` is resolved with the context instead: `InputProcessor`).
DEFAULTABLE = frozenset(_HF_KEYS.values()) - {"max_tokens"}


@dataclass(frozen=True)
class GenerationDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    @classmethod
    def from_hf_folder(cls, folder: Path) -> GenerationDefaults:
        path = folder / "generation_config.json"
        if not path.is_file():
            return cls()
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path}: invalid JSON ({exc})", param="model") from exc
        values = {field: raw[key] for key, field in _HF_KEYS.items() if raw.get(key) is not None}
        defaults = cls(**values)
        try:  # the same checks as a request's
            SamplingParams(**values)
        except InvalidRequestError as exc:
            raise ModelLoadError(f"{path}: {exc}", param="model") from exc
        return defaults

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> GenerationDefaults:
        """A GGUF file's `general.sampling.*` keys (llama.cpp's per-model sampling defaults)."""
        values = {
            _HF_KEYS[key]: fields[gguf_key]
            for gguf_key, key in GGUF_SAMPLING_KEYS.items()
            if gguf_key in fields
        }
        return cls(**values)

    def to_hf_dict(self) -> dict[str, object]:
        """As generation_config.json keys (the fields set)."""
        names = {field: key for key, field in _HF_KEYS.items()}
        return {names[name]: value for name, value in self.as_dict().items()}

    def as_dict(self) -> dict[str, object]:
        """The fields the checkpoint sets (for `/v1/models`, stats and the start-up log)."""
        return {name: value for name, value in asdict(self).items() if value is not None}

    def apply(self, params: SamplingParams) -> SamplingParams:
        """`params` with the fields it leaves to the model (`SamplingParams.model_defaults`) set
        from these defaults where the checkpoint has one."""
        if not params.model_defaults:
            return params
        names = params.model_defaults & DEFAULTABLE
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name in names}
        return params.with_values({k: v for k, v in values.items() if v is not None})
