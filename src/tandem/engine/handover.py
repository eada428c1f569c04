"""Prefill/decode hand-over on one engine's side: a prefill engine computes a prompt and its first
token and exports the prompt's KV as checksummed pages (`kv_transfer.py`); a decode engine verifies
and imports them and decodes from there.

The decode side tokenises the request once (`LLMEngine.make_request`) and sends the prompt's
token ids; neither side tokenises it again. The sender's first token enters the receiver's
scheduler through `Scheduler.add_handed_over`, the same stop checks and output path as any token.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from tandem.engine.kv_cache import FREED_BLOCK
from tandem.engine.kv_transfer import (
    KVPage,
    KVPrefixEvictedError,
    KVTransfer,
    fingerprint,
    page_checksum,
    verify,
)
from tandem.engine.protocol import GenerationRequest, RequestOutput
from tandem.engine.request import Request
from tandem.platform.errors import InvalidRequestError, NotFoundError, ServiceUnavailableError

if TYPE_CHECKING:
    from tandem.engine.engine import LLMEngine


def with_token_ids(gen: GenerationRequest, token_ids: list[int]) -> GenerationRequest:
    """`gen` carrying its prompt as token ids (what a decode engine sends its prefill engine)."""
    return dataclasses.replace(gen, prompt=None, messages=None, prompt_token_ids=list(token_ids))


def make_prefill_request(engine: LLMEngine, gen: GenerationRequest) -> tuple[Request, str | None]:
    """`make_request` for a prefill: compute the prompt, sample one token, and keep the KV blocks
    for `export_kv` (or until `kv_hold_ttl_s` passes)."""
    request, prompt = engine.make_request(gen, compress=False)  # handed over in the shared layout, whole
    request.sampling_params = dataclasses.replace(
        request.sampling_params, max_tokens=1, n=1, speculative=False
    )
    request.hold_kv = True
    return request, prompt


def kv_fingerprint(engine: LLMEngine) -> str:
    cfg = engine.model_config
    mla = getattr(cfg, "mla", None)  # a latent cache: one shared vector per token (`models/mla.py`)
    if mla is not None:
        return (
            fingerprint(engine.model_name, cfg.num_hidden_layers, 1, mla.latent_dim, cfg.vocab_size)
            + "|latent"
        )
    return fingerprint(
        engine.model_name, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size
    )


def cached_prefix_pages(engine: LLMEngine, gen: GenerationRequest) -> int:
    """How many leading pages (blocks) of `gen`'s prompt this engine's prefix cache holds now:
    a sender need not send them (`export_kv(skip_pages=...)`)."""
    request, _ = engine.make_request(gen, compress=False)
    return engine.kv_manager.num_cached_prefix_blocks(
        request.num_tokens, request.token_ids_slice, engine.scheduler.cache_salt(request)
    )


def export_kv(
    engine: LLMEngine, request_id: str, cache_dtype: str | None = None, skip_pages: int = 0
) -> KVTransfer:
    """The prompt KV of a finished prefill request as checksummed pages in `cache_dtype` (this
    cache's own, or "float8_e4m3fn" for an FP8 receiver), from page `skip_pages` on (the receiver
    holds the ones before), and its first token; its blocks are freed. Raises `NotFoundError`
    when it is not held."""
    request = engine.scheduler.held.get(request_id)
    if request is None:
        raise NotFoundError(f"no prefilled KV is held for request {request_id!r} (expired or never made)")
    try:
        dtype = engine.kv_cache_dtype if cache_dtype is None else cache_dtype
        if dtype not in (engine.kv_cache_dtype, "float8_e4m3fn"):
            raise InvalidRequestError(
                f"this engine's {engine.kv_cache_dtype} cache exports as itself or float8_e4m3fn, not {dtype}",
                param="cache_dtype",
            )
        prompt = request.prompt_token_ids
        size = engine.kv_manager.block_size
        if not 0 <= skip_pages <= (len(prompt) - 1) // size:
            raise InvalidRequestError(
                f"skip_pages {skip_pages} must be between 0 and {(len(prompt) - 1) // size} for a prompt of "
                f"{len(prompt)} tokens (the last token's page is always sent)",
                param="skip_pages",
            )
        block_ids = engine.kv_manager.block_table(request_id).block_ids
        if FREED_BLOCK in block_ids:  # `hold_kv` keeps a prefill's blocks: this is a bug, not bad input
            raise RuntimeError(
                f"request {request_id!r}: blocks past the sliding window were given back before export"
            )
        datas = engine.runner.export_pages(block_ids[skip_pages:], len(prompt) - skip_pages * size, dtype)
        pages = []
        for index, data in enumerate(datas, start=skip_pages):
            tokens = tuple(prompt[index * size : (index + 1) * size])
            pages.append(KVPage(index, tokens, data, page_checksum(request_id, index, tokens, dtype, data)))
        return KVTransfer(
            request_id,
            kv_fingerprint(engine),
            dtype,
            size,
            request.output_token_ids[0],
            tuple(pages),
            skip_pages,
        )
    finally:
        engine.scheduler.release_held(request_id)


def add_request_with_kv(
    engine: LLMEngine, gen: GenerationRequest, transfer: KVTransfer, *, stream_text: bool = False
) -> RequestOutput:
    """Continue a request whose prompt another engine computed: verify the transfer (model, cache
    type, checksums, the prompt's tokens), copy its pages into blocks of this cache, and decode
    from there. Returns the output of its first token (sampled by the sender). A bad transfer
    raises `KVTransferError` and allocates nothing; no free blocks: 503."""
    request, prompt = engine.make_request(gen, compress=False)  # the transfer's pages: shared layout
    if request.sampling_params.n > 1:
        raise InvalidRequestError(
            "a handed-over prompt continues as one choice: compute n > 1 here", param="n"
        )
    verify(
        transfer,
        model_fingerprint=kv_fingerprint(engine),
        cache_dtype=engine.kv_cache_dtype,
        block_size=engine.kv_manager.block_size,
        prompt_token_ids=request.prompt_token_ids,
    )
    if request.request_id in engine.scheduler.requests:
        raise InvalidRequestError(f"request id {request.request_id!r} is already running", param="request_id")
    num_cached_blocks = _allocate(engine, request, transfer)
    try:
        block_ids = engine.kv_manager.block_table(request.request_id).block_ids
        # Never into cached (shared) blocks: only the pages past this engine's own prefix.
        imported = [p for p in transfer.pages if p.index >= num_cached_blocks]
        engine.runner.import_pages(
            block_ids[num_cached_blocks:], [(len(p.token_ids), p.data) for p in imported]
        )
        engine.runner.imported_prompt(
            request.request_id, num_cached_blocks * engine.kv_manager.block_size, request.num_prompt_tokens
        )
        if request.lora_name is not None:
            engine.acquire_lora(request.lora_name)
    except BaseException:
        engine.kv_manager.free(request.request_id)
        raise
    request.num_computed_tokens = request.num_prompt_tokens
    engine.output_processor.add(request, prompt, stream_text)
    update = engine.scheduler.add_handed_over(request, transfer.first_token_id)
    return engine.outputs([update])[0]


def _allocate(engine: LLMEngine, request: Request, transfer: KVTransfer) -> int:
    """Blocks for the prompt and its first token: the pages left out of the transfer from this
    engine's prefix cache (their count returned), the rest fresh. Frees what it took on failure."""
    kv_manager, size = engine.kv_manager, engine.kv_manager.block_size
    num_cached_blocks = 0
    if transfer.num_skipped_pages:
        cached = kv_manager.allocate_cached_prefix(
            request.request_id,
            request.num_tokens,
            request.token_ids_slice,
            engine.scheduler.cache_salt(request),
        )
        num_cached_blocks = cached // size
        if num_cached_blocks < transfer.num_skipped_pages:
            kv_manager.free(request.request_id)
            raise KVPrefixEvictedError(
                f"{transfer.num_skipped_pages} prompt pages were left out of the KV transfer but only "
                f"{num_cached_blocks} are still cached here; the request needs a whole transfer"
            )
        request.num_cached_tokens = cached
    if not kv_manager.allocate_slots(request.request_id, request.num_prompt_tokens + 1, admission=True):
        kv_manager.free(request.request_id)
        raise ServiceUnavailableError(
            "no free KV blocks for a handed-over request; retry shortly", code="kv_cache_full"
        )
    return num_cached_blocks
