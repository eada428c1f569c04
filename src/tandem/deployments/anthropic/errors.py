"""Errors in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`), the type
chosen by HTTP status as Anthropic's API does; the parameter is named in the message."""

from __future__ import annotations

from collections.abc import Mapping

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error(status: int, message: str) -> dict[str, object]:
    return {"type": "error", "error": {"type": _TYPES.get(status, "api_error"), "message": message}}


def anthropic_error_body(status: int, body: Mapping[str, object]) -> dict[str, object]:
    """An OpenAI error body (what the routes build) in Anthropic's shape; its message already
    names the field, or is prefixed with it."""
    error = body.get("error")
    info = error if isinstance(error, dict) else {}
    message = str(info.get("message") or "error")
    param = info.get("param")
    if isinstance(param, str) and param and param not in message:
        message = f"{param}: {message}"
    return anthropic_error(status, message)
