"""An engine's parts with no model (`EngineConfig.null_model_step_ms`): the checkpoint's config
and tokenizer, a `NullRunner`, and a KV block pool sized for `max_num_seqs` full contexts (blocks
are bookkeeping only: nothing is stored in them)."""

from __future__ import annotations

from tandem.engine.engine_parts import EngineParts
from tandem.engine.models.loader import load_config_and_tokenizer
from tandem.engine.runner.null_runner import NullRunner
from tandem.platform.config import EngineConfig

DEFAULT_NULL_MAX_MODEL_LEN = 4096


def null_token_ids(vocab: dict[str, int], special_ids: set[int], num: int = 64) -> list[int]:
    """`num` ordinary token ids (a space then an ASCII word, no special tokens), in a fixed order."""
    words = sorted(
        (token_id, text)
        for text, token_id in vocab.items()
        if token_id not in special_ids
        and text[:1] in ("Ġ", "▁")
        and text[1:].isascii()
        and text[1:].isalpha()
    )
    return [token_id for token_id, _ in words[:num]]


def build_null_parts(config: EngineConfig) -> EngineParts:
    cfg, tokenizer = load_config_and_tokenizer(config.model)
    eos_token_ids = frozenset(cfg.eos_token_ids) | frozenset(tokenizer.eos_token_ids)
    vocab = tokenizer.backend.get_vocab(with_added_tokens=False)
    special = set(eos_token_ids) | {cfg.bos_token_id or -1}
    token_ids = null_token_ids(vocab, special)
    max_model_len = config.max_model_len or min(cfg.max_position_embeddings, DEFAULT_NULL_MAX_MODEL_LEN)
    num_blocks = config.max_num_seqs * -(-max_model_len // config.block_size)
    step_s = (config.null_model_step_ms or 0.0) / 1000
    return EngineParts(
        model_name=config.model,
        model_config=cfg,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids,
        runner=NullRunner(token_ids, step_s),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        kv_cache_dtype="none",
    )
