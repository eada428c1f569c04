"""What the architecture modules compute exactly, and the refusal of everything else (no torch).

A checkpoint is served only when every config key that changes the maths has a value its module
implements, and every tensor in it is consumed by a module (or is a known derived buffer).
Anything else raises `ModelLoadError` naming the key or the tensors: a model we would answer with
wrong tokens is refused, never silently approximated. The family modules (`llama.py`,
`qwen.py`, `gemma.py`, ...) call `check_common` with what they implement and read the shared
fields with `decoder_fields`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

from tandem.engine.models.hf_config import HFConfig
from tandem.platform.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama",)
SUPPORTED_ACTIVATIONS = ("silu", "swish")
GELU_TANH_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}

# Tensors some checkpoints carry that are derived from the config, not weights (old HF Llama
# checkpoints saved each layer's RoPE inverse frequencies).
_DERIVED_TENSOR = re.compile(r"^(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")

# Keys whose only value Llama computes is "off"; a family that implements one says so
# (`check_common(implemented=...)`).
MATH_KEYS = (
    "attention_bias",
    "mlp_bias",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "use_qk_norm",
)


def _refuse(message: str) -> ModelLoadError:
    return ModelLoadError(
        message + " (not implemented: refused rather than answered inexactly)", param="model"
    )


def rope_settings(
    cfg: HFConfig, layer_type: str = "full_attention"
) -> tuple[float | None, dict[str, Any] | None, str]:
    """(rope_theta, the scaling dict or None, which key it came from) from either layout:
    `rope_scaling` + `rope_theta`, or transformers 5's `rope_parameters` (per layer type where it
    is keyed by layer type, as Gemma 3's is)."""
    theta = cfg.get("rope_theta")
    scaling = cfg.get("rope_scaling")
    key = "rope_scaling"
    params = cfg.get("rope_parameters")
    if params and isinstance(params.get(layer_type), dict):
        params, key = params[layer_type], f"rope_parameters.{layer_type}"
    elif params:
        key = "rope_parameters"
    if params:
        theta = params.get("rope_theta", theta)
        scaling = params if params.get("rope_type", params.get("type", "default")) != "default" else None
    elif key == "rope_scaling" and scaling is not None:
        scaling = dict(scaling)
    if scaling is not None and scaling.get("original_max_position_embeddings") is None:
        original = cfg.get("original_max_position_embeddings")  # Phi-3 states it at the top level
        if original is not None:
            scaling = {**scaling, "original_max_position_embeddings": original}
    return theta, scaling, key


