"""Tiny random checkpoints of an encoder family (BERT) for the embedding tests: a `BertModel`
saved by transformers with a WordPiece tokenizer, and optionally sentence-transformers' module
files declaring its pooling."""

from __future__ import annotations

import json
import string
from pathlib import Path

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "hello",
    "world",
    "paris",
    "france",
    "embedding",
    "model",
    "text",
]


def make_tiny_bert(folder: Path, *, pooling: str | None = None, seed: int = 0) -> Path:
    """A 2-layer BERT (hidden 32, 4 heads, 128 positions) in `folder`; `pooling`
    ("cls", "mean", "lasttoken"): sentence-transformers' `modules.json` and pooling config."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *string.ascii_lowercase, *string.digits, *WORDS]
    vocab += [f"##{c}" for c in string.ascii_lowercase] + list(".,!?'")
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(str(folder))
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128,
    )  # fmt: skip
    BertModel(config).eval().save_pretrained(str(folder), safe_serialization=True)
    if pooling is not None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]
        (folder / "modules.json").write_text(json.dumps(modules))
        (folder / "1_Pooling").mkdir(exist_ok=True)
        keys = {
            "cls": "pooling_mode_cls_token",
            "mean": "pooling_mode_mean_tokens",
            "lasttoken": "pooling_mode_lasttoken",
        }
        modes = {key: name == pooling for name, key in keys.items()}
        (folder / "1_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": 32, **modes})
        )
    return folder
