"""The draft side of speculative decoding, built from an `EngineConfig`: which draft (an EAGLE
head, bundled or given, or a small model of the same vocabulary), its proposer over its own paged
cache, and the settings the scheduler plans drafts with."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from tandem.engine.model_weights import kv_cache_spec
from tandem.engine.models.eagle import EagleDraft, is_eagle_folder, load_eagle
from tandem.engine.models.interface import CausalLM
from tandem.engine.models.loader import LoadedModel, build_model, load_model, resolve_model_path
from tandem.engine.runner import KVCacheSpec, allocate_kv_caches
from tandem.engine.runner.draft import DraftProposer, EagleProposer, PagedDraftCache
from tandem.platform.config import EngineConfig
from tandem.platform.errors import InvalidRequestError

# Draft heads trained for bundled models (scripts/train_draft.py), by model name.
BUNDLED_DRAFTS = {"smollm2-135m-instruct": Path(__file__).parent / "drafts" / "smollm2-135m-instruct-eagle"}


@dataclasses.dataclass
class LoadedDraft:
    """A loaded draft: an EAGLE head or a small model of the same vocabulary, and its cache's shape."""

    spec: KVCacheSpec
    head: EagleDraft | None = None
    model: LoadedModel | None = None


def load_draft(
    config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype, device: torch.device, kv_dtype: torch.dtype
) -> LoadedDraft | None:
    """The configured draft (`draft_path`): an EAGLE head folder, or a model that tokenises
    exactly as the target does."""
    path = draft_path(config)
    if path is None:
        return None
    if is_eagle_folder(path):
        try:
            head = load_eagle(
                path, dtype=dtype, device=device, max_positions=loaded.config.max_position_embeddings
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="speculative.draft_model") from exc
        hcfg = head.config
        return LoadedDraft(
            KVCacheSpec(1, hcfg.num_key_value_heads, hcfg.head_dim, config.block_size, kv_dtype), head=head
        )
    spec = config.speculative
    assert spec is not None and spec.draft_model is not None
    model = load_model(spec.draft_model)
    if model.tokenizer.token_bytes_table() != loaded.tokenizer.token_bytes_table():
        raise InvalidRequestError(
            f"draft model {spec.draft_model!r} does not share the target's vocabulary; a draft must "
            "tokenise exactly as the target does",
            param="speculative.draft_model",
        )
    return LoadedDraft(kv_cache_spec(model, config.block_size, kv_dtype), model=model)


def build_proposer(
    config: EngineConfig, loaded: LoadedModel, model: CausalLM, draft: LoadedDraft | None, num_blocks: int, max_model_len: int,
    dtype: torch.dtype, device: torch.device,
) -> PagedDraftCache | None:  # fmt: skip
    """The draft's proposer over its own paged cache: an EAGLE head reading the target's
    embedding, final norm and LM head, or a draft model."""
    if draft is None:
        return None
    caches = allocate_kv_caches(draft.spec, num_blocks, device)
    if draft.head is not None:
        weights = loaded.weights
        prefix = "model." if "model.norm.weight" in weights else ""
        try:
            draft.head.attach_target(
                model.embed_tokens,
                weights[prefix + "norm.weight"],
                weights.get("lm_head.weight", weights[prefix + "embed_tokens.weight"]),
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="speculative.draft_model") from exc
        return EagleProposer(draft.head, caches, draft.spec.num_kv_heads, config.block_size, device)
    assert draft.model is not None
    draft_model = build_model(draft.model, dtype=dtype, device=device, max_positions=max_model_len)
    return DraftProposer(draft_model, caches, draft.spec.num_kv_heads, config.block_size, device)


def draft_path(config: EngineConfig) -> Path | None:
    """Where the draft comes from: `draft_model`, else the head bundled for the model (methods
    'draft' and 'auto'); None for prompt lookup alone."""
    spec = config.speculative
    if spec is None or spec.method == "ngram":
        return None
    if spec.draft_model is not None:
        return resolve_model_path(spec.draft_model)
    bundled = BUNDLED_DRAFTS.get(config.model.lower())
    if bundled is not None and (bundled / "model.safetensors").exists():
        return bundled
    if spec.method == "draft":
        raise InvalidRequestError(
            f"speculative method 'draft' needs draft_model: no draft is bundled for {config.model!r}",
            param="speculative.draft_model",
        )
    return None
