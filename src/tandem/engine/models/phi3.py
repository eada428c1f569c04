"""Phi-3: Llama's maths with q/k/v and gate/up stored fused in the checkpoint (`qkv_proj`,
`gate_up_proj`; PEFT adapters target those names too), LongRoPE scaling, and a sliding window on
every layer when `sliding_window` is shorter than the context.

LongRoPE: HF uses the short factors while a sequence is within `original_max_position_embeddings`
and re-rotates the whole sequence with the long ones beyond it (which a KV cache cannot do
exactly), so a LongRoPE model is served up to its original context: `max_position_embeddings`
becomes that, with the scaling's `factor` kept at HF's (its stated context / the original).
"""

from __future__ import annotations

import torch

from tandem.engine.lora.checkpoint import FUSED_CHECKPOINT_TARGETS
from tandem.engine.models.decoder import DecoderLM
from tandem.engine.models.decoder_config import DecoderConfig, decoder_kv_layers
from tandem.engine.models.hf_config import HFConfig
from tandem.engine.models.registry import Architecture, register
from tandem.engine.models.support import check_common, decoder_fields, layer_windows, layered_tensor_names


def check_phi3(cfg: HFConfig) -> None:
    check_common(cfg, sliding_window=True)


def parse_phi3(cfg: HFConfig) -> DecoderConfig:
    fields = decoder_fields(cfg)
    layers = int(cfg["num_hidden_layers"])
    scaling = fields["rope_scaling"]
    if scaling and scaling.get("rope_type", scaling.get("type")) == "longrope":
        original = int(scaling["original_max_position_embeddings"])
        context = fields["max_position_embeddings"]
        if scaling.get("factor") is None:
            fields["rope_scaling"] = {**scaling, "factor": context / original}
        fields["max_position_embeddings"] = min(context, original)
    return DecoderConfig(
        **fields, model_type="phi3", layer_windows=layer_windows(cfg, ["sliding_attention"] * layers)
    )


PHI3_LAYER_TENSORS = (
    "self_attn.qkv_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


def phi3_tensor_names(cfg: DecoderConfig, prefix: str) -> set[str]:
    return layered_tensor_names(cfg.num_hidden_layers, PHI3_LAYER_TENSORS, prefix=prefix)


class Phi3ForCausalLM(DecoderLM):
    """The shared decoder; the checkpoint's fused tensors are split into the decoder's HF names
    (q/k/v rows in that order, gate rows then up rows: how HF's `Phi3` splits them)."""

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        cfg = self.config
        q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        split: dict[str, torch.Tensor] = {}
        for name, tensor in weights.items():
            if name.endswith("self_attn.qkv_proj.weight"):
                base = name.removesuffix("qkv_proj.weight")
                if tensor.shape[0] != q_size + 2 * kv_size:
                    raise ValueError(
                        f"weight {name!r}: expected {q_size + 2 * kv_size} rows, got {tensor.shape[0]}"
                    )
                q, k, v = tensor.split([q_size, kv_size, kv_size], dim=0)
                split.update(
                    {base + "q_proj.weight": q, base + "k_proj.weight": k, base + "v_proj.weight": v}
                )
            elif name.endswith("mlp.gate_up_proj.weight"):
                base = name.removesuffix("gate_up_proj.weight")
                if tensor.shape[0] != 2 * cfg.intermediate_size:
                    raise ValueError(
                        f"weight {name!r}: expected {2 * cfg.intermediate_size} rows, got {tensor.shape[0]}"
                    )
                gate, up = tensor.split(cfg.intermediate_size, dim=0)
                split.update({base + "gate_proj.weight": gate, base + "up_proj.weight": up})
            else:
                split[name] = tensor
        super().load_hf_state_dict(split)


PHI3 = Architecture(
    name="phi3",
    model_types=("phi3",),
    hf_classes=("Phi3ForCausalLM",),
    check_config=check_phi3,
    parse_config=parse_phi3,
    model_class=Phi3ForCausalLM,
    tensor_names=phi3_tensor_names,
    kv_layers=decoder_kv_layers,
    lora_targets=FUSED_CHECKPOINT_TARGETS,
)
register(PHI3, replace=True)
