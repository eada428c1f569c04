"""Tiny random checkpoints of each family written to GGUF with the `gguf` package's own writer,
as llama.cpp's converter writes them: tensor names from `gguf`'s table, Llama's q/k rows permuted
for interleaved RoPE, Gemma's RMSNorm weights stored as 1 + w, the linears quantised by
`gguf.quants.quantize` to the family's type. The HF model returned holds the dequantised values:
it is the reference (HF float32 on the dequantised weights)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .model_families import COMMON  # the same tiny shapes as the HF-folder family tests

# family -> (GGUF architecture, transformers config, causal-LM class, overrides, the linears' type)
GGUF_FAMILIES: dict[str, tuple[str, str, str, dict[str, Any], str]] = {
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM", {}, "Q4_0"),
    "mixtral": (
        "llama",
        "MixtralConfig",
        "MixtralForCausalLM",
        {"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
        "Q5_0",
    ),
    "qwen2": ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", {}, "Q5_1"),
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, "Q8_0"),
    "qwen3moe": (
        "qwen3moe",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
        "Q4_0",
    ),
    "phi3": ("phi3", "Phi3Config", "Phi3ForCausalLM", {"sliding_window": None}, "Q4_1"),
    "gemma": (
        "gemma",
        "GemmaConfig",
        "GemmaForCausalLM",
        {"head_dim": 16, "hidden_act": "gelu_pytorch_tanh"},  # llama.cpp ties Gemma's head
        "Q5_0",
    ),
    "gemma2": (
        "gemma2",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 8,
            "query_pre_attn_scalar": 16,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 5.0,  # llama.cpp ties Gemma 2's head
        },
        "F16",
    ),  # fmt: skip
    "gemma3": (
        "gemma3",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 8,
            "query_pre_attn_scalar": 16,
            "tie_word_embeddings": False,
            "num_hidden_layers": 6,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        },
        "BF16",
    ),  # fmt: skip
}
ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight")  # kept float32, as llama.cpp keeps them


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert-time q/k permutation (HF rotate_half -> interleaved)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_family_gguf(family: str, tokenizer_files: Path, path: Path, seed: int = 0) -> Any:
    """Write `family`'s tiny random model to `path`; returns the HF model on the dequantised weights
    (saved by transformers, so per-expert checkpoint names, which llama.cpp stacks per layer)."""
    import gguf
    import transformers
    from safetensors.numpy import load_file, save_file

    arch, config_name, model_name, overrides, linear_type = GGUF_FAMILIES[family]
    vocab = json.loads((tokenizer_files / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    config = getattr(transformers, config_name)(
        vocab_size=len(tokens), bos_token_id=vocab["<|endoftext|>"], eos_token_id=vocab["<|im_end|>"],
        pad_token_id=None, **{**COMMON, **overrides},
    )  # fmt: skip
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's (1 + w): w near 0
                param.normal_(0.0 if "gemma" in family else 1.0, 0.2)
            else:
                param.normal_(0.0, 0.2 if name.endswith(".bias") else 0.12)
    folder = path.with_suffix(".hf")
    model.save_pretrained(str(folder), safe_serialization=True)
    state = load_file(str(folder / "model.safetensors"))
    qtype = gguf.GGMLQuantizationType[linear_type]
    for name, array in state.items():  # the reference holds what the file holds
        if array.ndim == 2 and "embed_tokens" not in name and not name.endswith(ROUTERS):
            state[name] = gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype).reshape(
                array.shape
            )
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, config, arch, tokenizer_files, tokens)
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    table = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    for gguf_name, array, quantised in _gguf_tensors(state, config, family, table):
        if quantised:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return getattr(transformers, model_name).from_pretrained(str(folder), dtype=torch.float32).eval()


def _gguf_tensors(
    state: dict[str, np.ndarray], config: Any, family: str, table: Any
) -> list[tuple[str, np.ndarray, bool]]:
    """(GGUF name, values as llama.cpp stores them, quantised?) for every tensor; experts stacked."""
    out, experts = [], {}
    for name, array in sorted(state.items()):
        match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name)
        if match:
            experts.setdefault(f"{match[1]}.{match[3]}", {})[int(match[2])] = array
            continue
        quantised = array.ndim == 2 and "embed_tokens" not in name and not name.endswith(ROUTERS)
        if family in ("llama", "mixtral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            array = _permute(array, heads)
        if name.endswith("norm.weight") and "gemma" in family:
            array = array + np.float32(1.0)
        gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        out.append((gguf_name, array, quantised))
    for merged, by_index in experts.items():
        stacked = np.stack([by_index[i] for i in sorted(by_index)])
        out.append((table.get_name(merged + ".weight", try_suffixes=(".weight",)), stacked, True))
    return out


def _write_metadata(writer: Any, config: Any, arch: str, tokenizer_files: Path, tokens: list[str]) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("full_attention", rope).get("rope_theta", 10000.0)
    writer.add_rope_freq_base(float(theta))
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(config.sliding_window)
    if arch == "llama" and hasattr(config, "num_local_experts"):
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    tokenizer = json.loads((tokenizer_files / "tokenizer.json").read_text())
    specials = {t["content"] for t in tokenizer["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_add_bos_token(False)
