"""An encoder's engine parts (BERT family: `Architecture.encoder`): the model dense in its
compute dtype, a runner whose requests all embed, and block bookkeeping over the model's one
narrow dummy KV layer (`bert.bert_kv_layers`: an encoder keeps nothing between steps).

No precision probe or quantisation runs for an encoder: the quality gate measures generation,
which an encoder does not do; it runs float32 unless `dtype` names another.
"""

from __future__ import annotations

import torch

from tandem.engine.engine_parts import EngineParts
from tandem.engine.host.precision import PrecisionChoice
from tandem.engine.host.quality_gate import DTYPES
from tandem.engine.model_weights import kv_cache_spec
from tandem.engine.models.loader import LoadedModel, build_model
from tandem.engine.models.pooling import read_pooling
from tandem.engine.runner import ModelRunner
from tandem.platform.config import EngineConfig
from tandem.platform.errors import InvalidRequestError


def check_encoder_config(config: EngineConfig) -> None:
    """Refuse, naming the setting, what an encoder does not have."""
    if config.weight_dtype not in ("auto", "dense"):
        raise InvalidRequestError(
            "an encoder runs dense weights; leave weight_dtype auto", param="weight_dtype"
        )
    if config.enable_lora:
        raise InvalidRequestError("LoRA adapters are not supported for encoders", param="enable_lora")
    if config.enable_kv_compression or config.kv_compression_rate is not None:
        raise InvalidRequestError("an encoder keeps no KV to compress", param="enable_kv_compression")


def build_encoder_parts(config: EngineConfig, loaded: LoadedModel, device: torch.device) -> EngineParts:
    check_encoder_config(config)
    cfg = loaded.config
    dtype_name = "float32" if config.dtype == "auto" else config.dtype
    precision = PrecisionChoice(
        dtype_name,
        "dense",
        reason=f"an encoder: {dtype_name} dense weights (the quality gate judges generation, so encoders keep their weights)",
    )
    max_len = min(cfg.max_position_embeddings, config.max_model_len or cfg.max_position_embeddings)
    kv_spec = kv_cache_spec(loaded, config.block_size, torch.float32)
    # Enough blocks for every seat at the longest input: bookkeeping only (one float per token).
    num_blocks = config.max_num_seqs * -(-max_len // config.block_size) + 1
    model = build_model(loaded, dtype=DTYPES[dtype_name], device=device, max_positions=max_len)
    pooling = read_pooling(loaded.path if loaded.path.is_dir() else loaded.path.parent, encoder=True)
    runner = ModelRunner(
        model, kv_spec, num_blocks, device, seed=config.seed, native_decoder=False, max_model_len=max_len,
        pooling=pooling,
    )  # fmt: skip
    return EngineParts(
        model_name=loaded.name,
        model_config=cfg,
        tokenizer=loaded.tokenizer,
        eos_token_ids=frozenset(),
        runner=runner,
        num_blocks=num_blocks,
        max_model_len=max_len,
        kv_cache_dtype="none",
        precision=precision,
        pooling=pooling,
        encoder=True,
    )
