"""OpenAI request/response models for /v1/chat/completions, /v1/completions and /v1/models.

Requests reject unknown fields (extra="forbid"), and OpenAI fields the engine does not implement
are listed in `UNSUPPORTED_FIELDS` so the API answers 400 naming the field instead of silently
ignoring it. vLLM-style extensions (`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`) are accepted.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from tandem.platform.errors import InvalidRequestError, TandemError

UNSUPPORTED_FIELDS = {
    "logit_bias",
    "functions",  # deprecated by OpenAI for `tools`
    "function_call",  # deprecated by OpenAI for `tool_choice`
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


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape: the body of an error response, or an error event in a stream."""
    return ErrorResponse(
        error=ErrorInfo(message=message, type=error_type, param=param, code=code)
    ).model_dump()


def validation_error_body(errors: Sequence[Any]) -> dict[str, Any]:
    """An `invalid_request_error` naming the first field pydantic refused (`messages.0.content`)."""
    if not errors:
        return error_body("invalid request", "invalid_request_error")
    # A union field reports one error per member: take the member that got furthest in.
    field = errors[0].get("loc", ())[:1]
    first = max((e for e in errors if e.get("loc", ())[:1] == field), key=lambda e: len(e.get("loc", ())))
    param = _escape_surrogates(".".join(str(p) for p in first.get("loc", ()) if _is_field(p))) or None
    message = str(first.get("msg", "invalid value"))
    return error_body(f"{param}: {message}" if param else message, "invalid_request_error", param, None)


def _escape_surrogates(text: str) -> str:
    """`text` with lone surrogates written as `\\udXXX` (a dict key can carry one into an error)."""
    return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_field(part: Any) -> bool:
    """A location part that names a field or an index, not a union member's type tag
    (`function-after[...]`, `list[int]`, `TextContentPart`) or FastAPI's `body`."""
    if isinstance(part, int):
        return True
    text = str(part)
    return not (text == "body" or text in _TYPE_TAGS or "[" in text or text[:1].isupper())


def tandem_error_body(exc: TandemError, request_id: str) -> dict[str, Any]:
    """`exc` in OpenAI's shape; a 5xx also names `request_id` (the id its traceback is logged under)."""
    message = exc.message
    if exc.status_code >= 500 and request_id not in message:
        message = f"{message} (request id {request_id})"
    return error_body(message, exc.error_type, exc.param, exc.code)


def internal_error_body(request_id: str) -> dict[str, Any]:
    """The body for a failure with no `TandemError` behind it: nothing internal, only the request
    id under which the traceback was logged."""
    return error_body(
        f"The server had an error while processing your request (request id {request_id}); "
        "retry it, and report the request id if the error persists",
        "server_error",
        None,
        "internal_error",
    )


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# The engine's integer limits (tandem.engine.sampling_params; platform imports no engine code).
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1
MAX_INT32 = (1 << 31) - 1


def _unicode_text(value: str) -> str:
    """JSON may escape half of a UTF-16 surrogate pair (`"\\ud83d"`) alone: no character, and
    nothing downstream (tokenizer, logs, storage) can encode it."""
    if _LONE_SURROGATE.search(value):
        raise ValueError(
            "the text holds a lone UTF-16 surrogate (half of an escaped emoji?): send valid Unicode"
        )
    return value


def require_unicode(value: str, param: str) -> str:
    """`value`, or a 400 naming `param` when it is not valid Unicode (for fields read by hand)."""
    try:
        return _unicode_text(value)
    except ValueError as exc:
        raise InvalidRequestError(f"{param}: {exc}", param=param) from exc


# Every string a request carries is checked to be valid Unicode (NUL is valid text).
Text = Annotated[str, AfterValidator(_unicode_text)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_unicode_text)]
# Integers that reach tensors or counters stay within a signed 32-bit int.
Int32 = Annotated[int, Field(ge=0, le=MAX_INT32)]
# Stop strings: each one is searched for in the text at every step (OpenAI allows 4).
MAX_STOP_STRINGS, MAX_STOP_LENGTH = 16, 1000
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH), AfterValidator(_unicode_text)]


