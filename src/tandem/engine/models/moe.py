"""Mixture-of-experts families on the shared decoder: Mixtral (Mistral's attention, every layer
sparse, w1/w3/w2 experts under `block_sparse_moe`), Qwen3-MoE (Qwen3's attention with q/k norms,
sparse layers by `decoder_sparse_step` and `mlp_only_layers`, `norm_topk_prob`) and GLM-4.5
(`glm4_moe`: partial rotary embeddings, optional q/k norms and q/k/v biases, dense layers before
`first_k_dense_replace`, DeepSeek-V3's sigmoid routing with groups, a score correction bias and a
routed scaling factor, and a shared expert). Their attention keeps LoRA; the experts do not
(`lora_targets`: an adapter naming an MLP module is refused)."""

from __future__ import annotations

from typing import Any

from tandem.engine.models.decoder import DecoderLM
from tandem.engine.models.decoder_config import DecoderConfig, decoder_kv_layers, decoder_tensor_names
from tandem.engine.models.hf_config import HFConfig
from tandem.engine.models.moe_layer import MoEConfig
from tandem.engine.models.qwen import check_qwen3, parse_qwen3
from tandem.engine.models.registry import Architecture, register
from tandem.engine.models.support import check_common, decoder_fields, layer_windows
from tandem.platform.errors import ModelLoadError

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _num_experts(cfg: HFConfig) -> int:
    value = cfg.get("num_local_experts", cfg.get("num_experts"))
    if not value or int(value) < 1:
        raise ModelLoadError(
            "config key num_local_experts (or num_experts) must be a positive count", param="model"
        )
    return int(value)


def _top_k(cfg: HFConfig, num_experts: int) -> int:
    top_k = int(cfg.get("num_experts_per_tok", 2))
    if not 1 <= top_k <= num_experts:
        raise ModelLoadError(
            f"config key num_experts_per_tok={top_k} must be between 1 and the {num_experts} experts",
            param="model",
        )
    return top_k


def check_mixtral(cfg: HFConfig) -> None:
    check_common(cfg, sliding_window=True)
    _top_k(cfg, _num_experts(cfg))


def parse_mixtral(cfg: HFConfig) -> DecoderConfig:
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


def _qwen3_moe_sparse_layers(cfg: HFConfig) -> frozenset[int]:
    """HF's rule: a layer has experts unless it is in `mlp_only_layers`, and when (i + 1) is a
    multiple of `decoder_sparse_step`."""
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or [])
    return frozenset(
        i for i in range(int(cfg["num_hidden_layers"])) if i not in dense and step > 0 and (i + 1) % step == 0
    )


def check_qwen3_moe(cfg: HFConfig) -> None:
    check_qwen3(cfg)
    _top_k(cfg, _num_experts(cfg))
    if cfg.get("shared_expert_intermediate_size"):
        raise ModelLoadError(
            "config key shared_expert_intermediate_size is set: a shared expert is not part of qwen3_moe "
            "(refused rather than answered inexactly)",
            param="model",
        )


def parse_qwen3_moe(cfg: HFConfig) -> DecoderConfig:
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


def _rope_fraction(cfg: HFConfig) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))


