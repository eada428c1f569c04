"""DeepSeek-V3 (and Kimi K2, whose checkpoints name `DeepseekV3ForCausalLM`): multi-head latent
attention (`mla.py`: a latent KV cache shared by every head, absorbed attention) and
mixture-of-experts layers after `first_k_dense_replace` dense ones, routed as GLM-4.5 is (sigmoid
scores, expert groups, a correction bias, a routed scaling factor) with shared experts. LoRA
adapters are refused (`lora_targets` is empty): their targets would be the latent projections."""

from __future__ import annotations

import math

from tandem.engine.models.decoder import DecoderLM
from tandem.engine.models.decoder_config import DecoderConfig, decoder_tensor_names
from tandem.engine.models.hf_config import HFConfig
from tandem.engine.models.interface import LayerKV
from tandem.engine.models.mla import MLAConfig
from tandem.engine.models.moe import check_grouped_routing, mtp_layer_tensor, num_mtp_layers, routed_experts
from tandem.engine.models.registry import Architecture, register
from tandem.engine.models.support import check_common, decoder_fields, rope_settings
from tandem.platform.errors import ModelLoadError


def _softmax_scale(cfg: HFConfig) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale squared when `mscale_all_dim` is set (HF's
    `yarn_apply_mscale`: DeepSeek scales the whole score, the non-rotary dims included)."""
    scale = (int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])) ** -0.5
    _, scaling, _ = rope_settings(cfg)
    if scaling and scaling.get("mscale_all_dim"):
        factor, mscale_all_dim = float(scaling["factor"]), float(scaling["mscale_all_dim"])
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def check_deepseek_v3(cfg: HFConfig) -> None:
    check_common(cfg, implemented=("attention_bias",))
    for key, allowed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if cfg.get(key) not in (None, allowed):
            raise ModelLoadError(
                f"config key {key}={cfg[key]!r} is not supported (only {allowed!r}; refused rather than "
                "answered inexactly)",
                param="model",
            )
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not cfg.get(key) or int(cfg[key]) < 1:
            raise ModelLoadError(f"config key {key} must be a positive size", param="model")
    if int(cfg["qk_rope_head_dim"]) % 2:
        raise ModelLoadError("config key qk_rope_head_dim must be even (rotary pairs)", param="model")
    check_grouped_routing(cfg)


def parse_deepseek_v3(cfg: HFConfig) -> DecoderConfig:
    rope_dim = int(cfg["qk_rope_head_dim"])
    q_lora = cfg.get("q_lora_rank")
    fields = decoder_fields(cfg, default_eps=1e-6)
    fields["head_dim"] = rope_dim  # what the rotary tables cover (HF's `head_dim` for DeepSeek)
    fields["num_key_value_heads"] = 1  # one latent vector per token, shared by every head
    return DecoderConfig(
        **fields,
        model_type="deepseek_v3",
        mla=MLAConfig(
            q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=rope_dim,
            v_head_dim=int(cfg["v_head_dim"]),
            softmax_scale=_softmax_scale(cfg),
            rope_interleave=bool(cfg.get("rope_interleave", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
        ),
        moe=routed_experts(cfg),
        num_mtp_layers=num_mtp_layers(cfg),
    )


def deepseek_kv_layers(cfg: DecoderConfig) -> list[LayerKV]:
    assert cfg.mla is not None
    return [LayerKV(1, cfg.mla.latent_dim, shared_kv=True) for _ in range(cfg.num_hidden_layers)]


DEEPSEEK_V3 = Architecture(
    name="deepseek_v3",
    model_types=("deepseek_v3", "kimi_k2"),
    hf_classes=("DeepseekV3ForCausalLM",),
    check_config=check_deepseek_v3,
    parse_config=parse_deepseek_v3,
    model_class=DecoderLM,
    tensor_names=decoder_tensor_names,
    kv_layers=deepseek_kv_layers,
    lora_targets=(),
    unused_tensors=mtp_layer_tensor,
)
register(DEEPSEEK_V3, replace=True)
