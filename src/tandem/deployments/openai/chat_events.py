"""A streamed chat completion (`OpenAIServer.chat` with `stream: true`, one choice) read back as
typed events, for the protocols answered through it (`/v1/responses`, Anthropic's
`/v1/messages`): text deltas, tool calls opened and their argument deltas, the finish, the usage.

Chat is the path every request takes, so metering, tenant limits, drain and cancellation are the
same for all protocols; this module only reads the chunks chat streams. The chat stream is closed
however the reader ends (a client gone aborts the request in the engine).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    """A tool call opens: its position among the calls, its id and the function's name."""

    index: int
    call_id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    delta: str  # the next piece of the arguments' JSON text


@dataclass(frozen=True)
class Finish:
    reason: str  # chat's finish_reason: "stop", "length", "tool_calls"
    stop_reason: str | int | None = None  # the stop string or token that ended it


@dataclass(frozen=True)
class TurnUsage:
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0


ChatEvent = TextDelta | CallStart | CallArguments | Finish | TurnUsage


class StreamFailedError(Exception):
    """The chat stream reported an error in-band after it started (its OpenAI error body)."""

    def __init__(self, error: dict[str, object]) -> None:
        super().__init__(str(error.get("message")))
        self.error = error


def usage_of(usage: dict[str, object]) -> TurnUsage:
    """Chat's usage object as `TurnUsage`."""
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
    return TurnUsage(
        int(str(usage["prompt_tokens"])), int(str(usage["completion_tokens"])), int(str(cached or 0))
    )


async def chat_events(sse: AsyncIterator[str]) -> AsyncGenerator[ChatEvent, None]:
    """The events of a chat SSE stream (one choice, asked with `include_usage`); an error event
    raises `StreamFailedError`. `sse` is closed when this generator ends or is closed."""
    try:
        async for message in sse:
            payload = message.removeprefix("data: ").rstrip("\n")
            if payload == "[DONE]":
                return
            chunk = json.loads(payload)
            if "error" in chunk:
                raise StreamFailedError(chunk["error"])
            for event in _chunk_events(chunk):
                yield event
    finally:
        aclose = getattr(sse, "aclose", None)
        if aclose is not None:
            await aclose()


def _chunk_events(chunk: dict[str, object]) -> list[ChatEvent]:
    events: list[ChatEvent] = []
    choices = chunk.get("choices")
    for choice in choices if isinstance(choices, list) else []:
        delta = choice.get("delta") or {}
        if delta.get("content"):
            events.append(TextDelta(delta["content"]))
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if "id" in call:
                events.append(CallStart(call["index"], call["id"], function.get("name", "")))
            if function.get("arguments"):
                events.append(CallArguments(call["index"], function["arguments"]))
        if choice.get("finish_reason") is not None:
            events.append(Finish(choice["finish_reason"], choice.get("stop_reason")))
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        events.append(usage_of(usage))
    return events


@dataclass
class CallState:
    call_id: str
    name: str
    arguments: str = ""


@dataclass
class ChatTurn:
    """What a chat answer said so far: its text, its tool calls, how it finished and its usage
    (built from a finished JSON body, or event by event from a stream)."""

    text: str = ""
    calls: list[CallState] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: TurnUsage | None = None

    def add(self, event: ChatEvent) -> None:
        if isinstance(event, TextDelta):
            self.text += event.text
        elif isinstance(event, CallStart):
            self.calls.append(CallState(event.call_id, event.name))
        elif isinstance(event, CallArguments):
            self.calls[event.index].arguments += event.delta
        elif isinstance(event, Finish):
            self.finish_reason, self.stop_reason = event.reason, event.stop_reason
        else:
            self.usage = event

    @classmethod
    def of_body(cls, body: dict[str, object]) -> ChatTurn:
        """A finished chat completion's first choice."""
        choices = body["choices"]
        assert isinstance(choices, list) and choices, "a chat completion has a choice"
        choice = choices[0]
        message = choice["message"]
        turn = cls(text=message.get("content") or "")
        for call in message.get("tool_calls") or []:
            turn.calls.append(CallState(call["id"], call["function"]["name"], call["function"]["arguments"]))
        turn.finish_reason, turn.stop_reason = choice["finish_reason"], choice.get("stop_reason")
        usage = body.get("usage")
        if isinstance(usage, dict):
            turn.usage = usage_of(usage)
        return turn

    def as_chat_message(self) -> dict[str, object]:
        """This answer as an assistant message of a chat conversation (what a next turn sends)."""
        message: dict[str, object] = {"role": "assistant", "content": self.text or None}
        if self.calls:
            message["tool_calls"] = [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls
            ]
        elif not self.text:
            message["content"] = " "  # a chat message needs content: an empty answer is a blank one
        return message


class ClosingStream:
    """The events another protocol writes (`events`, a generator reading the chat stream
    `source`). Closing it closes `source` too, also when `events` never started (an async
    generator closed before its first step never runs its `finally`): the request is aborted
    and its tenant slot given back."""

    def __init__(self, events: AsyncGenerator[str, None], source: AsyncIterator[str]) -> None:
        self.events, self.source = events, source

    def __aiter__(self) -> ClosingStream:
        return self

    async def __anext__(self) -> str:
        return await self.events.__anext__()

    async def aclose(self) -> None:
        try:
            await self.events.aclose()
        finally:
            aclose = getattr(self.source, "aclose", None)
            if aclose is not None:
                await aclose()
