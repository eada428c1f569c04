"""Isolation at the API, tried as a hostile tenant would: every hostile request runs while another
tenant streams and a batch of that tenant runs, and those must all finish normally.

The app runs under a real uvicorn server on loopback (streams are really incremental), with a
batch worker in its own event loop, a real `AsyncEngine` on a small model with LoRA enabled, and
the official `openai` client for the bystanders."""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from safetensors.torch import save as save_safetensors

from tandem import AsyncEngine
from tandem.batch.service import BatchLimits
from tandem.deployments.adapters import AdapterRecord, AdapterStore
from tandem.deployments.ingress import create_app
from tandem.deployments.local import local_platform
from tandem.engine.lora.manager import parse_peft_adapter
from tandem.platform.api_keys import parse_keys, parse_operator_keys
from tandem.platform.object_store import FileObjectStore
from tandem.platform.tenancy import TenantRegistry

from .conftest import make_tiny_model, serve_with_worker

HOSTILE, BYSTANDER, OPERATOR = "sk-hostile", "sk-bystander", "sk-operator"
BYSTANDER_TOKENS = 600  # long enough to outlast every hostile request of a test


@dataclass
class Platform:
    base_url: str
    engine: AsyncEngine
    adapters: AdapterStore
    sources: Path  # the operator's adapter source root: sources/<tenant>/...
    peft_folder: Path  # a valid PEFT adapter folder

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=0, timeout=120)

    def post(
        self, path: str, body: Any = None, *, key: str = HOSTILE, content: bytes | None = None, **kw: Any
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"}
        if content is not None:
            headers["Content-Type"] = "application/json"
            return httpx.post(f"{self.base_url}{path}", content=content, headers=headers, timeout=60, **kw)
        return httpx.post(f"{self.base_url}{path}", json=body, headers=headers, timeout=60, **kw)


@contextlib.contextmanager
def start_platform(root: Path, peft_folder: Path, *, max_positions: int) -> Iterator[Platform]:
    """The app under uvicorn on a free loopback port, a batch worker in its own event loop, and an
    `AsyncEngine` on a small model with LoRA enabled (`max_positions` bounds every request)."""

    model_dir = make_tiny_model(root / "model", max_positions=max_positions)
    engine = AsyncEngine.from_options(
        str(model_dir), kv_cache_memory=16 << 20, served_model_name="tiny", enable_lora=True, max_loras=2
    )
    store = FileObjectStore(str(root / "objects"))
    adapters = AdapterStore(store, "tiny", source_prefixes=(f"file://{root}/sources/{{tenant}}/",))
    tenants = TenantRegistry(
        parse_keys(f"{HOSTILE}=acme,{BYSTANDER}=globex"), operator_keys=parse_operator_keys(OPERATOR)
    )
    local = local_platform(
        engine, store, tenants, batch_limits=BatchLimits(shard_size=2, lease_ttl_s=30.0), adapters=adapters,
        worker_id="isolation",
    )  # fmt: skip
    try:
        with serve_with_worker(create_app(local.server), local.worker) as base_url:
            yield Platform(base_url, engine, adapters, root / "sources", peft_folder)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, peft_adapters: dict[str, Path]) -> Iterator[Platform]:
    with start_platform(
        tmp_path_factory.mktemp("isolation"), peft_adapters["attn-r4"], max_positions=4096
    ) as started:
        yield started


@dataclass
class _Stream:
    ready: threading.Event = field(default_factory=threading.Event)
    text: str = ""
    finish_reason: str | None = None
    last_chunk_at: float = 0.0
    error: BaseException | None = None