class _Request(BaseModel):
    """Base of request bodies: unknown fields, NaN and infinities are refused, and values are
    taken only as the type they are (strict: `"yes"` is no boolean and `"5"` no integer, where
    lax parsing would coerce them; an integer is still a number)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class TextContentPart(_Request):
    type: Literal["text"]
    text: Text


# OpenAI's rule for function and schema names.
Name = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionCall(_Request):
    name: Name
    arguments: Text  # JSON text, as the model wrote it


class ToolCall(_Request):
    id: NonEmptyText
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: NonEmptyText | Annotated[list[TextContentPart], Field(min_length=1)] | None = None
    name: Text | None = None
    tool_calls: Annotated[list[ToolCall], Field(min_length=1)] | None = None  # assistant turns
    tool_call_id: NonEmptyText | None = None  # tool turns: the call this result answers

    @model_validator(mode="after")
    def _content_rules(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (an assistant message may give tool_calls instead)")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class JSONSchemaSpec(_Request):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True, populate_by_name=True)

    name: Name
    description: Text | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class TextFormat(_Request):
    type: Literal["text"]


class JSONObjectFormat(_Request):
    type: Literal["json_object"]


class JSONSchemaFormat(_Request):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


_FORMAT_TAGS = {"text": "TextFormat", "json_object": "JSONObjectFormat", "json_schema": "JSONSchemaFormat"}


def _format_tag(value: Any) -> str | None:
    """The member of `ResponseFormat` that `value` is, by its `type`. The tags are class names,
    which error locations leave out (`_is_field`): a bad schema name is
    `response_format.json_schema.name`, not `response_format.json_schema.json_schema.name`."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _FORMAT_TAGS.get(kind) if isinstance(kind, str) else None


ResponseFormat = Annotated[
    Annotated[TextFormat, Tag("TextFormat")]
    | Annotated[JSONObjectFormat, Tag("JSONObjectFormat")]
    | Annotated[JSONSchemaFormat, Tag("JSONSchemaFormat")],
    Discriminator(_format_tag),
]


class FunctionDefinition(_Request):
    name: Name
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; None: no arguments
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: Name


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class _SamplingRequest(_Request):
    model: Text
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)  # choices, computed from one prompt (OpenAI's limit: 128)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    metadata: dict[Text, Text] | None = None
    store: bool | None = None
    service_tier: Text | None = None
    # vLLM-style extensions
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    stop_token_ids: list[Int32] | None = None
    # Tandem extension: false turns speculative decoding off for this request (when the server has it on)
    speculative: bool = True
    # Tandem extension: compress this request's KV cache by per-head eviction at this rate (the
    # server needs a KV compression pool: `enable_kv_compression` / `kv_compression_rate`)
    kv_compression_rate: float | None = Field(None, ge=1.0, le=1024.0)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: Annotated[list[ToolDefinition], Field(min_length=1, max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tool_rules(self) -> ChatCompletionRequest:
        """OpenAI's: tool_choice and parallel_tool_calls need tools; a named tool must be one of them."""
        if self.tools is None:
            if self.tool_choice is not None and self.tool_choice != "none":
                raise _param_error("tool_choice", "tool_choice is only allowed when tools are specified")
            if self.parallel_tool_calls is not None:
                raise _param_error(
                    "parallel_tool_calls", "parallel_tool_calls is only allowed when tools are specified"
                )
            return self
        names = [tool.function.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise _param_error("tools", "tool function names must be unique")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise _param_error(
                "tool_choice",
                f"tool_choice names the function {self.tool_choice.function.name!r}, which is not in tools",
            )
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        if forced and self.response_format is not None and self.response_format.type != "text":
            raise _param_error(
                "response_format",
                "response_format cannot constrain the text when tool_choice forces a tool call",
            )
        return self


class CompletionRequest(_SamplingRequest):
    prompt: NonEmptyText | Annotated[list[Int32], Field(min_length=1)]
    logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None  # as vLLM accepts it on completions


class FieldRuleError(TandemError):
    """A rule between fields broken (HTTP 400 `invalid_request_error` naming `param`). Not a
    ValueError, so pydantic lets it out of a model validator as it is, and the 400 names the field
    instead of the model."""

    status_code = 400
    error_type = "invalid_request_error"


def _param_error(param: str, message: str) -> FieldRuleError:
    return FieldRuleError(message, param=param)


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
    logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One choice of a chat completion; `text` is the message content (None with tool calls and
    no text before them)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_completion(
    *, request_id: str, model: str, choices: list[dict[str, Any]], usage: Usage
) -> dict[str, Any]:
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
    delta: dict[str, Any],
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
    usage: Usage | None = None,
    no_choices: bool = False,
    index: int = 0,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": []
        if no_choices
        else [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
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
    index: int = 0,
) -> dict[str, Any]:
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


def reject_unsupported(body: dict[str, Any]) -> None:
    for name in UNSUPPORTED_FIELDS:
        if body.get(name) is not None:
            raise InvalidRequestError(
                f"'{name}' is not supported by this server", param=name, code="unsupported_parameter"
            )
