"""Structured output and tool calls through the official `openai` client, on the default model
(SmolLM2-135M-Instruct) behind a real uvicorn server; outputs checked with `jsonschema`, and the
engine's constrained tokens against HF transformers' logits masked step by step by llguidance's
own matcher."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from tandem import AsyncEngine
from tandem.batch.service import BatchLimits, BatchService
from tandem.batch.worker import BatchWorker
from tandem.deployments.batch_execution import execute_batch_line
from tandem.deployments.engine_clients import LocalEngineClient
from tandem.deployments.ingress import create_app
from tandem.deployments.openai.endpoints import ENDPOINTS
from tandem.deployments.openai.server import OpenAIServer
from tandem.deployments.openai.structured_output import ToolCallStream, parse_tool_calls
from tandem.engine.sampling_params import SamplingParams, StructuredOutput
from tandem.platform.api_keys import parse_keys
from tandem.platform.object_store import FileObjectStore
from tandem.platform.tenancy import TenantRegistry
from tests.conftest import serve_with_worker

pytestmark = pytest.mark.slow
KEY = "sk-structured"
MODEL = "smol"

REVIEW_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["food", "travel", "tech", "music"]},
            "maxItems": 3,
        },
        "recommended": {"type": "boolean"},
    },
    "required": ["title", "rating", "tags", "recommended"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}  # type: ignore[index]


@dataclass
class Server:
    base_url: str
    engine: AsyncEngine

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)

    def post(self, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(
            f"{self.base_url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=120,
        )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The app under uvicorn on a loopback port with the default model, and a batch worker."""
    root = tmp_path_factory.mktemp("structured")
    engine = AsyncEngine.from_options(kv_cache_memory=128 << 20, max_num_seqs=16, served_model_name=MODEL)
    batches = BatchService(
        FileObjectStore(str(root / "objects")), {MODEL}, BatchLimits(shard_size=4), endpoints=ENDPOINTS
    )
    api = OpenAIServer(LocalEngineClient(engine), TenantRegistry(parse_keys(f"{KEY}=acme")), batches=batches)
    worker = BatchWorker(
        batches, partial(execute_batch_line, api), poll_interval_s=0.05, worker_id="structured"
    )
    try:
        with serve_with_worker(create_app(api), worker) as base_url:
            yield Server(base_url, engine)
    finally:
        engine.shutdown()


class Address(BaseModel):
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int
    address: Address
    languages: list[str] = Field(max_length=3)


def test_parse_returns_a_nested_pydantic_object(server: Server) -> None:
    completion = server.client().chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Invent a person who lives in Italy and describe them."}],
        response_format=Person,
        temperature=0,
        max_tokens=200,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person) and isinstance(message.parsed.address, Address)
    assert Person.model_validate_json(message.content or "") == message.parsed


REVIEW_PROMPTS = [
    "Review a pizza restaurant in Naples.",
    "Write a review of a new laptop.",
    "Review your last trip to Japan.",
    "Give a short review of a jazz concert.",
    "Review a coffee shop that just opened.",
    "What do you think of electric cars? Answer as a review.",
    "Review a museum of modern art.",
    "Review a cheap smartphone.",
]


def test_json_schema_strict_outputs_validate_for_many_prompts_and_seeds(server: Server) -> None:
    client = server.client()
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "review", "schema": REVIEW_SCHEMA, "strict": True},
    }

    def ask(job: tuple[str, int]) -> tuple[str | None, str | None]:
        prompt, seed = job
        choice = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            response_format=response_format,  # type: ignore[arg-type]
            temperature=1.0,
            seed=seed,
            max_tokens=120,
        ).choices[0]
        return choice.message.content, choice.finish_reason

    jobs = [(prompt, seed) for prompt in REVIEW_PROMPTS for seed in (1, 2)]
    with ThreadPoolExecutor(len(jobs)) as pool:  # concurrent: constrained rows share batches
        answers = list(pool.map(ask, jobs))
    for (prompt, seed), (content, finish_reason) in zip(jobs, answers, strict=True):
        assert finish_reason == "stop", (prompt, seed, content)
        jsonschema.validate(json.loads(content or ""), REVIEW_SCHEMA)
    assert len({content for content, _ in answers}) > len(jobs) // 2  # sampled, not one fixed answer


