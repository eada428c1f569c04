"""Mistral: Llama's maths with a sliding window on every layer (`sliding_window`; HF's
`MistralForCausalLM`, whose q/k/v/o carry no biases); Ministral: the same with the window on the
layers its `layer_types` name."""

from __future__ import annotations

from tandem.engine.models.decoder_config import DecoderConfig, decoder_kv_layers, decoder_tensor_names
from tandem.engine.models.hf_config import HFConfig
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.models.registry import Architecture, register
from tandem.engine.models.support import check_common, decoder_fields, layer_windows


def check_mistral(cfg: HFConfig) -> None:
    check_common(cfg, sliding_window=True)


def parse_mistral(cfg: HFConfig) -> DecoderConfig:
    layers = int(cfg["num_hidden_layers"])
    return DecoderConfig(
        **decoder_fields(cfg),
        model_type=str(cfg.get("model_type", "mistral")),
        layer_windows=layer_windows(cfg, ["sliding_attention"] * layers),
    )


MISTRAL = Architecture(
    name="mistral",
    model_types=("mistral", "ministral"),
    hf_classes=("MistralForCausalLM", "MinistralForCausalLM"),
    check_config=check_mistral,
    parse_config=parse_mistral,
    model_class=LlamaForCausalLM,
    tensor_names=decoder_tensor_names,
    kv_layers=decoder_kv_layers,
)
register(MISTRAL, replace=True)
