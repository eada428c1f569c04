"""What a GGUF file's architecture means in HF terms: its metadata as an HF `config.json` dict,
its tensor names as the HF checkpoint names the registered architecture consumes, and the value
transforms llama.cpp's converter applied (undone here).

Contract: `GGUFModel.hf_config()` is the config an HF folder of the same weights would carry (the
loader parses it with the registered architecture, exactly as a folder's); `hf_name(gguf_name)`
is the checkpoint name of a file tensor (None: the architecture does not consume it, and the
loader refuses the file by that name); `to_hf(hf_name, array)` undoes the converter's layout and
value changes on a dequantised [rows, cols] array. Tensor names come from the `gguf` package's own
`TensorNameMap` (llama.cpp's table), never from a table of ours.

Converter transforms undone: Llama's q/k rows permuted for llama.cpp's interleaved RoPE
(`unpermute_rope`); Gemma's `(1 + w)` RMSNorm weights stored as `1 + w`; the router correction
bias's name (`e_score_correction.bias`); DeepSeek's `kv_b_proj` split in two for absorbed MLA
(joined by `gguf_file.MergedKVB`); GLM-4.5's NextN blocks counted in `block_count` (`skipped`). Settings llama.cpp hard-
codes per architecture rather than writing to the file (Gemma 3's five-in-six sliding layers and
10k local RoPE base; the attention scale of Gemma 2 and 3) are stated here as llama.cpp's
`llama-model.cpp` states them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tandem.engine.models.gguf_names import unpermute_rope
from tandem.platform.errors import ModelLoadError

_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")  # HF's per-expert checkpoint names


@dataclass(frozen=True)
class GGUFFamily:
    gguf_arch: str  # general.architecture
    model_type: str  # the HF model_type it becomes
    hf_class: str
    extra_config: Callable[[GGUFMeta], dict[str, object]]  # family keys of the HF config
    permute_qk: bool = False  # llama.cpp permuted q/k rows (Llama)
    norms_plus_one: bool = False  # llama.cpp stored RMSNorm weights as 1 + w (Gemma)
    mtp_layers: bool = False  # the last `nextn_predict_layers` blocks predict further tokens (skipped)


class GGUFMeta:
    """The file's metadata under its architecture's prefix (`arch.key`), plus its tensor names."""

    def __init__(self, arch: str, fields: dict[str, object], tensor_names: set[str]) -> None:
        self.arch = arch
        self.fields = fields
        self.tensor_names = tensor_names

    def get(self, key: str, default: object = None) -> object:
        return self.fields.get(f"{self.arch}.{key}", default)

    def number(self, key: str, default: float | None = None) -> float | None:
        """A numeric key's value (None: absent and no default)."""
        value = self.get(key, default)
        return None if value is None else float(value)  # type: ignore[arg-type]

    def integer(self, key: str, default: int | None = None) -> int:
        """A required integer key (`default` where absent; refused by name when neither)."""
        value = self.get(key, default)
        if value is None:
            raise ModelLoadError(f"GGUF key {self.arch}.{key} missing", param="model")
        return int(value)  # type: ignore[call-overload]

    @property
    def head_dim(self) -> int:
        heads = self.integer("attention.head_count")
        key_length = self.integer("attention.key_length", 0) or self.integer("rope.dimension_count", 0)
        return key_length or self.integer("embedding_length") // heads