@contextlib.contextmanager
def bystanders(platform: Platform, num_streams: int = 2) -> Iterator[None]:
    """Another tenant's streams (each already generating) and batch (already in progress) around
    the block; afterwards every stream must have ended normally after the block did, and every
    batch line must have succeeded."""
    client = platform.client(BYSTANDER)
    lines = [
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": f"Item {i}"}],
                    "max_tokens": 6,
                },
            }
        )
        for i in range(4)
    ]
    batch_file = client.files.create(
        file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=batch_file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    streams = [_Stream() for _ in range(num_streams)]

    def consume(i: int, state: _Stream) -> None:
        try:
            for chunk in client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": f"Bystander stream {i}"}],
                max_tokens=BYSTANDER_TOKENS,
                temperature=0.7,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                state.last_chunk_at = time.monotonic()
                if chunk.choices:
                    state.text += chunk.choices[0].delta.content or ""
                    state.finish_reason = chunk.choices[0].finish_reason or state.finish_reason
                state.ready.set()
        except BaseException as exc:  # reported below, in the test's thread
            state.error = exc
        finally:
            state.ready.set()

    threads = [threading.Thread(target=consume, args=(i, s), daemon=True) for i, s in enumerate(streams)]
    for thread in threads:
        thread.start()
    for state in streams:
        assert state.ready.wait(60) and state.error is None, state.error
    assert client.batches.retrieve(batch.id).status in ("validating", "in_progress")
    yield
    hostile_done_at = time.monotonic()
    for thread in threads:
        thread.join(timeout=300)
    for state in streams:
        assert state.error is None, repr(state.error)
        assert state.finish_reason == "length" and state.text, state
        assert state.last_chunk_at > hostile_done_at, "the stream ended before the hostile requests did"
    deadline = time.monotonic() + 300
    while (done := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, f"batch stuck in {done.status}"
        time.sleep(0.1)
    assert done.status == "completed" and done.request_counts is not None
    assert done.request_counts.completed == 4 and done.request_counts.failed == 0, done.request_counts
    assert platform.engine.is_alive()


def assert_openai_error(
    response: httpx.Response, status: int, param: str | None = "__any__"
) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"] and "Traceback" not in body["error"]["message"]
    if param != "__any__":
        assert body["error"]["param"] == param, body
    return body["error"]


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

# (name, raw JSON body for /v1/chat/completions, status, param)
HOSTILE_BODIES: list[tuple[str, str, int, str | None]] = [
    ("seed 2^64", json.dumps({**CHAT, "seed": 1 << 64}), 400, "seed"),
    ("seed below -2^63", json.dumps({**CHAT, "seed": -(1 << 63) - 1}), 400, "seed"),
    ("seed 10^40", json.dumps({**CHAT, "seed": 10**40}), 400, "seed"),
    ("negative seed", json.dumps({**CHAT, "seed": -5, "temperature": 1.0}), 200, None),
    ("largest seed", json.dumps({**CHAT, "seed": (1 << 64) - 1, "temperature": 1.0}), 200, None),
    ("NaN temperature", json.dumps(CHAT)[:-1] + ', "temperature": NaN}', 400, "temperature"),
    ("Infinity top_p", json.dumps(CHAT)[:-1] + ', "top_p": Infinity}', 400, "top_p"),
    (
        "-Infinity penalty",
        json.dumps(CHAT)[:-1] + ', "presence_penalty": -Infinity}',
        400,
        "presence_penalty",
    ),
    (
        "1e400 frequency_penalty",
        json.dumps(CHAT)[:-1] + ', "frequency_penalty": 1e400}',
        400,
        "frequency_penalty",
    ),
    ("NaN min_p", json.dumps(CHAT)[:-1] + ', "min_p": NaN}', 400, "min_p"),
    ("huge max_tokens", json.dumps({**CHAT, "max_tokens": 10**30}), 400, "max_tokens"),
    (
        "huge max_completion_tokens",
        json.dumps({**CHAT, "max_completion_tokens": 1 << 63}),
        400,
        "max_completion_tokens",
    ),
    ("huge top_k", json.dumps({**CHAT, "top_k": 1 << 70, "temperature": 1.0}), 400, "top_k"),
    ("top_k above the vocabulary", json.dumps({**CHAT, "top_k": 1 << 30, "temperature": 1.0}), 200, None),
    ("huge n", json.dumps({**CHAT, "n": 10**20}), 400, "n"),
    (
        "huge top_logprobs",
        json.dumps({**CHAT, "logprobs": True, "top_logprobs": 10**20}),
        400,
        "top_logprobs",
    ),
    ("huge stop token id", json.dumps({**CHAT, "stop_token_ids": [1 << 63]}), 400, "stop_token_ids.0"),
    (
        "lone surrogate in content",
        json.dumps({**CHAT, "messages": [{"role": "user", "content": "\ud83d"}]}),
        400,
        "messages.0.content",
    ),
    (
        "lone surrogate in a content part",
        json.dumps(
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]}
        ),
        400,
        "messages.0.content.0.text",
    ),
    ("lone surrogate in stop", json.dumps({**CHAT, "stop": ["\ud800"]}), 400, "stop.0"),
    ("lone surrogate in user", json.dumps({**CHAT, "user": "\udfff"}), 400, "user"),
    ("lone surrogate in metadata", json.dumps({**CHAT, "metadata": {"k": "\ud83d"}}), 400, "metadata.k"),
    ("lone surrogate in model", json.dumps({**CHAT, "model": "tiny\ud83d"}), 400, "model"),
    (
        "lone surrogate in name",
        json.dumps({**CHAT, "messages": [{"role": "user", "content": "x", "name": "\ud83d"}]}),
        400,
        "messages.0.name",
    ),
    (
        "NUL in content",
        json.dumps({**CHAT, "messages": [{"role": "user", "content": "a\u0000b"}]}),
        200,
        None,
    ),
    ("NUL in model", json.dumps({**CHAT, "model": "tiny\u0000"}), 404, "model"),
    ("NUL in adapter model", json.dumps({**CHAT, "model": "tiny:ev\u0000il"}), 404, "model"),
    ("newline in adapter model", json.dumps({**CHAT, "model": "tiny:ok\n"}), 404, "model"),
    ("traversal in adapter model", json.dumps({**CHAT, "model": "tiny:../globex/adapters/x"}), 404, "model"),
    (
        "invalid UTF-8",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}'.decode("latin-1"),
        400,
        None,
    ),
    ("not an object", "[1, 2, 3]", 400, None),
    ("deeply nested", '{"model": "tiny", "metadata": ' + "[" * 5000 + "]" * 5000 + "}", 400, None),
]


