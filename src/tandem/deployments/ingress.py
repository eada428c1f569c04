"""FastAPI app with the OpenAI routes, and the Ray Serve ingress deployment that serves it.

The two completion routes are answered by `CompletionRoutes` (ASGI middleware in this app, in
front of FastAPI's routing); the files, batches, adapters, models, health and metrics routes are
FastAPI routes, and so are the console's pages and session (`console_routes.py`; its cookie is
turned into the `Authorization` header by `ConsoleSessionAuth`, in front of everything).

Routes read the `OpenAIServer` from `app.state.server`, so the same app runs under Serve
(`OpenAIIngress.__init__` installs a server backed by a deployment handle) and in tests
(`create_app(server)` with a local `AsyncEngine`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.deployments.adapter_routes import adapter_router
from tandem.deployments.admin_routes import admin_router
from tandem.deployments.batch_routes import batch_router
from tandem.deployments.console_routes import ConsoleSessionAuth, console_router
from tandem.deployments.openai.endpoints import ENDPOINTS
from tandem.deployments.openai.errors import ErrorResponse, error_body, internal_error_body
from tandem.deployments.openai.responses import new_id
from tandem.deployments.openai.routes import (
    CompletionRoutes,
    log_refusal,
    parse_json_object,
    tandem_error_reply,
    validation_error_reply,
)
from tandem.deployments.openai.server import OpenAIServer
from tandem.deployments.operator_routes import operator_router
from tandem.deployments.response_routes import response_router
from tandem.deployments.usage_routes import usage_router
from tandem.platform.errors import TandemError

logger = logging.getLogger("tandem.api")

HEALTH_TIMEOUT_S = 2.0


def error_response(
    status: int,
    message: str,
    error_type: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, param, code), status_code=status, headers=headers)


def _reply_response(status: int, body: Mapping[str, object], headers: dict[str, str]) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


_installed_server: OpenAIServer | None = None


def install_server(server: OpenAIServer) -> None:
    """Make `server` answer this process's requests. Under Serve the app that handles requests is
    a deserialised copy of the one passed to `@serve.ingress`, so its `state` is not ours to set;
    this module (imported once per process) is shared by both."""
    global _installed_server
    _installed_server = server


def server_for_app(app: object) -> OpenAIServer | None:
    """The server answering for the Starlette `app`. Routes call this module-level function rather
    than reading `_installed_server` themselves: Serve ships the routes (closures) to the replica by
    value, with a copy of the module globals they name taken before any server was installed."""
    return getattr(getattr(app, "state", None), "server", None) or _installed_server


def _server(request: Request) -> OpenAIServer:
    server = server_for_app(request.app)
    if server is None:
        raise TandemError("server is starting; retry shortly", code="not_ready")
    return server


def _authenticated(request: Request) -> tuple[OpenAIServer, str]:
    """The server and the caller's tenant; 401 without a valid key."""
    server = _server(request)
    return server, server.tenants.authenticate(request.headers.get("authorization"))


async def json_body(request: Request) -> dict[str, object]:
    return parse_json_object(await request.body())


