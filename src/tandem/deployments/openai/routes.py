"""`POST /v1/chat/completions` and `POST /v1/completions` as plain ASGI, in front of FastAPI.

These two routes carry nearly all traffic, and at 16 concurrent streams on a small node every
request's trip through FastAPI (its middleware stack, route matching, dependency solving, and
`StreamingResponse`'s anyio task group with a disconnect listener) was paid one request after
another on the event loop before the engine saw the request and again before its first token
left: more than half of what a streamed request cost the loop (figures: docs/operations.md,
"Serving overhead").
`CompletionRoutes` answers them itself and hands every other request to the app behind it.

Contract, the same as FastAPI routes would give: OpenAI's error body with the status of the
`TandemError` (and `Retry-After` where it has one), 400 naming the field for a schema violation,
400 for a body that is not a JSON object, 413 for one over `MAX_BODY_BYTES` (refused from its
`Content-Length` before it is read), 405 for another method; a JSON body or an SSE stream with
`Server-Timing`. Anything else raised is logged with its traceback and a request id, and answered
with a 500 in OpenAI's shape that names only that request id (a stream reports it in-band). A
client that disconnects once its body is read, while its request waits for the first token or
streams, cancels the request, which aborts it in the engine. A refused request is logged ("request
refused": path, status, error code, request id).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from typing import Any, NamedTuple

from pydantic import ValidationError

from tandem.deployments.openai.endpoints import ENDPOINTS, Endpoint
from tandem.deployments.openai.errors import (
    error_body,
    internal_error_body,
    tandem_error_body,
    validation_error_body,
)
from tandem.deployments.openai.mapping import ResponseTiming
from tandem.deployments.openai.requests import reject_unsupported
from tandem.deployments.openai.responses import new_id
from tandem.deployments.openai.server import OpenAIServer
from tandem.platform.errors import InvalidRequestError, PayloadTooLargeError, TandemError
from tandem.platform.tenancy import Caller

logger = logging.getLogger("tandem.api")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 4 << 20


_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class BadJSONError(InvalidRequestError):
    """The body is not a JSON object (HTTP 400)."""


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; `BadJSONError` (400) otherwise, `PayloadTooLargeError`
    (413) above `MAX_BODY_BYTES`."""
    if len(raw) > MAX_BODY_BYTES:
        raise PayloadTooLargeError(f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadJSONError(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise BadJSONError("request body is nested too deeply") from exc
    if not isinstance(body, dict):
        raise BadJSONError("request body must be a JSON object")
    return body


def tandem_error_reply(exc: TandemError, request_id: str) -> tuple[int, dict[str, Any], dict[str, str]]:
    """Status, body and extra headers (`Retry-After` for errors that carry a retry hint). A 5xx
    names `request_id` in its message and `X-Request-ID`, and is logged under it."""
    retry_after = getattr(exc, "retry_after_s", None)
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after is not None else {}
    if exc.status_code >= 500:
        headers["X-Request-ID"] = request_id
        logger.warning(
            "request failed", extra={"request_id": request_id, "code": exc.code, "error": exc.message}
        )
    return exc.status_code, tandem_error_body(exc, request_id), headers


def log_refusal(
    route: str, status: int, body: dict[str, Any], request_id: str | None, tenant: str | None
) -> None:
    """One INFO line for a refused request (4xx): route, status, error code and param, request
    id and tenant. A 5xx is logged where it happens, with its traceback."""
    error = body.get("error", {})
    logger.info(
        "request refused",
        extra={
            "route": route,
            "status": status,
            "code": error.get("code"),
            "param": error.get("param"),
            "request_id": request_id,
            "tenant": tenant,
        },
    )


def validation_error_reply(errors: Sequence[Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
    """400 `invalid_request_error` naming the first offending field (`messages.0.content`), as
    OpenAI answers (never FastAPI's 422)."""
    return 400, validation_error_body(errors), {}


class _Disconnected(Exception):
    """The client went away before its request body was complete."""


class _RequestHeaders(NamedTuple):
    """The request headers the routes read, from one pass over them."""

    authorization: str | None  # or Anthropic's `x-api-key`, as a bearer token
    content_length: int | None
    request_id: bytes | None  # the client's X-Request-ID

    @classmethod
    def of(cls, scope: Scope) -> _RequestHeaders:
        authorization = api_key = content_length = request_id = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"x-api-key":  # Anthropic's clients send the key here
                api_key = value.decode("latin-1")
            elif name == b"content-length" and value.isdigit():
                content_length = int(value)
            elif name == b"x-request-id":
                request_id = value
        if authorization is None and api_key is not None:
            authorization = f"Bearer {api_key}"
        return cls(authorization, content_length, request_id)


class CompletionRoutes:
    """ASGI middleware: serves the two completion routes, passes everything else to `app`.

    `server_of(app)` returns the `OpenAIServer` answering for the Starlette app in
    `scope["app"]` (None while it starts: 500 `not_ready`, as the FastAPI routes give).
    """

    def __init__(self, app: ASGIApp, server_of: Callable[[Any], OpenAIServer | None]) -> None:
        self.app = app
        self.server_of = server_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = None
        if scope["type"] == "http":
            path, root = scope["path"], scope.get("root_path", "")
            endpoint = ENDPOINTS.get(path[len(root) :] if root and path.startswith(root) else path)
        if endpoint is None:
            await self.app(scope, receive, send)
        else:
            await self._answer(scope, receive, send, endpoint)

    async def _answer(self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        """Answer `scope`'s request at `endpoint`."""
        headers = _RequestHeaders.of(scope)
        client_request_id = headers.request_id
        if scope["method"] != "POST":
            message = f"{scope['method']} is not allowed here: send POST"
            body = error_body(message, "invalid_request_error", None, "method_not_allowed")
            reply = (405, endpoint.error_body(405, body), {"Allow": "POST"})
            await self._refuse(scope, send, reply, client_request_id, None)
            return
        timing = ResponseTiming(started=time.monotonic())
        response_started = False

        async def send_tracked(message: Message) -> None:
            nonlocal response_started
            response_started = True
            await send(message)

        tenant: str | None = None
        try:
            server, caller, body = await self._read_request(scope, headers, receive)
            tenant, key_id = caller.tenant, caller.api_key_id
            async with _CancelOnDisconnect(receive):
                request = endpoint.request_model.model_validate(body)
                result = await endpoint.run(server, request, tenant, timing=timing, api_key_id=key_id)
                reply_headers = {"Server-Timing": timing.header()}
                if isinstance(result, dict):
                    await _send_json(send_tracked, 200, result, reply_headers)
                else:
                    await _stream(result, reply_headers, send_tracked)
        except _Disconnected:
            return
        except TandemError as exc:  # raised before the response started (a stream reports in-band)
            request_id = timing.request_id or new_id("req")
            reply = _shaped(endpoint, tandem_error_reply(exc, request_id))
            await self._refuse(scope, send, reply, client_request_id, request_id, tenant)
        except ValidationError as exc:
            reply = _shaped(endpoint, validation_error_reply(exc.errors()))
            await self._refuse(scope, send, reply, client_request_id, timing.request_id, tenant)
        except Exception:  # a bug: the traceback goes to the log under the request id, not to the client
            request_id = timing.request_id or new_id("req")
            logger.exception(
                "request failed", extra={"route": scope["path"], "request_id": request_id, "tenant": tenant}
            )
            if not response_started:
                reply = _shaped(endpoint, (500, internal_error_body(request_id), {}))
                await self._refuse(scope, send, reply, client_request_id, request_id, tenant)

    async def _refuse(
        self,
        scope: Scope,
        send: Send,
        reply: tuple[int, dict[str, Any], dict[str, str]],
        client_request_id: bytes | None,
        request_id: str | None,
        tenant: str | None = None,
    ) -> None:
        """Send an error reply, and log it as one line, no traceback (with the client's
        `X-Request-ID`, else ours): a client's mistake is not the server's failure."""
        status, body, headers = reply
        log_refusal(
            scope["path"],
            status,
            body,
            client_request_id.decode("latin-1") if client_request_id else request_id,
            tenant,
        )
        await _send_json(send, status, body, headers)

    async def _read_request(
        self, scope: Scope, headers: _RequestHeaders, receive: Receive
    ) -> tuple[OpenAIServer, Caller, dict[str, Any]]:
        """The server, the caller (401 without a valid key) and the body as a JSON object
        with no unsupported field (400), refused from its `Content-Length` when too large (413)."""
        server = self.server_of(scope.get("app"))
        if server is None:
            raise TandemError("server is starting; retry shortly", code="not_ready")
        caller = server.tenants.identify(headers.authorization)
        if headers.content_length is not None and headers.content_length > MAX_BODY_BYTES:
            raise PayloadTooLargeError(
                f"request body is {headers.content_length} bytes; the limit is {MAX_BODY_BYTES}"
            )
        body = parse_json_object(await _read_body(receive))
        reject_unsupported(body)
        return server, caller, body


Reply = tuple[int, dict[str, Any], dict[str, str]]


def _shaped(endpoint: Endpoint, reply: Reply) -> Reply:
    """An error reply in the shape `endpoint`'s clients parse (Anthropic's on `/v1/messages`)."""
    status, body, headers = reply
    return status, endpoint.error_body(status, body), headers


async def _read_body(receive: Receive) -> bytes:
    """The whole request body, at most one chunk over `MAX_BODY_BYTES` (the caller refuses it)."""
    chunks: list[bytes] = []
    num_bytes = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunk = message.get("body", b"")
        chunks.append(chunk)
        num_bytes += len(chunk)
        if num_bytes > MAX_BODY_BYTES or not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class _CancelOnDisconnect:
    """`async with` block that a client disconnect cancels, and that then ends quietly.

    After the body is read, `receive()` only answers `http.disconnect`; a watcher task waits for
    it and cancels the task running the block. Whatever the block awaits at that moment (the
    engine's first output, the next one, a send) gets the cancellation: `OpenAIServer` closes the
    engine stream, which aborts the request and frees its KV blocks.
    """

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.disconnected = False

    async def __aenter__(self) -> None:
        task = asyncio.current_task()
        assert task is not None, "runs in a task"
        self.task = task
        self.watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        self.task.cancel()

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> bool:
        self.watcher.cancel()
        if exc_type is not None and issubclass(exc_type, asyncio.CancelledError) and self.disconnected:
            uncancel = getattr(self.task, "uncancel", None)  # Python 3.11+: the task is not cancelling
            if uncancel is not None:
                uncancel()
            return True
        return False


def _raw_headers(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]


async def _send_json(send: Send, status: int, payload: dict[str, Any], headers: dict[str, str]) -> None:
    body = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    raw_headers = [*_JSON_HEADERS, (b"content-length", str(len(body)).encode()), *_raw_headers(headers)]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _stream(events: AsyncIterator[str], headers: dict[str, str], send: Send) -> None:
    """Send `events` as an SSE body; `events` is closed however this ends (a cancellation closes
    the engine stream under it, aborting the request)."""
    try:
        start_headers = [*_SSE_HEADERS, *_raw_headers(headers)]
        await send({"type": "http.response.start", "status": 200, "headers": start_headers})
        async for event in events:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
