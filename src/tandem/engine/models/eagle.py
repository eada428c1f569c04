"""EAGLE-style draft head: one decoder layer over the target model's own hidden states.

A draft for a model that has no smaller sibling. At position p the head reads the embedding of
token p and the target's last hidden state at p - 1 (the output of its last decoder layer, before
the final norm: the state from which the target predicted token p), mixes them with `fc`, runs one
Llama decoder layer (its own paged KV cache, one layer deep) and predicts the target's hidden
state at p. The target's final norm and LM head turn that into next-token logits over a reduced
draft vocabulary (`token_map`: the target token ids the head may propose, the most frequent ones
in text the target generated, as in FR-Spec / EAGLE-3), so its LM head costs a fraction of the
target's. Drafting deeper feeds the head's own predicted state back in place of the target's.

Files: a folder with `config.json` (`"architectures": ["TandemEagleDraft"]`) and
`model.safetensors` (`fc.weight`, `fc.bias`, `layer.*` with fused qkv / gate_up as in
`LlamaDecoderLayer`, `token_map` int64 [K]). Safetensors only. The target's embedding, final norm and
LM-head rows come from the target at load time (`attach_target`), so the file holds only what is
the head's own.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from tandem.engine.models.decoder import DecoderAttention
from tandem.engine.models.interface import KVLayer
from tandem.engine.models.llama import LlamaConfig, LlamaDecoderLayer, rms_norm
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.rotary import apply_rope, rope_cos_sin, rope_inv_freq

ARCHITECTURE = "TandemEagleDraft"


@dataclass
class EagleConfig:
    hidden_size: int  # == the target's
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    draft_vocab_size: int  # K: rows of the reduced LM head (len(token_map))
    target_vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    target: dict[str, Any] = field(default_factory=dict)  # what it was trained for (name, dims)
    # Target layers whose outputs the head reads, fused by `fuse` into one state (EAGLE-3: low,
    # middle and top layers); empty: the last layer's output alone.
    feature_layers: list[int] = field(default_factory=list)

    def layer_config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.target_vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
        )

    @classmethod
    def for_target(cls, target: LlamaConfig, draft_vocab_size: int, **target_info: Any) -> EagleConfig:
        """A head shaped like one of the target's layers."""
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            draft_vocab_size=draft_vocab_size,
            target_vocab_size=target.vocab_size,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
            target={"hidden_size": target.hidden_size, "vocab_size": target.vocab_size, **target_info},
        )


def is_eagle_folder(path: Path) -> bool:
    config = path / "config.json"
    if not path.is_dir() or not config.exists():
        return False
    return ARCHITECTURE in json.loads(config.read_text()).get("architectures", [])


