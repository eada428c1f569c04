"""Stored responses (`store: true` on `/v1/responses`), per tenant, on the object store.

One object per response, `responses/<tenant>/<response id>.json`: the response as the client got
it, its input items, and the conversation up to and including it as chat messages (what a later
request with `previous_response_id` continues). A tenant's key prefix is its own: another
tenant's id, or one that was never stored, is the same 404. The store is only read and written on
`/v1/responses` requests that ask for it (`store`, `previous_response_id`, the GET and DELETE
routes), never by chat or completions.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tandem.platform.errors import NotFoundError
from tandem.platform.object_store import ObjectNotFound, ObjectStore

_RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, object]  # the response object, as `GET /v1/responses/{id}` returns it
    input_items: list[dict[str, object]]  # this request's input items, each with its id
    messages: list[dict[str, object]]  # the conversation through this response, as chat messages

    def to_json(self) -> bytes:
        return json.dumps(
            {"response": self.response, "input_items": self.input_items, "messages": self.messages},
            ensure_ascii=False,
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> StoredResponse:
        record = json.loads(data)
        return cls(record["response"], record["input_items"], record["messages"])


class ResponseStore:
    """`StoredResponse`s under `responses/<tenant>/` of `store` (blocking calls: run them off the
    event loop). A store that does not answer raises `StoreUnavailableError` (503)."""

    PREFIX = "responses"

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    def _key(self, tenant: str, response_id: str) -> str:
        if not _RESPONSE_ID.match(response_id):
            raise self._not_found(response_id)
        return f"{self.PREFIX}/{tenant}/{response_id}.json"

    @staticmethod
    def _not_found(response_id: str) -> NotFoundError:
        return NotFoundError(
            f"No response with id {response_id!r} was found", param="response_id", code="response_not_found"
        )

    def save(self, tenant: str, response_id: str, record: StoredResponse) -> None:
        self.store.put(self._key(tenant, response_id), record.to_json())

    def load(self, tenant: str, response_id: str) -> StoredResponse:
        """The tenant's stored response; `NotFoundError` (404) for any other id."""
        try:
            return StoredResponse.from_json(self.store.get(self._key(tenant, response_id)).data)
        except ObjectNotFound:
            raise self._not_found(response_id) from None

    def delete(self, tenant: str, response_id: str) -> None:
        """Delete the tenant's stored response; `NotFoundError` (404) when there is none."""
        key = self._key(tenant, response_id)
        if not self.store.exists(key):
            raise self._not_found(response_id)
        self.store.delete(key)