def _rope_scaling(meta: GGUFMeta) -> dict[str, object] | None:
    """The file's RoPE scaling as HF's `rope_scaling` (none, linear, YaRN; DeepSeek's YaRN mscale
    is `_deepseek2`'s)."""
    kind = meta.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": meta.number("rope.scaling.factor", 1.0)}
    if kind == "yarn":
        return {
            "rope_type": "yarn",
            "factor": meta.number("rope.scaling.factor", 1.0),
            "original_max_position_embeddings": meta.integer("rope.scaling.original_context_length"),
            "beta_fast": meta.number("rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": meta.number("rope.scaling.yarn_beta_slow", 1.0),
        }
    raise ModelLoadError(
        f"GGUF key {meta.arch}.rope.scaling.type={kind!r} is not supported (none, linear, yarn)",
        param="model",
    )


def _llama(meta: GGUFMeta) -> dict[str, object]:
    return {"hidden_act": "silu", "rope_scaling": _rope_scaling(meta), "attention_bias": False}


def _qwen2(meta: GGUFMeta) -> dict[str, object]:
    return {"hidden_act": "silu", "use_sliding_window": False, "rope_scaling": _rope_scaling(meta)}


def _qwen3(meta: GGUFMeta) -> dict[str, object]:
    bias = "blk.0.attn_q.bias" in meta.tensor_names
    return {**_qwen2(meta), "attention_bias": bias}


def _qwen3moe(meta: GGUFMeta) -> dict[str, object]:
    """llama.cpp's Qwen3-MoE: every layer sparse, the top-k weights renormalised."""
    return {
        **_qwen3(meta),
        "num_experts": meta.integer("expert_count"),
        "num_experts_per_tok": meta.integer("expert_used_count"),
        "moe_intermediate_size": meta.integer("expert_feed_forward_length"),
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _phi3(meta: GGUFMeta) -> dict[str, object]:
    window = meta.get("attention.sliding_window")
    return {"hidden_act": "silu", "rope_scaling": _rope_scaling(meta), "sliding_window": window}


def _gemma_scalar(meta: GGUFMeta, layers_27b: int) -> float:
    """llama.cpp's attention scale for Gemma 2 / 3: 1/sqrt(head_dim), except the 27B models
    (known by their layer count), which use 1/sqrt(hidden / heads)."""
    if meta.integer("block_count") == layers_27b:
        return meta.integer("embedding_length") / meta.integer("attention.head_count")
    return float(meta.head_dim)


def _gemma(meta: GGUFMeta) -> dict[str, object]:
    return {"hidden_act": "gelu_pytorch_tanh"}  # llama.cpp's GeLU is the tanh approximation


def _gemma2(meta: GGUFMeta) -> dict[str, object]:
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": meta.get("attn_logit_softcapping"),
        "final_logit_softcapping": meta.get("final_logit_softcapping"),
        "sliding_window": meta.get("attention.sliding_window"),
        "query_pre_attn_scalar": _gemma_scalar(meta, layers_27b=46),
    }


def _gemma3(meta: GGUFMeta) -> dict[str, object]:
    layers = meta.integer("block_count")
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": meta.get("attention.sliding_window"),
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        "rope_local_base_freq": 10000.0,
        "rope_scaling": _rope_scaling(meta),
        "query_pre_attn_scalar": _gemma_scalar(meta, layers_27b=62),
        "final_logit_softcapping": meta.get("final_logit_softcapping"),
        "attn_logit_softcapping": meta.get("attn_logit_softcapping"),
    }


def _glm4moe(meta: GGUFMeta) -> dict[str, object]:
    """llama.cpp's GLM-4.5 (`Glm4MoeModel`): NeoX RoPE over the head's first `rope.dimension_count`
    dims (q/k rows not permuted), DeepSeek-V3-style routing (`_sigmoid_routing`; the correction
    bias is `exp_probs_b`); the block count includes the `nextn_predict_layers` multi-token-
    prediction layers (`GGUFModel.skipped`)."""
    heads = meta.integer("attention.head_count")
    head_dim = meta.integer("attention.key_length", 0) or meta.integer("embedding_length") // heads
    return {
        **_sigmoid_routing(meta, missing=2),
        "hidden_act": "silu",
        "head_dim": head_dim,
        "partial_rotary_factor": meta.integer("rope.dimension_count", head_dim) / head_dim,
        "rope_scaling": _rope_scaling(meta),
        "attention_bias": "blk.0.attn_q.bias" in meta.tensor_names,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in meta.tensor_names,
    }


