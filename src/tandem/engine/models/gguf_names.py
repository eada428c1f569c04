"""GGUF tensor names and layouts as HF's (shared by the GGUF reader, `loader.py`, and the Q4_1
reader, `quantized.py`)."""

from __future__ import annotations

import numpy as np

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time q/k permutation (interleaved -> HF rotate_half layout)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_to_hf_name(name: str) -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if name.startswith("blk."):
        _, index, kind, suffix = name.split(".", 3)
        if kind in _GGUF_LAYER_NAMES:
            return f"model.layers.{index}.{_GGUF_LAYER_NAMES[kind]}.{suffix}"
    return None  # e.g. rope_freqs: refused by `loader._check_gguf_tensor_names`
