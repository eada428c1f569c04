"""What the Llama-family module computes exactly, and the refusal of everything else (no torch).

A checkpoint is served only when every config key that changes the maths has a value the model
module implements, and every tensor in it is consumed by a module (or is a known derived buffer).
Anything else raises `ModelLoadError` naming the key or the tensors: a model we would answer with
wrong tokens is refused, never silently approximated.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tandem.platform.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral")
SUPPORTED_ACTIVATIONS = ("silu", "swish")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")

# Tensors some checkpoints carry that are derived from the config, not weights (old HF Llama
# checkpoints saved each layer's RoPE inverse frequencies).
_DERIVED_TENSOR = re.compile(r"^(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")

# Keys whose only exact value here is "off"; any other value changes the maths.
_MUST_BE_OFF = (
    "attention_bias",
    "mlp_bias",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "use_qk_norm",
)


def _refuse(message: str) -> ModelLoadError:
    return ModelLoadError(message + " (not implemented: refused rather than answered inexactly)", param="model")


def rope_settings(cfg: dict[str, Any]) -> tuple[float | None, dict[str, Any] | None, str]:
    """(rope_theta, the scaling dict or None, which key it came from) from either layout:
    `rope_scaling` + `rope_theta`, or transformers 5's `rope_parameters`."""
    theta = cfg.get("rope_theta")
    scaling = cfg.get("rope_scaling")
    key = "rope_scaling"
    params = cfg.get("rope_parameters")
    if params:
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", params.get("type", "default")) != "default":
            scaling, key = params, "rope_parameters"
    return theta, scaling, key


def check_config(cfg: dict[str, Any]) -> None:
    """Raise `ModelLoadError` for a config the Llama module would compute inexactly.

    Refused (the model type is the registry's to match, `registry.architecture_for`): biases, soft-capping, q/k norms, an activation other than SiLU, partial
    rotary embeddings, a sliding window shorter than the context, and rope types other than
    default / linear / llama3 (and dynamic NTK, which equals the default within the original
    context, only when that context is the whole one)."""
    for key in _MUST_BE_OFF:
        if cfg.get(key):
            raise _refuse(f"config key {key}={cfg[key]!r} is not supported")
    for key in ("hidden_act", "hidden_activation"):
        act = cfg.get(key)
        if act is not None and act not in SUPPORTED_ACTIVATIONS:
            raise _refuse(f"config key {key}={act!r} is not supported; supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
    partial = cfg.get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0:
        raise _refuse(f"config key partial_rotary_factor={partial!r} is not supported (only 1.0)")
    max_positions = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    if window is not None and cfg.get("use_sliding_window", True) and int(window) < max_positions:
        raise _refuse(
            f"config key sliding_window={window} is shorter than the context "
            f"(max_position_embeddings={max_positions}); sliding-window attention is not supported"
        )
    _, scaling, key = rope_settings(cfg)
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise _refuse(
                f"config key {key}.rope_type={rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        original = scaling.get("original_max_position_embeddings")
        if rope_type == "dynamic" and original is not None and int(original) < max_positions:
            raise _refuse(
                f"config key {key}.rope_type='dynamic' beyond its original context "
                f"({original} < max_position_embeddings={max_positions}) is not supported"
            )
        required = {"linear": ("factor",), "llama3": (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"
        )}.get(rope_type, ())
        missing = [name for name in required if scaling.get(name) is None]
        if missing:
            raise ModelLoadError(f"config key {key} ({rope_type}) lacks {', '.join(missing)}", param="model")


def expected_tensor_names(num_layers: int, *, prefix: str = "model.") -> set[str]:
    """Every tensor name the Llama module consumes (HF names; `lm_head.weight` included, which a
    tied checkpoint may omit)."""
    names = {f"{prefix}embed_tokens.weight", f"{prefix}norm.weight", "lm_head.weight"}
    per_layer = (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    )
    for index in range(num_layers):
        names.update(f"{prefix}layers.{index}.{name}" for name in per_layer)
    return names


def tensor_prefix(names: Iterable[str]) -> str:
    """"model." when the checkpoint's decoder tensors carry it (HF's usual layout), else ""."""
    return "model." if any(n.startswith("model.") for n in names) else ""


def check_tensor_names(names: Iterable[str], expected: Callable[[str], set[str]], *, source: str) -> None:
    """Raise `ModelLoadError` naming the checkpoint tensors no module consumes (a bias, a norm,
    an extra layer...): dropping them would change the answers. `expected(prefix)`: every name
    the architecture consumes."""
    names = list(names)
    expected_names = expected(tensor_prefix(names))
    unused = sorted(n for n in names if n not in expected_names and not _DERIVED_TENSOR.match(n))
    if unused:
        shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
        raise _refuse(f"{source}: {len(unused)} checkpoint tensor(s) no module consumes: {shown}")


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's weight files (safetensors only: pickle checkpoints are never loaded)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{folder}: no *.safetensors weights (pickle checkpoints are not loaded)", param="model"
        )
    return files


def safetensors_names(files: list[Path]) -> list[str]:
    """Tensor names from the files' headers (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    names: list[str] = []
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as handle:
                names.extend(handle.keys())
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"{file}: corrupt safetensors file ({exc})", param="model") from exc
    return names
