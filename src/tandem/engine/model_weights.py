"""What a loaded checkpoint is built into for one precision: its paged cache's shape
(`kv_cache_spec`) and its model, with the INT4 copy of an explicit hybrid (`build_models`, which
the engine and the quality probe's candidates share), INT4 weights GPTQ-calibrated where they come
from float weights (`uses_calibrated_int4`)."""

from __future__ import annotations

import functools

import torch

from tandem.engine.host.int4_calibration import calibrated_int4, int4_source
from tandem.engine.host.precision import PrecisionChoice
from tandem.engine.host.quality_gate import DTYPES
from tandem.engine.models.interface import CausalLM
from tandem.engine.models.loader import LoadedModel, build_model, default_cache_dir
from tandem.engine.models.quantized import DEFAULT_INT4_GROUP_SIZE
from tandem.engine.runner import KVCacheSpec
from tandem.kernels.int8 import Int8HeadLinear
from tandem.platform.config import EngineConfig
from tandem.platform.errors import ModelLoadError


def kv_cache_spec(loaded: LoadedModel, block_size: int, kv_dtype: torch.dtype) -> KVCacheSpec:
    """The paged cache for a model, from its architecture's per-layer KV (`Architecture.kv_layers`).
    Raises `ModelLoadError` for layers that differ: the paged cache holds one shape for all."""
    layers = loaded.architecture.kv_layers(loaded.config)
    first = layers[0]
    shape = (first.num_kv_heads, first.head_dim, first.shared_kv)
    if any((layer.num_kv_heads, layer.head_dim, layer.shared_kv) != shape for layer in layers):
        shapes = sorted({(layer.num_kv_heads, layer.head_dim) for layer in layers})
        raise ModelLoadError(
            f"{loaded.path}: layers with different KV shapes (kv heads, head dim) {shapes} are not supported",
            param="model",
        )
    return KVCacheSpec(len(layers), *shape[:2], block_size, kv_dtype, shared_kv=first.shared_kv)


def build_models(
    config: EngineConfig, loaded: LoadedModel, precision: PrecisionChoice, max_positions: int, *,
    device: torch.device,
) -> tuple[CausalLM, CausalLM | None]:  # fmt: skip
    """The model in `precision`, and with `weight_dtype="hybrid"` its INT4 copy for small decode steps."""
    hybrid = precision.weight_dtype == "hybrid"
    dtype = DTYPES[precision.dtype]
    int4_weights = None
    if precision.weight_dtype in ("int4", "hybrid") and uses_calibrated_int4(config, loaded):
        group_size = config.int4_group_size or DEFAULT_INT4_GROUP_SIZE
        spec = kv_cache_spec(loaded, config.block_size, torch.float32)
        int4_weights = calibrated_int4(loaded, group_size, spec, device, default_cache_dir())
    build = functools.partial(
        build_model, loaded, dtype=dtype, device=device, max_positions=max_positions,
        int4_group_size=config.int4_group_size, int4_double_quant=config.int4_double_quant,
        int4_kernel=config.int4_kernel, int4_weights=int4_weights,
    )  # fmt: skip
    model = build(
        # inductor cannot lower oneDNN's prepacked (opaque) weights; it plans its own GEMMs
        pack_weights=hybrid or not config.compile_decode,
        weight_dtype=precision.weight_dtype
        if precision.weight_dtype in ("int4", "int8", "gguf")
        else "dense",
    )
    decode_model = build(weight_dtype="int4") if hybrid else None
    if decode_model is not None and isinstance(decode_model.lm_head, Int8HeadLinear):
        # Decode steps above the INT8 head's rows take the dense model's head (its compute
        # dtype, prepacked): no second 16-bit copy, and the logits of the dense path.
        decode_model.lm_head.use_dense_head(model.lm_head, dtype)
    return model, decode_model


def uses_calibrated_int4(config: EngineConfig, loaded: LoadedModel) -> bool:
    """INT4 from float weights by GPTQ (`int4_method`), unless the file's own Q4_1 codes load as
    they are (a GGUF without an explicit group size)."""
    return int4_source(config.int4_method, config.int4_group_size, loaded).startswith("GPTQ")
