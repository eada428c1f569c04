"""The OpenAI API in-process: the official `openai` client over FastAPI's TestClient transport,
a real AsyncEngine on a small model, no cluster."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from tandem import AsyncEngine
from tandem.deployments.engine_clients import LocalEngineClient
from tandem.deployments.ingress import create_app
from tandem.deployments.openai.server import OpenAIServer
from tandem.platform.api_keys import parse_keys, parse_operator_keys
from tandem.platform.tenancy import TenantLimits, TenantRegistry

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
OPERATOR_KEY = "sk-operator"


@pytest.fixture()
def http(engine: AsyncEngine) -> Iterator[TestClient]:
    tenants = TenantRegistry(
        parse_keys(f"{KEY_A}=acme,{KEY_B}=globex"),
        per_tenant_limits={"globex": TenantLimits(max_concurrent_requests=0)},
        operator_keys=parse_operator_keys(OPERATOR_KEY),
    )
    server = OpenAIServer(LocalEngineClient(engine), tenants)
    with TestClient(create_app(server)) as client:
        yield client


@pytest.fixture()
def client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEY_A, http_client=http, max_retries=0)


def test_models_and_chat_completion(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("tiny:nope")
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    resp = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant" and choice.message.content
    assert resp.usage is not None and resp.usage.completion_tokens == 6 and resp.usage.prompt_tokens > 0


def test_streamed_text_equals_non_streamed_for_greedy(client: openai.OpenAI) -> None:
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": "The quick brown fox"}],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completions_stream_and_not(client: openai.OpenAI) -> None:
    full = client.completions.create(
        model="tiny", prompt="Paged attention", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny",
            prompt="Paged attention",
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert full.choices[0].text == streamed and full.usage is not None and full.usage.completion_tokens == 8


def test_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == t.top_logprobs[0].logprob for t in content)  # greedy picks the top token
    # Tokens carry their text and bytes (not ids): the bytes put together are the answer's text.
    joined = b"".join(bytes(t.bytes or []) for t in content)
    assert joined.decode("utf-8", "replace") == resp.choices[0].message.content
    assert all(bytes(t.bytes or []).decode("utf-8", "replace") == t.token for t in content)


@pytest.mark.parametrize(
    ("call", "status", "param"),
    [
        (
            lambda c: c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}]),
            404,
            "model",
        ),
        (
            lambda c: c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], n=129
            ),
            400,
            "n",
        ),
        (
            lambda c: c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], logit_bias={"1": 5}
            ),
            400,
            "logit_bias",
        ),
        (
            lambda c: c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], temperature=5
            ),
            400,
            "temperature",
        ),
        (lambda c: c.chat.completions.create(model="tiny", messages=[]), 400, "messages"),
        (
            lambda c: c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": ""}]),
            400,
            "messages.0.content",
        ),
        (lambda c: c.completions.create(model="tiny", prompt="word " * 600), 400, "prompt"),
        (lambda c: c.completions.create(model="tiny", prompt="x", max_tokens=0), 400, "max_tokens"),
        # limits at the edge: at most 16 stop strings of at most 1,000 characters, token ids of
        # this model's vocabulary, extension fields of their own type only
        (
            lambda c: c.completions.create(model="tiny", prompt="x", stop=[f"s{i}" for i in range(17)]),
            400,
            "stop",
        ),
        (lambda c: c.completions.create(model="tiny", prompt="x", stop=["s" * 1001]), 400, "stop.0"),
        (lambda c: c.completions.create(model="tiny", prompt="x", stop="s" * 1001), 400, "stop"),
        (
            lambda c: c.completions.create(
                model="tiny", prompt="x", extra_body={"stop_token_ids": [1_000_000_000]}
            ),
            400,
            "stop_token_ids",
        ),
        (
            lambda c: c.completions.create(model="tiny", prompt="x", extra_body={"speculative": "yes"}),
            400,
            "speculative",
        ),
        (
            lambda c: c.completions.create(model="tiny", prompt="x", extra_body={"ignore_eos": 1}),
            400,
            "ignore_eos",
        ),
        (
            lambda c: c.completions.create(model="tiny", prompt="x", extra_body={"max_tokens": "5"}),
            400,
            "max_tokens",
        ),
    ],
)
def test_bad_requests_get_openai_errors(client: openai.OpenAI, call, status: int, param: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.APIStatusError) as info:
        call(client)
    assert info.value.status_code == status
    body = info.value.body
    assert isinstance(body, dict) and body.get("param") == param and body.get("message")


def test_auth_and_rate_limits(http: TestClient) -> None:
    bad = openai.OpenAI(base_url="http://testserver/v1", api_key="sk-wrong", http_client=http, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert http.get("/v1/models").status_code == 401
    limited = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY_B, http_client=http, max_retries=0)
    with pytest.raises(openai.RateLimitError) as info:
        limited.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert info.value.response.headers.get("retry-after")


def test_malformed_json_and_server_keeps_serving(http: TestClient, client: openai.OpenAI) -> None:
    resp = http.post(
        "/v1/chat/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY_A}"}
    )
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    assert http.get("/health").json() == {"status": "ok"}
    assert client.completions.create(model="tiny", prompt="x", max_tokens=1).choices[0].finish_reason


def test_body_over_the_limit_is_413_wrong_method_405_and_server_keeps_serving(
    http: TestClient, client: openai.OpenAI
) -> None:
    from tandem.deployments.openai.routes import MAX_BODY_BYTES

    padding = "x" * (MAX_BODY_BYTES + 1)
    for path in ("/v1/chat/completions", "/v1/completions"):
        resp = http.post(
            path,
            json={"model": "tiny", "prompt": padding},
            headers={"Authorization": f"Bearer {KEY_A}"},
        )
        assert resp.status_code == 413, resp.text
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        assert str(MAX_BODY_BYTES) in resp.json()["error"]["message"]
    assert client.completions.create(model="tiny", prompt="x", max_tokens=1).choices[0].finish_reason
    wrong_method = http.get("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY_A}"})
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["code"] == "method_not_allowed"


def test_disconnect_before_the_first_token_aborts_the_request() -> None:
    """A client that leaves while its request waits for the engine (queued, or in a long prefill)
    ends the request there, without waiting for a first token that nobody will read."""
    import asyncio
    import json

    from tandem.engine.protocol import GenerationRequest, RequestOutput

    class NeverAnswers:
        """An engine whose first token never comes; it records that its stream was closed."""

        model_name = "tiny"

        def __init__(self) -> None:
            self.started = asyncio.Event()
            self.closed = asyncio.Event()

        async def generate(self, request: GenerationRequest, usage: Any = None) -> Any:
            self.started.set()
            try:
                await asyncio.Event().wait()
                yield RequestOutput(request.request_id, None, [], [], False, None)  # type: ignore[arg-type]
            finally:
                self.closed.set()

        async def stats(self) -> dict[str, Any]:
            return {}

        async def lora_info(self) -> dict[str, Any]:
            return {}

    async def scenario() -> tuple[list[dict[str, Any]], int]:
        engine = NeverAnswers()
        tenants = TenantRegistry(parse_keys(f"{KEY_A}=acme"), TenantLimits(max_concurrent_requests=1))
        app = create_app(OpenAIServer(engine, tenants))  # type: ignore[arg-type]
        body = json.dumps({"model": "tiny", "prompt": "hi", "stream": True}).encode()
        gone = asyncio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "root_path": "",
            "query_string": b"",
            "headers": [(b"authorization", f"Bearer {KEY_A}".encode())],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
        }
        call = asyncio.create_task(app(scope, receive, send))
        await asyncio.wait_for(engine.started.wait(), 5)
        gone.set()
        await asyncio.wait_for(call, 5)  # the route ends instead of waiting on the engine
        await asyncio.wait_for(engine.closed.wait(), 5)  # and it closed the engine stream
        tenants.acquire("acme")  # the tenant's one concurrent slot was given back
        return sent, len(asyncio.all_tasks())

    sent, num_tasks = asyncio.run(scenario())
    assert sent == []  # nothing was answered to a client that is gone
    assert num_tasks == 1  # no watcher task left behind: only the scenario itself


def test_metrics_and_traces_per_tenant(http: TestClient, client: openai.OpenAI) -> None:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tandem.platform.telemetry import get_telemetry

    spans = InMemorySpanExporter()
    get_telemetry().add_span_processor(SimpleSpanProcessor(spans))
    client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert http.get("/metrics").status_code == 401  # operators only
    assert http.get("/metrics", headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 403
    text = http.get("/metrics", headers={"Authorization": f"Bearer {OPERATOR_KEY}"}).text
    ttft = [
        line
        for line in text.splitlines()
        if line.startswith("tandem_time_to_first_token_seconds_count") and 'tenant="acme"' in line
    ]
    assert ttft and float(ttft[0].split()[-1]) >= 1
    assert any(
        line.startswith("tandem_generation_tokens") and 'tenant="acme"' in line for line in text.splitlines()
    )
    assert any(
        line.startswith("tandem_kv_cache_occupancy") and 'model="tiny"' in line for line in text.splitlines()
    ), [ln for ln in text.splitlines() if "kv" in ln]
    steps = [ln for ln in text.splitlines() if ln.startswith("tandem_engine_steps_total")]
    assert steps and float(steps[0].split()[-1]) >= 5  # one prefill and four decode steps at least
    finished = spans.get_finished_spans()
    root = next(s for s in finished if s.name == "llm.request")
    assert root.attributes["tandem.tenant"] == "acme"
    children = {s.name for s in finished if s.parent is not None and s.parent.span_id == root.context.span_id}
    assert children == {"llm.queue", "llm.prefill", "llm.decode"}


def test_health_is_503_until_an_engine_answers(engine: AsyncEngine) -> None:
    import asyncio

    class StartingEngine:  # a replica still loading its model: stats never come back
        model_name = "tiny"

        async def replica_stats(self) -> dict:
            await asyncio.Event().wait()
            return {}

    class NoReportYet(StartingEngine):  # the fleet state before any replica's first report
        async def replica_stats(self) -> dict:
            return {}

    for client in (StartingEngine(), NoReportYet()):
        server = OpenAIServer(client, TenantRegistry({}))  # type: ignore[arg-type]
        with TestClient(create_app(server)) as starting:
            response = starting.get("/health")
            assert response.status_code == 503 and response.json()["error"]["code"] == "not_ready"
    ready = OpenAIServer(LocalEngineClient(engine), TenantRegistry({}))
    with TestClient(create_app(ready)) as http:
        assert http.get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize("stream_interval", [1, 4])
def test_replica_stream_interval_groups_tokens_into_fewer_messages(
    engine: AsyncEngine, stream_interval: int
) -> None:
    """`LLMReplica(stream_interval=k)` sends the first token at once, then one message per k new
    tokens, then the end; the tokens and text joined are the same as with one message per token."""
    import asyncio

    from tandem import GenerationRequest, SamplingParams
    from tandem.deployments.replicas import LLMReplica

    replica = LLMReplica(engine_factory=lambda: engine, stream_interval=stream_interval)
    params = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)

    async def messages() -> list:  # type: ignore[type-arg]
        request = GenerationRequest(
            f"interval-{stream_interval}", prompt="Hello there", sampling_params=params
        )
        return [out async for out in replica.generate(request)]

    sent = asyncio.run(messages())
    sizes = [len(out.outputs[0].delta_token_ids) for out in sent]
    final = sent[-1]
    assert final.finished and not any(out.finished for out in sent[:-1])
    assert [t for out in sent for t in out.outputs[0].delta_token_ids] == final.outputs[0].token_ids
    assert "".join(out.outputs[0].delta_text for out in sent) == final.outputs[0].text
    assert sum(sizes) == 11
    # The first message is never held back to k tokens (it can carry two when the consumer lagged
    # behind the engine, which then merges updates: so with k = 1 any size is allowed).
    assert stream_interval == 1 or sizes[0] < stream_interval, sizes
    # Between the first and the last message, each carries at least k tokens (more only when the
    # consumer lagged and the engine merged updates).
    assert all(size >= stream_interval for size in sizes[1:-1])
    if stream_interval == 4:
        assert len(sent) <= 4  # 1 + 4 + 4 + 2 at most, where one message per token would be 11


def test_spans_are_built_only_for_a_span_processor() -> None:
    """With no span processor (no OTLP endpoint) a finished request builds no spans; once one is
    added, each request gives a root span and its phases."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tandem.platform.telemetry import Telemetry

    telemetry = Telemetry("spans-test")
    started: list[str] = []
    start_span = telemetry.tracer.start_span

    def counting_start_span(name: str, *args: Any, **kwargs: Any) -> Any:
        started.append(name)
        return start_span(name, *args, **kwargs)

    telemetry.tracer.start_span = counting_start_span
    request = {
        "tenant": "acme",
        "model": "tiny",
        "request_id": "cmpl-1",
        "finish_reason": "length",
        "num_prompt_tokens": 3,
        "num_output_tokens": 2,
        "ttft_s": 0.01,
        "e2e_s": 0.02,
        "phases": {"queue": 0.001, "prefill": 0.009, "decode": 0.01},
        "started_ns": time.time_ns(),
    }
    try:
        telemetry.record_request(**request)
        assert started == []
        spans = InMemorySpanExporter()
        telemetry.add_span_processor(SimpleSpanProcessor(spans))
        telemetry.record_request(**request)
        assert sorted(started) == ["llm.decode", "llm.prefill", "llm.queue", "llm.request"]
        assert sorted(s.name for s in spans.get_finished_spans()) == sorted(started)
    finally:  # its Prometheus reader leaves the process-wide registry that /metrics reads
        telemetry.meter_provider.shutdown()
        telemetry.tracer_provider.shutdown()


