"""The pre-norm decoder every dense architecture module configures (`DecoderConfig`).

One implementation of the blocks the supported families share (embedding, RoPE attention with GQA
over the paged KV cache, gated MLP, RMSNorm, LM head), with each family's differences stated as
config fields rather than code branches in the engine:

- biases on q/k/v (Qwen2), on o (Llama `attention_bias`), on the MLP (Llama `mlp_bias`);
- RMSNorm of each head of q and k before RoPE (Qwen3, Gemma 3);
- `(1 + w)` RMSNorm weights (Gemma), norms after attention and after the MLP as well (Gemma 2/3);
- GeLU (tanh or exact) instead of SiLU, the embedding scaled by sqrt(hidden) (Gemma);
- the attention scale (`query_pre_attn_scalar`), attention and final-logit soft-capping (Gemma 2);
- a sliding window per layer (Mistral, Qwen2, Gemma 2/3, Phi-3) and a second RoPE for the
  sliding layers (Gemma 3's local base);
- a sparse mixture of experts in place of the MLP on some or all layers (`moe_layer.py`: Mixtral,
  Qwen3-MoE, GLM-4.5, DeepSeek-V3), partial rotary embeddings (GLM-4.5), and multi-head latent
  attention in place of GQA (`mla.py`: DeepSeek-V3, Kimi K2).

An architecture module parses its HF config into a `DecoderConfig`, names the checkpoint tensors
(`decoder_tensor_names`, or its own mapping) and registers an `Architecture` (`registry.py`).
Weights use HF names; q/k/v and gate/up are fused into one matmul each at load time. Every
formula matches the HF module of the family in float32 (the tests compare logits and tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.models.decoder_config import DecoderConfig
from tandem.engine.models.interface import Int4Target, KVLayer, LoRAContext
from tandem.engine.models.mla import MLAAttention
from tandem.engine.models.moe_layer import SparseMoE
from tandem.kernels.attention import finite_kv, paged_attention, write_kv
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.head_attention import HeadAttentionMetadata, head_attention_layer
from tandem.kernels.rotary import apply_rope, rope_cos_sin, rope_inv_freq


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """HF LlamaRMSNorm: weight * (x / sqrt(mean(x^2) + eps)), computed in float32; with `offset`,
    Gemma's (offset + weight) * normed, all in float32 then cast."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (offset + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def _norm_weight(size: int) -> nn.Parameter:
    return nn.Parameter(torch.ones(size))


def _activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if name == "gelu_tanh" else "none")


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


class DecoderAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = cfg.attention_scale if cfg.attention_scale is not None else self.head_dim**-0.5
        self.window = cfg.window(layer_idx)
        self.softcap = cfg.attn_logit_softcap
        self.eps, self.norm_offset = cfg.rms_norm_eps, cfg.norm_offset
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = _norm_weight(self.head_dim) if cfg.qk_norm else None
        self.k_norm = _norm_weight(self.head_dim) if cfg.qk_norm else None
        self.rope_dim = cfg.rope_dim

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
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = rms_norm(q, self.q_norm, self.eps, self.norm_offset)
            k = rms_norm(k, self.k_norm, self.eps, self.norm_offset)
        if self.rope_dim == self.head_dim:
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
        else:  # partial rotary: the rest of each head passes unrotated
            r = self.rope_dim
            q = torch.cat((apply_rope(q[..., :r], cos, sin), q[..., r:]), dim=-1)
            k = torch.cat((apply_rope(k[..., :r], cos, sin), k[..., r:]), dim=-1)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if isinstance(metadata, HeadAttentionMetadata):  # compressed requests: head-block pool
            out = head_attention_layer(metadata, self.layer_idx, q, k, v, self.scale)
            return self.o_proj(out.reshape(num_tokens, self.q_size))
        k_cache, v_cache, k_scale, v_scale = kv_cache
        if lora is not None:  # an adapter's rows may be non-finite: never let them into the cache
            k, v = finite_kv(k, k_cache.dtype), finite_kv(v, v_cache.dtype)
        write_kv(k, v, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
        out = paged_attention(
            q, k, v, k_cache, v_cache, metadata, self.scale, k_scale, v_scale, self.window, self.softcap
        )
        out = out.reshape(num_tokens, self.q_size)
        if lora is None:
            return self.o_proj(out)
        return lora.apply(self.layer_idx, "o", out, self.o_proj(out))


class DecoderMLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.intermediate_size = cfg.intermediate_size
        self.hidden_act = cfg.hidden_act
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, lora: LoRAContext | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            gate_up = lora.apply(self.layer_idx, "gate_up", x, gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        act = _activation(self.hidden_act, gate) * up
        if lora is None:
            return self.down_proj(act)
        return lora.apply(self.layer_idx, "down", act, self.down_proj(act))


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then h + mlp(norm(h)); with `sandwich_norms` each branch's output is
    normed too (Gemma 2/3: `post_attention_layernorm` is then the attention output's norm and
    `pre_feedforward_layernorm` the MLP input's)."""

    def __init__(self, cfg: DecoderConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.eps, self.offset = cfg.rms_norm_eps, cfg.norm_offset
        self.input_layernorm = _norm_weight(cfg.hidden_size)
        self.post_attention_layernorm = _norm_weight(cfg.hidden_size)
        self.pre_feedforward_layernorm = _norm_weight(cfg.hidden_size) if cfg.sandwich_norms else None
        self.post_feedforward_layernorm = _norm_weight(cfg.hidden_size) if cfg.sandwich_norms else None
        mla, moe = cfg.mla, cfg.moe if cfg.moe is not None and cfg.moe.is_sparse(layer_idx) else None
        self.self_attn: DecoderAttention | MLAAttention = (
            MLAAttention(mla, cfg.hidden_size, cfg.num_attention_heads, layer_idx)
            if mla
            else DecoderAttention(cfg, layer_idx)
        )
        self.mlp: DecoderMLP | SparseMoE = (
            SparseMoE(moe, cfg.hidden_size, layer_idx) if moe else DecoderMLP(cfg, layer_idx)
        )

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVLayer,
        metadata: AttentionMetadata | HeadAttentionMetadata,
        lora: LoRAContext | None = None,
    ) -> torch.Tensor:
        eps, offset = self.eps, self.offset
        attended = self.self_attn(
            rms_norm(x, self.input_layernorm, eps, offset), cos, sin, kv_cache, metadata, lora
        )
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            h = x + attended
            return h + self.mlp(rms_norm(h, self.post_attention_layernorm, eps, offset), lora)
        h = x + rms_norm(attended, self.post_attention_layernorm, eps, offset)
        out = self.mlp(rms_norm(h, self.pre_feedforward_layernorm, eps, offset), lora)
        return h + rms_norm(out, self.post_feedforward_layernorm, eps, offset)


class DecoderLM(nn.Module):
    """A `CausalLM` (interface.py) for every `DecoderConfig`."""

    rope_cos: torch.Tensor  # [max_positions, head_dim] float32 (`init_rope`)
    rope_sin: torch.Tensor
    local_rope_cos: torch.Tensor  # the sliding layers' tables when they have their own RoPE
    local_rope_sin: torch.Tensor

    def __init__(self, cfg: DecoderConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.max_positions = max_positions
        self.register_buffer("rope_cos", torch.empty(max_positions, cfg.rope_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(max_positions, cfg.rope_dim), persistent=False)
        # Layers on the local RoPE (Gemma 3's sliding layers) read these tables instead.
        self.local_rope_layers = (
            {i for i in range(cfg.num_hidden_layers) if cfg.window(i) is not None}
            if cfg.local_rope_theta is not None
            else set()
        )
        self.register_buffer("local_rope_cos", torch.empty(max_positions, cfg.rope_dim), persistent=False)
        self.register_buffer("local_rope_sin", torch.empty(max_positions, cfg.rope_dim), persistent=False)

    def init_rope(self) -> None:
        """(Re)compute the cos/sin tables on the model's device (after building on 'meta')."""
        cfg = self.config
        device = self.norm.device
        tables = [(cfg.rope_theta, cfg.rope_scaling, "rope")]
        if cfg.local_rope_theta is not None:
            tables.append((cfg.local_rope_theta, cfg.local_rope_scaling, "local_rope"))
        for theta, scaling, name in tables:
            inv_freq, attention_scaling = rope_inv_freq(
                cfg.rope_dim, theta, scaling, max_position_embeddings=cfg.max_position_embeddings
            )
            cos, sin = rope_cos_sin(inv_freq, self.max_positions, attention_scaling)
            setattr(self, f"{name}_cos", cos.to(device))
            setattr(self, f"{name}_sin", sin.to(device))

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
        x = self.embed(input_ids, dtype)
        cos = self.rope_cos[positions].to(dtype).unsqueeze(1)
        sin = self.rope_sin[positions].to(dtype).unsqueeze(1)
        if self.local_rope_layers:
            local = (
                self.local_rope_cos[positions].to(dtype).unsqueeze(1),
                self.local_rope_sin[positions].to(dtype).unsqueeze(1),
            )
        states: list[torch.Tensor] = []
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            layer_cos, layer_sin = local if index in self.local_rope_layers else (cos, sin)
            x = layer(x, layer_cos, layer_sin, kv_cache, metadata, lora)
            if return_hidden and index in hidden_layers:
                states.append(x)
        logits = self.final_logits(x.index_select(0, logits_indices).to(dtype))
        if not return_hidden:
            return logits
        return logits, (torch.cat(states, dim=-1) if hidden_layers else x)

    def embed(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [T] -> [T, hidden]
        """The input embedding in `dtype` (times `embedding_scale`, Gemma's sqrt(hidden))."""
        x = self.embed_tokens(input_ids).to(dtype)
        scale = self.config.embedding_scale
        return x if scale is None else x * torch.tensor(scale, dtype=dtype)

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, hidden]
        """The final norm of the last layer's states: HF's `last_hidden_state` (what an
        embedding pools)."""
        cfg = self.config
        return rms_norm(hidden.to(self.norm.dtype), self.norm, cfg.rms_norm_eps, cfg.norm_offset)

    def final_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, hidden] -> [B, vocab] float32
        """The final norm, the LM head and the final soft-capping (Gemma 2)."""
        cfg = self.config
        logits = self.lm_head(rms_norm(hidden, self.norm, cfg.rms_norm_eps, cfg.norm_offset)).float()
        return logits if cfg.final_logit_softcap is None else _softcap(logits, cfg.final_logit_softcap)

    def decoder_layers(self) -> list[DecoderLayer]:
        return list(self.layers)  # type: ignore[arg-type]

    def int4_targets(self) -> list[Int4Target]:
        """The fused q/k/v, o, fused gate/up and down linears of every layer, every expert's
        included (biases and a sparse layer's router stay in the compute dtype)."""
        targets = []
        for index, layer in enumerate(self.decoder_layers()):
            p = f"model.layers.{index}."
            attn, mlp = layer.self_attn, layer.mlp
            if isinstance(attn, DecoderAttention):  # latent attention stays in the compute dtype
                targets += [
                    Int4Target(
                        attn,
                        "qkv_proj",
                        (p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"),
                    ),
                    Int4Target(attn, "o_proj", (p + "self_attn.o_proj",)),
                ]
            if isinstance(mlp, SparseMoE):
                targets += mlp.int4_targets(p)
                continue
            targets += [
                Int4Target(mlp, "gate_up_proj", (p + "mlp.gate_proj", p + "mlp.up_proj")),
                Int4Target(mlp, "down_proj", (p + "mlp.down_proj",)),
            ]
        return targets

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named weights in (`decoder_tensor_names`' layout), fusing q/k/v and gate/up.
        Raises `ValueError` naming a missing or misshapen tensor."""
        cfg = self.config
        prefix = "model." if any(k.startswith("model.") for k in weights) else ""

        def take(name: str) -> torch.Tensor:
            key = prefix + name if not name.startswith("lm_head") else name
            if key not in weights:
                raise ValueError(f"weight {key!r} missing from checkpoint")
            return weights[key]

        def put(param: torch.Tensor | None, value: torch.Tensor, name: str) -> None:
            assert param is not None
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
        for i, layer in enumerate(self.decoder_layers()):
            p = f"layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            if isinstance(attn, MLAAttention):
                attn.load_hf(take, put, p)
            else:
                self._load_attention(attn, take, put, p)
            for norm in _layer_norm_names(cfg):
                put(getattr(layer, norm), take(p + f"{norm}.weight"), p + norm)
            if isinstance(mlp, SparseMoE):
                mlp.load_hf(take, put, p)
                continue
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0)
            put(mlp.gate_up_proj.weight, gate_up, p + "mlp.gate_up_proj")
            put(mlp.down_proj.weight, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj")
            if cfg.mlp_bias:
                gate_up_bias = torch.cat(
                    [take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")], dim=0
                )
                put(mlp.gate_up_proj.bias, gate_up_bias, p + "mlp.gate_up_proj.bias")
                put(mlp.down_proj.bias, take(p + "mlp.down_proj.bias"), p + "mlp.down_proj.bias")

    def _load_attention(
        self,
        attn: DecoderAttention,
        take: Callable[[str], torch.Tensor],
        put: Callable[[torch.Tensor | None, torch.Tensor, str], None],
        p: str,
    ) -> None:
        """Copy one layer's q/k/v (fused), o, their biases and q/k norms."""
        cfg = self.config
        qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
        put(attn.qkv_proj.weight, qkv, p + "self_attn.qkv_proj")
        put(attn.o_proj.weight, take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj")
        if cfg.qkv_bias:
            bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0)
            put(attn.qkv_proj.bias, bias, p + "self_attn.qkv_proj.bias")
        if cfg.o_bias:
            put(attn.o_proj.bias, take(p + "self_attn.o_proj.bias"), p + "self_attn.o_proj.bias")
        if cfg.qk_norm:
            put(attn.q_norm, take(p + "self_attn.q_norm.weight"), p + "self_attn.q_norm")
            put(attn.k_norm, take(p + "self_attn.k_norm.weight"), p + "self_attn.k_norm")


def _layer_norm_names(cfg: DecoderConfig) -> tuple[str, ...]:
    names: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    if cfg.sandwich_norms:
        names += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    return names
