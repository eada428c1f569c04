"""OpenAI response bodies: chat completions and their chunks, text completions, usage, model cards."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "tandem"
    # Tandem extension on the base model: the precision it runs and why (quality verdicts
    # included) and the generation defaults that fill a request's unset sampling fields
    tandem: dict[str, Any] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def chat_choice(
    *,
    index: int,
    text: str | None,
    finish_reason: str | None,
    logprobs: dict[str, object] | None = None,
    tool_calls: list[dict[str, object]] | None = None,
    stop_reason: str | int | None = None,
) -> dict[str, object]:
    """One choice of a chat completion; `text` is the message content (None with tool calls and
    no text before them). `stop_reason` (vLLM's extension): the stop string or token id that
    ended it, null when none did."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_completion(
    *, request_id: str, model: str, choices: list[dict[str, object]], usage: Usage
) -> dict[str, object]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": usage.model_dump(),
    }


def chat_chunk(
    *,
    request_id: str,
    model: str,
    created: int,
    delta: Mapping[str, object],
    finish_reason: str | None,
    logprobs: dict[str, object] | None = None,
    usage: Usage | None = None,
    no_choices: bool = False,
    index: int = 0,
    stop_reason: str | int | None = None,
) -> dict[str, object]:
    """A chat stream's chunk; the chunk that finishes a choice also carries its `stop_reason`
    (as `chat_choice`)."""
    choice: dict[str, Any] = {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [] if no_choices else [choice],
    }
    if usage is not None:
        chunk["usage"] = usage.model_dump()
    return chunk


def text_completion(
    *,
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    usage: Usage | None,
    logprobs: dict[str, object] | None = None,
    no_choices: bool = False,
    index: int = 0,
) -> dict[str, object]:
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": []
        if no_choices
        else [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if usage is not None:
        body["usage"] = usage.model_dump()
    return body
