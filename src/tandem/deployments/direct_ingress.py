"""The completion routes in front of Ray Serve's per-request handling, on a direct-ingress replica.

With Serve's direct ingress (`tandem serve`), each LLM replica runs an HTTP server of Serve's, and
Serve wraps every request it receives (`Replica._direct_ingress_asgi`) before our app sees it:
request metadata and ids, a receive proxy with a disconnect-watch task and a second task for the
request, `asyncio.wait` on both, queue and ongoing-request accounting, route matching over the
FastAPI routes for its metrics, its request metrics and an access-log line; then the FastAPI app's
outer middleware stack before `CompletionRoutes`. On the 2-core dev machine, all that cost the
replica's event loop 0.8-1.1 ms of CPU per streamed completion (2.0-2.3 ms in all, 1.2 ms without
it), paid one request after another in a burst (see docs/operations.md, "Serving overhead").

Serve lets a replica's process add ASGI middleware around that server, by import path in
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` (read when the server starts; Serve's proxy reads the
same variable, so it is set in the LLM replica's environment only: `DIRECT_INGRESS_ENV_VARS`).
`http_middlewares` is that callback. Its middleware answers `POST /v1/chat/completions` and
`POST /v1/completions` under the replica's route prefix with `CompletionRoutes` before Serve's
wrapper, and hands everything else (health checks, `/-/routes`, the other API routes) to it.

What Serve's wrapper did for those two routes, and what does it here:
- client disconnects: `CompletionRoutes`' own watcher aborts the request in the engine;
- backpressure: `InProcessReplicaClient`'s in-flight limit (429 with `Retry-After`), as before;
- `X-Request-ID`: echoed when the client sends one, else the completion's id (`CompletionRoutes`
  with `request_id_header`);
- the access log: our "request finished" and "request refused" lines (tenant, request id, status);
- request metrics: ours (TTFT, e2e, tokens per tenant on `/metrics`). Serve's own HTTP request
  metrics no longer count these two routes;
- graceful shutdown: when Serve stops the replica's server, uvicorn waits for open responses;
- Serve's `request_timeout_s` is not applied to them (`tandem serve` sets none).

The replica's route prefix is read from the handler the middleware wraps (a private attribute of
Serve's replica). Where it cannot be found (another Ray version), the middleware passes every
request on, so the routes still work, through Serve's wrapper and FastAPI.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.middleware import Middleware

from tandem.deployments.completion_routes import ROUTES, ASGIApp, CompletionRoutes
from tandem.deployments.ingress import server_for_app

logger = logging.getLogger("tandem.api")

CALLBACK_ENV_VAR = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
DIRECT_INGRESS_ENV_VARS = {CALLBACK_ENV_VAR: "tandem.deployments.direct_ingress:http_middlewares"}


def serve_route_prefix(app: Any, max_depth: int = 8) -> str | None:
    """The route prefix of the Serve replica whose request handler `app` is or wraps (through
    middlewares that keep the next app as `app` or `_app`); None if there is none to find."""
    for _ in range(max_depth):
        prefix = getattr(getattr(app, "__self__", None), "_route_prefix", None)
        if isinstance(prefix, str):
            return prefix
        app = getattr(app, "_app", None) or getattr(app, "app", None)
        if app is None:
            return None
    return None


def completion_routes_in_front(app: ASGIApp) -> ASGIApp:
    """`CompletionRoutes` around Serve's direct-ingress request handler `app`, for the two
    completion routes under the replica's route prefix; `app` itself where the prefix is not found."""
    prefix = serve_route_prefix(app)
    if prefix is None:
        logger.warning(
            "direct ingress: Serve's route prefix was not found (another Ray version?); the "
            "completion routes go through Serve's request handling"
        )
        return app
    mount = prefix.rstrip("/")
    routes = {mount + path: chat for path, chat in ROUTES.items()}
    return CompletionRoutes(app, server_of=server_for_app, request_id_header=True, routes=routes)


def http_middlewares() -> list[Middleware]:
    """Serve's HTTP middleware callback (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`)."""
    return [Middleware(completion_routes_in_front)]
