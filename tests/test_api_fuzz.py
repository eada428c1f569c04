"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis): data that
fits the schema and data that does not, for every operation, against the live app on loopback.
Whatever is sent, the answer is never a 5xx, and every error is in OpenAI's shape.

Bounded: `EXAMPLES_PER_MODE` examples per operation and generation mode, derandomized (the same
inputs on every run), and at most `TIME_BUDGET_S` seconds in all. The number of requests sent is
printed (`pytest -s`)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from .test_isolation import HOSTILE, Platform, start_platform

pytestmark = pytest.mark.slow  # hundreds of requests through the live app (make test runs it)

EXAMPLES_PER_MODE = 60
TIME_BUDGET_S = 240.0


@pytest.fixture(scope="module")
def fuzz_platform(
    tmp_path_factory: pytest.TempPathFactory, peft_adapters: dict[str, Path]
) -> Iterator[Platform]:
    # A short context: no generated max_tokens can make a request run long.
    with start_platform(
        tmp_path_factory.mktemp("fuzz"), peft_adapters["attn-r4"], max_positions=64
    ) as started:
        yield started


def check_answer(method: str, path: str, response: httpx.Response | object) -> None:
    status = response.status_code  # type: ignore[attr-defined]
    text = response.text  # type: ignore[attr-defined]
    assert status < 500, f"{method} {path} -> {status}: {text[:500]}"
    if status >= 400:
        body = json.loads(text)
        if path.startswith("/v1/messages"):  # Anthropic's error shape on Anthropic's routes
            assert set(body) == {"type", "error"} and body["type"] == "error", (
                f"{method} {path} -> {status}: {text[:500]}"
            )
            assert set(body["error"]) == {"type", "message"}, text[:500]
        else:
            assert set(body) == {"error"}, f"{method} {path} -> {status}: {text[:500]}"
            assert set(body["error"]) == {"message", "type", "param", "code"}, text[:500]
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], text[:500]


def test_fuzz_the_api_from_its_openapi_schema(fuzz_platform: Platform) -> None:
    document = httpx.get(f"{fuzz_platform.base_url}/openapi.json", timeout=30).json()
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/batches",
        "/v1/adapters",
    } <= set(document["paths"])
    schema = schemathesis.openapi.from_dict(document)
    auth = {"Authorization": f"Bearer {HOSTILE}"}
    deadline = time.monotonic() + TIME_BUDGET_S
    sent: dict[str, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=EXAMPLES_PER_MODE,
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode), served_model=st.booleans())
            def run(case: schemathesis.Case, served_model: bool) -> None:
                if time.monotonic() > deadline:
                    return
                if served_model and isinstance(case.body, dict) and "model" in case.body:
                    case.body["model"] = "tiny"  # half the bodies name the served model: they run
                response = case.call(base_url=fuzz_platform.base_url, headers=auth, timeout=60)
                label = f"{case.operation.label} {response.status_code}"
                sent[label] = sent.get(label, 0) + 1
                check_answer(case.operation.method.upper(), case.operation.path, response)

            run()
    total = sum(sent.values())
    print(f"\nfuzz: {total} requests; by operation and status: {json.dumps(sent, sort_keys=True, indent=0)}")
    assert fuzz_platform.engine.is_alive()
    operations = {label.rsplit(" ", 1)[0] for label in sent}
    assert len(operations) == sum(len(methods) for methods in document["paths"].values())
    assert total >= 2 * EXAMPLES_PER_MODE * len(operations) // 2  # most examples really ran
    # Valid generated requests really ran (not only refusals).
    assert sent.get("POST /v1/chat/completions 200", 0) + sent.get("POST /v1/completions 200", 0) > 0