def num_mtp_layers(cfg: HFConfig) -> int:
    """How many multi-token-prediction layers the checkpoint carries after the decoder's."""
    return int(cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers")) or 0)


def mtp_layer_tensor(cfg: DecoderConfig, name: str) -> bool:
    """A tensor of a multi-token-prediction layer (GLM-4.5, DeepSeek-V3): the layers numbered
    from `num_hidden_layers` on, which predict further tokens for speculation and are not in the
    model's forward pass (HF skips them too)."""
    parts = name.split(".")
    if "layers" not in parts[:-1]:
        return False
    index = parts[parts.index("layers") + 1]
    return (
        index.isdigit() and cfg.num_hidden_layers <= int(index) < cfg.num_hidden_layers + cfg.num_mtp_layers
    )


def check_grouped_routing(cfg: HFConfig) -> None:
    """DeepSeek-style routing keys (GLM-4.5, DeepSeek-V3): experts, top-k and groups that fit."""
    num_experts = _num_experts(
        HFConfig({**cfg, "num_local_experts": cfg.get("n_routed_experts", cfg.get("num_local_experts"))})
    )
    _top_k(cfg, num_experts)
    groups, topk_groups = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if groups < 1 or num_experts % groups or not 1 <= topk_groups <= groups:
        raise ModelLoadError(
            f"config keys n_group={groups} / topk_group={topk_groups} must split the {num_experts} experts evenly "
            "and choose at most n_group groups",
            param="model",
        )
    if groups > 1 and num_experts // groups < 2:
        raise ModelLoadError(
            "config key n_group leaves groups of one expert (a group scores its best two)", param="model"
        )


def routed_experts(cfg: HFConfig) -> MoEConfig:
    """The sparse layers of GLM-4.5 and DeepSeek-V3: after `first_k_dense_replace` dense ones,
    sigmoid routing with groups, a correction bias and a scale, plus `n_shared_experts`."""
    num_experts = int(cfg.get("n_routed_experts", cfg.get("num_local_experts", 0)))
    first_sparse = int(cfg.get("first_k_dense_replace") or 0)
    return MoEConfig(
        num_experts=num_experts,
        top_k=_top_k(cfg, num_experts),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        renormalize=bool(cfg.get("norm_topk_prob", True)),
        sparse_layers=frozenset(range(first_sparse, int(cfg["num_hidden_layers"]))),
        scoring="sigmoid",
        num_groups=int(cfg.get("n_group") or 1),
        topk_groups=int(cfg.get("topk_group") or 1),
        routed_scaling=float(cfg.get("routed_scaling_factor", 1.0)),
        correction_bias=True,
        shared_intermediate_size=int(cfg["moe_intermediate_size"]) * int(cfg.get("n_shared_experts") or 0),
    )


def check_glm4_moe(cfg: HFConfig) -> None:
    check_common(cfg, implemented=("attention_bias", "use_qk_norm"), partial_rotary=True)
    check_grouped_routing(cfg)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    rotary = head_dim * _rope_fraction(cfg)
    if rotary != int(rotary) or int(rotary) % 2 or int(rotary) < 2:
        raise ModelLoadError(
            f"partial_rotary_factor gives {rotary} rotary dims of {head_dim}: not an even count",
            param="model",
        )


def parse_glm4_moe(cfg: HFConfig) -> DecoderConfig:
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    rotary_dim = int(head_dim * _rope_fraction(cfg))
    return DecoderConfig(
        **decoder_fields(cfg),
        model_type="glm4_moe",
        qkv_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=bool(cfg.get("use_qk_norm", False)),
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
        moe=routed_experts(HFConfig({"first_k_dense_replace": 1, **cfg})),
        num_mtp_layers=num_mtp_layers(cfg),
    )


def _moe_architecture(name: str, hf_class: str, check: Any, parse: Any, **extra: Any) -> Architecture:
    """An entry on the shared decoder whose LoRA adapters may target the attention only."""
    return Architecture(
        name=name, model_types=(name,), hf_classes=(hf_class,), check_config=check, parse_config=parse,
        model_class=DecoderLM, tensor_names=decoder_tensor_names, kv_layers=decoder_kv_layers,
        lora_targets=ATTENTION_TARGETS, **extra,
    )  # fmt: skip


MIXTRAL = _moe_architecture("mixtral", "MixtralForCausalLM", check_mixtral, parse_mixtral)
QWEN3_MOE = _moe_architecture("qwen3_moe", "Qwen3MoeForCausalLM", check_qwen3_moe, parse_qwen3_moe)
GLM4_MOE = _moe_architecture(
    "glm4_moe", "Glm4MoeForCausalLM", check_glm4_moe, parse_glm4_moe, unused_tensors=mtp_layer_tensor
)
register(MIXTRAL, replace=True)
register(GLM4_MOE, replace=True)
register(QWEN3_MOE, replace=True)
