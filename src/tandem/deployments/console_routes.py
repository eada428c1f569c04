"""The console (`/console`): web pages for tenants and operators, a client of the API.

The pages are static files built from `console/` at the repository root (`make console`, esbuild)
into `console_static/` in this package; they call the same `/v1` routes as any client, so every
read and mutation goes through the API's own authentication, tenant scoping and limits.

Signing in: `POST /console/session` with `{"key": ...}` (and the console's header, as every
session change: no cross-site form can sign a browser in or out) checks the key (an operator's or a
tenant's) and sets the session cookie, `HttpOnly` (no script reads it), `SameSite=Strict`, `Secure`
when the request came over TLS (directly or as `X-Forwarded-Proto: https`), for 12 hours; the key
is never in a URL or in the page's storage. `GET /console/session` says who is signed in (401 if
nobody), `DELETE /console/session` signs out. `ConsoleSessionAuth` (ASGI, in front of every route)
turns the cookie into the `Authorization` header, but only on requests that also carry the
`X-Tandem-Console: 1` header: a page on another site can neither read the cookie nor add that
header to a request here without a CORS preflight this server never grants, so the cookie alone
authorises nothing (no cross-site request forgery).

Every console response carries a Content-Security-Policy without inline scripts or styles
(`default-src 'none'`, scripts, styles, images and API calls from this origin only), denies
framing, and is not cached by shared caches.
"""

# No `from __future__ import annotations`: FastAPI must see the real `Request` annotation after
# Serve ships the routes to the replica by value (as admin_routes.py).

import mimetypes
import re
from collections.abc import Awaitable, Callable
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from tandem.deployments.openai.server import OpenAIServer
from tandem.platform.errors import InvalidRequestError, NotFoundError
from tandem.platform.tenancy import PermissionDeniedError

SESSION_COOKIE = "tandem_console"
CONSOLE_HEADER = "x-tandem-console"
SESSION_MAX_AGE_S = 12 * 3600
STATIC_DIR = Path(__file__).parent / "console_static"
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_ASSET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*")  # no path, no dot files
# The pages the single-page app routes itself (a reload of any of them serves index.html).
PAGES = frozenset(
    {"", "signin", "usage", "batches", "adapters", "keys", "playground", "fleet", "tenants", "queue"}
)


def _over_tls(request: Request) -> bool:
    return request.url.scheme == "https" or request.headers.get("x-forwarded-proto", "").lower() == "https"


def session_key(cookie_header: str | None) -> str | None:
    """The key in the console's session cookie, from a `Cookie` header (None: no session)."""
    if not cookie_header:
        return None
    cookie: SimpleCookie = SimpleCookie()
    try:
        cookie.load(cookie_header)
    except Exception:  # a malformed Cookie header is no session
        return None
    morsel = cookie.get(SESSION_COOKIE)
    return morsel.value if morsel is not None and morsel.value else None


def _who(server: OpenAIServer, key: str) -> dict[str, Any]:
    """Who `key` is: an operator, or a tenant (401 for an unknown, revoked or expired key)."""
    authorization = f"Bearer {key}"
    if server.tenants.is_operator(authorization):
        return {"object": "console.session", "role": "operator", "tenant": None}
    return {
        "object": "console.session",
        "role": "tenant",
        "tenant": server.tenants.authenticate(authorization),
    }


async def _asset(name: str, request: Request) -> Response:
    """A built file; its precompressed copy (`<name>.gz`, made by the build) to a browser that
    accepts gzip."""
    if not _ASSET_NAME.fullmatch(name) or name == "index.html" or not (STATIC_DIR / name).is_file():
        raise NotFoundError(f"no console asset {name!r}")
    path, headers = STATIC_DIR / name, {**SECURITY_HEADERS, "Vary": "Accept-Encoding"}
    media_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
    compressed = STATIC_DIR / f"{name}.gz"
    if "gzip" in request.headers.get("accept-encoding", "") and compressed.is_file():
        path, headers["Content-Encoding"] = compressed, "gzip"
    return FileResponse(path, media_type=media_type, headers=headers)


async def _page(page: str = "") -> Response:
    if page not in PAGES:
        raise NotFoundError(f"no console page {page!r}")
    index = STATIC_DIR / "index.html"
    if not index.is_file():
        raise NotFoundError("the console is not built: run `make console`")
    return FileResponse(index, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)


def console_router(
    server_of: Callable[[Request], OpenAIServer],
    json_body: Callable[[Request], Awaitable[dict[str, Any]]],
) -> APIRouter:
    router = APIRouter()

    def from_the_console(request: Request) -> None:
        """Session changes need the console's header too: a cross-site form could otherwise sign a
        victim's browser in with the attacker's key (login CSRF) or out."""
        if request.headers.get(CONSOLE_HEADER) != "1":
            raise PermissionDeniedError(
                f"session changes come from the console (the {CONSOLE_HEADER!r} header)"
            )

    @router.post("/console/session")
    async def sign_in(request: Request) -> Response:
        server = server_of(request)
        from_the_console(request)
        body = await json_body(request)
        key = body.get("key")
        if not isinstance(key, str) or not key.strip():
            raise InvalidRequestError("key must be an API key (a non-empty string)", param="key")
        who = _who(server, key.strip())
        response = JSONResponse(who, headers=SECURITY_HEADERS)
        response.set_cookie(
            SESSION_COOKIE, key.strip(), max_age=SESSION_MAX_AGE_S, path="/",
            httponly=True, samesite="strict", secure=_over_tls(request),
        )  # fmt: skip
        return response

    @router.get("/console/session")
    async def session(request: Request) -> Response:
        server = server_of(request)
        key = session_key(request.headers.get("cookie"))
        if key is None:
            return JSONResponse(
                {"error": {"message": "not signed in", "type": "invalid_request_error", "param": None,
                           "code": "not_signed_in"}},
                status_code=401, headers=SECURITY_HEADERS,
            )  # fmt: skip
        return JSONResponse(_who(server, key), headers=SECURITY_HEADERS)

    @router.delete("/console/session")
    async def sign_out(request: Request) -> Response:
        from_the_console(request)
        response = JSONResponse(
            {"object": "console.session.deleted", "deleted": True}, headers=SECURITY_HEADERS
        )
        response.delete_cookie(
            SESSION_COOKIE, path="/", httponly=True, samesite="strict", secure=_over_tls(request)
        )
        return response

    router.add_api_route("/console/assets/{name}", _asset, methods=["GET"])
    router.add_api_route("/console", _page, methods=["GET"])
    router.add_api_route("/console/{page}", _page, methods=["GET"])
    return router


class ConsoleSessionAuth:
    """ASGI middleware: a request with the console's header and its session cookie, and no
    `Authorization` header, is authorised as the cookie's key (module docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers: list[tuple[bytes, bytes]] = scope["headers"]
            names = {name for name, _ in headers}
            if b"authorization" not in names and (CONSOLE_HEADER.encode(), b"1") in headers:
                cookie = b"; ".join(value for name, value in headers if name == b"cookie")
                key = session_key(cookie.decode("latin-1")) if cookie else None
                if key is not None:
                    scope = {**scope, "headers": [*headers, (b"authorization", f"Bearer {key}".encode())]}
        await self.app(scope, receive, send)
