"""The objects of OpenAI's Responses API: a response built from a chat answer (`ChatTurn`), its
output items, its usage, and the typed events of a streamed response (`ResponseEvents`), in the
shapes the `openai` SDK parses (`Response`, `ResponseStreamEvent`)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from tandem.deployments.openai.chat_events import (
    CallArguments,
    CallStart,
    CallState,
    ChatEvent,
    ChatTurn,
    TextDelta,
    TurnUsage,
)
from tandem.deployments.openai.response_requests import FunctionToolChoice, ResponsesRequest


def new_item_id(prefix: str) -> str:
    """`resp_...`, `msg_...`, `fc_...`: OpenAI's id shapes (a prefix and 32 hex digits)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(usage: TurnUsage | None) -> dict[str, object] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.input_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.input_tokens + usage.output_tokens,
    }


def message_item(item_id: str, text: str, status: str) -> dict[str, object]:
    content = [] if status == "in_progress" else [output_text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def output_text_part(text: str) -> dict[str, object]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call: CallState, status: str) -> dict[str, object]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call.call_id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


@dataclass
class ResponseShell:
    """The fields of a response that its request decides, and its id and creation time."""

    request: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: new_item_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    stored: bool = False

    def body(
        self,
        *,
        status: str,
        output: list[dict[str, object]],
        usage: TurnUsage | None = None,
        error: Mapping[str, object] | None = None,
    ) -> dict[str, object]:
        req = self.request
        tool_choice: object = req.tool_choice or "auto"
        if isinstance(tool_choice, FunctionToolChoice):
            tool_choice = tool_choice.model_dump()
        text_format = req.text.format if req.text is not None and req.text.format is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None
            if error is None
            else {"code": error.get("code") or "server_error", "message": error.get("message")},
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tool_choice": tool_choice,
            "tools": [tool.model_dump(exclude_none=True) for tool in req.tools or []],
            "text": {"format": text_format.model_dump(by_alias=True) if text_format else {"type": "text"}},
            "truncation": "disabled",
            "store": self.stored,
            "metadata": req.metadata or {},
            "user": req.user,
            "usage": response_usage(usage),
        }

    def finished_body(self, turn: ChatTurn, output: list[dict[str, object]]) -> dict[str, object]:
        status = "incomplete" if turn.finish_reason == "length" else "completed"
        return self.body(status=status, output=output, usage=turn.usage)


def output_items(turn: ChatTurn) -> list[dict[str, object]]:
    """A finished answer's output: its text as a message (unless it only made tool calls), then
    one `function_call` item per call."""
    status = "incomplete" if turn.finish_reason == "length" else "completed"
    items = []
    if turn.text or not turn.calls:
        items.append(message_item(new_item_id("msg"), turn.text, status))
    items += [function_call_item(new_item_id("fc"), call, status) for call in turn.calls]
    return items


class ResponseEvents:
    """The SSE events of a streamed response, from the chat events of its answer: each output
    item opened (`response.output_item.added`), its deltas, closed (`...done`), with numbered
    events; `output` holds the items closed so far."""

    def __init__(self, shell: ResponseShell) -> None:
        self.shell = shell
        self.sequence_number = 0
        self.output: list[dict[str, object]] = []
        self.open_item: dict[str, object] | None = None  # the item deltas go to
        self.text = ""
        self.call: CallState | None = None

    def event(self, kind: str, **fields: object) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def opening(self) -> list[str]:
        body = self.shell.body(status="in_progress", output=[])
        return [
            self.event("response.created", response=body),
            self.event("response.in_progress", response=body),
        ]

    def on(self, event: ChatEvent) -> list[str]:
        """The events one chat event makes: text opens a message, a call a function_call item."""
        if isinstance(event, TextDelta):
            events = (
                []
                if self.open_item is not None and self.call is None
                else self._close() + self._open_message()
            )
            self.text += event.text
            return [
                *events,
                self._at("response.output_text.delta", content_index=0, delta=event.text, logprobs=[]),
            ]
        if isinstance(event, CallStart):
            self.call = CallState(event.call_id, event.name)
            events = self._close()
            item = function_call_item(new_item_id("fc"), self.call, "in_progress")
            self.open_item = item
            return [
                *events,
                self.event("response.output_item.added", output_index=len(self.output), item=item),
            ]
        if isinstance(event, CallArguments) and self.call is not None:
            self.call.arguments += event.delta
            return [self._at("response.function_call_arguments.delta", delta=event.delta)]
        return []

    def closing(self, turn: ChatTurn) -> list[str]:
        """The events that close what is open, once the answer finished (`turn`)."""
        if self.open_item is None and not self.output:
            return self._open_message() + self._close(turn)  # an empty answer is an empty message
        return self._close(turn)

    def _at(self, kind: str, **fields: object) -> str:
        assert self.open_item is not None
        return self.event(kind, item_id=self.open_item["id"], output_index=len(self.output), **fields)

    def _open_message(self) -> list[str]:
        self.open_item, self.text, self.call = message_item(new_item_id("msg"), "", "in_progress"), "", None
        return [
            self.event("response.output_item.added", output_index=len(self.output), item=self.open_item),
            self._at("response.content_part.added", content_index=0, part=output_text_part("")),
        ]

    def _close(self, turn: ChatTurn | None = None) -> list[str]:
        item = self.open_item
        if item is None:
            return []
        status = "incomplete" if turn is not None and turn.finish_reason == "length" else "completed"
        if self.call is not None:
            done = function_call_item(str(item["id"]), self.call, status)
            events = [self._at("response.function_call_arguments.done", arguments=self.call.arguments)]
        else:
            done = message_item(str(item["id"]), self.text, status)
            events = [
                self._at("response.output_text.done", content_index=0, text=self.text, logprobs=[]),
                self._at("response.content_part.done", content_index=0, part=output_text_part(self.text)),
            ]
        events.append(self.event("response.output_item.done", output_index=len(self.output), item=done))
        self.output.append(done)
        self.open_item, self.call = None, None
        return events
