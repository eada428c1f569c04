"""OpenAI request/response models for /v1/chat/completions, /v1/completions and /v1/models.

Requests reject unknown fields (extra="forbid"), and OpenAI fields the engine does not implement
are listed in `UNSUPPORTED_FIELDS` so the API answers 400 naming the field instead of silently
ignoring it. vLLM-style extensions (`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`) are accepted.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.platform.errors import InvalidRequestError

UNSUPPORTED_FIELDS = {
    "logit_bias",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "response_format",
    "audio",
    "modalities",
    "prediction",
    "best_of",
    "echo",
    "suffix",
    "web_search_options",
    "reasoning_effort",
}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM-style extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=20)


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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def chat_completion(
    *,
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    usage: Usage,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage.model_dump(),
    }


def chat_chunk(
    *,
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
    usage: Usage | None = None,
    no_choices: bool = False,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": []
        if no_choices
        else [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
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
    logprobs: dict[str, Any] | None = None,
    no_choices: bool = False,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": []
        if no_choices
        else [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if usage is not None:
        body["usage"] = usage.model_dump()
    return body


def reject_unsupported(body: dict[str, Any]) -> None:
    for name in UNSUPPORTED_FIELDS:
        if body.get(name) is not None:
            raise InvalidRequestError(
                f"'{name}' is not supported by this server", param=name, code="unsupported_parameter"
            )
    if body.get("n", 1) not in (1, None):
        raise InvalidRequestError("only n=1 is supported", param="n", code="unsupported_parameter")
