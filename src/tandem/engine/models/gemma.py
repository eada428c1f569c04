"""Gemma (1), Gemma 2 and Gemma 3 (text), on the shared decoder. Gemma: GeLU MLP (HF's
`hidden_act`), the embedding scaled by sqrt(hidden), `(1 + w)` RMSNorms. Gemma 2 and 3: GeLU-tanh MLP, the embedding scaled by
sqrt(hidden), `(1 + w)` RMSNorms before and after both attention and MLP, the attention scale
`query_pre_attn_scalar ** -0.5`, sliding-window layers (Gemma 2: every other one; Gemma 3: five
of six), attention and final-logit soft-capping (Gemma 2), q/k norms and a separate RoPE base
for the sliding layers (Gemma 3)."""

from __future__ import annotations

import math
from typing import Any

from tandem.engine.models.decoder import DecoderLM
from tandem.engine.models.decoder_config import DecoderConfig, decoder_kv_layers, decoder_tensor_names
from tandem.engine.models.hf_config import HFConfig
from tandem.engine.models.registry import Architecture, register
from tandem.engine.models.support import (
    GELU_TANH_ACTIVATIONS,
    check_common,
    check_rope,
    decoder_fields,
    layer_windows,
    rope_settings,
)
from tandem.platform.errors import ModelLoadError

_IMPLEMENTED = ("attention_bias", "attn_logit_softcapping", "final_logit_softcapping")


def _gemma_fields(cfg: HFConfig, default_types: list[str]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    hidden = int(cfg["hidden_size"])
    attn_cap, final_cap = cfg.get("attn_logit_softcapping"), cfg.get("final_logit_softcapping")
    return {
        **decoder_fields(cfg, default_eps=1e-6),
        "qkv_bias": bias,
        "o_bias": bias,
        "norm_offset": 1.0,
        "sandwich_norms": True,
        "hidden_act": "gelu_tanh",
        "embedding_scale": math.sqrt(hidden),
        "attention_scale": float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        "attn_logit_softcap": float(attn_cap) if attn_cap else None,
        "final_logit_softcap": float(final_cap) if final_cap else None,
        "layer_windows": layer_windows(cfg, default_types),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
    }


def check_gemma(cfg: HFConfig) -> None:
    # HF's GemmaMLP reads `hidden_act` only: a `hidden_activation` key changes nothing there
    check_common(
        HFConfig({**cfg, "hidden_activation": None}),
        implemented=("attention_bias",),
        activations=(*GELU_TANH_ACTIVATIONS, "gelu"),
    )


def parse_gemma(cfg: HFConfig) -> DecoderConfig:
    """HF's `GemmaMLP` applies `hidden_act` as named: "gelu" is the exact GeLU."""
    bias = bool(cfg.get("attention_bias", False))
    act = cfg.get("hidden_act") or "gelu_pytorch_tanh"
    return DecoderConfig(
        **{
            **decoder_fields(cfg, default_eps=1e-6),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        },
        model_type="gemma",
        qkv_bias=bias,
        o_bias=bias,
        norm_offset=1.0,
        hidden_act="gelu" if act == "gelu" else "gelu_tanh",
        embedding_scale=math.sqrt(int(cfg["hidden_size"])),
    )


def check_gemma2(cfg: HFConfig) -> None:
    check_common(cfg, implemented=_IMPLEMENTED, activations=GELU_TANH_ACTIVATIONS, sliding_window=True)


def parse_gemma2(cfg: HFConfig) -> DecoderConfig:
    layers = int(cfg["num_hidden_layers"])
    default_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    return DecoderConfig(**_gemma_fields(cfg, default_types), model_type="gemma2")


def check_gemma3(cfg: HFConfig) -> None:
    check_common(cfg, implemented=_IMPLEMENTED, activations=GELU_TANH_ACTIVATIONS, sliding_window=True)
    check_rope(cfg, "sliding_attention")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(
            "config key use_bidirectional_attention=True is not supported "
            "(not implemented: refused rather than answered inexactly)",
            param="model",
        )


def parse_gemma3(cfg: HFConfig) -> DecoderConfig:
    layers = int(cfg["num_hidden_layers"])
    pattern = int(cfg.get("sliding_window_pattern", 6))
    default_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    fields = _gemma_fields(cfg, default_types)
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get("sliding_attention"), dict):
        local_theta, local_scaling, _ = rope_settings(cfg, "sliding_attention")
    else:  # transformers 4's layout: the local base apart, unscaled
        local_theta, local_scaling = cfg.get("rope_local_base_freq", 10000.0), None
    if not cfg.get("rope_parameters") and cfg.get("rope_theta") is None:
        fields["rope_theta"] = 1_000_000.0  # HF's default global base for Gemma 3
    return DecoderConfig(
        **fields,
        model_type="gemma3_text",
        qk_norm=True,
        local_rope_theta=float(local_theta or 10000.0),
        local_rope_scaling=local_scaling,
    )


GEMMA = Architecture(
    name="gemma",
    model_types=("gemma",),
    hf_classes=("GemmaForCausalLM",),
    check_config=check_gemma,
    parse_config=parse_gemma,
    model_class=DecoderLM,
    tensor_names=decoder_tensor_names,
    kv_layers=decoder_kv_layers,
)
GEMMA2 = Architecture(
    name="gemma2",
    model_types=("gemma2",),
    hf_classes=("Gemma2ForCausalLM",),
    check_config=check_gemma2,
    parse_config=parse_gemma2,
    model_class=DecoderLM,
    tensor_names=decoder_tensor_names,
    kv_layers=decoder_kv_layers,
)
GEMMA3 = Architecture(
    name="gemma3_text",
    model_types=("gemma3_text",),
    hf_classes=("Gemma3ForCausalLM",),
    check_config=check_gemma3,
    parse_config=parse_gemma3,
    model_class=DecoderLM,
    tensor_names=decoder_tensor_names,
    kv_layers=decoder_kv_layers,
)
register(GEMMA, replace=True)
register(GEMMA2, replace=True)
register(GEMMA3, replace=True)
