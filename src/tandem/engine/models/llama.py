"""Llama (and every checkpoint with its maths: RoPE incl. scaling, RMSNorm, SwiGLU, GQA, tied or
untied embeddings, `attention_bias` / `mlp_bias`), on the shared decoder (`decoder.py`).

`LlamaConfig` adds the round trip to an HF config dict (the GGUF reader writes one);
`LlamaForCausalLM` is the decoder as Llama computes it (Mistral's too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.engine.models.decoder import DecoderAttention, DecoderLayer, DecoderLM, DecoderMLP, rms_norm
from tandem.engine.models.decoder_config import DecoderConfig, decoder_kv_layers, decoder_tensor_names
from tandem.engine.models.hf_config import HFConfig
from tandem.engine.models.interface import LayerKV
from tandem.engine.models.registry import Architecture, register
from tandem.engine.models.support import SUPPORTED_MODEL_TYPES, check_config, decoder_fields

__all__ = [
    "LLAMA",
    "LlamaAttention",
    "LlamaConfig",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaMLP",
    "llama_kv_layers",
    "llama_tensor_names",
    "rms_norm",
]

LlamaAttention = DecoderAttention
LlamaMLP = DecoderMLP
LlamaDecoderLayer = DecoderLayer


@dataclass
class LlamaConfig(DecoderConfig):
    @classmethod
    def from_hf_dict(cls, cfg: HFConfig) -> LlamaConfig:
        bias = bool(cfg.get("attention_bias", False))
        return cls(
            **decoder_fields(cfg), qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False))
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json an HF `LlamaForCausalLM` (and `from_hf_dict`) reads back."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids,
            "hidden_act": "silu",
            "attention_bias": self.qkv_bias,
            "mlp_bias": self.mlp_bias,
            "torch_dtype": "float32",
        }


class LlamaForCausalLM(DecoderLM):
    """The shared decoder with Llama's maths (`LlamaConfig`)."""


def llama_tensor_names(config: DecoderConfig, prefix: str) -> set[str]:
    return decoder_tensor_names(config, prefix)


def llama_kv_layers(config: DecoderConfig) -> list[LayerKV]:
    return decoder_kv_layers(config)


LLAMA = Architecture(
    name="llama",
    model_types=SUPPORTED_MODEL_TYPES,
    hf_classes=("LlamaForCausalLM",),
    check_config=check_config,
    parse_config=LlamaConfig.from_hf_dict,
    model_class=LlamaForCausalLM,
    tensor_names=llama_tensor_names,
    kv_layers=llama_kv_layers,
)
register(LLAMA, replace=True)