def test_json_object_and_completions_response_format(server: Server) -> None:
    client = server.client()
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "List three colours."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=100,
    )
    assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "List three colours."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=100,
        stream=True,
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        == chat.choices[0].message.content
    )
    completion = client.completions.create(
        model=MODEL,
        prompt="A JSON review of a bakery:",
        temperature=0,
        max_tokens=120,
        extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": REVIEW_SCHEMA}}
        },
    )
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(completion.choices[0].text), REVIEW_SCHEMA)


def _check_calls(calls: list[Any], allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_tool_choice_required_named_and_none(server: Server) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "What is the weather like in Paris, in celsius?"}]
    required = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=120,  # type: ignore[arg-type]
    ).choices[0]
    assert required.finish_reason == "tool_calls" and required.message.content is None
    _check_calls(required.message.tool_calls or [], {"get_weather", "add"})

    named = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is 12 plus 30?"}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "add"}},
        temperature=0,
        max_tokens=120,
    ).choices[0]
    assert named.finish_reason == "tool_calls" and len(named.message.tool_calls or []) == 1
    _check_calls(named.message.tool_calls or [], {"add"})

    single = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # type: ignore[arg-type]
        temperature=1.0,
        seed=5,
        max_tokens=150,
    ).choices[0]
    assert single.finish_reason == "tool_calls" and len(single.message.tool_calls or []) == 1

    none = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=40,  # type: ignore[arg-type]
    ).choices[0]
    assert (
        none.message.tool_calls is None and none.message.content and none.finish_reason in ("stop", "length")
    )

    # The call goes back into the conversation, with its result, and the model answers in text.
    call = (required.message.tool_calls or [])[0]
    follow_up = client.chat.completions.create(
        model=MODEL,
        messages=[
            *messages,
            {"role": "assistant", "tool_calls": [call.model_dump()]},  # type: ignore[list-item]
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'},
        ],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
        temperature=0,
        max_tokens=40,
    ).choices[0]
    assert follow_up.message.content and follow_up.message.tool_calls is None


def _weather_turns(city: str, call_id: str, degrees: int) -> list[dict[str, Any]]:
    arguments = json.dumps({"city": city, "unit": "celsius"})
    return [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"temperature": degrees})},
        {"role": "assistant", "content": f"It is {degrees} degrees in {city}."},
    ]


def test_tool_choice_auto_lets_the_model_choose(server: Server) -> None:
    """Two earlier turns show the model its tool at work (a 135M model given only the tool list
    answers in text); then a weather question gets a call and a greeting gets text, each from the
    same grammar with `tool_choice` left to its default, "auto"."""
    client = server.client()
    history = _weather_turns("Madrid", "call_1", 30) + _weather_turns("Lima", "call_2", 18)
    choices = {}
    for name, question in (
        ("weather", "What is the weather in Berlin?"),
        ("chat", "Say hello to my friend Anna."),
    ):
        choices[name] = client.chat.completions.create(
            model=MODEL,
            messages=[*history, {"role": "user", "content": question}],  # type: ignore[list-item]
            tools=TOOLS,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=80,
        ).choices[0]
    assert choices["weather"].finish_reason == "tool_calls"
    _check_calls(choices["weather"].message.tool_calls or [], {"get_weather", "add"})
    assert json.loads((choices["weather"].message.tool_calls or [])[0].function.arguments)["city"] == "Berlin"
    assert choices["chat"].message.tool_calls is None and choices["chat"].message.content
    assert choices["chat"].finish_reason == "stop"


def test_streamed_tool_call_deltas_reassemble_to_the_same_calls(server: Server) -> None:
    client = server.client()
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Rome and in Oslo, please, in fahrenheit."}],
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=150,
    )
    full = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict[str, Any]] = {}
    finish_reasons = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish_reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                if delta.id:
                    assert call["id"] is None  # the id comes once, with the name
                    call["id"] = delta.id
                if delta.function and delta.function.name:
                    call["name"] += delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
    assert [f for f in finish_reasons if f] == ["tool_calls"]
    expected = [(c.function.name, c.function.arguments) for c in full.message.tool_calls or []]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected
    assert all(call["id"] for call in calls.values())


