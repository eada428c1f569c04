"""Prefill/decode hand-over on one engine's side: a prefill engine computes a prompt and its first
token and exports the prompt's KV as checksummed pages (`kv_transfer.py`); a decode engine verifies
and imports them and decodes from there.

The decode side tokenises the request once (`LLMEngine.make_request`) and sends the prompt's
token ids; neither side tokenises it again. The sender's first token enters the receiver's
scheduler through `Scheduler.add_handed_over`, the same stop checks and output path as any token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from tandem.engine.kv.block_manager import KVCacheManager
from tandem.engine.kv.block_pool import FREED_BLOCK
from tandem.engine.kv.transfer import (
    KVPage,
    KVPrefixEvictedError,
    KVTransfer,
    fingerprint,
    page_checksum,
    verify,
)
from tandem.engine.protocol import GenerationRequest, RequestOutput
from tandem.engine.request import Request
from tandem.engine.sched.scheduler import Scheduler
from tandem.engine.sched.step import RequestUpdate, Runner
from tandem.platform.errors import InvalidRequestError, NotFoundError, ServiceUnavailableError


class CacheShape(Protocol):
    """What of a model config a KV page's fingerprint names (`models.interface.ModelConfig`)."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int


MakeRequest = Callable[..., tuple[Request, str | None]]


def with_token_ids(gen: GenerationRequest, token_ids: list[int]) -> GenerationRequest:
    """`gen` carrying its prompt as token ids (what a decode engine sends its prefill engine)."""
    return dataclasses.replace(gen, prompt=None, messages=None, prompt_token_ids=list(token_ids))


def kv_fingerprint(model_name: str, model_config: CacheShape) -> str:
    """What a receiver's cache must match to take a sender's pages: the model and its cache shape."""
    cfg = model_config
    mla = getattr(cfg, "mla", None)  # a latent cache: one shared vector per token (`models/mla.py`)
    if mla is not None:
        return fingerprint(model_name, cfg.num_hidden_layers, 1, mla.latent_dim, cfg.vocab_size) + "|latent"
    return fingerprint(
        model_name, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size
    )


