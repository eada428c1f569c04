"""`DecoderConfig`: what the shared decoder (`decoder.py`) computes for a family, its fields the
families' differences (biases, norms, activations, windows, soft-caps, experts, latent attention);
and the checkpoint tensors and KV layers such a decoder has."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.engine.models.interface import LayerKV
from tandem.engine.models.mla import MLAConfig
from tandem.engine.models.moe_layer import MoEConfig
from tandem.engine.models.support import LLAMA_LAYER_TENSORS, layered_tensor_names

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


@dataclass
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # -- what differs between families (defaults: Llama) --
    model_type: str = "llama"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim of each q and k head, before RoPE
    norm_offset: float = 0.0  # RMSNorm multiplies by (norm_offset + w): Gemma's 1
    sandwich_norms: bool = False  # also norms after attention and after the MLP (Gemma 2/3)
    hidden_act: str = "silu"  # one of ACTIVATIONS ("gelu" is exact, "gelu_tanh" the tanh approximation)
    embedding_scale: float | None = None  # the embedding times this (Gemma: sqrt(hidden))
    attention_scale: float | None = None  # default head_dim ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    layer_windows: list[int | None] | None = None  # per layer: sliding window (None: global)
    local_rope_theta: float | None = None  # RoPE of the sliding-window layers, when it differs
    local_rope_scaling: dict[str, Any] | None = None
    moe: MoEConfig | None = None  # experts in place of the MLP on its sparse layers (Mixtral, Qwen3-MoE)
    rotary_dim: int | None = None  # RoPE on each head's first `rotary_dim` dims only (GLM-4.5); None: all
    mla: MLAConfig | None = None  # multi-head latent attention in place of GQA (DeepSeek-V3; `mla.py`)
    num_mtp_layers: int = 0  # multi-token-prediction layers after the last one (checkpoint only; unread)

    @property
    def rope_dim(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def window(self, layer: int) -> int | None:
        return None if self.layer_windows is None else self.layer_windows[layer]


def decoder_tensor_names(cfg: DecoderConfig, prefix: str = "model.") -> set[str]:
    """Every checkpoint tensor `DecoderLM.load_hf_state_dict` consumes for `cfg` (HF names;
    `lm_head.weight` included, which a tied checkpoint may omit)."""
    per_layer = list(LLAMA_LAYER_TENSORS)
    if cfg.sandwich_norms:
        per_layer += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    if cfg.qkv_bias:
        per_layer += [f"self_attn.{n}_proj.bias" for n in "qkv"]
    if cfg.o_bias:
        per_layer.append("self_attn.o_proj.bias")
    if cfg.mlp_bias:
        per_layer += [f"mlp.{n}_proj.bias" for n in ("gate", "up", "down")]
    if cfg.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    if cfg.mla is not None:
        per_layer = [n for n in per_layer if not n.startswith("self_attn.")] + cfg.mla.layer_tensor_names()
    if cfg.moe is None:
        return layered_tensor_names(cfg.num_hidden_layers, per_layer, prefix=prefix)
    names = layered_tensor_names(0, (), prefix=prefix)
    sparse_layer = [n for n in per_layer if not n.startswith("mlp.")] + cfg.moe.layer_tensor_names()
    for index in range(cfg.num_hidden_layers):
        layer = sparse_layer if cfg.moe.is_sparse(index) else per_layer
        names.update(f"{prefix}layers.{index}.{name}" for name in layer)
    return names


def decoder_kv_layers(cfg: DecoderConfig) -> list[LayerKV]:
    return [
        LayerKV(cfg.num_key_value_heads, cfg.head_dim, cfg.window(i)) for i in range(cfg.num_hidden_layers)
    ]