def check_rope(cfg: HFConfig, layer_type: str = "full_attention", *, partial_rotary: bool = False) -> None:
    """Refuse rope types and parameters the rotary tables do not compute exactly (HF's values);
    a partial rotary factor only where the family implements it (`partial_rotary`)."""
    max_positions = int(cfg.get("max_position_embeddings", 2048))
    _, scaling, key = rope_settings(cfg, layer_type)
    if not scaling:
        return
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _refuse(
            f"config key {key}.rope_type={rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = scaling.get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0 and not partial_rotary:
        raise _refuse(f"config key {key}.partial_rotary_factor={partial!r} is not supported (only 1.0)")
    original = scaling.get("original_max_position_embeddings")
    if rope_type == "dynamic" and original is not None and int(original) < max_positions:
        raise _refuse(
            f"config key {key}.rope_type='dynamic' beyond its original context "
            f"({original} < max_position_embeddings={max_positions}) is not supported"
        )
    missing = [name for name in _ROPE_REQUIRED.get(rope_type, ()) if scaling.get(name) is None]
    if missing:
        raise ModelLoadError(f"config key {key} ({rope_type}) lacks {', '.join(missing)}", param="model")


def check_common(
    cfg: HFConfig,
    *,
    implemented: Collection[str] = (),
    activations: Collection[str] = SUPPORTED_ACTIVATIONS,
    sliding_window: bool = False,
    partial_rotary: bool = False,
) -> None:
    """Raise `ModelLoadError` for a config a family module would compute inexactly: a key of
    `MATH_KEYS` set that the family does not list in `implemented`, an activation not in
    `activations`, partial rotary embeddings, a sliding window shorter than the context when the
    family has none, and rope types or parameters `check_rope` refuses."""
    for key in MATH_KEYS:
        if cfg.get(key) and key not in implemented:
            raise _refuse(f"config key {key}={cfg[key]!r} is not supported")
    for key in ("hidden_act", "hidden_activation"):
        act = cfg.get(key)
        if act is not None and act not in activations:
            raise _refuse(f"config key {key}={act!r} is not supported; supported: {', '.join(activations)}")
    partial = cfg.get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0 and not partial_rotary:
        raise _refuse(f"config key partial_rotary_factor={partial!r} is not supported (only 1.0)")
    max_positions = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    if (
        not sliding_window
        and window is not None
        and cfg.get("use_sliding_window", True)
        and int(window) < max_positions
    ):
        raise _refuse(
            f"config key sliding_window={window} is shorter than the context "
            f"(max_position_embeddings={max_positions}); sliding-window attention is not supported "
            f"for model_type {cfg.get('model_type', 'llama')!r}"
        )
    check_rope(cfg, partial_rotary=partial_rotary)


def check_config(cfg: HFConfig) -> None:
    """Raise `ModelLoadError` for a config the Llama module would compute inexactly (Llama's
    `attention_bias` and `mlp_bias` are computed; soft-capping, q/k norms, activations other than
    SiLU, partial rotary embeddings and sliding windows are not)."""
    check_common(cfg, implemented=("attention_bias", "mlp_bias"))


def decoder_fields(cfg: HFConfig, *, default_eps: float = 1e-5) -> dict[str, Any]:
    """The `DecoderConfig` fields every family reads the same way from an HF config dict."""
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    eos = cfg.get("eos_token_id")
    rope_theta, rope_scaling, _ = rope_settings(cfg)
    return {
        "vocab_size": int(cfg["vocab_size"]),
        "hidden_size": hidden,
        "intermediate_size": int(cfg["intermediate_size"]),
        "num_hidden_layers": int(cfg["num_hidden_layers"]),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or num_heads),
        "head_dim": int(cfg.get("head_dim") or hidden // num_heads),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", default_eps)),
        "rope_theta": float(rope_theta or 10000.0),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(cfg.get("max_position_embeddings", 2048)),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_ids": [eos] if isinstance(eos, int) else list(eos or []),
    }


def layer_windows(cfg: HFConfig, default_types: list[str]) -> list[int | None] | None:
    """Each layer's sliding window from `layer_types` ("sliding_attention" / "full_attention"),
    or `default_types` (the family's rule) when the config has none; None when no layer slides."""
    window = cfg.get("sliding_window")
    if window is None:
        return None
    types = cfg.get("layer_types") or default_types
    if len(types) != int(cfg["num_hidden_layers"]):
        raise ModelLoadError(
            f"config key layer_types has {len(types)} entries, expected one per layer", param="model"
        )
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise _refuse(f"config key layer_types: {', '.join(map(repr, unknown))} is not supported")
    windows = [int(window) if kind == "sliding_attention" else None for kind in types]
    max_positions = int(cfg.get("max_position_embeddings", 2048))
    windows = [None if w is not None and w >= max_positions else w for w in windows]
    return windows if any(w is not None for w in windows) else None


LLAMA_LAYER_TENSORS = (
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


def layered_tensor_names(num_layers: int, per_layer: Iterable[str], *, prefix: str = "model.") -> set[str]:
    """The embedding, the final norm, `lm_head.weight` (which a tied checkpoint may omit) and
    `per_layer` names (HF's, after `layers.<i>.`) for every layer."""
    names = {f"{prefix}embed_tokens.weight", f"{prefix}norm.weight", "lm_head.weight"}
    per_layer = tuple(per_layer)
    for index in range(num_layers):
        names.update(f"{prefix}layers.{index}.{name}" for name in per_layer)
    return names


def tensor_prefix(names: Iterable[str]) -> str:
    """ "model." when the checkpoint's decoder tensors carry it (HF's usual layout), else ""."""
    return "model." if any(n.startswith("model.") for n in names) else ""


def check_tensor_names(
    names: Iterable[str],
    expected: Callable[[str], set[str]],
    *,
    source: str,
    unused: Callable[[str], bool] | None = None,
) -> None:
    """Raise `ModelLoadError` naming the checkpoint tensors no module consumes (a bias, a norm,
    an extra layer...): dropping them would change the answers. `expected(prefix)`: every name
    the architecture consumes; `unused(name)`: those it knowingly leaves unread (outside the
    forward pass)."""
    names = [n for n in names if unused is None or not unused(n)]
    expected_names = expected(tensor_prefix(names))
    unused_names = sorted(n for n in names if n not in expected_names and not _DERIVED_TENSOR.match(n))
    if unused_names:
        shown = ", ".join(unused_names[:8]) + (
            f" and {len(unused_names) - 8} more" if len(unused_names) > 8 else ""
        )
        raise _refuse(f"{source}: {len(unused_names)} checkpoint tensor(s) no module consumes: {shown}")


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