class KVHandover:
    """One engine's side of the hand-over, built with what it needs from the engine."""

    def __init__(
        self,
        scheduler: Scheduler,
        kv_manager: KVCacheManager,
        runner: Runner,
        *,
        make_request: MakeRequest,
        fingerprint: str,
        kv_cache_dtype: str,
        acquire_lora: Callable[[str], None],
        add_output: Callable[[Request, str | None, bool], None],
        outputs: Callable[[list[RequestUpdate]], list[RequestOutput]],
    ) -> None:
        """`make_request`: the engine's validation and tokenisation; `add_output`: register a
        request with the output processor; `outputs`: outputs for applied updates."""
        self.scheduler = scheduler
        self.kv_manager = kv_manager
        self.runner = runner
        self.make_request = make_request
        self.fingerprint = fingerprint
        self.kv_cache_dtype = kv_cache_dtype
        self.acquire_lora = acquire_lora
        self.add_output = add_output
        self.outputs = outputs

    def make_prefill_request(self, gen: GenerationRequest) -> tuple[Request, str | None]:
        """`make_request` for a prefill: compute the prompt, sample one token, and keep the KV blocks
        for `export_kv` (or until `kv_hold_ttl_s` passes)."""
        request, prompt = self.make_request(gen, compress=False)  # handed over in the shared layout, whole
        request.sampling_params = dataclasses.replace(
            request.sampling_params, max_tokens=1, n=1, speculative=False
        )
        request.hold_kv = True
        return request, prompt

    def cached_prefix_pages(self, gen: GenerationRequest) -> int:
        """How many leading pages (blocks) of `gen`'s prompt this engine's prefix cache holds now:
        a sender need not send them (`export_kv(skip_pages=...)`)."""
        request, _ = self.make_request(gen, compress=False)
        return self.kv_manager.num_cached_prefix_blocks(
            request.num_tokens, request.token_ids_slice, self.scheduler.cache_salt(request)
        )

    def export_kv(self, request_id: str, cache_dtype: str | None = None, skip_pages: int = 0) -> KVTransfer:
        """The prompt KV of a finished prefill request as checksummed pages in `cache_dtype` (this
        cache's own, or "float8_e4m3fn" for an FP8 receiver), from page `skip_pages` on (the receiver
        holds the ones before), and its first token; its blocks are freed. Raises `NotFoundError`
        when it is not held."""
        request = self.scheduler.held.get(request_id)
        if request is None:
            raise NotFoundError(f"no prefilled KV is held for request {request_id!r} (expired or never made)")
        try:
            dtype = self.kv_cache_dtype if cache_dtype is None else cache_dtype
            if dtype not in (self.kv_cache_dtype, "float8_e4m3fn"):
                raise InvalidRequestError(
                    f"this engine's {self.kv_cache_dtype} cache exports as itself or float8_e4m3fn, not {dtype}",
                    param="cache_dtype",
                )
            prompt = request.prompt_token_ids
            size = self.kv_manager.block_size
            if not 0 <= skip_pages <= (len(prompt) - 1) // size:
                raise InvalidRequestError(
                    f"skip_pages {skip_pages} must be between 0 and {(len(prompt) - 1) // size} for a prompt of "
                    f"{len(prompt)} tokens (the last token's page is always sent)",
                    param="skip_pages",
                )
            block_ids = self.kv_manager.block_table(request_id).block_ids
            if FREED_BLOCK in block_ids:  # `hold_kv` keeps a prefill's blocks: this is a bug, not bad input
                raise RuntimeError(
                    f"request {request_id!r}: blocks past the sliding window were given back before export"
                )
            datas = self.runner.export_pages(block_ids[skip_pages:], len(prompt) - skip_pages * size, dtype)
            pages = []
            for index, data in enumerate(datas, start=skip_pages):
                tokens = tuple(prompt[index * size : (index + 1) * size])
                pages.append(
                    KVPage(index, tokens, data, page_checksum(request_id, index, tokens, dtype, data))
                )
            return KVTransfer(
                request_id,
                self.fingerprint,
                dtype,
                size,
                request.output_token_ids[0],
                tuple(pages),
                skip_pages,
            )
        finally:
            self.scheduler.release_held(request_id)

    def add_request_with_kv(
        self, gen: GenerationRequest, transfer: KVTransfer, *, stream_text: bool = False
    ) -> RequestOutput:
        """Continue a request whose prompt another engine computed: verify the transfer (model, cache
        type, checksums, the prompt's tokens), copy its pages into blocks of this cache, and decode
        from there. Returns the output of its first token (sampled by the sender). A bad transfer
        raises `KVTransferError` and allocates nothing; no free blocks: 503."""
        request, prompt = self.make_request(gen, compress=False)  # the transfer's pages: shared layout
        if request.sampling_params.n > 1:
            raise InvalidRequestError(
                "a handed-over prompt continues as one choice: compute n > 1 here", param="n"
            )
        verify(
            transfer,
            model_fingerprint=self.fingerprint,
            cache_dtype=self.kv_cache_dtype,
            block_size=self.kv_manager.block_size,
            prompt_token_ids=request.prompt_token_ids,
        )
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError(
                f"request id {request.request_id!r} is already running", param="request_id"
            )
        num_cached_blocks = self._allocate(request, transfer)
        try:
            block_ids = self.kv_manager.block_table(request.request_id).block_ids
            # Never into cached (shared) blocks: only the pages past this engine's own prefix.
            imported = [p for p in transfer.pages if p.index >= num_cached_blocks]
            self.runner.import_pages(
                block_ids[num_cached_blocks:], [(len(p.token_ids), p.data) for p in imported]
            )
            self.runner.imported_prompt(
                request.request_id, num_cached_blocks * self.kv_manager.block_size, request.num_prompt_tokens
            )
            if request.lora_name is not None:
                self.acquire_lora(request.lora_name)
        except BaseException:
            self.kv_manager.free(request.request_id)
            raise
        request.num_computed_tokens = request.num_prompt_tokens
        self.add_output(request, prompt, stream_text)
        update = self.scheduler.add_handed_over(request, transfer.first_token_id)
        return self.outputs([update])[0]

    def _allocate(self, request: Request, transfer: KVTransfer) -> int:
        """Blocks for the prompt and its first token: the pages left out of the transfer from this
        engine's prefix cache (their count returned), the rest fresh. Frees what it took on failure."""
        kv_manager, size = self.kv_manager, self.kv_manager.block_size
        num_cached_blocks = 0
        if transfer.num_skipped_pages:
            cached = kv_manager.allocate_cached_prefix(
                request.request_id,
                request.num_tokens,
                request.token_ids_slice,
                self.scheduler.cache_salt(request),
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