def test_a_call_cut_by_max_tokens_comes_back_in_tool_calls(server: Server) -> None:
    """max_tokens=20 cuts the call: `tool_calls` holds it with its partial arguments, `content`
    holds no markup, finish_reason is "length"; the stream says the same."""
    client = server.client()
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather like in Paris, in celsius?"}],
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=20,
    )
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    arguments = calls[0].function.arguments
    assert arguments.startswith("{") and not _is_json_text(arguments)  # cut: not whole JSON yet
    streamed_args, streamed_content, finishes = "", "", []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for streamed in chunk.choices:
            streamed_content += streamed.delta.content or ""
            finishes += [streamed.finish_reason] if streamed.finish_reason else []
            for delta in streamed.delta.tool_calls or []:
                streamed_args += (delta.function.arguments or "") if delta.function else ""
    assert finishes == ["length"] and streamed_content == "" and streamed_args == arguments


def _is_json_text(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def test_tool_call_stream_parser_matches_the_whole_text_parser() -> None:
    text = (
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris}\\n", "unit": "celsius"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    for step in (1, 2, 5, 11, len(text)):
        stream = ToolCallStream()
        deltas = [d for i in range(0, len(text), step) for d in stream.feed(text[i : i + step])]
        deltas += stream.feed("", final=True)
        streamed_content = "".join(d.get("content", "") for d in deltas)
        pieces: dict[int, list[str]] = {}
        names = {}
        for delta in deltas:
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    names[call["index"]] = call["function"]["name"]
                pieces.setdefault(call["index"], []).append(call["function"]["arguments"])
        assert streamed_content == content
        assert [(names[i], "".join(pieces[i])) for i in sorted(pieces)] == [
            (c.name, c.arguments) for c in calls
        ]
    assert (
        parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1')[1] == []
    )  # ended, not cut: text


def test_a_cut_call_is_a_call_with_partial_arguments_streamed_and_not() -> None:
    """At every cut point of a text with content and two calls: the whole-text parser and the
    stream parser agree, no call markup is ever content, and a call cut after its name is a call
    whose arguments are the start of the full arguments."""
    text = (
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    _, whole_calls = parse_tool_calls(text)
    full_args = [c.arguments for c in whole_calls]
    for cut in range(1, len(text)):
        piece = text[:cut]
        content, calls = parse_tool_calls(piece, cut=True)
        assert "<" not in (content or "")  # no markup, not even a cut marker
        for index, call in enumerate(calls):
            assert call.name == whole_calls[index].name and full_args[index].startswith(call.arguments)
        if piece.endswith('"a": 1'):
            assert calls[-1].arguments == '{"a": 1'
        if piece.endswith('"celsius"}'):  # the closing marker's brace is not taken for arguments
            assert calls[-1].arguments == full_args[0]
        stream = ToolCallStream()
        deltas = [d for i in range(0, cut, 7) for d in stream.feed(piece[i : i + 7])]
        deltas += stream.feed("", final=True, cut=True)
        streamed = "".join(d.get("content", "") for d in deltas)
        pieces: dict[int, str] = {}
        for delta in deltas:
            for call_delta in delta.get("tool_calls", []):
                pieces[call_delta["index"]] = (
                    pieces.get(call_delta["index"], "") + call_delta["function"]["arguments"]
                )
        assert streamed == (content or "")
        assert [pieces[i] for i in sorted(pieces)] == [c.arguments for c in calls]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "format": "no-such-format"}},
                }
            },
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
            "response_format.json_schema.name",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                        },
                    }
                ]
            },
            "tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(server: Server, body: dict[str, Any], param: str) -> None:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body}
    response = server.post(request)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


