"""The completion routes in front of Serve's direct-ingress request handling, composed as Serve
composes its replica's HTTP app (`_apply_middlewares`), with a stand-in for Serve's handler and a
real AsyncEngine on a small model. `tandem serve` runs it for real in test_cli_serve."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from starlette.testclient import TestClient

from tandem import AsyncEngine
from tandem.deployments import ingress
from tandem.deployments.direct_ingress import http_middlewares, serve_route_prefix
from tandem.deployments.openai_server import OpenAIServer
from tandem.platform.tenancy import TenantRegistry, parse_keys

KEY = "sk-direct-ingress"


class ServeReplicaStandIn:
    """Stands in for Serve's replica: its direct-ingress handler answers 299 and records paths."""

    def __init__(self, route_prefix: str) -> None:
        self._route_prefix = route_prefix
        self.paths: list[str] = []

    async def _direct_ingress_asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.paths.append(scope["path"])
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b"serve"})


@pytest.fixture()
def installed(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server a direct-streaming replica installs for its process."""
    server = OpenAIServer(engine, TenantRegistry(parse_keys(f"{KEY}=acme")))
    monkeypatch.setattr(ingress, "_installed_server", server)


def replica_http_app(replica: ServeReplicaStandIn) -> Any:
    """The ASGI app Serve's replica server runs: its handler inside Serve's own request-id
    middleware, inside the middlewares of `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`."""
    from ray.serve._private.http_util import _apply_middlewares

    return _apply_middlewares(replica._direct_ingress_asgi, http_middlewares())


@contextlib.contextmanager
def http_client(app: Any) -> Iterator[TestClient]:
    """A test client without ASGI lifespan events: Serve runs its replica server with none."""
    client = TestClient(app)
    try:
        yield client
    finally:
        client.close()


@pytest.mark.usefixtures("installed")
def test_completions_are_answered_in_front_of_serve_and_the_rest_reaches_it() -> None:
    replica = ServeReplicaStandIn("/")
    assert serve_route_prefix(replica_http_app(replica)) == "/"
    with http_client(replica_http_app(replica)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)
        raw = client.completions.with_raw_response.create(model="tiny", prompt="Paged", max_tokens=3)
        completion = raw.parse()
        assert completion.usage is not None and completion.usage.completion_tokens == 3
        assert raw.headers["x-request-id"] == completion.id  # ours, not Serve's uuid
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert replica.paths == []  # neither reached Serve's handler

        # Refusals have OpenAI's shape and echo the client's request id.
        refused = http.post("/v1/completions", json={"model": "tiny"}, headers={"X-Request-ID": "mine-7"})
        assert refused.status_code == 401 and refused.headers["x-request-id"] == "mine-7"
        assert refused.json()["error"]["code"] == "invalid_api_key"

        health = http.get("/-/healthz")
        assert (health.status_code, health.text) == (299, "serve")
        assert http.get("/v1/models").status_code == 299
        assert replica.paths == ["/-/healthz", "/v1/models"]


@pytest.mark.usefixtures("installed")
def test_only_paths_under_the_route_prefix_are_answered_in_front() -> None:
    replica = ServeReplicaStandIn("/app")
    with http_client(replica_http_app(replica)) as http:
        headers = {"Authorization": f"Bearer {KEY}"}
        body = {"model": "tiny", "prompt": "Paged", "max_tokens": 2}
        answered = http.post("/app/v1/completions", json=body, headers=headers)
        assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] == 2
        assert replica.paths == []
        # Not under the prefix: Serve's handler decides (it answers 404 for a path outside it).
        assert http.post("/v1/completions", json=body, headers=headers).status_code == 299
        assert replica.paths == ["/v1/completions"]


@pytest.mark.usefixtures("installed")
def test_without_a_route_prefix_to_find_everything_goes_to_serve() -> None:
    """Another Ray version whose handler does not keep its route prefix where we look: the routes
    still work, through Serve's handling."""
    paths: list[str] = []

    async def handler(scope: dict[str, Any], receive: Any, send: Any) -> None:
        paths.append(scope["path"])
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b"serve"})

    from ray.serve._private.http_util import _apply_middlewares

    with http_client(_apply_middlewares(handler, http_middlewares())) as http:
        response = http.post("/v1/completions", json={}, headers={"Authorization": f"Bearer {KEY}"})
        assert response.status_code == 299 and paths == ["/v1/completions"]
