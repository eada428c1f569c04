"""OpenAI's error bodies: a `TandemError` or a request's validation errors in the shape the
OpenAI SDKs parse (`{"error": {"message", "type", "param", "code"}}`), naming the parameter."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from tandem.platform.errors import TandemError

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# OpenAI's error shape: {"error": {"message", "type", "param", "code"}}
ErrorBody = dict[str, dict[str, str | None]]


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> ErrorBody:
    """OpenAI's error shape: the body of an error response, or an error event in a stream."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def validation_error_body(errors: Sequence[Any]) -> ErrorBody:
    """An `invalid_request_error` naming the first field pydantic refused (`messages.0.content`)."""
    if not errors:
        return error_body("invalid request", "invalid_request_error")
    # A union field reports one error per member: take the member that got furthest in.
    field = errors[0].get("loc", ())[:1]
    first = max((e for e in errors if e.get("loc", ())[:1] == field), key=lambda e: len(e.get("loc", ())))
    param = _escape_surrogates(".".join(str(p) for p in first.get("loc", ()) if _is_field(p))) or None
    message = str(first.get("msg", "invalid value"))
    return error_body(f"{param}: {message}" if param else message, "invalid_request_error", param, None)


def _escape_surrogates(text: str) -> str:
    """`text` with lone surrogates written as `\\udXXX` (a dict key can carry one into an error)."""
    return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_field(part: Any) -> bool:
    """A location part that names a field or an index, not a union member's type tag
    (`function-after[...]`, `list[int]`, `TextContentPart`) or FastAPI's `body`."""
    if isinstance(part, int):
        return True
    text = str(part)
    return not (text == "body" or text in _TYPE_TAGS or "[" in text or text[:1].isupper())


def tandem_error_body(exc: TandemError, request_id: str) -> ErrorBody:
    """`exc` in OpenAI's shape; a 5xx also names `request_id` (the id its traceback is logged under)."""
    message = exc.message
    if exc.status_code >= 500 and request_id not in message:
        message = f"{message} (request id {request_id})"
    return error_body(message, exc.error_type, exc.param, exc.code)


def internal_error_body(request_id: str) -> ErrorBody:
    """The body for a failure with no `TandemError` behind it: nothing internal, only the request
    id under which the traceback was logged."""
    return error_body(
        f"The server had an error while processing your request (request id {request_id}); "
        "retry it, and report the request id if the error persists",
        "server_error",
        None,
        "internal_error",
    )