def test_hostile_numbers_and_text_are_refused_at_the_edge(platform: Platform) -> None:
    """Out-of-range and non-finite numbers in every numeric field, lone surrogates and NUL in
    content and names: a 400 naming the field (or a normal answer where the value is legal), never
    a 5xx, and the other tenant's streams and batch are untouched. The same bodies as batch lines
    are refused at upload, line by line."""
    with bystanders(platform):
        for name, body, status, param in HOSTILE_BODIES:
            raw = body.encode("latin-1") if name == "invalid UTF-8" else body.encode("utf-8", "surrogatepass")
            response = platform.post("/v1/chat/completions", content=raw)
            if status == 200:
                assert response.status_code == 200, (name, response.text)
            else:
                assert_openai_error(response, status, param)
            if status == 400 and param and not param.startswith(("messages", "top_logprobs")):
                completion = {k: v for k, v in json.loads(body).items() if k != "messages"}
                response = platform.post(
                    "/v1/completions", content=json.dumps({**completion, "prompt": "hi"}).encode()
                )
                assert_openai_error(response, 400, param)  # the completions route validates the same way
    # Batch lines: the same hostile bodies in one file are each that line's 400 naming the same
    # field (a body the endpoint refuses is the request's problem, not the file's); a good line
    # in the same file is answered.
    client = platform.client(HOSTILE)
    expected = {}
    lines = [
        '{"custom_id": "good", "method": "POST", "url": "/v1/chat/completions", "body": '
        + json.dumps(CHAT)
        + "}"
    ]
    for number, (name, body, status, param) in enumerate(HOSTILE_BODIES):
        if status != 400 or name in ("invalid UTF-8", "not an object", "deeply nested"):
            continue
        if json.loads(body).get("model") != "tiny":  # another model is a problem of the file
            continue
        expected[f"h{number}"] = (name, param)
        lines.append(
            f'{{"custom_id": "h{number}", "method": "POST", "url": "/v1/chat/completions", "body": {body}}}'
        )
    upload = client.files.create(
        file=("in.jsonl", io.BytesIO("\n".join(lines).encode("utf-8", "surrogatepass"))), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = _until_done(client, batch)
    assert batch.status == "completed", batch.errors
    assert batch.output_file_id is not None and batch.error_file_id is not None
    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in output] == ["good"]
    errors = {
        e["custom_id"]: e["response"]
        for e in map(json.loads, client.files.content(batch.error_file_id).text.splitlines())
    }
    assert sorted(errors) == sorted(expected)
    for custom_id, (name, param) in expected.items():
        assert errors[custom_id]["status_code"] == 400, (name, errors[custom_id])
        error = errors[custom_id]["body"]["error"]
        assert error["type"] == "invalid_request_error" and "Traceback" not in error["message"], name
        if param is not None:
            assert error["param"] == param, (name, error)


