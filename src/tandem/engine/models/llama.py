"""Llama-family decoder (RoPE incl. scaling, RMSNorm, SwiGLU, GQA, tied or untied embeddings).

Weights use HF `LlamaForCausalLM` names; q/k/v and gate/up are fused into one matmul each at
load time. Attention reads and writes the paged KV cache through `tandem.kernels.attention`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.models.interface import Int4Target, KVLayer, LayerKV, LoRAContext
from tandem.engine.models.registry import Architecture, register
from tandem.engine.models.support import (
    SUPPORTED_MODEL_TYPES,
    check_config,
    expected_tensor_names,
    rope_settings,
)
from tandem.kernels.attention import AttentionMetadata, finite_kv, paged_attention, write_kv
from tandem.kernels.head_attention import HeadAttentionMetadata, head_attention_layer
from tandem.kernels.rotary import apply_rope, rope_cos_sin, rope_inv_freq


@dataclass
class LlamaConfig:
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

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> LlamaConfig:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        rope_theta, rope_scaling, _ = rope_settings(cfg)
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
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
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,
        kv_cache: KVLayer,
        metadata: AttentionMetadata | HeadAttentionMetadata,
        lora: LoRAContext | None = None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if lora is not None:
            qkv = lora.apply(self.layer_idx, "qkv", x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if isinstance(metadata, HeadAttentionMetadata):  # compressed requests: head-block pool
            out = head_attention_layer(metadata, self.layer_idx, q, k, v, self.scale)
            return self.o_proj(out.reshape(num_tokens, self.q_size))
        k_cache, v_cache, k_scale, v_scale = kv_cache
        if lora is not None:  # an adapter's rows may be non-finite: never let them into the cache
            k, v = finite_kv(k, k_cache.dtype), finite_kv(v, v_cache.dtype)
        write_kv(k, v, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
        out = paged_attention(q, k, v, k_cache, v_cache, metadata, self.scale, k_scale, v_scale)
        out = out.reshape(num_tokens, self.q_size)
        if lora is None:
            return self.o_proj(out)
        return lora.apply(self.layer_idx, "o", out, self.o_proj(out))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: LoRAContext | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            gate_up = lora.apply(self.layer_idx, "gate_up", x, gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        act = F.silu(gate) * up
        if lora is None:
            return self.down_proj(act)
        return lora.apply(self.layer_idx, "down", act, self.down_proj(act))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg, layer_idx)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVLayer,
        metadata: AttentionMetadata | HeadAttentionMetadata,
        lora: LoRAContext | None = None,
    ) -> torch.Tensor:
        normed = rms_norm(x, self.input_layernorm, self.eps)
        h = x + self.self_attn(normed, cos, sin, kv_cache, metadata, lora)
        return h + self.mlp(rms_norm(h, self.post_attention_layernorm, self.eps), lora)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: weight * (x / sqrt(mean(x^2) + eps)), computed in float32."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.max_positions = max_positions
        self.register_buffer("rope_cos", torch.empty(max_positions, cfg.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(max_positions, cfg.head_dim), persistent=False)

    def init_rope(self) -> None:
        """(Re)compute the cos/sin tables on the model's device (after building on 'meta')."""
        cfg = self.config
        inv_freq, attention_scaling = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        cos, sin = rope_cos_sin(inv_freq, self.max_positions, attention_scaling)
        self.rope_cos = cos.to(self.norm.device)
        self.rope_sin = sin.to(self.norm.device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVLayer],  # per layer
        metadata: AttentionMetadata | HeadAttentionMetadata,
        logits_indices: torch.Tensor,  # [B] rows whose next-token logits are wanted
        lora: LoRAContext | None = None,  # adapters of this step's rows, if any
        return_hidden: bool = False,
        hidden_layers: tuple[int, ...] = (),
    ) -> Any:
        """Next-token logits [B, vocab] float32 at `logits_indices`; with `return_hidden`, also
        decoder layers' outputs for every token (what an EAGLE draft head reads): the last
        layer's [T, hidden] (before the final norm), or those of `hidden_layers` (indices,
        ascending) side by side [T, len(hidden_layers) * hidden]."""
        dtype = self.norm.dtype  # the compute dtype (the embedding may be stored narrower)
        x = self.embed_tokens(input_ids).to(dtype)
        cos = self.rope_cos[positions].to(dtype).unsqueeze(1)
        sin = self.rope_sin[positions].to(dtype).unsqueeze(1)
        states: list[torch.Tensor] = []
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = layer(x, cos, sin, kv_cache, metadata, lora)
            if return_hidden and index in hidden_layers:
                states.append(x)
        logits = self.lm_head(rms_norm(x.index_select(0, logits_indices), self.norm, self.config.rms_norm_eps)).float()
        if not return_hidden:
            return logits
        return logits, (torch.cat(states, dim=-1) if hidden_layers else x)

    def int4_targets(self) -> list[Int4Target]:
        """The fused q/k/v, o, fused gate/up and down linears of every layer."""
        targets = []
        layers: list[LlamaDecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        for index, layer in enumerate(layers):
            p = f"model.layers.{index}."
            attn, mlp = layer.self_attn, layer.mlp
            targets += [
                Int4Target(attn, "qkv_proj", (p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj")),
                Int4Target(attn, "o_proj", (p + "self_attn.o_proj",)),
                Int4Target(mlp, "gate_up_proj", (p + "mlp.gate_proj", p + "mlp.up_proj")),
                Int4Target(mlp, "down_proj", (p + "mlp.down_proj",)),
            ]
        return targets

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named weights in, fusing q/k/v and gate/up. Raises on missing or misshapen."""
        cfg = self.config
        prefix = "model." if any(k.startswith("model.") for k in weights) else ""

        def take(name: str) -> torch.Tensor:
            key = prefix + name if not name.startswith("lm_head") else name
            if key not in weights:
                raise ValueError(f"weight {key!r} missing from checkpoint")
            return weights[key]

        def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if tuple(param.shape) != tuple(value.shape):
                raise ValueError(
                    f"weight {name!r}: expected shape {tuple(param.shape)}, got {tuple(value.shape)}"
                )
            with torch.no_grad():
                param.copy_(value)

        put(self.embed_tokens.weight, take("embed_tokens.weight"), "embed_tokens.weight")
        put(self.norm, take("norm.weight"), "norm.weight")
        if cfg.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head.weight = self.embed_tokens.weight
        else:
            put(self.lm_head.weight, weights["lm_head.weight"], "lm_head.weight")
        layers: list[LlamaDecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        for i, layer in enumerate(layers):
            p = f"layers.{i}."
            qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
            put(layer.self_attn.qkv_proj.weight, qkv, p + "self_attn.qkv_proj")
            put(layer.self_attn.o_proj.weight, take(p + "self_attn.o_proj.weight"), p + "o_proj")
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0)
            put(layer.mlp.gate_up_proj.weight, gate_up, p + "mlp.gate_up_proj")
            put(layer.mlp.down_proj.weight, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj")
            put(layer.input_layernorm, take(p + "input_layernorm.weight"), p + "input_layernorm")
            put(
                layer.post_attention_layernorm,
                take(p + "post_attention_layernorm.weight"),
                p + "post_attention_layernorm",
            )


def llama_tensor_names(config: LlamaConfig, prefix: str) -> set[str]:
    return expected_tensor_names(config.num_hidden_layers, prefix=prefix)


def llama_kv_layers(config: LlamaConfig) -> list[LayerKV]:
    return [LayerKV(config.num_key_value_heads, config.head_dim)] * config.num_hidden_layers


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
