"""`/v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API over the chat path.

A request becomes a chat completion (`MessagesRequest.chat_body`) run by `OpenAIServer.chat`, so
tenant limits, metering, drain, cancellation and tool calls are chat's; its answer is written
back as a message: a JSON body, or Anthropic's stream events (`message_start`,
`content_block_start` / `_delta` / `_stop`, `message_delta`, `message_stop`; an error after the
stream started is an `error` event).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING

from pydantic import ValidationError

from tandem.deployments.anthropic.errors import anthropic_error
from tandem.deployments.anthropic.requests import CountTokensRequest, MessagesRequest
from tandem.deployments.openai.chat_events import (
    CallArguments,
    CallStart,
    ChatEvent,
    ChatTurn,
    ClosingStream,
    StreamFailedError,
    TextDelta,
    chat_events,
)
from tandem.deployments.openai.mapping import ResponseTiming
from tandem.deployments.openai.requests import ChatCompletionRequest
from tandem.engine.request import Priority
from tandem.platform.errors import InvalidRequestError

if TYPE_CHECKING:
    from tandem.deployments.openai.server import OpenAIServer


def _chat_request(body: dict[str, object]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        path = ".".join(str(part) for part in error.get("loc", ()))
        raise InvalidRequestError(f"messages: {error.get('msg')} (at {path})", param="messages") from exc


def stop_reason(turn: ChatTurn, stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` for a finished answer."""
    if turn.calls and turn.finish_reason in ("stop", "tool_calls"):
        return "tool_use", None
    if turn.finish_reason == "length":
        return "max_tokens", None
    if isinstance(turn.stop_reason, str) and turn.stop_reason in (stop_sequences or []):
        return "stop_sequence", turn.stop_reason
    return "end_turn", None


def _usage(turn: ChatTurn) -> dict[str, object]:
    usage = turn.usage
    input_tokens, output_tokens, cached = (
        (0, 0, 0) if usage is None else (usage.input_tokens, usage.output_tokens, usage.cached_tokens)
    )
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _tool_input(arguments: str) -> dict[str, object]:
    """A call's arguments as the `input` object (the tool grammar writes a JSON object)."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesAPI:
    """The Messages API over `server`'s chat path."""

    def __init__(self, server: OpenAIServer) -> None:
        self.server = server

    async def count_tokens(
        self,
        req: CountTokensRequest,
        tenant: str,
        priority: Priority = Priority.INTERACTIVE,
        *,
        timing: ResponseTiming | None = None,
        api_key_id: str | None = None,
    ) -> dict[str, object]:
        """`{"input_tokens": n}`: the prompt the model would read, tools and template included."""
        chat = _chat_request(CountTokensRequest.chat_body(req))
        return {"input_tokens": await self.server.count_prompt_tokens(chat, tenant)}

    async def create(
        self,
        req: MessagesRequest,
        tenant: str,
        priority: Priority = Priority.INTERACTIVE,
        *,
        timing: ResponseTiming | None = None,
        api_key_id: str | None = None,
    ) -> dict[str, object] | AsyncIterator[str]:
        """A message (JSON), or its events (`stream`)."""
        chat = _chat_request(req.chat_body())
        answer = await self.server.chat(chat, tenant, priority, timing=timing, api_key_id=api_key_id)
        message_id = f"msg_{uuid.uuid4().hex[:24]}"
        if isinstance(answer, dict):
            turn = ChatTurn.of_body(answer)
            reason, sequence = stop_reason(turn, req.stop_sequences)
            content: list[dict[str, object]] = (
                [{"type": "text", "text": turn.text}] if turn.text or not turn.calls else []
            )
            content += [
                {"type": "tool_use", "id": c.call_id, "name": c.name, "input": _tool_input(c.arguments)}
                for c in turn.calls
            ]
            return {
                **self._message(message_id, req.model, content),
                "stop_reason": reason,
                "stop_sequence": sequence,
                "usage": _usage(turn),
            }
        return ClosingStream(self._events(message_id, req, answer), answer)

    @staticmethod
    def _message(message_id: str, model: str, content: list[dict[str, object]]) -> dict[str, object]:
        return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content}

    async def _events(
        self, message_id: str, req: MessagesRequest, sse: AsyncIterator[str]
    ) -> AsyncGenerator[str, None]:
        start = {**self._message(message_id, req.model, []), "stop_reason": None, "stop_sequence": None}
        start["usage"] = {"input_tokens": 0, "output_tokens": 0}
        yield _event("message_start", message=start)
        blocks = _BlockWriter()
        turn = ChatTurn()
        try:
            async for chat_event in chat_events(sse):
                turn.add(chat_event)
                for event in blocks.on(chat_event):
                    yield event
        except StreamFailedError as exc:
            yield _event("error", **anthropic_error(500, str(exc.error.get("message"))))
            return
        for event in blocks.close():
            yield event
        reason, sequence = stop_reason(turn, req.stop_sequences)
        yield _event(
            "message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=_usage(turn)
        )
        yield _event("message_stop")


def _event(kind: str, **fields: object) -> str:
    payload = {"type": kind, **fields} if kind != "error" else fields
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _BlockWriter:
    """Content blocks of a streamed message: text opens a text block, a tool call a `tool_use`
    block whose input arrives as `input_json_delta`s."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "text" or "tool_use"

    def on(self, event: ChatEvent) -> list[str]:
        if isinstance(event, TextDelta):
            events = [] if self.open == "text" else self._start({"type": "text", "text": ""})
            return [*events, self._delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, CallStart):
            return self._start({"type": "tool_use", "id": event.call_id, "name": event.name, "input": {}})
        if isinstance(event, CallArguments):
            return [self._delta({"type": "input_json_delta", "partial_json": event.delta})]
        return []

    def _start(self, block: dict[str, object]) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = str(block["type"])
        return [*events, _event("content_block_start", index=self.index, content_block=block)]

    def _delta(self, delta: dict[str, object]) -> str:
        return _event("content_block_delta", index=self.index, delta=delta)

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.index)]
