"""OpenAI's Responses API (`/v1/responses`) and Anthropic's Messages API (`/v1/messages`) through
the unchanged `openai`, `anthropic` and `openai-agents` clients, on the default model
(SmolLM2-135M-Instruct) behind a real uvicorn server with the platform as `tandem serve` wires it
(`local_platform`: the object store, batches, usage). Both protocols run through the chat path,
so each answer is checked against the chat completion of the same conversation, greedy: the
same text and the same prompt tokens. `tests/test_serve.py` runs them on Ray Serve."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel

from tandem import AsyncEngine
from tandem.batch.service import BatchLimits
from tandem.deployments.ingress import create_app
from tandem.deployments.local import local_platform
from tandem.platform.api_keys import parse_keys
from tandem.platform.object_store import FileObjectStore
from tandem.platform.tenancy import TenantRegistry
from tandem.platform.usage_log import UsageLog
from tests.conftest import serve_with_worker

pytestmark = pytest.mark.slow
KEY, OTHER_KEY = "sk-responses", "sk-responses-globex"
MODEL = "smol"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
QUESTION = "What is the capital of France?"


@dataclass
class Server:
    base_url: str
    store: FileObjectStore

    def openai(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=0, timeout=120)

    def anthropic(self, key: str = KEY) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.base_url, api_key=key, max_retries=0, timeout=120)

    def chat(self, messages: list[dict[str, Any]], **fields: Any) -> Any:
        """The chat completion of the same conversation: what the other protocols must equal."""
        return self.openai().chat.completions.create(model=MODEL, messages=messages, temperature=0, **fields)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("responses")
    store = FileObjectStore(str(root / "objects"))
    engine = AsyncEngine.from_options(kv_cache_memory=128 << 20, max_num_seqs=16, served_model_name=MODEL)
    usage_log = UsageLog(store, commit_interval_s=0.0)
    platform = local_platform(
        engine,
        store,
        TenantRegistry(parse_keys(f"{KEY}=acme,{OTHER_KEY}=globex")),
        batch_limits=BatchLimits(shard_size=8),
        model=MODEL,
        usage_log=usage_log,
    )
    try:
        with serve_with_worker(create_app(platform.server), platform.worker) as base_url:
            yield Server(base_url, store)
    finally:
        usage_log.close()
        engine.shutdown()


def test_a_response_is_the_chat_answer_plain_and_streamed(server: Server) -> None:
    client = server.openai()
    response = client.responses.create(
        model=MODEL,
        input=QUESTION,
        instructions="Answer in one sentence.",
        max_output_tokens=40,
        temperature=0,
    )
    chat = server.chat(
        [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": QUESTION}],
        max_tokens=40,
    )
    assert response.object == "response" and response.status == "completed"
    assert response.output_text == chat.choices[0].message.content and "Paris" in response.output_text
    assert response.usage is not None and chat.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    kinds: list[str] = []
    deltas: list[str] = []
    with client.responses.stream(
        model=MODEL,
        input=QUESTION,
        instructions="Answer in one sentence.",
        max_output_tokens=40,
        temperature=0,
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta")
    assert "".join(deltas) == final.output_text == response.output_text
    assert final.usage is not None and final.usage.output_tokens == response.usage.output_tokens
    # A cut answer is `incomplete`, for the reason the SDK reads.
    cut = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"


def test_a_function_tool_round_trip_through_previous_response_id(server: Server) -> None:
    client = server.openai()
    tools: Any = [
        {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS, "strict": True}
    ]
    first = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and first.status == "completed"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}],
        tools=tools,
        max_output_tokens=40,
        temperature=0,
    )
    # The stored conversation was continued: the same as chat given the whole of it.
    chat = server.chat(
        [
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": c.call_id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in calls
                ],
            },
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": "Sunny, 21 C"},
        ],
        tools=[
            {
                "type": "function",
                "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS, "strict": True},
            }
        ],
        max_tokens=40,
    )
    assert second.output_text == (chat.choices[0].message.content or "")
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == second.output_text
    items = client.responses.input_items.list(second.id).data
    assert [item.type for item in items] == ["function_call_output"]


def test_parse_with_a_pydantic_text_format(server: Server) -> None:
    class City(BaseModel):
        name: str
        country: str

    parsed = server.openai().responses.parse(
        model=MODEL, input="Name a city in Japan.", text_format=City, max_output_tokens=60, temperature=0
    )
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.name


def test_stored_responses_belong_to_their_tenant(server: Server) -> None:
    client, other = server.openai(), server.openai(OTHER_KEY)
    kept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    for attempt in (
        lambda: other.responses.retrieve(kept.id),
        lambda: other.responses.input_items.list(kept.id),
        lambda: other.responses.delete(kept.id),
        lambda: other.responses.create(model=MODEL, input="Go on", previous_response_id=kept.id),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert client.responses.retrieve(kept.id).id == kept.id  # still there
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_unsupported_fields_are_400s_naming_them(server: Server) -> None:
    client = server.openai()
    for fields, param in [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"tool_choice": "required"}, "tool_choice"),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, input="Hi", **fields)
        assert refused.value.param == param, fields
    unknown = httpx.get(f"{server.base_url}/v1/embedding", headers={"Authorization": f"Bearer {KEY}"})
    assert unknown.status_code == 404
    message = unknown.json()["error"]["message"]
    assert "POST /v1/responses" in message and "POST /v1/messages" in message and "GET /v1/models" in message


def test_a_batch_of_responses_lines_is_answered_once_each(server: Server) -> None:
    client = server.openai()
    prompts = [f"Name a colour, number {i}." for i in range(6)]
    lines = [
        json.dumps(
            {
                "custom_id": f"r-{i}",
                "method": "POST",
                "url": "/v1/responses",
                "body": {"model": MODEL, "input": p, "max_output_tokens": 5, "temperature": 0},
            }
        )
        for i, p in enumerate(prompts)
    ]
    file_id = client.files.create(file=("r.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/responses", completion_window="24h")
    deadline = time.monotonic() + 300
    while batch.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch.errors
    assert batch.output_file_id is not None
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == sorted(f"r-{i}" for i in range(6))  # each once
    body = next(o for o in output if o["custom_id"] == "r-2")["response"]["body"]
    realtime = client.responses.create(model=MODEL, input=prompts[2], max_output_tokens=5, temperature=0)
    assert body["object"] == "response" and body["output"][0]["content"][0]["text"] == realtime.output_text
    assert batch.usage is not None
    assert (
        batch.usage.output_tokens == sum(o["response"]["body"]["usage"]["output_tokens"] for o in output) > 0
    )
    assert batch.usage.input_tokens == sum(o["response"]["body"]["usage"]["input_tokens"] for o in output) > 0


def test_an_openai_agents_agent_with_a_tool_finishes_on_the_default_model_class(server: Server) -> None:
    """openai-agents' default provider and model class (`OpenAIResponsesModel`: the Responses
    API): the agent calls its tool, reads the result and answers; the run ends by itself."""
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
    from agents.models.openai_provider import OpenAIProvider
    from agents.models.openai_responses import OpenAIResponsesModel

    looked_up: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        looked_up.append(city)
        return f"Sunny, 21 C in {city}"

    provider = OpenAIProvider(openai_client=openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=KEY))
    assert isinstance(provider.get_model(MODEL), OpenAIResponsesModel)  # the default model class
    agent = Agent(
        name="weather",
        instructions="Use the tool, then answer in one sentence.",
        tools=[get_weather],
        model=MODEL,
        # The first turn must call the tool; agents then resets tool_choice, so the next answers.
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0
        ),
    )
    result = Runner.run_sync(
        agent,
        "What is the weather in Paris?",
        run_config=RunConfig(model_provider=provider, tracing_disabled=True),
        max_turns=4,
    )
    kinds = [item.type for item in result.new_items]
    assert looked_up and kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, str) and result.final_output


# -- Anthropic's Messages API ---------------------------------------------------------------------
# Anthropic's SDK sends no sampling fields (temperature, top_k) any more; the API still takes them,
# and greedy answers are what can be compared with chat's.
GREEDY = {"temperature": 0}
ANTHROPIC_WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather",
    "input_schema": WEATHER_PARAMETERS,
}


def test_a_message_is_the_chat_answer_plain_and_streamed(server: Server) -> None:
    client = server.anthropic()
    message = client.messages.create(
        model=MODEL,
        max_tokens=40,
        system="Be brief.",
        messages=[{"role": "user", "content": QUESTION}],
        extra_body=GREEDY,
    )
    chat = server.chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}], max_tokens=40
    )
    assert message.type == "message" and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]
    assert message.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert chat.usage is not None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    with client.messages.stream(
        model=MODEL,
        max_tokens=40,
        system="Be brief.",
        messages=[{"role": "user", "content": QUESTION}],
        extra_body=GREEDY,
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == message.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == message.stop_reason and final.usage.input_tokens == message.usage.input_tokens
    counted = client.messages.count_tokens(
        model=MODEL, system="Be brief.", messages=[{"role": "user", "content": QUESTION}]
    )
    assert counted.input_tokens == message.usage.input_tokens


def test_stop_sequences_say_which_one_stopped(server: Server) -> None:
    client = server.anthropic()
    base = client.messages.create(
        model=MODEL, max_tokens=30, messages=[{"role": "user", "content": QUESTION}], extra_body=GREEDY
    )
    full = base.content[0].text  # type: ignore[union-attr]
    words = full.split()
    assert len(words) >= 4, full
    stop = " " + words[2]
    message = client.messages.create(
        model=MODEL,
        max_tokens=30,
        messages=[{"role": "user", "content": QUESTION}],
        extra_body=GREEDY,
        stop_sequences=[stop],
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert full.startswith(message.content[0].text)  # type: ignore[union-attr]


def test_a_tool_use_round_trip(server: Server) -> None:
    client = server.anthropic()
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.messages.create(
        model=MODEL,
        max_tokens=60,
        tools=[ANTHROPIC_WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
        messages=[question],  # type: ignore[list-item]
    )
    uses = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    assert set(uses[0].input) == {"city"}  # type: ignore[arg-type]
    with client.messages.stream(
        model=MODEL,
        max_tokens=60,
        tools=[ANTHROPIC_WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
        messages=[question],  # type: ignore[list-item]
    ) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == [b.type for b in first.content]
    assert streamed.content[-1].input == uses[-1].input  # type: ignore[union-attr]
    result = {"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 21 C"}
    second = client.messages.create(
        model=MODEL,
        max_tokens=40,
        extra_body=GREEDY,
        tools=[ANTHROPIC_WEATHER],
        messages=[
            question,
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [result]},
        ],  # type: ignore[list-item]
    )
    chat = server.chat(
        [
            question,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": u.id,
                        "type": "function",
                        "function": {"name": u.name, "arguments": json.dumps(u.input)},
                    }
                    for u in uses
                ],
            },
            {"role": "tool", "tool_call_id": uses[0].id, "content": "Sunny, 21 C"},
        ],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "The weather",
                    "parameters": WEATHER_PARAMETERS,
                },
            }
        ],
        max_tokens=40,
    )
    texts = [b.text for b in second.content if b.type == "text"]
    assert texts == ([chat.choices[0].message.content] if chat.choices[0].message.content else texts)
    assert second.usage.input_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]


def test_anthropic_errors_and_auth(server: Server) -> None:
    client = server.anthropic()
    with pytest.raises(anthropic.AuthenticationError) as unauthorised:
        server.anthropic("sk-wrong").messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Hi"}]
        )
    assert unauthorised.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [image]}])  # type: ignore[list-item]
    body: Any = refused.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("messages.0.content.0.type")
    raw = httpx.post(
        f"{server.base_url}/v1/messages",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
        headers={"x-api-key": KEY},
    )
    assert raw.status_code == 400 and raw.json()["error"]["message"].startswith("max_tokens")
    for path in ("/v1/messages", "/v1/messages/count_tokens"):  # wrong shapes: 400, never a 500
        for shaped in ({"tools": 1.5}, {"messages": "Hi"}, {"messages": [{"role": "user", "content": 3}]}):
            odd = httpx.post(
                f"{server.base_url}{path}",
                json={
                    "model": MODEL,
                    "max_tokens": 5,
                    "messages": [{"role": "user", "content": "Hi"}],
                    **shaped,
                },
                headers={"x-api-key": KEY},
            )
            assert odd.status_code == 400 and odd.json()["type"] == "error", (path, shaped, odd.text)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "Hi"}])


def test_parse_with_an_output_format(server: Server) -> None:
    class City(BaseModel):
        name: str
        country: str

    parsed = server.anthropic().messages.parse(
        model=MODEL,
        max_tokens=60,
        messages=[{"role": "user", "content": "Name a city in Japan."}],
        output_format=City,
        extra_body=GREEDY,
    )
    assert isinstance(parsed.parsed_output, City) and parsed.parsed_output.name