CYCLE = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}
SELF_REQUIRED = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "child": {"$ref": "#"}},
    "required": ["name", "child"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("schema", [CYCLE, SELF_REQUIRED], ids=["cycle", "self-required"])
def test_schemas_with_no_finite_value_are_400s_within_a_second(
    server: Server, schema: dict[str, Any]
) -> None:
    """A $ref cycle and a required recursive $ref: a 400 naming the field, found before anything
    is generated, as a response format and as a tool's parameters."""
    for body, param in (
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
            "response_format",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                "tool_choice": "required",
            },
            "tools.0.function.parameters",
        ),
    ):
        started = time.monotonic()
        response = server.post(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, **body}
        )
        assert time.monotonic() - started < 1.0
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and "no finite value" in error["message"], error


def test_a_batch_file_with_response_format_lines(server: Server) -> None:
    client = server.client()
    response_format = {"type": "json_schema", "json_schema": {"name": "review", "schema": REVIEW_SCHEMA}}
    lines = [
        {
            "custom_id": f"review-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": prompt}],
                "response_format": response_format,
                "temperature": 0,
                "max_tokens": 120,
            },
        }
        for i, prompt in enumerate(REVIEW_PROMPTS[:4])
    ]
    lines.append({**lines[0], "custom_id": "bad-schema"})
    lines[-1]["body"] = {
        **lines[0]["body"],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "objekt"}},
        },
    }
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file_id = client.files.create(file=("reviews.jsonl", io.BytesIO(data)), purpose="batch").id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 300
    while batch.status not in ("completed", "failed"):
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}"
        time.sleep(0.1)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch.errors
    assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 1)  # type: ignore[union-attr]
    assert batch.output_file_id is not None and batch.error_file_id is not None
    for line in client.files.content(batch.output_file_id).text.splitlines():
        body = json.loads(line)["response"]["body"]
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), REVIEW_SCHEMA)
    (error,) = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert error["custom_id"] == "bad-schema" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "response_format"


# -- the engine's masking against a reference --------------------------------------------------


def _reference_tokens(
    hf_model: Any, prompt_ids: list[int], grammar_spec: StructuredOutput, engine: Any, max_tokens: int
) -> list[int]:
    """HF transformers' greedy decoding, each step's logits masked by llguidance's own matcher and
    its own numpy bitmask helpers (of ours: only the tokenizer and the grammar text handed to the
    library, which `grammar_text` gets from the library's own `grammar_from_json_schema`)."""
    import llguidance as llg
    import llguidance.numpy as llg_np

    from tandem.engine.structured.grammar import grammar_text

    tokenizer = llg.LLTokenizer(
        engine.tokenizer.backend.to_str(),
        n_vocab=engine.model_config.vocab_size,
        eos_token=sorted(engine.eos_token_ids),
    )
    matcher = llg.LLMatcher(tokenizer, grammar_text(grammar_spec))
    bitmask = llg_np.allocate_token_bitmask(1, engine.model_config.vocab_size)
    ids = list(prompt_ids)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = hf_model(torch.tensor([ids])).logits[0, -1].float().numpy().copy()[None, :]
            llg_np.fill_next_token_bitmask(matcher, bitmask, 0)
            llg_np.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            out.append(token)
            if token in engine.eos_token_ids:
                break
            assert matcher.consume_token(token), matcher.get_error()
            ids.append(token)
    return out


def test_constrained_tokens_equal_a_reference_masked_step_by_step(
    default_llm: Any, hf_default_model: Any
) -> None:
    engine = default_llm.engine
    spec = StructuredOutput("json_schema", json.dumps(REVIEW_SCHEMA))
    params = SamplingParams(max_tokens=60, temperature=0, structured=spec, speculative=False)
    messages = [{"role": "user", "content": "Review a small bookshop."}]
    (plain,) = default_llm.chat([messages], params)
    prompt_ids = plain.prompt_token_ids
    reference = _reference_tokens(hf_default_model, prompt_ids, spec, engine, 60)
    assert plain.outputs[0].token_ids == reference
    # Several tokens accepted in one step (prompt-lookup drafts verified under the masks): the same.
    saved = engine.scheduler.speculation.step_cost
    engine.scheduler.speculation.always_draft()
    drafts_before = engine.scheduler.speculation.num_draft_tokens_total
    try:
        (speculated,) = default_llm.chat(
            [messages], SamplingParams(max_tokens=60, temperature=0, structured=spec)
        )
    finally:
        engine.scheduler.speculation.step_cost = saved
    assert engine.scheduler.speculation.num_draft_tokens_total > drafts_before
    assert speculated.outputs[0].token_ids == reference


