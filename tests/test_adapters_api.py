"""Adapters through the API (in-process, the official openai client): upload, use, delete while
other requests stream; tenant isolation; validation errors."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from tandem import AsyncEngine
from tandem.deployments.adapters import AdapterStore
from tandem.deployments.engine_clients import LocalEngineClient
from tandem.deployments.ingress import create_app
from tandem.deployments.openai.server import OpenAIServer
from tandem.engine.io.tokenizer import Tokenizer
from tandem.platform.api_keys import parse_keys
from tandem.platform.object_store import FileObjectStore
from tandem.platform.tenancy import TenantRegistry

from .test_lora import _peft_reference

KEY_A, KEY_B = "sk-lora-a", "sk-lora-b"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[AsyncEngine]:
    eng = AsyncEngine.from_options(
        str(tiny_model_dir), kv_cache_memory=8 << 20, served_model_name="tiny", enable_lora=True, max_loras=2
    )
    yield eng
    eng.shutdown()


@pytest.fixture()
def http(engine: AsyncEngine, tmp_path: Path, peft_adapters: dict[str, Path]) -> Iterator[TestClient]:
    adapters = AdapterStore(
        FileObjectStore(str(tmp_path / "objects")),
        "tiny",
        source_prefixes=(f"file://{tmp_path}/sources/{{tenant}}/",),
    )
    tenants = TenantRegistry(parse_keys(f"{KEY_A}=acme,{KEY_B}=globex"))
    server = OpenAIServer(LocalEngineClient(engine, adapters), tenants, adapters=adapters)
    with TestClient(create_app(server)) as client:
        yield client


def upload(http: TestClient, key: str, name: str, folder: Path) -> httpx.Response:
    return http.post(
        "/v1/adapters",
        headers={"Authorization": f"Bearer {key}"},
        data={"name": name},
        files={
            "adapter_config": ("adapter_config.json", (folder / "adapter_config.json").read_bytes()),
            "adapter_model": (
                "adapter_model.safetensors",
                (folder / "adapter_model.safetensors").read_bytes(),
            ),
        },
    )


def client_for(http: TestClient, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)


def test_hot_load_use_and_delete_while_others_stream(
    http: TestClient, peft_adapters: dict[str, Path], tiny_model_dir: Path
) -> None:
    client = client_for(http, KEY_A)
    base_kwargs = dict(prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    base_text = client.completions.create(model="tiny", **base_kwargs).choices[0].text

    # A long stream on the base model runs through the whole adapter lifecycle.
    streamed: list[str] = []
    started = threading.Event()

    def stream_base() -> None:
        for chunk in client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=200,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            started.set()
            streamed.append(chunk.choices[0].text if chunk.choices else "")

    streamer = threading.Thread(target=stream_base)
    streamer.start()
    assert started.wait(60)

    response = upload(http, KEY_A, "support-bot", peft_adapters["all-r8"])
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "tiny:support-bot" and response.json()["rank"] == 8
    assert "tiny:support-bot" in [m.id for m in client.models.list().data]
    assert client.models.retrieve("tiny:support-bot").owned_by == "acme"

    result = client.completions.create(model="tiny:support-bot", **base_kwargs)
    assert result.model == "tiny:support-bot"
    tokens, _ = _peft_reference(tiny_model_dir, peft_adapters["all-r8"], 8)  # PEFT, same adapter
    tokenizer = Tokenizer.from_hf_folder(tiny_model_dir, [])
    assert result.choices[0].text == tokenizer.decode(tokens[0]) != base_text

    chat = client.chat.completions.create(
        model="tiny:support-bot", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert chat.model == "tiny:support-bot" and chat.usage.completion_tokens <= 4

    deleted = http.delete("/v1/adapters/support-bot", headers={"Authorization": f"Bearer {KEY_A}"})
    assert deleted.status_code == 200 and deleted.json()["deleted"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny:support-bot", **base_kwargs)
    assert "tiny:support-bot" not in [m.id for m in client.models.list().data]

    streamer.join(120)
    assert not streamer.is_alive() and len("".join(streamed)) > 0  # never disturbed
    # Re-uploading the name gives a new version: replicas cannot serve the old weights for it.
    assert upload(http, KEY_A, "support-bot", peft_adapters["attn-r4"]).status_code == 200
    again = client.completions.create(model="tiny:support-bot", **base_kwargs).choices[0].text
    assert again != result.choices[0].text


def test_tenants_never_see_each_others_adapters(http: TestClient, peft_adapters: dict[str, Path]) -> None:
    assert upload(http, KEY_A, "private", peft_adapters["all-r8"]).status_code == 200
    b = client_for(http, KEY_B)
    headers_b = {"Authorization": f"Bearer {KEY_B}"}
    assert http.get("/v1/adapters", headers=headers_b).json()["data"] == []
    assert http.get("/v1/adapters/private", headers=headers_b).status_code == 404
    assert http.delete("/v1/adapters/private", headers=headers_b).status_code == 404
    assert [m.id for m in b.models.list().data] == ["tiny"]
    with pytest.raises(openai.NotFoundError):
        b.models.retrieve("tiny:private")
    with pytest.raises(openai.NotFoundError) as info:
        b.completions.create(model="tiny:private", prompt="x", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    # B may use the same name for its own adapter; A's is untouched.
    assert upload(http, KEY_B, "private", peft_adapters["attn-r4"]).status_code == 200
    a_list = http.get("/v1/adapters", headers={"Authorization": f"Bearer {KEY_A}"}).json()["data"]
    assert [(x["id"], x["rank"]) for x in a_list] == [("private", 8)]


def test_bad_uploads_get_clear_errors(
    http: TestClient, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    headers = {"Authorization": f"Bearer {KEY_A}"}
    folder = peft_adapters["all-r8"]
    config = json.loads((folder / "adapter_config.json").read_text())

    def post(name: str, cfg: dict, weights: bytes) -> httpx.Response:
        return http.post(
            "/v1/adapters",
            headers=headers,
            data={"name": name},
            files={"adapter_config": ("c.json", json.dumps(cfg).encode()), "adapter_model": ("m", weights)},
        )

    weights = (folder / "adapter_model.safetensors").read_bytes()
    too_big = post("big", {**config, "r": 64}, weights)
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "r"
    pickle = post("pkl", config, b"\x80\x04\x95pickled")
    assert pickle.status_code == 400 and "safetensors" in pickle.json()["error"]["message"]
    dora = post("dora", {**config, "use_dora": True}, weights)
    assert dora.status_code == 400 and dora.json()["error"]["param"] == "use_dora"
    assert post("bad name!", config, weights).status_code == 400
    missing = http.post("/v1/adapters", headers=headers, data={"name": "x"})
    assert missing.status_code == 400
    assert post("dup", config, weights).status_code == 200
    assert post("dup", config, weights).status_code == 409
    # A source URI works only under the caller's own folder of the allowed prefixes.
    shutil.copytree(peft_adapters["attn-r4"], tmp_path / "sources" / "acme" / "attn")
    ok = http.post(
        "/v1/adapters",
        headers=headers,
        json={"name": "src", "source": f"file://{tmp_path}/sources/acme/attn"},
    )
    assert ok.status_code == 200, ok.text
    denied = http.post("/v1/adapters", headers=headers, json={"name": "src2", "source": f"file://{tmp_path}"})
    assert denied.status_code == 400 and denied.json()["error"]["param"] == "source"
    assert (
        http.post("/v1/adapters", headers={"Authorization": "Bearer nope"}, data={"name": "x"}).status_code
        == 401
    )


def test_per_tenant_adapter_count_and_bytes_limits(
    engine: AsyncEngine, tmp_path: Path, peft_adapters: dict[str, Path]
) -> None:
    """A tenant at its adapter count, or one whose next upload would pass its bytes, gets a 400
    naming the limit; deleting one makes room; another tenant is unaffected."""
    folder = peft_adapters["all-r8"]
    size = (folder / "adapter_model.safetensors").stat().st_size
    adapters = AdapterStore(
        FileObjectStore(str(tmp_path / "objects")),
        "tiny",
        max_adapters_per_tenant=3,
        max_adapter_bytes_per_tenant=None,
    )
    server = OpenAIServer(
        LocalEngineClient(engine, adapters),
        TenantRegistry(parse_keys(f"{KEY_A}=acme,{KEY_B}=globex")),
        adapters=adapters,
    )
    with TestClient(create_app(server)) as http:
        for index in range(3):
            assert upload(http, KEY_A, f"a{index}", folder).status_code == 200
        refused = upload(http, KEY_A, "a3", folder)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "max_adapters_per_tenant" and error["code"] == "adapter_limit_reached"
        assert upload(http, KEY_B, "b0", folder).status_code == 200  # per tenant
        assert http.delete("/v1/adapters/a0", headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 200
        assert upload(http, KEY_A, "a3", folder).status_code == 200
    adapters.max_adapters_per_tenant, adapters.max_adapter_bytes_per_tenant = None, 2 * size + size // 2
    server = OpenAIServer(
        LocalEngineClient(engine, adapters), TenantRegistry(parse_keys(f"{KEY_B}=globex")), adapters=adapters
    )
    with TestClient(create_app(server)) as http:
        assert upload(http, KEY_B, "b1", folder).status_code == 200  # 2 of 2.5 sizes
        over = upload(http, KEY_B, "b2", folder)
        assert over.status_code == 400 and over.json()["error"]["param"] == "max_adapter_bytes_per_tenant"
