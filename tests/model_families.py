"""Tiny random-weight checkpoints of every supported family, saved by `transformers` itself (the
reference nobody here wrote): shared by the family parity tests and `benchmarks/`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

WINDOW = 8  # sliding window of the families that have one: every test prompt is longer

COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}

# family -> (transformers config class, causal-LM class, config overrides)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW, "head_dim": 16}),
    "ministral": (
        "MinistralConfig",
        "MinistralForCausalLM",
        {
            "sliding_window": WINDOW,
            "head_dim": 16,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        },
    ),  # fmt: skip
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2},
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "attention_bias": True}),
    "gemma": (
        "GemmaConfig",
        "GemmaForCausalLM",
        {"head_dim": 16, "tie_word_embeddings": False, "attention_bias": True},
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 2.0,  # small caps so that capping changes the answer
            "final_logit_softcapping": 5.0,
            "tie_word_embeddings": False,  # tied, a random model repeats its last token (embedding x sqrt(hidden))
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "tie_word_embeddings": False,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            },
        },
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            "sliding_window": WINDOW,
            "original_max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.25 * i for i in range(8)],
                "long_factor": [4.0] * 8,
                "original_max_position_embeddings": 256,
            },
        },
    ),
}

# Mixture-of-experts families: 8 experts, top-2 (Qwen3-MoE with one dense layer among the sparse)
MOE_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
            "norm_topk_prob": True,
        },
    ),  # fmt: skip
    # DeepSeek-style routing: 4 groups of 2, 2 groups eligible, a correction bias and a scale, one
    # shared expert, a dense first layer; q/k/v biases, q/k norms and half the head rotated
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        {
            "head_dim": 16,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 1,
            "norm_topk_prob": True,
            "attention_bias": True,
            "use_qk_norm": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        },
    ),  # fmt: skip
    # Multi-head latent attention (q and kv through low-rank latents, interleaved rotary dims) and
    # GLM's routing, scaled down: latent 32 + rotary 8 per token for 4 heads of 16 + 8 and 16
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            "num_key_value_heads": 4,
            "q_lora_rank": 32,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 1,
            "norm_topk_prob": True,
            "rope_interleave": True,
        },
    ),  # fmt: skip
    # Kimi K2's shape: DeepSeek-V3's layers with many experts, 8 active, one group, no q latent
    "kimi_k2": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            "num_key_value_heads": 4,
            "q_lora_rank": None,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 64,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 16,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 2.827,
            "first_k_dense_replace": 1,
            "norm_topk_prob": True,
        },
    ),  # fmt: skip
}
MLA_FAMILIES = ("deepseek_v3", "kimi_k2")
ALL_FAMILIES = {**FAMILIES, **MOE_FAMILIES}


def save_family_model(family: str, folder: Path, tokenizer_files: Path, *, seed: int = 0) -> Path:
    """The family's tiny model with every parameter drawn at random (biases and norm weights
    included: HF starts them at 0 / 1, where a dropped bias or a wrong norm offset would not
    show), saved with the tokenizer of `tokenizer_files`."""
    import transformers

    config_name, model_name, overrides = ALL_FAMILIES[family]
    vocab = json.loads((tokenizer_files / "config.json").read_text())
    config = getattr(transformers, config_name)(
        vocab_size=vocab["vocab_size"],
        eos_token_id=vocab["eos_token_id"],
        bos_token_id=vocab["bos_token_id"],
        pad_token_id=None,
        **{**COMMON, **overrides},
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and "gemma" in family:  # (1 + w): w near 0
                param.normal_(0.0, 0.2)
            elif name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.2)
            else:
                param.normal_(0.0, 0.12)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_files / name, folder / name)
    return folder


def load_hf(family: str, folder: Path) -> Any:
    import transformers

    _, model_name, _ = ALL_FAMILIES[family]
    model = getattr(transformers, model_name).from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def main() -> None:
    """`python -m tests.model_families OUT`: every family's tiny checkpoint under OUT/<family>
    (for `benchmarks/quant_quality.py --model` and `benchmarks/engine_throughput.py --model`)."""
    import argparse

    from .conftest import make_tiny_model

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(ALL_FAMILIES))
    args = parser.parse_args()
    tokenizer_files = make_tiny_model(args.out / "_tokenizer", num_layers=1)
    for family in args.families:
        print(save_family_model(family, args.out / family, tokenizer_files))


if __name__ == "__main__":
    main()
