"""OpenAI request models for /v1/chat/completions and /v1/completions.

Requests reject unknown fields (extra="forbid"), and OpenAI fields the engine does not implement
are listed in `UNSUPPORTED_FIELDS` so the API answers 400 naming the field instead of silently
ignoring it. vLLM-style extensions (`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`) are accepted.
"""

from __future__ import annotations

import re
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


def reject_unsupported(body: dict[str, object]) -> None:
    for name in UNSUPPORTED_FIELDS:
        if body.get(name) is not None:
            raise InvalidRequestError(
                f"'{name}' is not supported by this server", param=name, code="unsupported_parameter"
            )


# OpenAI's limit: 2048 inputs per embeddings request.
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingsRequest(_Request):
    """`POST /v1/embeddings`: one text, several, one token array or several."""

    model: Text
    input: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
        | Annotated[list[Int32], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[Int32], Field(min_length=1)]],
            Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS),
        ]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=MAX_INT32)
    user: Text | None = None

    def inputs(self) -> list[str | list[int]]:
        """Each input: a text or a token array."""
        given = self.input
        if isinstance(given, str):
            return [given]
        if all(isinstance(x, int) for x in given):
            return [[x for x in given if isinstance(x, int)]]
        return [x for x in given if isinstance(x, str | list)]
