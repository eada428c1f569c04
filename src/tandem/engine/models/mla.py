"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) over the paged cache, in absorbed form.

Per token the cache holds one vector shared by every head: the compressed latent c (kv_lora_rank,
after `kv_a_layernorm`) and the rotary key k_r (qk_rope_head_dim), `[c, k_r]`, stored once
(`LayerKV.shared_kv`: the cache's V is its K). Per head h, HF's expanded form is
`k_h = [W_uk_h c, k_r]`, `v_h = W_uv_h c` (W_uk, W_uv: the two halves of `kv_b_proj`), and

    score_h = q_nope_h . (W_uk_h c) + q_rope_h . k_r = [W_uk_h^T q_nope_h, q_rope_h] . [c, k_r]
    out_h   = W_uv_h (sum_j p_j c_j)

so attention runs as multi-query attention over `[c, k_r]` with the absorbed query
`[W_uk_h^T q_nope_h, q_rope_h]`, and its output's first kv_lora_rank dims (the rotary ones are
dropped) go through W_uv_h. The same paged kernels serve it (one KV head of width
kv_lora_rank + qk_rope_head_dim, V read from K); prefill and decode both take the absorbed form.
Bytes per token and layer: (kv_lora_rank + qk_rope_head_dim) x element, against
num_heads x (qk_head_dim + v_head_dim) x element for a per-head cache of the same model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tandem.engine.models.interface import KVLayer, LoRAContext
from tandem.kernels.attention import paged_attention, write_kv
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.head_attention import HeadAttentionMetadata
from tandem.kernels.rotary import apply_rope

LATENT_NORM_EPS = 1e-6  # HF builds q_a_layernorm and kv_a_layernorm with their default eps


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale squared where it applies
    rope_interleave: bool = True  # the rotary dims in interleaved pairs (DeepSeek's layout)
    attention_bias: bool = False  # biases on q_a_proj, kv_a_proj_with_mqa and o_proj

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """The cached vector per token: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def layer_tensor_names(self) -> list[str]:
        """The attention's checkpoint tensors in one layer (after `layers.<i>.`)."""
        a = "self_attn."
        names = [
            a + "kv_a_proj_with_mqa.weight",
            a + "kv_a_layernorm.weight",
            a + "kv_b_proj.weight",
            a + "o_proj.weight",
        ]
        if self.q_lora_rank is None:
            names.append(a + "q_proj.weight")
        else:
            names += [a + "q_a_proj.weight", a + "q_a_layernorm.weight", a + "q_b_proj.weight"]
        if self.attention_bias:
            names += [a + "kv_a_proj_with_mqa.bias", a + "o_proj.bias"]
            if self.q_lora_rank is not None:
                names.append(a + "q_a_proj.bias")
        return names


