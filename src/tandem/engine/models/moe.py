"""Mixture-of-experts families on the shared decoder: Mixtral (Mistral's attention, every layer
sparse, w1/w3/w2 experts under `block_sparse_moe`) and Qwen3-MoE (Qwen3's attention with q/k norms,
sparse layers by `decoder_sparse_step` and `mlp_only_layers`, `norm_topk_prob`). Their attention
keeps LoRA; the experts do not (`lora_targets`: an adapter naming an MLP module is refused)."""

from __future__ import annotations

from typing import Any

from tandem.engine.models.decoder import DecoderConfig, DecoderLM, decoder_kv_layers, decoder_tensor_names
from tandem.engine.models.moe_layer import MoEConfig
from tandem.engine.models.qwen import check_qwen3, parse_qwen3
from tandem.engine.models.registry import Architecture, register
from tandem.engine.models.support import check_common, decoder_fields, layer_windows
from tandem.platform.errors import ModelLoadError

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _num_experts(cfg: dict[str, Any]) -> int:
    value = cfg.get("num_local_experts", cfg.get("num_experts"))
    if not value or int(value) < 1:
        raise ModelLoadError(
            "config key num_local_experts (or num_experts) must be a positive count", param="model"
        )
    return int(value)


def _top_k(cfg: dict[str, Any], num_experts: int) -> int:
    top_k = int(cfg.get("num_experts_per_tok", 2))
    if not 1 <= top_k <= num_experts:
        raise ModelLoadError(
            f"config key num_experts_per_tok={top_k} must be between 1 and the {num_experts} experts",
            param="model",
        )
    return top_k


def check_mixtral(cfg: dict[str, Any]) -> None:
    check_common(cfg, sliding_window=True)
    _top_k(cfg, _num_experts(cfg))


def parse_mixtral(cfg: dict[str, Any]) -> DecoderConfig:
    num_experts = _num_experts(cfg)
    layers = int(cfg["num_hidden_layers"])
    return DecoderConfig(
        **decoder_fields(cfg),
        model_type="mixtral",
        layer_windows=layer_windows(cfg, ["sliding_attention"] * layers),
        moe=MoEConfig(
            num_experts=num_experts,
            top_k=_top_k(cfg, num_experts),
            intermediate_size=int(cfg["intermediate_size"]),
            renormalize=True,
            checkpoint_prefix="block_sparse_moe",
            expert_names=("w1", "w3", "w2"),
        ),
    )


def _qwen3_moe_sparse_layers(cfg: dict[str, Any]) -> frozenset[int]:
    """HF's rule: a layer has experts unless it is in `mlp_only_layers`, and when (i + 1) is a
    multiple of `decoder_sparse_step`."""
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or [])
    return frozenset(
        i for i in range(int(cfg["num_hidden_layers"])) if i not in dense and step > 0 and (i + 1) % step == 0
    )


def check_qwen3_moe(cfg: dict[str, Any]) -> None:
    check_qwen3(cfg)
    _top_k(cfg, _num_experts(cfg))
    if cfg.get("shared_expert_intermediate_size"):
        raise ModelLoadError(
            "config key shared_expert_intermediate_size is set: a shared expert is not part of qwen3_moe "
            "(refused rather than answered inexactly)",
            param="model",
        )


def parse_qwen3_moe(cfg: dict[str, Any]) -> DecoderConfig:
    dense = parse_qwen3(cfg)
    num_experts = _num_experts(cfg)
    dense.model_type = "qwen3_moe"
    dense.moe = MoEConfig(
        num_experts=num_experts,
        top_k=_top_k(cfg, num_experts),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        renormalize=bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=_qwen3_moe_sparse_layers(cfg),
    )
    return dense


MIXTRAL = Architecture(
    name="mixtral",
    model_types=("mixtral",),
    hf_classes=("MixtralForCausalLM",),
    check_config=check_mixtral,
    parse_config=parse_mixtral,
    model_class=DecoderLM,
    tensor_names=decoder_tensor_names,
    kv_layers=decoder_kv_layers,
    lora_targets=ATTENTION_TARGETS,
)
QWEN3_MOE = Architecture(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    hf_classes=("Qwen3MoeForCausalLM",),
    check_config=check_qwen3_moe,
    parse_config=parse_qwen3_moe,
    model_class=DecoderLM,
    tensor_names=decoder_tensor_names,
    kv_layers=decoder_kv_layers,
    lora_targets=ATTENTION_TARGETS,
)
register(MIXTRAL, replace=True)
register(QWEN3_MOE, replace=True)
