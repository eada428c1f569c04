"""Qwen2 / Qwen2.5 (biases on q, k and v) and Qwen3 (RMSNorm of each q and k head before RoPE),
on the shared decoder. Both may slide a window over the layers from `max_window_layers` on when
`use_sliding_window` is set (HF's rule; an explicit `layer_types` wins)."""

from __future__ import annotations

from tandem.engine.models.decoder import DecoderLM
from tandem.engine.models.decoder_config import DecoderConfig, decoder_kv_layers, decoder_tensor_names
from tandem.engine.models.hf_config import HFConfig
from tandem.engine.models.registry import Architecture, register
from tandem.engine.models.support import check_common, decoder_fields, layer_windows


def _windows(cfg: HFConfig) -> list[int | None] | None:
    if not cfg.get("use_sliding_window", False):
        return None
    layers = int(cfg["num_hidden_layers"])
    first = int(cfg.get("max_window_layers", layers))
    return layer_windows(
        cfg, ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    )


def check_qwen2(cfg: HFConfig) -> None:
    check_common(HFConfig({**cfg, "sliding_window": None}), sliding_window=True)


def parse_qwen2(cfg: HFConfig) -> DecoderConfig:
    return DecoderConfig(
        **decoder_fields(cfg, default_eps=1e-6),
        model_type="qwen2",
        qkv_bias=True,
        layer_windows=_windows(cfg),
    )


def check_qwen3(cfg: HFConfig) -> None:
    check_common(
        HFConfig({**cfg, "sliding_window": None}), implemented=("attention_bias",), sliding_window=True
    )


def parse_qwen3(cfg: HFConfig) -> DecoderConfig:
    bias = bool(cfg.get("attention_bias", False))
    return DecoderConfig(
        **decoder_fields(cfg, default_eps=1e-6),
        model_type="qwen3",
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        layer_windows=_windows(cfg),
    )


QWEN2 = Architecture(
    name="qwen2",
    model_types=("qwen2",),
    hf_classes=("Qwen2ForCausalLM",),
    check_config=check_qwen2,
    parse_config=parse_qwen2,
    model_class=DecoderLM,
    tensor_names=decoder_tensor_names,
    kv_layers=decoder_kv_layers,
)
QWEN3 = Architecture(
    name="qwen3",
    model_types=("qwen3",),
    hf_classes=("Qwen3ForCausalLM",),
    check_config=check_qwen3,
    parse_config=parse_qwen3,
    model_class=DecoderLM,
    tensor_names=decoder_tensor_names,
    kv_layers=decoder_kv_layers,
)
register(QWEN2, replace=True)
register(QWEN3, replace=True)