def test_max_tokens_beyond_the_context_is_refused_and_a_default_fits(
    client: openai.OpenAI, engine: AsyncEngine
) -> None:
    """A prompt plus an explicit max_tokens over the context is a 400 `context_length_exceeded`
    naming max_tokens (as OpenAI and vLLM answer); without max_tokens the server's default is cut
    to what the context leaves."""
    context = engine.engine.max_model_len
    prompt = [5] * (context - 12)  # 12 tokens of room
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=13)
    body = info.value.body
    assert (
        isinstance(body, dict) and body["code"] == "context_length_exceeded" and body["param"] == "max_tokens"
    )
    fits = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert fits.usage is not None and fits.usage.completion_tokens == 12
    default = client.completions.create(model="tiny", prompt=prompt, extra_body={"ignore_eos": True})
    assert default.choices[0].finish_reason == "length"
    assert default.usage is not None and default.usage.completion_tokens == 12


def test_a_stream_closed_before_its_first_event_frees_the_slot_and_the_request(engine) -> None:  # type: ignore[no-untyped-def]
    """A client gone before the response started: the events were never iterated, and closing
    them still gives the tenant's slot back and ends the engine request."""
    import asyncio

    from tandem.deployments.engine_clients import LocalEngineClient
    from tandem.deployments.openai.requests import CompletionRequest
    from tandem.deployments.openai.server import OpenAIServer
    from tandem.platform.api_keys import parse_keys
    from tandem.platform.tenancy import TenantLimits, TenantRegistry

    tenants = TenantRegistry(parse_keys("k=acme"), TenantLimits(max_concurrent_requests=1))
    server = OpenAIServer(LocalEngineClient(engine), tenants)
    body = CompletionRequest.model_validate(
        {"model": engine.model_name, "prompt": "x", "max_tokens": 500, "stream": True, "ignore_eos": True}
    )

    async def main() -> None:
        events = await server.completions(body, "acme")
        await events.aclose()  # never iterated
        again = await server.completions(body, "acme")  # the one slot is free again
        await again.aclose()

    asyncio.run(main())
    import time

    deadline = time.monotonic() + 5  # the engine thread applies the aborts between steps
    while engine.stats()["num_running"] or engine.stats()["num_waiting"]:
        assert time.monotonic() < deadline, engine.stats()


