"""The platform on Ray Serve: real HTTP, the official openai client, replicas with num_cpus 0."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

pytestmark = pytest.mark.ray

KEY = "sk-serve-test"


@pytest.fixture(scope="module")
def served(ray_serve: str, tiny_model_dir: Path) -> str:
    from ray import serve

    from tandem.deployments.app import build_app

    app = build_app({
        "engine": {"model": str(tiny_model_dir), "kv_cache_memory": 4 << 20, "served_model_name": "tiny"},
        "api_keys": f"{KEY}=acme",
        "replica_num_cpus": 0,
    })
    serve.run(app, name="tandem", route_prefix="/")
    yield ray_serve
    serve.delete("tandem")


def test_openai_client_through_serve(served: str) -> None:
    client = openai.OpenAI(base_url=f"{served}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_tokens=10,
                  temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert full.choices[0].message.content == streamed and full.usage.completion_tokens == 10
    text = client.completions.create(model="tiny", prompt="Paged attention", max_tokens=4, temperature=0)
    assert text.choices[0].finish_reason in ("length", "stop")


def test_errors_through_serve(served: str) -> None:
    client = openai.OpenAI(base_url=f"{served}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as info:  # raised inside the replica, mapped at the ingress
        client.completions.create(model="tiny", prompt="word " * 600)
    assert info.value.body.get("code") == "context_length_exceeded"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served}/v1", api_key="wrong", max_retries=0).models.list()
