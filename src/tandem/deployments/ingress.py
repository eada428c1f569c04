"""FastAPI app with the OpenAI routes, and the Ray Serve ingress deployment that serves it.

Routes read the `OpenAIServer` from `app.state.server`, so the same app runs under Serve
(`OpenAIIngress.__init__` installs a server backed by a deployment handle) and in tests
(`create_app(server)` with a local `AsyncEngine`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from tandem.deployments.adapter_routes import adapter_router
from tandem.deployments.batch_routes import batch_router
from tandem.deployments.openai_server import OpenAIServer, ResponseTiming
from tandem.platform.errors import PayloadTooLargeError, TandemError
from tandem.platform.openai_schemas import ChatCompletionRequest, CompletionRequest, reject_unsupported

logger = logging.getLogger("tandem.api")

MAX_BODY_BYTES = 4 << 20
HEALTH_TIMEOUT_S = 2.0


def error_response(
    status: int,
    message: str,
    error_type: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


_installed_server: OpenAIServer | None = None


def install_server(server: OpenAIServer) -> None:
    """Make `server` answer this process's requests. Under Serve the app that handles requests is
    a deserialised copy of the one passed to `@serve.ingress`, so its `state` is not ours to set;
    this module (imported once per process) is shared by both."""
    global _installed_server
    _installed_server = server


def _server_or_none(request: Request) -> OpenAIServer | None:
    """The server for `request`. Routes call this module-level function rather than reading
    `_installed_server` themselves: Serve ships the routes (closures) to the replica by value, with
    a copy of the module globals they name taken before any server was installed."""
    return getattr(request.app.state, "server", None) or _installed_server


def _server(request: Request) -> OpenAIServer:
    server = _server_or_none(request)
    if server is None:
        raise TandemError("server is starting; retry shortly", code="not_ready")
    return server


def _authenticated(request: Request) -> tuple[OpenAIServer, str]:
    """The server and the caller's tenant; 401 without a valid key."""
    server = _server(request)
    return server, server.tenants.authenticate(request.headers.get("authorization"))


async def json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise PayloadTooLargeError(f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _BadJSON(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise _BadJSON("request body must be a JSON object")
    return body


class _BadJSON(TandemError):
    status_code = 400
    error_type = "invalid_request_error"


def create_app(server: OpenAIServer | None = None) -> FastAPI:
    app = FastAPI(title="Tandem", version="0.1.0")
    app.state.server = server

    @app.exception_handler(TandemError)
    async def _tandem_error(_: Request, exc: TandemError) -> JSONResponse:
        retry_after = getattr(exc, "retry_after_s", None)
        headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after is not None else None
        return error_response(exc.status_code, exc.message, exc.error_type, exc.param, exc.code, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return error_response(422, f"{param}: {first.get('msg')}", "invalid_request_error", param)

    def _parse(model: type[ChatCompletionRequest] | type[CompletionRequest], body: dict[str, Any]) -> Any:
        reject_unsupported(body)
        try:
            return model.model_validate(body)
        except Exception as exc:  # pydantic.ValidationError -> 422 via the handler above
            from pydantic import ValidationError

            if isinstance(exc, ValidationError):
                raise RequestValidationError(exc.errors()) from exc
            raise

    def _respond(result: Any, timing: ResponseTiming) -> Any:
        headers = {"Server-Timing": timing.header()}
        if isinstance(result, dict):
            return JSONResponse(result, headers=headers)
        headers |= {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(result, media_type="text/event-stream", headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        timing = ResponseTiming(started=time.monotonic())
        server, tenant = _authenticated(request)
        req = _parse(ChatCompletionRequest, await json_body(request))
        return _respond(await server.chat(req, tenant, timing=timing), timing)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        timing = ResponseTiming(started=time.monotonic())
        server, tenant = _authenticated(request)
        req = _parse(CompletionRequest, await json_body(request))
        return _respond(await server.completions(req, tenant, timing=timing), timing)

    app.include_router(batch_router(_authenticated, json_body))
    app.include_router(adapter_router(_authenticated, json_body))

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        server, tenant = _authenticated(request)
        return await run_in_threadpool(server.models, tenant)

    @app.get("/health")
    async def health(request: Request) -> Any:
        """Ready when an engine answers: 503 while the model replicas are still starting."""
        server = _server(request)
        try:
            await asyncio.wait_for(server.refresh_engine_stats(), HEALTH_TIMEOUT_S)
        except Exception as exc:
            return error_response(
                503,
                f"no engine is ready yet ({type(exc).__name__}); retry shortly",
                "server_error",
                code="not_ready",
            )
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        from tandem.platform.telemetry import prometheus_text

        server = _server_or_none(request)
        if server is not None:
            await server.refresh_engine_stats()
        return PlainTextResponse(prometheus_text(), media_type="text/plain; version=0.0.4")

    return app
