"""BERT-family encoders (bge, e5, gte, MiniLM: `BertModel` checkpoints) for embeddings.

Post-norm layers over absolute position and token-type embeddings, with bidirectional attention:
every token of a request attends to every other, so a request's prompt runs whole in one step
(`Request.whole_prompt`) and nothing is kept between steps (no KV cache is read or written; the
engine's block bookkeeping runs over a one-block-wide dummy layer). An encoder embeds and does
not generate: `forward` returns no logits rows, and `final_hidden` is the last layer's output
(HF's `last_hidden_state`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.models.hf_config import HFConfig
from tandem.engine.models.interface import Int4Target, KVLayer, LayerKV, LoRAContext
from tandem.engine.models.registry import Architecture, register
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.head_attention import HeadAttentionMetadata
from tandem.platform.errors import ModelLoadError

_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


@dataclass
class BertConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    model_type: str = "bert"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    # What the engine reads of every model (`interface.ModelConfig`).
    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rms_norm_eps(self) -> float:
        return self.layer_norm_eps


def check_bert(cfg: HFConfig) -> None:
    """Refuse, naming the key, what this module would not compute exactly."""
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError(
            f"position_embedding_type {cfg['position_embedding_type']!r} is not supported (absolute is)",
            param="model",
        )
    if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
        raise ModelLoadError(
            "a BERT decoder (is_decoder / add_cross_attention) is not supported", param="model"
        )
    act = cfg.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ModelLoadError(
            f"hidden_act {act!r} is not supported ({sorted(_ACTIVATIONS)} are)", param="model"
        )


def parse_bert(cfg: HFConfig) -> BertConfig:
    return BertConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=int(cfg["num_attention_heads"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 512)),
        type_vocab_size=int(cfg.get("type_vocab_size", 2)),
        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        hidden_act=str(cfg.get("hidden_act", "gelu")),
    )


_EMBEDDING_TENSORS = (
    "embeddings.word_embeddings.weight",
    "embeddings.position_embeddings.weight",
    "embeddings.token_type_embeddings.weight",
    "embeddings.LayerNorm.weight",
    "embeddings.LayerNorm.bias",
)
_LAYER_TENSORS = tuple(
    f"{module}.{kind}"
    for module in (
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
        "attention.output.LayerNorm",
        "intermediate.dense",
        "output.dense",
        "output.LayerNorm",
    )
    for kind in ("weight", "bias")
)


def bert_tensor_names(cfg: BertConfig, prefix: str) -> set[str]:
    """Every tensor the encoder reads, as `BertModel` saves them or under `bert.` (a checkpoint
    saved from a task model)."""
    names = set(_EMBEDDING_TENSORS)
    for index in range(cfg.num_hidden_layers):
        names |= {f"encoder.layer.{index}.{name}" for name in _LAYER_TENSORS}
    return names | {f"bert.{name}" for name in names}


def bert_unused(cfg: BertConfig, name: str) -> bool:
    """The pooler and task heads are not part of the encoder's hidden states; position ids are a buffer."""
    bare = name.removeprefix("bert.")
    return bare.startswith(("pooler.", "cls.", "classifier.")) or bare == "embeddings.position_ids"


def bert_kv_layers(cfg: BertConfig) -> list[LayerKV]:
    """No KV is kept: one narrow dummy layer, so the engine's block bookkeeping costs nothing."""
    return [LayerKV(num_kv_heads=1, head_dim=1)]


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=cfg.layer_norm_eps)
        self.intermediate = nn.Linear(hidden, cfg.intermediate_size)
        self.out = nn.Linear(cfg.intermediate_size, hidden)
        self.out_norm = nn.LayerNorm(hidden, eps=cfg.layer_norm_eps)
        self.approximate = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, segments: Segments) -> torch.Tensor:  # [T, hidden]
        """Each request's rows attend to each other: one attention over the requests padded to
        the longest (`Segments`), padding keys masked out."""
        qkv = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim)
        q, k, v = (segments.pad(qkv[:, i]) for i in range(3))  # [B, H, L, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=segments.key_mask)
        attended = segments.unpad(out)
        x = self.attn_norm(x + self.attn_out(attended))
        return self.out_norm(x + self.out(F.gelu(self.intermediate(x), approximate=self.approximate)))


