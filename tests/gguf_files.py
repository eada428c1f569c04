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

from .model_families import COMMON, MOE_FAMILIES  # the same tiny shapes as the HF-folder family tests

DEEPSEEK_V3 = MOE_FAMILIES["deepseek_v3"][2]  # the HF-folder family tests' tiny DeepSeek-V3
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
    "glm4moe": (
        "glm4moe",
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        {
            "head_dim": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "n_group": 1,  # llama.cpp's converter writes no groups for GLM-4.5 (its files have one)
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 1,
            "norm_topk_prob": True,
            "attention_bias": True,
            "use_qk_norm": True,
            "num_nextn_predict_layers": 1,  # written as one more block, which the loader skips
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        },
        "Q8_0",
    ),  # fmt: skip
    "deepseek2": ("deepseek2", "DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK_V3, "Q8_0"),
    # a converter that wrote the halves and kept the whole kv_b too
    "deepseek2-kv-b-and-halves": (
        "deepseek2",
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        DEEPSEEK_V3,
        "Q8_0",
    ),
    # a file from before llama.cpp split kv_b for absorbed MLA (no `*_mla` head-size keys)
    "deepseek2-whole-kv-b": ("deepseek2", "DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK_V3, "Q4_0"),
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
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # the router's bias (a buffer): not zeros
                buffer.normal_(0.0, 0.5)
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
    _write_metadata(writer, config, family, tokenizer_files, tokens)
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    table = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers + _num_mtp(config))
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
        if family == "deepseek2-kv-b-and-halves" and name.endswith("kv_b_proj.weight"):
            out += _split_kv_b(name, array, config)  # and the whole one below
        elif family == "deepseek2" and name.endswith("kv_b_proj.weight"):  # split for absorbed MLA
            out += _split_kv_b(name, array, config)
            continue
        lookup = name.replace("e_score_correction_bias", "e_score_correction.bias")  # as llama.cpp renames it
        gguf_name = table.get_name(lookup, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        out.append((gguf_name, array, quantised))
    for merged, by_index in experts.items():
        stacked = np.stack([by_index[i] for i in sorted(by_index)])
        out.append((table.get_name(merged + ".weight", try_suffixes=(".weight",)), stacked, True))
    for index in range(config.num_hidden_layers, config.num_hidden_layers + _num_mtp(config)):
        rng = np.random.default_rng(index)  # a NextN block as GLM-4.5's files carry one
        hidden = config.hidden_size
        shapes = {
            "attn_norm.weight": (hidden,),
            "attn_q.weight": (hidden, hidden),
            "nextn.eh_proj.weight": (hidden, 2 * hidden),
        }
        for name, shape in shapes.items():
            out.append(
                (f"blk.{index}.{name}", rng.standard_normal(shape).astype(np.float32), len(shape) == 2)
            )
    return out


def _split_kv_b(name: str, kv_b: np.ndarray, config: Any) -> list[tuple[str, np.ndarray, bool]]:
    """llama.cpp's DeepSeek converter: kv_b [heads * (nope + v), kv_lora] as attn_k_b
    [heads, kv_lora, nope] (transposed) and attn_v_b [heads, v, kv_lora], kept float."""
    layer = name.split(".")[2]
    nope, v = config.qk_nope_head_dim, config.v_head_dim
    per_head = kv_b.reshape(config.num_attention_heads, nope + v, kv_b.shape[-1])
    k_b = np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))
    v_b = np.ascontiguousarray(per_head[:, nope:])
    return [(f"blk.{layer}.attn_k_b.weight", k_b, False), (f"blk.{layer}.attn_v_b.weight", v_b, False)]


def _num_mtp(config: Any) -> int:
    """The NextN blocks llama.cpp's converter writes: GLM-4.5's (it skips DeepSeek's)."""
    return int(config.num_nextn_predict_layers or 0) if config.model_type == "glm4_moe" else 0


def _write_metadata(writer: Any, config: Any, family: str, tokenizer_files: Path, tokens: list[str]) -> None:

    arch = GGUF_FAMILIES[family][0]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers + _num_mtp(config))
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(1 if arch == "deepseek2" else config.num_key_value_heads)  # MLA as MQA
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch != "deepseek2":
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
    if arch == "glm4moe":  # as llama.cpp's `Glm4MoeModel` writes them
        rope = config.rope_parameters
        writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
        _write_sigmoid_routing(writer, config)
        writer.add_nextn_predict_layers(config.num_nextn_predict_layers)
    if arch == "deepseek2":  # as llama.cpp's `DeepseekV2Model` writes it
        _write_deepseek2(writer, config, split_kv_b=family != "deepseek2-whole-kv-b")
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


def _write_deepseek2(writer: Any, config: Any, *, split_kv_b: bool) -> None:
    rope, nope, v, kv_lora = (
        config.qk_rope_head_dim,
        config.qk_nope_head_dim,
        config.v_head_dim,
        config.kv_lora_rank,
    )
    writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(kv_lora)
    if split_kv_b:  # MLA as MQA over the latent, the head sizes under `*_mla`
        writer.add_key_length(kv_lora + rope)
        writer.add_value_length(kv_lora)
        writer.add_key_length_mla(nope + rope)
        writer.add_value_length_mla(v)
    else:
        writer.add_key_length(nope + rope)
        writer.add_value_length(v)
    writer.add_rope_dimension_count(rope)
    _write_sigmoid_routing(writer, config)
    writer.add_expert_group_count(config.n_group)
    writer.add_expert_group_used_count(config.topk_group)


def _write_sigmoid_routing(writer: Any, config: Any) -> None:
    """GLM-4.5's and DeepSeek-V3's routing keys, as llama.cpp's converters write them."""
    import gguf

    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_weights_norm(config.norm_topk_prob)