def test_an_unconstrained_row_in_the_same_batch_is_untouched(default_llm: Any) -> None:
    spec = StructuredOutput("regex", r"[0-9]{3}")
    prompts = ["The capital of France is", "Once upon a time"]
    free = default_llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, speculative=False))
    mixed = default_llm.generate(
        prompts,
        [
            SamplingParams(max_tokens=8, temperature=0, speculative=False, structured=spec),
            SamplingParams(max_tokens=8, temperature=0, speculative=False),
        ],
    )
    assert len(mixed[0].outputs[0].text) == 3 and mixed[0].outputs[0].text.isdigit()
    assert mixed[1].outputs[0].token_ids == free[1].outputs[0].token_ids
    assert free[0].outputs[0].text != mixed[0].outputs[0].text


def test_draft_masks_stop_at_refused_and_end_tokens_and_leave_the_matcher_as_it_was(tiny_llm: Any) -> None:
    engine = tiny_llm.engine
    (eos,) = sorted(engine.eos_token_ids)
    matcher = engine.grammars.matcher(StructuredOutput("regex", r"(quick|lazy) dog"))
    text_ids = engine.tokenizer.encode("quick dog", add_special_tokens=False)
    before = torch.empty(matcher.num_words, dtype=torch.int32)
    matcher.fill_bitmask(before)

    masks, num_valid = matcher.draft_bitmasks([*text_ids, eos, text_ids[0]])  # stops before EOS
    assert num_valid == len(text_ids) and masks.shape == (num_valid + 1, matcher.num_words)
    assert torch.equal(masks[0], before)
    last = apply_row(masks[-1], engine.model_config.vocab_size)
    assert last.nonzero().flatten().tolist() == [eos]  # the grammar is complete: only EOS
    refused = engine.tokenizer.encode("lazy cat", add_special_tokens=False)
    _, num_valid = matcher.draft_bitmasks(refused)
    assert num_valid < len(refused)
    after = torch.empty_like(before)
    matcher.fill_bitmask(after)
    assert torch.equal(after, before)  # every draft consumed above was rolled back

    assert matcher.accept([*text_ids, eos]) and matcher.error is None
    assert not engine.grammars.matcher(StructuredOutput("regex", r"(quick|lazy) dog")).accept(refused)


def apply_row(bitmask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    """One bitmask row as a [vocab] bool tensor of allowed tokens."""
    shifts = torch.arange(32, dtype=torch.int32)
    return (((bitmask_row.unsqueeze(-1) >> shifts) & 1).flatten()[:vocab]).bool()


def test_langchain_structured_output_cut_by_max_tokens_raises_a_length_error(server: Server) -> None:
    """LangChain's default `with_structured_output` (json_schema) and its function-calling method,
    at a max_tokens too small for the answer: each raises its length error, not a parse error of
    markup; with room, both return the object."""
    from langchain_openai import ChatOpenAI

    def chat(max_tokens: int) -> ChatOpenAI:
        return ChatOpenAI(
            model=MODEL,
            base_url=f"{server.base_url}/v1",
            api_key=KEY,
            temperature=0,
            max_tokens=max_tokens,
            max_retries=0,  # type: ignore[arg-type]
        )

    question = "Invent a person who lives in Italy and describe them."
    with pytest.raises(openai.LengthFinishReasonError):
        chat(20).with_structured_output(Person).invoke(question)
    assert isinstance(chat(200).with_structured_output(Person).invoke(question), Person)
    raw = (
        chat(20).with_structured_output(Person, method="function_calling", include_raw=True).invoke(question)
    )
    message = raw["raw"]
    assert message.response_metadata["finish_reason"] == "length"  # type: ignore[union-attr]
    assert "<tool_call>" not in str(message.content)  # type: ignore[union-attr]
    assert message.invalid_tool_calls or message.tool_calls  # type: ignore[union-attr]
