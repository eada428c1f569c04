"""The platform on Ray Serve: real HTTP, the official openai client, replicas with num_cpus 0."""

from __future__ import annotations

import openai
import pytest

from .conftest import make_tiny_model

pytestmark = pytest.mark.ray

KEY = "sk-serve-test"


@pytest.fixture(scope="module")
def served(ray_serve: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    from ray import serve

    from tandem.deployments.app import build_app

    # A long context so a streamed request is still running when the client goes away.
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny-long"), max_positions=4096)
    app = build_app(
        {
            "engine": {"model": str(model_dir), "kv_cache_memory": 8 << 20, "served_model_name": "tiny"},
            "api_keys": f"{KEY}=acme",
            "replica_num_cpus": 0,
        }
    )
    serve.run(app, name="tandem", route_prefix="/")
    yield ray_serve
    serve.delete("tandem")


def test_openai_client_through_serve(served: str) -> None:
    client = openai.OpenAI(base_url=f"{served}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kwargs)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kwargs)
        if c.choices
    )
    assert full.choices[0].message.content == streamed and full.usage.completion_tokens == 10
    text = client.completions.create(model="tiny", prompt="Paged attention", max_tokens=4, temperature=0)
    assert text.choices[0].finish_reason in ("length", "stop")


def test_errors_through_serve(served: str) -> None:
    client = openai.OpenAI(base_url=f"{served}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as info:  # raised inside the replica, mapped at the ingress
        client.completions.create(model="tiny", prompt="word " * 5000)
    assert info.value.body.get("code") == "context_length_exceeded"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served}/v1", api_key="wrong", max_retries=0).models.list()


def test_client_disconnect_frees_kv_blocks(served: str) -> None:
    import time

    import httpx
    from ray import serve

    replica = serve.get_deployment_handle("LLMReplica", app_name="tandem")
    body = {
        "model": "tiny",
        "prompt": "Paged attention",
        "max_tokens": 4000,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream(
            "POST", f"{served}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        ) as resp,
    ):
        events = 0
        for line in resp.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                during = replica.stats.remote().result()
                assert during["kv_blocks_used"] > 0 and during["num_running"] == 1, during  # still generating
                break
    closed_at = time.monotonic()
    # The requirement is "free within a second": check the condition until that deadline.
    while replica.stats.remote().result()["kv_blocks_used"] > 0:
        assert time.monotonic() - closed_at < 1.0, "aborted request still holds KV blocks after 1 s"
    stats = replica.stats.remote().result()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_backpressure_is_429_not_a_hang(served: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    import asyncio

    from ray import serve

    from tandem.deployments.app import build_app

    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny-bp"), max_positions=4096)
    app = build_app(
        {
            "engine": {"model": str(model_dir), "kv_cache_memory": 8 << 20, "served_model_name": "tiny"},
            "api_keys": f"{KEY}=acme",
            "replica_num_cpus": 0,
            "max_ongoing_requests": 1,
            "max_queued_requests": 1,
        }
    )
    serve.run(app, name="tandem-bp", route_prefix="/bp")
    try:
        client = openai.AsyncOpenAI(base_url=f"{served}/bp/v1", api_key=KEY, max_retries=0, timeout=120)

        async def one() -> str:
            try:
                stream = await client.completions.create(
                    model="tiny",
                    prompt="x",
                    max_tokens=300,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                async for _ in stream:
                    pass
                return "ok"
            except openai.InternalServerError as exc:
                raise AssertionError(exc.response.text) from exc
            except openai.RateLimitError as exc:
                assert exc.response.headers.get("retry-after")
                return "429"

        async def many() -> list[str]:
            return await asyncio.wait_for(asyncio.gather(*(one() for _ in range(5))), timeout=120)

        results = asyncio.run(many())
        assert results.count("ok") >= 1 and results.count("429") >= 1, results
    finally:
        serve.delete("tandem-bp")