class EagleDraft(nn.Module):
    def __init__(self, cfg: EagleConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        hidden = cfg.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.fuse = (
            nn.Linear(len(cfg.feature_layers) * hidden, hidden, bias=False) if cfg.feature_layers else None
        )
        self.layer = LlamaDecoderLayer(cfg.layer_config(), 0)
        # The target's final norm and its LM-head rows for token_map (frozen; set by attach_target).
        self.norm = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.lm_head = nn.Linear(hidden, cfg.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)
        self.token_map: torch.Tensor
        self.register_buffer("token_map", torch.arange(cfg.draft_vocab_size, dtype=torch.int64))
        self.max_positions = max_positions
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", torch.empty(max_positions, cfg.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(max_positions, cfg.head_dim), persistent=False)
        self.embed_tokens: nn.Embedding | None = None  # the target's (not a submodule: not ours)

    def init_rope(self) -> None:
        cfg = self.config
        inv_freq, attention_scaling = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        cos, sin = rope_cos_sin(inv_freq, self.max_positions, attention_scaling)
        self.rope_cos, self.rope_sin = cos.to(self.fc.weight.device), sin.to(self.fc.weight.device)

    def attach_target(
        self, embed_tokens: nn.Embedding, final_norm: torch.Tensor, lm_head_weight: torch.Tensor
    ) -> None:
        """Share the target's embedding; copy its final norm and the LM-head rows of `token_map`
        (`lm_head_weight`: [V, hidden], the target's whole head)."""
        if tuple(lm_head_weight.shape) != (self.config.target_vocab_size, self.config.hidden_size):
            raise ValueError(
                f"the draft head was trained for a target with vocabulary {self.config.target_vocab_size} and "
                f"hidden size {self.config.hidden_size}; this target's LM head is {tuple(lm_head_weight.shape)}"
            )
        object.__setattr__(self, "embed_tokens", embed_tokens)
        dtype = self.fc.weight.dtype
        with torch.no_grad():
            self.norm.copy_(final_norm.to(dtype))
            self.lm_head.weight.copy_(
                lm_head_weight.index_select(0, self.token_map.to(lm_head_weight.device)).to(dtype)
            )

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """What to ask the target's forward for (`hidden_layers`; () is its last layer)."""
        return tuple(sorted(self.config.feature_layers))

    def fuse_states(self, states: torch.Tensor) -> torch.Tensor:
        """The target's states as the target returned them ([..., len(feature_layers) * hidden],
        or [..., hidden]) -> the one state [..., hidden] the head reads."""
        states = states.to(self.fc.weight.dtype)
        return self.fuse(states) if self.fuse is not None else states

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None, "attach_target first"
        return self.embed_tokens(input_ids).to(self.fc.weight.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        features: torch.Tensor,  # [T, hidden]: the (fused) target state at each token's previous position
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVLayer],  # one layer
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,  # [B]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [B, K] float32, predicted states [B, hidden]
        dtype = self.fc.weight.dtype
        x = self.fc(torch.cat([self._embed(input_ids), features.to(dtype)], dim=-1))
        cos = self.rope_cos[positions].to(dtype).unsqueeze(1)
        sin = self.rope_sin[positions].to(dtype).unsqueeze(1)
        hidden = self.layer(x, cos, sin, kv_caches[0], metadata).index_select(0, logits_indices)
        logits = self.lm_head(rms_norm(hidden, self.norm, self.config.rms_norm_eps)).float()
        return logits, hidden

    def dense_forward(
        self,
        input_ids: torch.Tensor,  # [N, T]
        features: torch.Tensor,  # [N, T, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [N, T, K] float32, predicted states [N, T, hidden]
        """The same computation over whole sequences with causal attention and no cache (for
        training; right padding is harmless: no earlier position attends to it)."""
        layer, attn = self.layer, self.layer.self_attn
        assert isinstance(attn, DecoderAttention), "a draft head's layer is the shared decoder's"
        num_seqs, length = input_ids.shape
        dtype = self.fc.weight.dtype
        x = self.fc(torch.cat([self._embed(input_ids), features.to(dtype)], dim=-1))  # [N, T, H]
        cos = self.rope_cos[:length].to(dtype).unsqueeze(1)  # [T, 1, D]
        sin = self.rope_sin[:length].to(dtype).unsqueeze(1)
        normed = rms_norm(x, layer.input_layernorm, layer.eps)
        q, k, v = attn.qkv_proj(normed).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = apply_rope(q.view(num_seqs, length, attn.num_heads, attn.head_dim), cos, sin)
        k = apply_rope(k.view(num_seqs, length, attn.num_kv_heads, attn.head_dim), cos, sin)
        v = v.view(num_seqs, length, attn.num_kv_heads, attn.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=attn.scale,
            enable_gqa=True,
        )  # [N, Hq, T, D]
        h = x + attn.o_proj(out.transpose(1, 2).reshape(num_seqs, length, attn.q_size))
        hidden = h + layer.mlp(rms_norm(h, layer.post_attention_layernorm, layer.eps))
        logits = self.lm_head(rms_norm(hidden, self.norm, self.config.rms_norm_eps)).float()
        return logits, hidden

    # -- files -----------------------------------------------------------------------------------
    def own_state_dict(self) -> dict[str, torch.Tensor]:
        """What the file holds: the head's trained weights and its token map."""
        return {
            name: tensor.detach().contiguous()
            for name, tensor in self.state_dict().items()
            if not name.startswith(("norm", "lm_head"))
        }

    def save(self, folder: Path, dtype: torch.dtype = torch.bfloat16) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        state = {
            name: (t if t.dtype == torch.int64 else t.to(dtype)).cpu()
            for name, t in self.own_state_dict().items()
        }
        save_file(state, str(folder / "model.safetensors"))
        config = {"architectures": [ARCHITECTURE], **asdict(self.config)}
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_eagle(folder: Path, *, dtype: torch.dtype, device: torch.device, max_positions: int) -> EagleDraft:
    """Read a head folder (validated: every tensor present with the expected shape, token ids
    inside the target vocabulary). Call `attach_target` before use."""
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("architectures", None)
    try:
        cfg = EagleConfig(**raw)
    except TypeError as exc:
        raise ValueError(f"{folder}/config.json is not an EAGLE head config: {exc}") from exc
    model = EagleDraft(cfg, max_positions=min(max_positions, cfg.max_position_embeddings))
    state = load_file(str(folder / "model.safetensors"))
    expected = model.own_state_dict()
    if set(state) != set(expected):
        raise ValueError(
            f"{folder}/model.safetensors: tensors {sorted(set(state) ^ set(expected))} missing or unexpected"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"{folder}: {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}"
            )
    token_map = state["token_map"]
    if int(token_map.min()) < 0 or int(token_map.max()) >= cfg.target_vocab_size:
        raise ValueError(f"{folder}: token_map holds ids outside the target vocabulary")
    model.load_state_dict(state, strict=False)
    model = model.to(device=device, dtype=dtype)
    model.token_map = token_map.to(device)  # the cast above must not touch the ids
    model.init_rope()
    return model.eval()