def _sigmoid_routing(meta: GGUFMeta, *, missing: int) -> dict[str, object]:
    """DeepSeek-V3-style routing keys (GLM-4.5, DeepSeek-V3): sigmoid scores (`missing`: the
    gating llama.cpp assumes where the key is absent), groups, a scale, shared experts after
    `leading_dense_block_count` dense layers, and the multi-token-prediction block count."""
    gating = meta.get("expert_gating_func", missing)
    if gating != 2:  # gguf.ExpertGatingFuncType.SIGMOID (1: softmax, DeepSeek-V2's)
        raise ModelLoadError(
            f"GGUF key {meta.arch}.expert_gating_func={gating} is not supported (2: sigmoid; "
            "softmax routing, DeepSeek-V2's, is not implemented)",
            param="model",
        )
    num_mtp = meta.integer("nextn_predict_layers", 0)
    return {
        "num_hidden_layers": meta.integer("block_count") - num_mtp,
        "num_nextn_predict_layers": num_mtp,
        "n_routed_experts": meta.integer("expert_count"),
        "num_experts_per_tok": meta.integer("expert_used_count"),
        "moe_intermediate_size": meta.integer("expert_feed_forward_length"),
        "n_shared_experts": meta.integer("expert_shared_count", 0),
        "first_k_dense_replace": meta.integer("leading_dense_block_count", 0),
        "routed_scaling_factor": meta.number("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(meta.get("expert_weights_norm", False)),  # llama.cpp's default
        "n_group": meta.integer("expert_group_count", 1),
        "topk_group": meta.integer("expert_group_used_count", 1),
    }


def _deepseek2(meta: GGUFMeta) -> dict[str, object]:
    """llama.cpp's DeepSeek-V3 / R1 / Kimi K2 (`DeepseekV2Model`): multi-head latent attention
    written as MQA (`head_count_kv` 1, `key_length` the latent plus the rotary dims); the head
    sizes are the `*_mla` keys (older files: `key_length` / `value_length` themselves). RoPE is
    interleaved (q/k rows not permuted). YaRN's mscale is `yarn_log_multiplier / 0.1`."""
    heads = meta.integer("attention.head_count")
    rope_dim = meta.integer("rope.dimension_count")
    kv_lora = meta.integer("attention.kv_lora_rank")
    mla_keys = meta.get("attention.key_length_mla") is not None
    qk_dim = meta.integer("attention.key_length_mla" if mla_keys else "attention.key_length")
    v_dim = meta.integer("attention.value_length_mla" if mla_keys else "attention.value_length")
    q_lora = meta.get("attention.q_lora_rank")
    scaling = _rope_scaling(meta)
    log_mul = meta.number("rope.scaling.yarn_log_multiplier")
    if scaling is not None and scaling["rope_type"] == "yarn" and log_mul:
        scaling = {**scaling, "mscale": log_mul / 0.1, "mscale_all_dim": log_mul / 0.1}
    return {
        **_sigmoid_routing(meta, missing=1),  # llama.cpp reads a file without the key as DeepSeek-V2's
        "hidden_act": "silu",
        "num_key_value_heads": heads,  # HF's MLA config: one key/value head per query head
        "head_dim": rope_dim,
        "q_lora_rank": None if q_lora is None else int(q_lora),  # type: ignore[call-overload]
        "kv_lora_rank": kv_lora,
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": qk_dim - rope_dim,
        "v_head_dim": v_dim,
        "rope_interleave": True,
        "rope_scaling": scaling,
        "attention_bias": False,
    }


def _mixtral(meta: GGUFMeta) -> dict[str, object]:
    return {
        **_llama(meta),
        "num_local_experts": meta.integer("expert_count"),
        "num_experts_per_tok": meta.integer("expert_used_count"),
        "sliding_window": None,
    }


MIXTRAL = GGUFFamily("llama", "mixtral", "MixtralForCausalLM", _mixtral, permute_qk=True)
FAMILIES = {
    family.gguf_arch: family
    for family in (
        GGUFFamily("llama", "llama", "LlamaForCausalLM", _llama, permute_qk=True),
        GGUFFamily("qwen2", "qwen2", "Qwen2ForCausalLM", _qwen2),
        GGUFFamily("qwen3", "qwen3", "Qwen3ForCausalLM", _qwen3),
        GGUFFamily("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM", _qwen3moe),
        GGUFFamily("phi3", "phi3", "Phi3ForCausalLM", _phi3),
        GGUFFamily("gemma", "gemma", "GemmaForCausalLM", _gemma, norms_plus_one=True),
        GGUFFamily("gemma2", "gemma2", "Gemma2ForCausalLM", _gemma2, norms_plus_one=True),
        GGUFFamily("gemma3", "gemma3_text", "Gemma3ForCausalLM", _gemma3, norms_plus_one=True),
        GGUFFamily("glm4moe", "glm4_moe", "Glm4MoeForCausalLM", _glm4moe, mtp_layers=True),
        GGUFFamily("deepseek2", "deepseek_v3", "DeepseekV3ForCausalLM", _deepseek2, mtp_layers=True),
    )
}


class GGUFModel:
    """One GGUF file's architecture: config, names and transforms (see the module docstring)."""

    def __init__(self, fields: dict[str, object], tensor_names: set[str], source: str) -> None:
        arch = fields.get("general.architecture")
        if arch not in FAMILIES:
            raise ModelLoadError(
                f"{source}: GGUF architecture {arch!r} unsupported (supported: {', '.join(FAMILIES)})",
                param="model",
            )
        self.family = FAMILIES[arch]
        if arch == "llama" and fields.get("llama.expert_count"):  # a Mixtral file is a llama with experts
            self.family = MIXTRAL
        self.meta = GGUFMeta(str(arch), fields, tensor_names)
        self.source = source
        self._names: dict[str, str] | None = None
        self._experts: dict[str, list[str]] = {}

    def hf_config(self, eos_token_ids: list[int]) -> dict[str, object]:
        meta, family = self.meta, self.family
        tokens = meta.fields["tokenizer.ggml.tokens"]
        vocab = meta.integer("vocab_size", 0) or len(tokens)  # type: ignore[arg-type]
        heads = meta.integer("attention.head_count")
        eos: int | list[int] = eos_token_ids[0] if len(eos_token_ids) == 1 else list(eos_token_ids)
        config = {
            "architectures": [family.hf_class],
            "model_type": family.model_type,
            "vocab_size": vocab,
            "hidden_size": meta.integer("embedding_length"),
            "intermediate_size": meta.integer(
                "feed_forward_length", meta.integer("expert_feed_forward_length", 0)
            ),
            "num_hidden_layers": meta.integer("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": meta.integer("attention.head_count_kv", heads),
            "head_dim": meta.head_dim,
            "rms_norm_eps": meta.number("attention.layer_norm_rms_epsilon", 1e-5),
            "rope_theta": meta.number("rope.freq_base", 10000.0),
            "max_position_embeddings": meta.integer("context_length", 2048),
            "tie_word_embeddings": "output.weight" not in meta.tensor_names,
            "bos_token_id": meta.fields.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": eos,
            "torch_dtype": "float32",
        }
        extra = {key: value for key, value in family.extra_config(meta).items() if value is not None}
        return {**config, **extra}

    def bind(self, expected_hf_names: set[str]) -> None:
        """Map the file's tensor names onto `expected_hf_names` (the architecture's checkpoint
        names for the parsed config) through the `gguf` package's tensor-name table."""
        import gguf

        arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == self.meta.arch)
        table = gguf.get_tensor_name_map(arch, self.meta.integer("block_count"))
        names: dict[str, str] = {}
        experts: dict[str, dict[int, str]] = {}
        for hf_name in expected_hf_names:
            expert = _EXPERT.fullmatch(hf_name)
            merged = f"{expert[1]}.{expert[3]}.weight" if expert else hf_name  # llama.cpp stacks experts
            # llama.cpp's converter renames the router's correction bias to a `.bias` suffix
            merged = merged.replace("e_score_correction_bias", "e_score_correction.bias")
            found = table.get_type_and_name(merged, try_suffixes=(".weight", ".bias"))
            if found is not None and expert:
                experts.setdefault(found[1], {})[int(expert[2])] = hf_name
            elif found is not None:
                names[found[1]] = hf_name
        self._names = names
        self._experts = {name: [by_index[i] for i in sorted(by_index)] for name, by_index in experts.items()}

    def skipped(self, gguf_name: str) -> bool:
        """A tensor of a multi-token-prediction block (GLM-4.5's NextN layers, numbered after the
        decoder's): outside the forward pass, never read, as an HF folder's are not."""
        if not self.family.mtp_layers or not gguf_name.startswith("blk."):
            return False
        num_mtp = self.meta.integer("nextn_predict_layers", 0)
        return int(gguf_name.split(".")[1]) >= self.meta.integer("block_count") - num_mtp

    def hf_name(self, gguf_name: str) -> str | None:
        assert self._names is not None, "bind() first"
        return self._names.get(gguf_name)

    def expert_names(self, gguf_name: str) -> list[str] | None:
        """A stacked expert tensor's per-expert HF names, in expert order (None: not one)."""
        return self._experts.get(gguf_name)

    def to_hf(self, hf_name: str, array: np.ndarray) -> np.ndarray:
        """`array` ([rows, cols] or [n], float32, dequantised) as the HF checkpoint holds it."""
        heads = self.permuted_heads(hf_name)
        if heads is not None:
            return unpermute_rope(array, heads)
        if self.family.norms_plus_one and hf_name.endswith("norm.weight"):
            return array - np.float32(1.0)
        return array

    def permuted_heads(self, hf_name: str) -> int | None:
        """How many heads llama.cpp permuted this tensor's rows over (None: not permuted)."""
        if not (self.family.permute_qk and hf_name.endswith(("q_proj.weight", "k_proj.weight"))):
            return None
        heads = self.meta.integer("attention.head_count")
        return heads if "q_proj" in hf_name else self.meta.integer("attention.head_count_kv", heads)