def _until_done(client: openai.OpenAI, batch: Any) -> Any:
    """`batch` polled until it ends (120 s at most)."""
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}"
        time.sleep(0.05)
        batch = client.batches.retrieve(batch.id)
    return batch


def _adapter_files(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return json.loads((folder / "adapter_config.json").read_text()), load_file(
        str(folder / "adapter_model.safetensors")
    )


def test_bad_adapters_are_refused_at_upload(platform: Platform) -> None:
    """NaN, infinite, huge weights and extreme scalings are a 400 at upload (nothing stored), as
    are names that are not whole matches of the name rule; other tenants are untouched."""
    config, tensors = _adapter_files(platform.peft_folder)
    first = next(iter(tensors))

    def upload(name: str, cfg: dict[str, Any], weights: dict[str, torch.Tensor]) -> httpx.Response:
        return httpx.post(
            f"{platform.base_url}/v1/adapters",
            headers={"Authorization": f"Bearer {HOSTILE}"},
            data={"name": name},
            files={
                "adapter_config": ("adapter_config.json", json.dumps(cfg).encode()),
                "adapter_model": ("adapter_model.safetensors", save_safetensors(weights)),
            },
            timeout=60,
        )

    def with_first(value: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**tensors, first: value}

    cases = [
        ("nan", config, with_first(torch.full_like(tensors[first], float("nan"))), "adapter_model"),
        ("inf", config, with_first(torch.full_like(tensors[first], float("inf"))), "adapter_model"),
        ("huge", config, with_first(tensors[first] * 1e6), "adapter_model"),
        ("alpha-1e308", {**config, "lora_alpha": 1e308}, tensors, "lora_alpha"),
        ("alpha-big", {**config, "lora_alpha": 10_000}, tensors, "lora_alpha"),
        ("alpha-negative", {**config, "lora_alpha": -16}, tensors, "lora_alpha"),
        ("ok\n", config, tensors, "name"),
        ("ok\u0000", config, tensors, "name"),
        ("../globex", config, tensors, "name"),
    ]
    with bystanders(platform):
        for name, cfg, weights, param in cases:
            assert_openai_error(upload(name, cfg, weights), 400, param)
        assert upload("fine", config, tensors).status_code == 200
    names = [
        a["id"]
        for a in httpx.get(
            f"{platform.base_url}/v1/adapters", headers={"Authorization": f"Bearer {HOSTILE}"}, timeout=30
        ).json()["data"]
    ]
    assert names == ["fine"]
    assert (
        httpx.delete(
            f"{platform.base_url}/v1/adapters/fine", headers={"Authorization": f"Bearer {HOSTILE}"}
        ).status_code
        == 200
    )


def _inject_adapter(platform: Platform, name: str, scale_b: float, fill_a: float | None = None) -> str:
    """An adapter that got past validation (a loader bug, a corrupted store): stored for tenant
    acme and loaded into the engine as is. Returns the model name to ask for."""
    config, tensors = _adapter_files(platform.peft_folder)
    engine = platform.engine.engine
    assert engine.adapters.manager is not None
    adapter = parse_peft_adapter(name, config, save_safetensors(tensors), engine.adapters.manager.shape)
    for key, (a, b) in adapter.weights.items():
        adapter.weights[key] = (a if fill_a is None else torch.full_like(a, fill_a), b * scale_b)
    record = AdapterRecord(
        name=name, tenant="acme", version="v1", base_model="tiny", created_at=0, rank=adapter.rank,
        target_modules=list(adapter.target_modules), bytes=0,
    )  # fmt: skip
    platform.adapters.store.put(f"tenants/acme/adapters/{name}.json", record.model_dump_json().encode())
    adapter.name = record.lora_id
    engine.adapters.manager.add(adapter)
    return f"tiny:{name}"


def test_an_adapter_past_validation_aborts_only_its_request(platform: Platform) -> None:
    """NaN weights and an overflowing scale, injected past upload validation: the request using
    one ends with a 500 in OpenAI's shape (streamed: the same before its first token, an error event
    then [DONE] after it); the other
    tenant's streams and batch finish normally, and the same tenant's next request on the base
    model works."""
    nan_model = _inject_adapter(platform, "nan-weights", 1.0, fill_a=float("nan"))
    huge_model = _inject_adapter(platform, "huge-scale", 1e38)
    with bystanders(platform):
        for model in (nan_model, huge_model):
            for temperature in (0.0, 1.0):
                body = {**CHAT, "model": model, "temperature": temperature, "max_tokens": 8}
                error = assert_openai_error(platform.post("/v1/chat/completions", body), 500, None)
                assert error["code"] == "request_failed" and error["type"] == "server_error"
                assert "request id" in error["message"]
                streamed = platform.post("/v1/chat/completions", {**body, "stream": True})
                if streamed.status_code == 200:  # failed after its first token: in-band, then [DONE]
                    events = [
                        x[len("data: ") :] for x in streamed.text.splitlines() if x.startswith("data: ")
                    ]
                    assert events[-1] == "[DONE]", events
                    assert json.loads(events[-2])["error"]["code"] == "request_failed", events
                else:  # failed before its first token: an HTTP error
                    assert assert_openai_error(streamed, 500, None)["code"] == "request_failed"
        ok = platform.client(HOSTILE).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert ok.choices[0].finish_reason in ("length", "stop")


def _sse_events(platform: Platform, body: dict[str, Any]) -> list[str]:
    """The `data:` payloads of a streamed completion, in order."""
    events = []
    with httpx.stream(
        "POST", f"{platform.base_url}/v1/chat/completions", json=body,
        headers={"Authorization": f"Bearer {HOSTILE}"}, timeout=60,
    ) as response:  # fmt: skip
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    return events


def test_adapter_sources_are_confined_to_the_tenants_prefix(platform: Platform, tmp_path: Path) -> None:
    """`source` resolves only under the caller's own folder of the operator's prefixes: another
    tenant's folder, the object store, traversal, links out, other schemes and other buckets are
    a 400 naming `source`; a missing folder is a 404 and nothing is created."""
    import shutil

    own = platform.sources / "acme" / "support"
    theirs = platform.sources / "globex" / "secret"
    for folder in (own, theirs):
        if not folder.exists():
            shutil.copytree(platform.peft_folder, folder)
    (platform.sources / "acme" / "escape").mkdir(exist_ok=True)
    link = platform.sources / "acme" / "escape" / "to-globex"
    if not link.exists():
        link.symlink_to(theirs)
    objects = platform.adapters.store.url  # type: ignore[attr-defined]
    refused = [
        f"file://{theirs}",
        f"file://{platform.sources}/acme/../globex/secret",
        f"file://{platform.sources}/acme/%2e%2e/globex/secret",
        f"file://{link}",
        f"{objects}/tenants/globex/adapter-data/x/v1",
        f"file://{platform.peft_folder}",
        "file:///etc",
        "s3://any-bucket/tenants/acme/",
        f"file://{own}?x=1",
        "http://127.0.0.1:1/adapter",
    ]
    missing = platform.sources / "acme" / "not-there" / "deeper"
    with bystanders(platform):
        for i, source in enumerate(refused):
            assert_openai_error(
                platform.post("/v1/adapters", {"name": f"s{i}", "source": source}), 400, "source"
            )
        assert_openai_error(
            platform.post("/v1/adapters", {"name": "gone", "source": f"file://{missing}"}), 404, "source"
        )
        assert not (platform.sources / "acme" / "not-there").exists()  # nothing created on read
        for name, source, param in (
            ("lone", f"file://{own}\ud83d", "source"),
            ("\ud83d", f"file://{own}", "name"),
        ):
            body = json.dumps({"name": name, "source": source}).encode()  # escaped: valid JSON
            assert_openai_error(platform.post("/v1/adapters", content=body), 400, param)
        ok = platform.post("/v1/adapters", {"name": "own", "source": f"file://{own}"})
        assert ok.status_code == 200, ok.text
    assert not os.path.exists(f"{platform.sources}/acme/%2e%2e")


def test_unexpected_errors_are_500s_in_openai_shape_with_a_request_id(
    platform: Platform, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in a route (not a `TandemError`): the client gets OpenAI's error shape with a request
    id and nothing internal; the traceback is logged with that id. A stream that breaks after its
    first chunk ends with an error event and then `[DONE]`."""
    import logging

    from tandem.deployments.openai import server as openai_server
    from tandem.deployments.openai import streaming

    def broken_chunk(*args: object, **kwargs: object) -> None:
        raise KeyError("internal detail that must not leak")

    with caplog.at_level(logging.ERROR, logger="tandem.api"):
        monkeypatch.setattr(openai_server.OpenAIServer, "models", lambda *a: 1 / 0)
        response = httpx.get(f"{platform.base_url}/v1/models", headers={"Authorization": f"Bearer {HOSTILE}"})
        error = assert_openai_error(response, 500, None)
        request_id = response.headers["x-request-id"]
        assert request_id in error["message"] and "ZeroDivision" not in response.text
        assert any(request_id == getattr(r, "request_id", None) and r.exc_info for r in caplog.records)

        monkeypatch.setattr(streaming, "stream_chunks", broken_chunk)
        events = _sse_events(platform, {**CHAT, "stream": True})
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "internal_error" and "internal detail" not in events[-2]
        assert any(
            "request_id" in r.__dict__ and r.exc_info
            for r in caplog.records
            if r.getMessage() == "stream failed"
        )

    unknown = httpx.get(f"{platform.base_url}/v1/nowhere", headers={"Authorization": f"Bearer {HOSTILE}"})
    assert_openai_error(unknown, 404, None)


def test_metrics_need_an_operator_key(platform: Platform) -> None:
    url = f"{platform.base_url}/metrics"
    assert_openai_error(httpx.get(url), 401, None)
    assert_openai_error(httpx.get(url, headers={"Authorization": f"Bearer {HOSTILE}"}), 403, None)
    assert_openai_error(httpx.get(url, headers={"Authorization": "Bearer wrong"}), 401, None)
    scraped = httpx.get(url, headers={"Authorization": f"Bearer {OPERATOR}"})
    assert scraped.status_code == 200 and "tandem_kv_cache_occupancy" in scraped.text


@pytest.mark.s3
def test_s3_adapter_sources_read_only_the_tenants_prefix(
    s3_server: Any, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """With `s3://bucket/adapters/{tenant}/` configured, a tenant imports from its own prefix on a
    real S3 server (SeaweedFS); another tenant's prefix, the rest of the bucket and other buckets
    are refused before anything is fetched, and a missing folder is a 404."""
    from tandem.deployments.adapters import CONFIG_FILE, WEIGHTS_FILE
    from tandem.platform.errors import InvalidRequestError, NotFoundError
    from tandem.platform.object_store import S3ObjectStore

    from .conftest import S3_BUCKET

    bucket = S3ObjectStore(S3_BUCKET, "", s3_server)
    folder = peft_adapters["attn-r4"]
    for owner in ("acme", "globex"):
        for file in (CONFIG_FILE, WEIGHTS_FILE):
            bucket.put(f"adapters/{owner}/bot/{file}", (folder / file).read_bytes())
    store = AdapterStore(
        FileObjectStore(str(tmp_path / "objects")),
        "tiny",
        source_prefixes=(f"s3://{S3_BUCKET}/adapters/{{tenant}}/",),
        s3_settings=s3_server,
    )
    config, weights = store.fetch_source("acme", f"s3://{S3_BUCKET}/adapters/acme/bot")
    assert config == (folder / CONFIG_FILE).read_bytes() and weights == (folder / WEIGHTS_FILE).read_bytes()
    for source in (
        f"s3://{S3_BUCKET}/adapters/globex/bot",
        f"s3://{S3_BUCKET}/adapters/acme/../globex/bot",
        f"s3://{S3_BUCKET}/adapters/",
        f"s3://{S3_BUCKET}/adapters/acmex/bot",
        "s3://another-bucket/adapters/acme/bot",
        "file:///adapters/acme/bot",
    ):
        with pytest.raises(InvalidRequestError) as info:
            store.fetch_source("acme", source)
        assert info.value.param == "source", source
    with pytest.raises(NotFoundError):
        store.fetch_source("acme", f"s3://{S3_BUCKET}/adapters/acme/missing")


def test_a_broken_engine_ends_every_stream_with_an_error_event(
    tmp_path: Path, peft_adapters: dict[str, Path]
) -> None:
    """The runner breaks while two streams are mid-generation: each ends with an error event
    (`engine_failed`, naming its request id) and then `[DONE]`, none hangs; the next request is a
    503 in OpenAI's shape with a request id."""
    with start_platform(tmp_path, peft_adapters["attn-r4"], max_positions=4096) as platform:
        headers = {"Authorization": f"Bearer {BYSTANDER}"}
        body = {**CHAT, "max_tokens": 2000, "stream": True, "ignore_eos": True}
        runner = platform.engine.engine.runner

        def broken_forward(*args: object, **kwargs: object) -> torch.Tensor:
            raise RuntimeError("device lost")

        with contextlib.ExitStack() as stack:
            streams = [
                stack.enter_context(
                    httpx.stream(
                        "POST",
                        f"{platform.base_url}/v1/chat/completions",
                        json=body,
                        headers=headers,
                        timeout=60,
                    )
                )
                for _ in range(2)
            ]
            lines = [response.iter_lines() for response in streams]
            for it in lines:  # a stream's first event follows its first token: both are generating
                while not next(it).startswith("data: "):
                    pass
            runner.model.forward = broken_forward  # type: ignore[method-assign]
            runner.decode_model.forward = broken_forward  # type: ignore[method-assign]
            for response, it in zip(streams, lines, strict=True):
                events = [line[len("data: ") :] for line in it if line.startswith("data: ")]
                assert events[-1] == "[DONE]", events[-3:]
                error = json.loads(events[-2])["error"]
                assert error["code"] == "engine_failed" and error["type"] == "server_error", error
                assert "request id chatcmpl-" in error["message"] and "device lost" not in error["message"]
                assert response.status_code == 200
        assert not platform.engine.is_alive()
        late = platform.post("/v1/chat/completions", CHAT, key=BYSTANDER)
        error = assert_openai_error(late, 503, None)
        assert error["code"] == "engine_unavailable" and late.headers["x-request-id"] in error["message"]


def _upload_adapter(platform: Platform, key: str, name: str) -> None:
    folder = platform.peft_folder
    response = httpx.post(
        f"{platform.base_url}/v1/adapters",
        headers={"Authorization": f"Bearer {key}"},
        data={"name": name},
        files={
            "adapter_config": ("adapter_config.json", (folder / "adapter_config.json").read_bytes()),
            "adapter_model": (
                "adapter_model.safetensors",
                (folder / "adapter_model.safetensors").read_bytes(),
            ),
        },
        timeout=60,
    )
    assert response.status_code in (200, 201), response.text


def test_a_batch_runs_its_adapter_lines_and_fails_only_its_bad_lines(platform: Platform) -> None:
    """One file: base-model lines, lines naming the tenant's own adapter, a line naming another
    tenant's adapter, and a line with an invalid parameter. The batch completes; the adapter lines
    answer what the adapter answers in real time (greedy), the two bad lines get their 404 and 400
    in the error file, every other custom_id is in the output exactly once."""
    _upload_adapter(platform, HOSTILE, "batch-mine")
    _upload_adapter(platform, BYSTANDER, "batch-theirs")
    client = platform.client(HOSTILE)
    prompts = ["Paged attention stores keys", "Continuous batching lets", "The quick brown fox"]

    def line(custom_id: str, model: str, prompt: str, **body: Any) -> dict[str, Any]:
        request = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 8,
            "temperature": 0,
        }
        return {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {**request, **body},
        }

    lines = [line(f"base-{i}", "tiny", p) for i, p in enumerate(prompts)]
    lines += [line(f"mine-{i}", "tiny:batch-mine", p) for i, p in enumerate(prompts)]
    lines.append(line("theirs", "tiny:batch-theirs", prompts[0]))
    lines.append(line("bad-max-tokens", "tiny", prompts[0], max_tokens=-1))
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    file_id = client.files.create(file=("mixed.jsonl", io.BytesIO(data)), purpose="batch").id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = _until_done(client, batch)
    assert batch.status == "completed", batch.errors
    counts = batch.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (8, 6, 2)

    assert batch.output_file_id is not None and batch.error_file_id is not None
    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == sorted(
        f"{k}-{i}" for k in ("base", "mine") for i in range(3)
    )
    by_id = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in output}
    for i, prompt in enumerate(prompts):
        for kind, model in (("base", "tiny"), ("mine", "tiny:batch-mine")):
            realtime = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0
            )
            assert by_id[f"{kind}-{i}"] == realtime.choices[0].message.content, (kind, i)
    assert any(by_id[f"mine-{i}"] != by_id[f"base-{i}"] for i in range(3))  # the adapter was applied

    errors = {
        e["custom_id"]: e
        for e in (json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines())
    }
    assert sorted(errors) == ["bad-max-tokens", "theirs"]
    theirs, bad = errors["theirs"]["response"], errors["bad-max-tokens"]["response"]
    assert theirs["status_code"] == 404 and theirs["body"]["error"]["code"] == "model_not_found"
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "max_tokens"
    for error in errors.values():
        assert error["error"] is None and "Traceback" not in json.dumps(error)
    # Another tenant's adapter name is that line's 404, never a load (acme's own one is loaded).
    assert not any(
        name.startswith("acme/batch-theirs") or name.startswith("globex/")
        for name in platform.engine.engine.adapters.names()
    )
    assert any(name.startswith("acme/batch-mine@") for name in platform.engine.engine.adapters.names())
