"""`/v1/responses`: OpenAI's Responses API, answered through the chat path.

A request becomes a chat conversation (its `instructions` as the system message, the stored
conversation of `previous_response_id`, its input items as messages and tool turns), runs as a
chat completion through `OpenAIServer.chat` (so tenant limits, metering, drain, cancellation,
tools and structured output are chat's), and its answer is written back as a response: a JSON
body, or the typed events of a stream. With `store` (the default) and an object store, the
response is stored for its tenant before the client sees it complete; a store that fails then
leaves the response answered with `store: false` (logged), not lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING

from pydantic import ValidationError

from tandem.deployments.openai.chat_events import ChatTurn, ClosingStream, StreamFailedError, chat_events
from tandem.deployments.openai.mapping import ResponseTiming
from tandem.deployments.openai.requests import ChatCompletionRequest
from tandem.deployments.openai.response_objects import (
    ResponseEvents,
    ResponseShell,
    new_item_id,
    output_items,
)
from tandem.deployments.openai.response_requests import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    InputItem,
    InputMessage,
    ResponsesRequest,
)
from tandem.deployments.openai.response_store import ResponseStore, StoredResponse
from tandem.engine.request import Priority
from tandem.platform.errors import InvalidRequestError, TandemError

if TYPE_CHECKING:
    from tandem.deployments.openai.server import OpenAIServer

logger = logging.getLogger("tandem.api")

# Chat's parameter names, as the Responses API calls them (errors name the client's field).
_PARAMS = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
}


def _client_param(param: str | None) -> str | None:
    if param is None:
        return None
    head = param.partition(".")[0]
    if head == "tools":
        return param.replace(".function.", ".", 1)
    return _PARAMS.get(head, param)


def input_messages(items: list[InputItem]) -> list[dict[str, object]]:
    """Input items as chat messages: a run of `function_call` items is one assistant turn with
    tool calls (joined to the assistant message before it), a `function_call_output` a tool turn."""
    messages: list[dict[str, object]] = []
    for item in items:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": item.text() or " "})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                calls = last.setdefault("tool_calls", [])
                assert isinstance(calls, list)
                calls.append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text() or " "})
    return messages


def stored_input_items(items: list[InputItem]) -> list[dict[str, object]]:
    """Input items as `/v1/responses/{id}/input_items` lists them, each with an id."""
    listed: list[dict[str, object]] = []
    for item in items:
        if isinstance(item, InputMessage):
            content = [
                {"type": "input_text" if item.role != "assistant" else "output_text", "text": item.text()}
            ]
            listed.append(
                {
                    "id": new_item_id("msg"),
                    "type": "message",
                    "role": item.role,
                    "content": content,
                    "status": "completed",
                }
            )
        elif isinstance(item, FunctionCallItem):
            listed.append({"id": new_item_id("fc"), **item.model_dump(), "status": "completed"})
        else:
            assert isinstance(item, FunctionCallOutputItem)
            listed.append(
                {"id": new_item_id("fco"), "type": item.type, "call_id": item.call_id, "output": item.text()}
            )
    return listed


def chat_request(req: ResponsesRequest, messages: list[dict[str, object]]) -> ChatCompletionRequest:
    """The chat completion that answers `req`, over the conversation `messages`."""
    body: dict[str, object] = {"model": req.model, "messages": messages, "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    fields: dict[str, object] = {
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
    }
    fields |= {
        "top_k": req.top_k,
        "seed": req.seed,
        "user": req.user,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    body |= {name: value for name, value in fields.items() if value is not None}
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in req.tools
        ]
    if isinstance(req.tool_choice, FunctionToolChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None and (req.tools or req.tool_choice == "none"):
        body["tool_choice"] = req.tool_choice
    text_format = req.text.format if req.text is not None else None
    if text_format is not None and text_format.type == "json_schema":
        schema = text_format.model_dump(
            include={"name", "description", "json_schema", "strict"}, by_alias=True, exclude_none=True
        )
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif text_format is not None:
        body["response_format"] = {"type": text_format.type}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        path = ".".join(str(part) for part in error.get("loc", ()))
        raise InvalidRequestError(
            f"input: {error.get('msg')} (at {path})", param=_client_param(path)
        ) from exc


class ResponsesAPI:
    """The Responses API over `server` (its chat path, and its `response_store`)."""

    def __init__(self, server: OpenAIServer) -> None:
        self.server = server
        self.store: ResponseStore | None = server.response_store

    def _require_store(self, param: str) -> ResponseStore:
        if self.store is None:
            raise InvalidRequestError(
                "this server keeps no responses (it runs without an object store)",
                param=param,
                code="store_disabled",
            )
        return self.store

    async def create(
        self,
        req: ResponsesRequest,
        tenant: str,
        priority: Priority = Priority.INTERACTIVE,
        *,
        timing: ResponseTiming | None = None,
        api_key_id: str | None = None,
    ) -> dict[str, object] | AsyncIterator[str]:
        """A response (JSON), or its events (`stream`)."""
        history: list[dict[str, object]] = []
        if req.previous_response_id is not None:
            store = self._require_store("previous_response_id")
            try:
                previous = await asyncio.to_thread(store.load, tenant, req.previous_response_id)
            except TandemError as exc:
                exc.param = "previous_response_id" if exc.param == "response_id" else exc.param
                raise
            history = previous.messages
        items = req.input_items()
        conversation = [*history, *input_messages(items)]
        instructions: list[dict[str, object]] = []
        if req.instructions:
            instructions.append({"role": "system", "content": req.instructions})
        chat = chat_request(req, [*instructions, *conversation])
        try:
            answer = await self.server.chat(chat, tenant, priority, timing=timing, api_key_id=api_key_id)
        except TandemError as exc:
            exc.param = _client_param(exc.param)
            raise
        shell = ResponseShell(req, model=req.model)
        record = _Record(tenant, items, conversation)
        if isinstance(answer, dict):
            turn = ChatTurn.of_body(answer)
            output = output_items(turn)
            await self._save(shell, record, turn, output)
            return shell.finished_body(turn, output)
        return ClosingStream(self._events(shell, record, answer), answer)

    async def _events(
        self, shell: ResponseShell, record: _Record, sse: AsyncIterator[str]
    ) -> AsyncGenerator[str, None]:
        writer = ResponseEvents(shell)
        for event in writer.opening():
            yield event
        turn = ChatTurn()
        try:
            async for chat_event in chat_events(sse):
                turn.add(chat_event)
                for event in writer.on(chat_event):
                    yield event
        except StreamFailedError as exc:
            body = shell.body(status="failed", output=writer.output, error=exc.error)
            yield writer.event("response.failed", response=body)
            return
        closing = writer.closing(turn)
        await self._save(shell, record, turn, writer.output)
        for event in closing:
            yield event
        body = shell.finished_body(turn, writer.output)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        yield writer.event(kind, response=body)

    async def _save(
        self, shell: ResponseShell, record: _Record, turn: ChatTurn, output: list[dict[str, object]]
    ) -> None:
        """Store the finished response for its tenant (with `store`, on a server with a store)."""
        if not shell.request.store or self.store is None:
            return
        shell.stored = True
        stored = StoredResponse(
            shell.finished_body(turn, output),
            stored_input_items(record.items),
            [*record.conversation, turn.as_chat_message()],
        )
        try:
            await asyncio.to_thread(self.store.save, record.tenant, shell.id, stored)
        except TandemError as exc:
            shell.stored = False
            logger.warning(
                "response not stored",
                extra={"tenant": record.tenant, "response_id": shell.id, "error": exc.message},
            )

    # -- the stored responses' routes ----------------------------------------------------------
    async def get(self, tenant: str, response_id: str) -> dict[str, object]:
        store = self._require_store("response_id")
        return (await asyncio.to_thread(store.load, tenant, response_id)).response

    async def delete(self, tenant: str, response_id: str) -> dict[str, object]:
        store = self._require_store("response_id")
        await asyncio.to_thread(store.delete, tenant, response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def input_items(
        self, tenant: str, response_id: str, *, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> dict[str, object]:
        """The input items of a stored response, OpenAI's list page (`order`, `limit`, `after`)."""
        store = self._require_store("response_id")
        items = (await asyncio.to_thread(store.load, tenant, response_id)).input_items
        if order == "desc":
            items = items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise InvalidRequestError(f"after: no input item {after!r} in this response", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }


class _Record:
    """What a stored response keeps of its request: the tenant, its input items, and the
    conversation it answered (without the instructions, which a next turn does not inherit)."""

    def __init__(self, tenant: str, items: list[InputItem], conversation: list[dict[str, object]]) -> None:
        self.tenant, self.items, self.conversation = tenant, items, conversation
