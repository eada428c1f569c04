"""Every protocol a running server answers, with the unchanged clients: OpenAI's Responses
(plain, streamed, a function tool round trip through `previous_response_id`, `responses.parse`),
an openai-agents agent on its default model class, Anthropic's Messages (plain, streamed, a tool
round trip, `count_tokens`) and embeddings (floats, the SDK's base64, `dimensions`). Prints one
line per check; exits non-zero on the first failure.

    make run   # or: tandem serve, then with the key it prints:
    python scripts/protocols_smoke.py --base-url http://127.0.0.1:8000 --api-key sk-dev-... \\
        --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import math

import anthropic
import openai
from pydantic import BaseModel

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}


class City(BaseModel):
    name: str
    country: str


def check(label: str, ok: bool, detail: object) -> None:
    print(f"{'ok ' if ok else 'FAIL'} {label}: {detail}", flush=True)
    if not ok:
        raise SystemExit(1)


def responses(client: openai.OpenAI, model: str) -> None:
    plain = client.responses.create(model=model, input="What is the capital of France?", max_output_tokens=32)
    check(
        "responses.create",
        plain.status in ("completed", "incomplete") and bool(plain.output_text),
        plain.output_text,
    )
    with client.responses.stream(model=model, input="Say hello.", max_output_tokens=32) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    check("responses stream", "".join(deltas) == final.output_text, final.output_text)
    tools: list = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
    first = client.responses.create(
        model=model, input="What is the weather in Paris?", tools=tools, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=60,
    )  # fmt: skip
    call = next(item for item in first.output if item.type == "function_call")
    second = client.responses.create(
        model=model, previous_response_id=first.id, tools=tools, max_output_tokens=60,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
    )  # fmt: skip
    check(
        "function tool round trip",
        second.previous_response_id == first.id,
        f"{call.arguments} -> {second.output_text!r}",
    )
    parsed = client.responses.parse(
        model=model, input="Name a city in Japan.", text_format=City, max_output_tokens=60
    )
    check("responses.parse", isinstance(parsed.output_parsed, City), parsed.output_parsed)


def agent(base_url: str, api_key: str, model: str) -> None:
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
    from agents.models.openai_provider import OpenAIProvider

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"Sunny, 21 C in {city}"

    provider = OpenAIProvider(openai_client=openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key))
    settings = ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=60)
    weather = Agent(
        name="weather",
        instructions="Use the tool, then answer.",
        tools=[get_weather],
        model=model,
        model_settings=settings,
    )
    result = Runner.run_sync(
        weather,
        "What is the weather in Paris?",
        run_config=RunConfig(model_provider=provider, tracing_disabled=True),
        max_turns=4,
    )
    kinds = [item.type for item in result.new_items]
    check(
        "openai-agents run",
        "tool_call_output_item" in kinds and kinds[-1] == "message_output_item",
        result.final_output,
    )


def messages(client: anthropic.Anthropic, model: str) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    plain = client.messages.create(
        model=model, max_tokens=32, messages=[{"role": "user", "content": "Hello!"}]
    )
    check("messages.create", plain.content[0].type == "text", plain.content[0].text)  # type: ignore[union-attr]
    with client.messages.stream(
        model=model, max_tokens=32, messages=[{"role": "user", "content": "Hello!"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    check("messages stream", final.stop_reason in ("end_turn", "max_tokens"), text)
    tool = {"name": "get_weather", "description": "The weather", "input_schema": WEATHER}
    first = client.messages.create(
        model=model, max_tokens=60, tools=[tool], messages=[question],  # type: ignore[list-item]
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )  # fmt: skip
    use = next(block for block in first.content if block.type == "tool_use")
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}
    second = client.messages.create(
        model=model, max_tokens=60, tools=[tool],  # type: ignore[list-item]
        messages=[question, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}],  # type: ignore[list-item]
    )  # fmt: skip
    check("tool_use round trip", first.stop_reason == "tool_use", f"{use.input} -> {second.content}")
    counted = client.messages.count_tokens(model=model, messages=[question])  # type: ignore[list-item]
    check("count_tokens", counted.input_tokens > 0, counted.input_tokens)


def embeddings(client: openai.OpenAI, model: str) -> None:
    floats = client.embeddings.create(
        model=model, input=["a passage", "another one"], encoding_format="float"
    )
    norm = math.sqrt(sum(x * x for x in floats.data[0].embedding))
    check(
        "embeddings (float)",
        abs(norm - 1) < 1e-4,
        f"{len(floats.data[0].embedding)} dims, usage {floats.usage}",
    )
    decoded = client.embeddings.create(model=model, input=["a passage", "another one"])
    check(
        "embeddings (base64)",
        max(abs(a - b) for a, b in zip(decoded.data[1].embedding, floats.data[1].embedding, strict=True))
        < 1e-6,
        "same",
    )
    short = client.embeddings.create(model=model, input="a passage", dimensions=64, encoding_format="float")
    check("embeddings (dimensions)", len(short.data[0].embedding) == 64, "64 dims")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key, max_retries=0, timeout=300)
    responses(client, args.model)
    agent(args.base_url, args.api_key, args.model)
    messages(
        anthropic.Anthropic(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=300),
        args.model,
    )
    embeddings(client, args.model)
    print(json.dumps({"all": "ok"}))


if __name__ == "__main__":
    main()
