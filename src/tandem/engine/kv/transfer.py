"""KV pages handed from one engine to another (prefill -> decode), verified on arrival.

A `KVTransfer` carries a request's prompt KV as pages, one per cache block, in the receiving
cache's dtype (an FP8 receiver gets FP8 codes and their per-(token, head) scales: half the bytes
of 16-bit). Each page has a checksum over its header (request, index, tokens, dtype, shape) and
its bytes, and the transfer names the model it came from. The receiver checks all of it, and
that the pages' tokens are its request's prompt, before it allocates anything: a corrupted,
stale or mixed-up transfer fails its request with `KVTransferError` and never produces text.

Pages the receiver already holds in its prefix cache are not sent: the receiver says how many
leading pages it holds (`KVHandover.cached_prefix_pages`), the sender leaves them out
(`num_skipped_pages`), and the receiver takes those blocks from its cache when it imports the
rest; should they have been evicted meanwhile, `KVPrefixEvictedError` asks for a whole transfer.

Page layout (`data`): for each layer, K then V, each [tokens, kv_heads, head_dim] in the cache
dtype; then (FP8 only) for each layer, K scales then V scales, each [tokens, kv_heads] float16. `tokens` is the
page's token count (the block size, or fewer in the last page).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from tandem.platform.errors import RequestFailedError, ServiceUnavailableError


class KVTransferError(RequestFailedError):
    """A KV transfer that cannot be used (corrupted, for another model, prompt or cache type)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="kv_transfer_invalid")


class KVPrefixEvictedError(ServiceUnavailableError):
    """A transfer left out prompt pages that the receiver's prefix cache held when asked, but
    evicted since: the request needs a whole transfer (the receiver allocated nothing)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="kv_prefix_evicted")


@dataclass(frozen=True)
class KVPage:
    index: int  # the page's block number in the request's sequence
    token_ids: tuple[int, ...]  # the tokens whose KV it holds, in order
    data: bytes  # see the module docstring
    checksum: str  # page_checksum(...) of the above


@dataclass(frozen=True)
class KVTransfer:
    request_id: str
    model_fingerprint: str  # what the sender's model and cache layout are (`fingerprint`)
    cache_dtype: str  # the pages' element type: "float32", "bfloat16", "float16", "float8_e4m3fn"
    block_size: int
    first_token_id: int  # the token the sender sampled after the prompt
    pages: tuple[KVPage, ...]
    # Leading prompt pages not sent: the receiver said its prefix cache holds them. Pages start
    # at this index; the receiver takes those blocks from its cache (or fails: KVPrefixEvictedError).
    num_skipped_pages: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(page.token_ids) for page in self.pages)

    @property
    def num_bytes(self) -> int:
        return sum(len(page.data) for page in self.pages)


def fingerprint(model_name: str, num_layers: int, num_kv_heads: int, head_dim: int, vocab_size: int) -> str:
    """What two engines must share for one's KV to be valid in the other's cache."""
    return f"{model_name}|layers={num_layers}|kv_heads={num_kv_heads}|head_dim={head_dim}|vocab={vocab_size}"


def page_checksum(
    request_id: str, index: int, token_ids: tuple[int, ...], cache_dtype: str, data: bytes
) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{request_id}|{index}|{cache_dtype}|{','.join(map(str, token_ids))}|".encode())
    digest.update(data)
    return digest.hexdigest()


def verify(
    transfer: KVTransfer,
    *,
    model_fingerprint: str,
    cache_dtype: str,
    block_size: int,
    prompt_token_ids: list[int],
) -> None:
    """Raise `KVTransferError` unless `transfer` fits this engine and this request's prompt:
    same model and cache layout, every page intact and in order, its tokens the prompt's."""
    if transfer.model_fingerprint != model_fingerprint:
        raise KVTransferError(
            f"KV transfer is for another model ({transfer.model_fingerprint}); this engine is {model_fingerprint}"
        )
    if transfer.cache_dtype != cache_dtype or transfer.block_size != block_size:
        raise KVTransferError(
            f"KV transfer holds {transfer.cache_dtype} pages of {transfer.block_size} tokens; this cache "
            f"holds {cache_dtype} blocks of {block_size}"
        )
    skipped_tokens = transfer.num_skipped_pages * transfer.block_size
    if skipped_tokens + transfer.num_tokens != len(prompt_token_ids) or skipped_tokens >= len(
        prompt_token_ids
    ):
        raise KVTransferError(
            f"KV transfer carries {transfer.num_tokens} tokens after {transfer.num_skipped_pages} skipped pages; "
            f"the prompt has {len(prompt_token_ids)}"
        )
    position = skipped_tokens
    for expected_index, page in enumerate(transfer.pages, start=transfer.num_skipped_pages):
        if page.index != expected_index:
            raise KVTransferError(
                f"KV transfer page {page.index} arrived where page {expected_index} belongs"
            )
        if (
            page_checksum(transfer.request_id, page.index, page.token_ids, transfer.cache_dtype, page.data)
            != page.checksum
        ):
            raise KVTransferError(f"KV transfer page {page.index} failed its checksum (corrupted in transit)")
        if list(page.token_ids) != prompt_token_ids[position : position + len(page.token_ids)]:
            raise KVTransferError(f"KV transfer page {page.index} holds other tokens than this prompt's")
        position += len(page.token_ids)
