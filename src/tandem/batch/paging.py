"""Listing pages of stored records as OpenAI lists them (`after`, `limit`, `order`), and the
checks of a list's or a batch's parameters."""

from __future__ import annotations

from typing import TypeVar

from tandem.platform.errors import InvalidRequestError
from tandem.platform.object_store import ObjectStore

T = TypeVar("T")


def record_ids(store: ObjectStore, prefix: str) -> list[str]:
    """Ids of the `<id>.json` records under `prefix`."""
    return [k.rsplit("/", 1)[1].removesuffix(".json") for k in store.list(prefix)]


def check_limit(limit: int, max_limit: int) -> int:
    if not 1 <= limit <= max_limit:
        raise InvalidRequestError(f"limit must be between 1 and {max_limit}", param="limit")
    return limit


def page_ids(ids: list[str], after: str | None, order: str) -> list[str]:
    """`ids` in `order` ("asc" or "desc"), those after `after` only."""
    if order not in ("asc", "desc"):
        raise InvalidRequestError("order must be 'asc' or 'desc'", param="order")
    ordered = sorted(ids, reverse=order == "desc")
    if after is not None:
        ordered = [i for i in ordered if (i < after if order == "desc" else i > after)]
    return ordered


def page(records: list[T], limit: int) -> tuple[list[T], bool]:
    """The first `limit` records, and whether there are more."""
    return records[:limit], len(records) > limit


def check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > 16:
        raise InvalidRequestError("metadata holds at most 16 pairs", param="metadata")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > 64 or len(value) > 512:
            raise InvalidRequestError(
                "metadata keys are strings of at most 64 characters, values of at most 512", param="metadata"
            )