def test_a_replica_refuses_batch_requests_over_its_seats_and_never_real_time_ones(
    engine: AsyncEngine,
) -> None:
    """`LLMReplica(max_batch_requests=2)`: a third batch request at once is refused before it
    starts (`BatchCapacityError`, code `batch_capacity`); an interactive request is not; once a
    batch request ends, its seat is free again."""
    import asyncio

    from tandem import GenerationRequest, SamplingParams
    from tandem.deployments.replicas import LLMReplica
    from tandem.engine.request import Priority
    from tandem.platform.errors import BatchCapacityError

    replica = LLMReplica(engine_factory=lambda: engine, max_batch_requests=2)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    def request(rid: str, priority: Priority) -> GenerationRequest:
        return GenerationRequest(rid, prompt="Seats", sampling_params=params, priority=priority)

    async def scenario() -> None:
        running = [replica.generate(request(f"seat-b{i}", Priority.BATCH)) for i in range(2)]
        for stream in running:
            await anext(stream)  # both hold a seat
        # sent as a value (the handle client raises it): a raised one Serve logs as a failure
        refused = await anext(replica.generate(request("seat-b2", Priority.BATCH)))
        assert isinstance(refused, BatchCapacityError)
        assert refused.code == "batch_capacity" and refused.status_code == 429
        interactive = replica.generate(request("seat-i", Priority.INTERACTIVE))
        assert (await anext(interactive)).outputs[0].delta_token_ids
        await interactive.aclose()
        await running[0].aclose()  # a client leaving frees the seat (and aborts the request)
        again = replica.generate(request("seat-b3", Priority.BATCH))
        assert (await anext(again)).outputs[0].delta_token_ids
        await again.aclose()
        await running[1].aclose()
        stats = await replica.stats()
        assert stats["num_batch_requests"] == 0 and stats["num_batch_requests_refused"] == 1

    asyncio.run(scenario())


