"""What the engine needs of a model: the `CausalLM` protocol, its config, and its KV layers.

Every architecture module (`llama.py`, ...) implements these and registers itself
(`registry.py`); the runner, the draft model and the loader see nothing else of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.head_attention import HeadAttentionMetadata

# One layer's cache: (k, v, k_scale, v_scale); the scales are None unless the cache is FP8.
KVLayer = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


class LoRAContext(Protocol):
    """Per-step multi-LoRA state the layers call into (`engine.lora.LoRAStep`): `module` is one
    of the model's LoRA targets ("qkv", "o", "gate_up", "down"); y += the adapters' delta for x."""

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class LayerKV:
    """What one layer keeps in the KV cache: K and V of `num_kv_heads` heads of `head_dim` per
    token (a layout per layer, so that architectures whose layers differ can say so; the paged
    cache serves models whose layers have one KV shape and refuses others by name at load), and
    how far back the layer attends (its sliding window, None for the whole context)."""

    num_kv_heads: int
    head_dim: int
    window: int | None = None  # sliding window: the layer reads only its last `window` positions
    # One vector per token serves as both K and V (multi-head latent attention: the latent and
    # the rotary key, read as the key, and its first dims as the value): stored once.
    shared_kv: bool = False


@dataclass(frozen=True)
class Int4Target:
    """A linear the INT4 path quantises: `getattr(parent, attr)`, whose weight is the
    concatenation (along output rows) of the checkpoint tensors `<source_names[i]>.weight`."""

    parent: nn.Module
    attr: str
    source_names: tuple[str, ...]  # HF names without ".weight", e.g. "model.layers.0.self_attn.q_proj"


class ModelConfig(Protocol):
    """The shape of a decoder-only model, as every part of the engine reads it."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: list[int]


class CausalLM(Protocol):
    """A decoder-only model over the paged KV cache.

    Contract of `forward`: the rows of `input_ids` / `positions` [T] are the step's tokens,
    request after request; each layer writes their K/V into `kv_caches[layer]` at
    `metadata.slot_mapping` (or, with `HeadAttentionMetadata`, into the head-block pool) and
    attends over each request's context. Returns next-token logits [B, vocab] float32 at the rows
    `logits_indices` [B]; with `return_hidden`, also the decoder's hidden states for every row (an
    EAGLE draft head reads them): the last layer's [T, hidden] (before the final norm), or those of
    `hidden_layers` side by side [T, len(hidden_layers) * hidden].

    `embed_tokens`, `layers`, `norm` (the final norm's weight; its dtype is the compute dtype) and
    `lm_head` are read by the draft head (which shares the target's embedding and head) and by
    the fast paths (INT4 packing, the native decoder stack) that the architecture allows.
    """

    @property
    def config(self) -> ModelConfig: ...

    @property
    def embed_tokens(self) -> nn.Embedding: ...

    @property
    def layers(self) -> nn.ModuleList: ...

    @property
    def norm(self) -> nn.Parameter: ...

    lm_head: Any  # the INT4 path swaps it for an INT8 head

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVLayer],
        metadata: AttentionMetadata | HeadAttentionMetadata,
        logits_indices: torch.Tensor,
        lora: LoRAContext | None = None,
        return_hidden: bool = False,
        hidden_layers: tuple[int, ...] = (),
    ) -> Any: ...

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] last-layer states (as `forward` returns them) -> the model's final hidden
        states [N, hidden] (after the final norm, where the architecture has one), which an
        embedding pools."""
        ...

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named weights in (fusing what the module fuses); raises `ValueError` naming a
        missing or misshapen tensor."""
        ...

    def init_rope(self) -> None:
        """(Re)compute position tables on the model's device (after building on 'meta')."""
        ...

    def int4_targets(self) -> list[Int4Target]:
        """The linears `weight_dtype="int4"` quantises (the LM head and embedding are not)."""
        ...

    def to(self, *args: Any, **kwargs: Any) -> Any: ...

    def to_empty(self, *, device: Any, recurse: bool = True) -> Any: ...

    def eval(self) -> Any: ...
