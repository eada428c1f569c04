"""Checks shared by the routes that take multipart uploads (files, adapters)."""

from collections.abc import Mapping

from fastapi import Request

from tandem.platform.errors import PayloadTooLargeError

MULTIPART_OVERHEAD_BYTES = 64 << 10  # form boundaries and headers around the file itself


def reject_declared_oversize(request: Request, limit: int, param: str) -> None:
    """413 before reading the body when Content-Length already says the upload is over `limit`."""
    declared = int(request.headers.get("content-length") or 0)
    if declared > limit + MULTIPART_OVERHEAD_BYTES:
        raise PayloadTooLargeError(
            f"the upload is {declared} bytes; the limit is {limit}", param=param, code="file_too_large"
        )


def json_request_body(schema: Mapping[str, object]) -> dict[str, object]:
    """`openapi_extra` declaring a JSON request body (for routes that parse their body themselves)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