def apply_rope_interleaved(
    x: torch.Tensor,  # [T, H, D]: pairs (x0, x1), (x2, x3), ... each rotated by one frequency
    cos: torch.Tensor,  # [T, 1, D]: the table's cat(freqs, freqs) layout
    sin: torch.Tensor,
) -> torch.Tensor:  # [T, H, D]
    """HF's `apply_rotary_pos_emb_interleave`: the rotated pairs come out de-interleaved (the
    even results, then the odd ones), the same permutation for queries and keys, so their dot
    products are those of the interleaved rotation."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + LATENT_NORM_EPS)).to(x.dtype)


Take = Callable[[str], torch.Tensor]
Put = Callable[[torch.Tensor, torch.Tensor, str], None]


class MLAAttention(nn.Module):
    def __init__(self, mla: MLAConfig, hidden_size: int, num_heads: int, layer_idx: int = 0) -> None:
        super().__init__()
        self.mla = mla
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        bias = mla.attention_bias
        self.q_proj = (
            nn.Linear(hidden_size, num_heads * mla.qk_head_dim, bias=False)
            if mla.q_lora_rank is None
            else None
        )
        if mla.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(hidden_size, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = nn.Parameter(torch.ones(mla.q_lora_rank))
            self.q_b_proj = nn.Linear(mla.q_lora_rank, num_heads * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = nn.Parameter(torch.ones(mla.kv_lora_rank))
        # kv_b_proj's two halves per head: keys' W_uk [H, nope, R] and values' W_uv [H, v, R]
        self.w_uk = nn.Parameter(torch.empty(num_heads, mla.qk_nope_head_dim, mla.kv_lora_rank))
        self.w_uv = nn.Parameter(torch.empty(num_heads, mla.v_head_dim, mla.kv_lora_rank))
        self.o_proj = nn.Linear(num_heads * mla.v_head_dim, hidden_size, bias=bias)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, qk_rope_head_dim]
        sin: torch.Tensor,
        kv_cache: KVLayer,
        metadata: AttentionMetadata | HeadAttentionMetadata,
        lora: LoRAContext | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        if isinstance(metadata, HeadAttentionMetadata):
            raise RuntimeError("latent attention has no per-head KV layout (the engine refuses compression)")
        mla, num_tokens = self.mla, x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(_rms(self.q_a_proj(x), self.q_a_layernorm))
        q = q.view(num_tokens, self.num_heads, mla.qk_head_dim)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = _rms(latent, self.kv_a_layernorm)  # [T, R]
        k_rope = k_rope.reshape(num_tokens, 1, mla.qk_rope_head_dim)
        rope = apply_rope_interleaved if mla.rope_interleave else apply_rope
        q_rope, k_rope = rope(q_rope, cos, sin), rope(k_rope, cos, sin)
        q_latent = torch.einsum("thn,hnr->thr", q_nope, self.w_uk)  # [T, H, R]
        query = torch.cat((q_latent, q_rope), dim=-1)  # [T, H, R + rope]
        cached = torch.cat((latent.unsqueeze(1), k_rope), dim=-1)  # [T, 1, R + rope]: K, and V
        k_cache, v_cache, k_scale, v_scale = kv_cache
        write_kv(cached, cached, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
        out = paged_attention(
            query, cached, cached, k_cache, v_cache, metadata, mla.softmax_scale, k_scale, v_scale
        )
        values = torch.einsum("thr,hvr->thv", out[..., : mla.kv_lora_rank], self.w_uv)  # [T, H, v]
        return self.o_proj(values.reshape(num_tokens, self.num_heads * mla.v_head_dim))

    def load_hf(self, take: Take, put: Put, layer_prefix: str) -> None:
        """Copy HF's tensors (`layers.<i>.` in `layer_prefix`), splitting `kv_b_proj` per head."""
        mla, a = self.mla, layer_prefix + "self_attn."
        linears: list[tuple[str, nn.Linear]] = [
            ("kv_a_proj_with_mqa", self.kv_a_proj_with_mqa),
            ("o_proj", self.o_proj),
        ]
        if self.q_proj is not None:
            linears.append(("q_proj", self.q_proj))
        else:
            linears += [("q_a_proj", self.q_a_proj), ("q_b_proj", self.q_b_proj)]
            put(self.q_a_layernorm, take(a + "q_a_layernorm.weight"), a + "q_a_layernorm")
        for name, linear in linears:
            put(linear.weight, take(f"{a}{name}.weight"), a + name)
            if linear.bias is not None:
                put(linear.bias, take(f"{a}{name}.bias"), f"{a}{name}.bias")
        put(self.kv_a_layernorm, take(a + "kv_a_layernorm.weight"), a + "kv_a_layernorm")
        kv_b = take(a + "kv_b_proj.weight").view(
            self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank
        )
        put(self.w_uk, kv_b[:, : mla.qk_nope_head_dim], a + "kv_b_proj (keys)")
        put(self.w_uv, kv_b[:, mla.qk_nope_head_dim :], a + "kv_b_proj (values)")