class Segments:
    """A step's requests, each a run of rows starting at position 0, as a padded batch:
    `pad` lays [T, H, D] rows out as [B, H, L, D] (L: the longest request), `unpad` takes the
    real rows back in order [T, H * D], and `key_mask` [B, 1, 1, L] hides the padding keys."""

    def __init__(self, positions: torch.Tensor) -> None:  # [T]
        num_rows = int(positions.shape[0])
        starts = torch.nonzero(positions == 0).flatten()
        lengths = torch.diff(starts, append=torch.tensor([num_rows], device=positions.device))
        self.num_requests, self.longest = int(starts.shape[0]), int(lengths.max())
        offsets = torch.arange(self.longest, device=positions.device)
        valid = offsets.unsqueeze(0) < lengths.unsqueeze(1)  # [B, L]
        self.index = torch.where(valid, starts.unsqueeze(1) + offsets, 0).flatten()  # [B * L] rows
        self.real_rows = torch.nonzero(valid.flatten()).flatten()  # [T], in row order
        self.key_mask = valid.view(self.num_requests, 1, 1, self.longest)

    def pad(self, rows: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, L, D]
        heads, dim = rows.shape[1], rows.shape[2]
        return (
            rows.index_select(0, self.index).view(self.num_requests, self.longest, heads, dim).transpose(1, 2)
        )

    def unpad(self, batch: torch.Tensor) -> torch.Tensor:  # [B, H, L, D] -> [T, H * D]
        flat = batch.transpose(1, 2).reshape(self.num_requests * self.longest, -1)
        return flat.index_select(0, self.real_rows)


def _take(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in weights:
        raise ValueError(f"tensor {name!r} is missing")
    return weights[name]


def _put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(value)


def _load_module(module: nn.Linear | nn.LayerNorm, weights: dict[str, torch.Tensor], prefix: str) -> None:
    """A linear's or a layer norm's weight and bias."""
    _put(module.weight, _take(weights, f"{prefix}.weight"), f"{prefix}.weight")
    _put(module.bias, _take(weights, f"{prefix}.bias"), f"{prefix}.bias")


class BertEncoder(nn.Module):
    """`CausalLM`'s interface over an encoder: the engine runs it like a model whose every
    request is an embedding (`forward` rows per request from position 0 to its end)."""

    lm_head: Any = None  # no LM head: an encoder does not generate

    def __init__(self, cfg: BertConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.embedding_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.word_embeddings

    @property
    def norm(self) -> nn.Parameter:
        """The embedding norm's weight: its dtype is the compute dtype (as a decoder's final norm's)."""
        return self.embedding_norm.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]: requests' whole prompts, one after another
        positions: torch.Tensor,  # [T]: each request's from 0
        kv_caches: list[KVLayer],  # unused: nothing is kept
        metadata: AttentionMetadata | HeadAttentionMetadata,
        logits_indices: torch.Tensor,  # [B]
        lora: LoRAContext | None = None,
        return_hidden: bool = False,
        hidden_layers: tuple[int, ...] = (),
    ) -> Any:
        """The last layer's states [T, hidden] (with `return_hidden`), and empty logits [B, 0]."""
        if int(positions.max()) >= self.config.max_position_embeddings:
            raise ValueError(
                f"an encoder input is longer than {self.config.max_position_embeddings} positions"
            )
        dtype = self.norm.dtype
        token_type = self.token_type_embeddings.weight[0]
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + token_type
        x = self.embedding_norm(x.to(dtype))
        segments = Segments(positions)
        for layer in self.layers:
            x = layer(x, segments)
        logits = x.new_zeros(logits_indices.shape[0], 0, dtype=torch.float32)
        return (logits, x) if return_hidden else logits

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy `BertModel`'s tensors in (or a task model's, under `bert.`), fusing each layer's
        query, key and value; raises `ValueError` naming a missing or misshapen tensor."""
        bare = {name.removeprefix("bert."): tensor for name, tensor in weights.items()}
        for embedding, name in (
            (self.word_embeddings, "embeddings.word_embeddings"),
            (self.position_embeddings, "embeddings.position_embeddings"),
            (self.token_type_embeddings, "embeddings.token_type_embeddings"),
        ):
            _put(embedding.weight, _take(bare, f"{name}.weight"), f"{name}.weight")
        _load_module(self.embedding_norm, bare, "embeddings.LayerNorm")
        for index, layer in enumerate(self.layers):
            assert isinstance(layer, BertLayer)
            p = f"encoder.layer.{index}."
            for kind in ("weight", "bias"):
                parts = [_take(bare, f"{p}attention.self.{n}.{kind}") for n in ("query", "key", "value")]
                _put(getattr(layer.qkv, kind), torch.cat(parts), f"{p}attention.self.query/key/value.{kind}")
            for module, name in (
                (layer.attn_out, "attention.output.dense"),
                (layer.attn_norm, "attention.output.LayerNorm"),
                (layer.intermediate, "intermediate.dense"),
                (layer.out, "output.dense"),
                (layer.out_norm, "output.LayerNorm"),
            ):
                _load_module(module, bare, p + name)

    def init_rope(self) -> None:
        """Absolute position embeddings: no rotary tables."""

    def int4_targets(self) -> list[Int4Target]:
        return []


BERT = Architecture(
    name="bert",
    model_types=("bert",),
    hf_classes=("BertModel",),
    check_config=check_bert,
    parse_config=parse_bert,  # type: ignore[arg-type]
    model_class=BertEncoder,  # type: ignore[arg-type]
    tensor_names=bert_tensor_names,
    kv_layers=bert_kv_layers,
    lora_targets=(),
    unused_tensors=bert_unused,
    encoder=True,
)
register(BERT)