def _openapi_schema(app: FastAPI) -> dict[str, object]:
    """FastAPI's schema of the routes, plus the two completion routes (`CompletionRoutes` answers
    them in front of FastAPI, so FastAPI does not know them) and bearer-key security."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {})
    models = components.setdefault("schemas", {})
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for endpoint in ENDPOINTS.values():
        model = endpoint.request_model
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        models.update(body.pop("$defs", {}))
        models[model.__name__] = body
        schema["paths"][endpoint.path] = {
            "post": {
                "summary": endpoint.summary,
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
                    },
                },
                "responses": {
                    "200": {"description": "A completion (JSON), or with `stream` its chunks (SSE)"},
                    "400": {"description": "Invalid request", "content": error},
                },
            }
        }
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    models.update(error_schema.pop("$defs", {}))
    models["ErrorResponse"] = error_schema
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    schema["security"] = [{"bearer": []}]
    app.openapi_schema = schema
    return schema


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: `TandemError`s as they say, validation errors naming the
    parameter, Starlette's own 404 / 405, and a bug as a 500 with only a request id."""

    @app.exception_handler(TandemError)
    async def _tandem_error(request: Request, exc: TandemError) -> JSONResponse:
        request_id = request.headers.get("x-request-id") or new_id("req")
        reply = tandem_error_reply(exc, request_id)
        if reply[0] < 500:
            log_refusal(request.url.path, reply[0], reply[1], request_id, None)
        return _reply_response(*reply)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        reply = validation_error_reply(list(exc.errors()))
        log_refusal(request.url.path, reply[0], reply[1], request.headers.get("x-request-id"), None)
        return _reply_response(*reply)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Starlette's own answers (no such route: 404 listing the routes served, another method:
        405) in OpenAI's shape."""
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = str(exc.detail)
        if exc.status_code == 404 and exc.detail == "Not Found":
            message = (
                f"{request.method} {request.url.path} is not a route of this server; it serves "
                + ", ".join(served_routes(request.app))
            )
        return error_response(exc.status_code, message, error_type, None, code, dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        """A bug: its traceback goes to the log under a request id; the client gets only that id."""
        request_id = request.headers.get("x-request-id") or new_id("req")
        logger.error(
            "request failed",
            exc_info=exc,
            extra={"path": request.url.path, "method": request.method, "request_id": request_id},
        )
        return _reply_response(500, internal_error_body(request_id), {"X-Request-ID": request_id})


def served_routes(app: FastAPI) -> list[str]:
    """The API's routes as `METHOD /path`, from its OpenAPI document (the endpoint table's and
    every router's): the `/v1/` routes, `/health` and `/metrics`, for the 404 that lists them."""
    paths = _openapi_schema(app)["paths"]
    assert isinstance(paths, dict)
    return [
        f"{method.upper()} {path}"
        for path, operations in paths.items()
        if path.startswith("/v1/") or path in ("/health", "/metrics")
        for method in operations
    ]


async def _models(request: Request) -> dict[str, object]:
    server, tenant = _authenticated(request)
    return await run_in_threadpool(server.models, tenant, await server.model_info())


async def _model(model_id: str, request: Request) -> dict[str, object]:
    server, tenant = _authenticated(request)
    return await run_in_threadpool(server.model, tenant, model_id, await server.model_info())


async def _health(request: Request) -> JSONResponse:
    """Ready when an engine replica reports: 503 while every model replica is still loading
    (the fleet state then holds no report) or none answers in time."""
    server = _server(request)
    try:
        num_reporting = await asyncio.wait_for(server.refresh_engine_stats(), HEALTH_TIMEOUT_S)
    except Exception as exc:
        return error_response(
            503,
            f"no engine is ready yet ({type(exc).__name__}); retry shortly",
            "server_error",
            code="not_ready",
        )
    if num_reporting == 0:
        return error_response(
            503, "no engine replica is ready yet (loading the model); retry shortly", "server_error",
            code="not_ready",
        )  # fmt: skip
    return JSONResponse({"status": "ok"})


async def _metrics(request: Request) -> PlainTextResponse:
    """Prometheus text, for operators only (its series are labelled by tenant): 401 without a
    key, 403 with a tenant's key."""
    from tandem.platform.telemetry import prometheus_text

    server = _server(request)
    server.tenants.authenticate_operator(request.headers.get("authorization"))
    await server.refresh_engine_stats()
    return PlainTextResponse(prometheus_text(), media_type="text/plain; version=0.0.4")


def create_app(server: OpenAIServer | None = None) -> FastAPI:
    """The OpenAI app. `POST /v1/chat/completions` and `POST /v1/completions` are answered by
    `CompletionRoutes` in front of FastAPI's routing (they are the hot path); the rest are routes."""
    app = FastAPI(title="Tandem", version="0.1.0")
    app.state.server = server
    app.add_middleware(CompletionRoutes, server_of=server_for_app)
    app.add_middleware(ConsoleSessionAuth)  # outermost: the console's cookie becomes the key for every route

    _add_error_handlers(app)
    app.openapi = lambda: _openapi_schema(app)  # type: ignore[method-assign]
    app.include_router(batch_router(_authenticated, json_body))
    app.include_router(adapter_router(_authenticated, json_body))
    app.include_router(admin_router(_server, json_body))
    app.include_router(operator_router(_server))
    app.include_router(usage_router(_server))
    app.include_router(response_router(_authenticated))
    app.include_router(console_router(_server, json_body))

    app.add_api_route("/v1/models", _models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", _model, methods=["GET"])
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])
    return app