def test_n_choices_seeded_greedy_streamed_and_usage(client: openai.OpenAI) -> None:
    """n > 1: seeded choices are reproducible and equal separate requests with seeds seed+i;
    greedy choices are identical; a stream interleaves the choices' indexes; usage counts the
    prompt once."""
    messages = [{"role": "user", "content": "Tell me about paged attention"}]
    sampled = dict(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=1.0,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    first = client.chat.completions.create(n=4, **sampled)  # type: ignore[call-overload]
    again = client.chat.completions.create(n=4, **sampled)  # type: ignore[call-overload]
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices] and len(set(texts)) > 1
    one = client.chat.completions.create(**{**sampled, "seed": 12})  # type: ignore[call-overload]
    assert one.choices[0].message.content == texts[1]
    assert first.usage is not None and one.usage is not None
    assert first.usage.prompt_tokens == one.usage.prompt_tokens
    assert first.usage.completion_tokens == 4 * 8

    greedy = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, n=3, extra_body={"ignore_eos": True}
    )
    assert len(greedy.choices) == 3 and len({c.message.content for c in greedy.choices}) == 1

    stream = client.chat.completions.create(
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        **sampled,  # type: ignore[call-overload]
    )
    indexes: list[int] = []
    streamed = {0: "", 1: ""}
    finishes = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                indexes.append(choice.index)
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert [streamed[0], streamed[1]] == texts[:2]
    assert finishes == {0: "length", 1: "length"}
    last_of_0 = len(indexes) - 1 - indexes[::-1].index(0)
    assert indexes.index(1) < last_of_0  # interleaved: choice 1's text starts before choice 0's ends
    assert (
        usage is not None
        and usage.completion_tokens == 16
        and usage.prompt_tokens == first.usage.prompt_tokens
    )

    completion = client.completions.create(
        model="tiny",
        prompt="Paged attention",
        n=3,
        max_tokens=5,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert completion.usage is not None and completion.usage.completion_tokens == 15
