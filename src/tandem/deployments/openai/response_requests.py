"""The request body of `POST /v1/responses` (OpenAI's Responses API), validated.

Accepted: `input` as a string or items (messages with text parts, `function_call` and
`function_call_output` items, as a client sends back a previous turn), `instructions`, function
tools and `tool_choice`, `text.format` (text, json_object, json_schema), `max_output_tokens`,
the sampling fields, `stream`, `store`, `previous_response_id`, `metadata`. Fields this server
does not implement (built-in tools, `reasoning`, `background`, `conversation`, prompt
templates, images and files) are a 400 naming them, never ignored. Items a client echoes back
carry fields this server has no use for (`id`, `status`, `annotations`, `logprobs`): those are
accepted and dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.deployments.openai.requests import (
    MAX_INT32,
    MAX_SEED,
    MIN_SEED,
    FieldRuleError,
    Name,
    NonEmptyText,
    Text,
)

# Fields of OpenAI's Responses API this server does not implement: a 400 naming the field when
# a request sets them (to anything but their "off" value).
UNSUPPORTED_RESPONSE_FIELDS = (
    "background",
    "conversation",
    "prompt",
    "reasoning",
    "max_tool_calls",
    "context_management",
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class _Echoed(BaseModel):
    """An item a client may send back as the server gave it: fields beyond the model's are
    dropped (`id`, `status`, `annotations`, `logprobs`, ...)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class InputText(_Echoed):
    type: Literal["input_text", "output_text", "text"]
    text: Text


class InputMessage(_Echoed):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: NonEmptyText | Annotated[list[InputText], Field(min_length=1)]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Echoed):
    type: Literal["function_call"]
    call_id: NonEmptyText
    name: Name
    arguments: Text


class FunctionCallOutputItem(_Echoed):
    type: Literal["function_call_output"]
    call_id: NonEmptyText
    output: Text | Annotated[list[InputText], Field(min_length=1)]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Name
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: Name


class TextFormatText(_Strict):
    type: Literal["text"]


class TextFormatJSONObject(_Strict):
    type: Literal["json_object"]


class TextFormatJSONSchema(_Strict):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True, populate_by_name=True)

    type: Literal["json_schema"]
    name: Name
    description: Text | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormatText | TextFormatJSONObject | TextFormatJSONSchema | None = None
    verbosity: Literal["medium"] | None = None  # only the default: no verbosity control


class ResponsesRequest(_Strict):
    model: Text
    input: NonEmptyText | Annotated[list[InputItem], Field(min_length=1)]
    instructions: Text | None = None
    previous_response_id: NonEmptyText | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)  # vLLM-style extension
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)  # Tandem extension, as on chat
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[Text, Text] | None = None
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    service_tier: Text | None = None
    truncation: Literal["disabled"] | None = None  # "auto" would drop turns: not implemented
    include: list[Text] | None = None  # nothing extra to include: any entry is refused
    stream_options: dict[str, Any] | None = None
    # Fields refused by name when set (UNSUPPORTED_RESPONSE_FIELDS); typed loosely so the refusal,
    # not a type error, is what the client reads.
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    max_tool_calls: Any = None
    context_management: Any = None

    @model_validator(mode="before")
    @classmethod
    def _built_in_tools(cls, data: object) -> object:
        """A tool of another type than `function` (web_search, file_search, mcp, ...) is refused
        naming it, before the union's type error would."""
        tools = data.get("tools") if isinstance(data, dict) else None
        for position, tool in enumerate(tools if isinstance(tools, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise FieldRuleError(
                    f"tools.{position}: the built-in tool {kind!r} is not supported by this server; "
                    "only function tools are",
                    param=f"tools.{position}.type",
                    code="unsupported_parameter",
                )
        return data

    @model_validator(mode="after")
    def _rules(self) -> ResponsesRequest:
        for name in UNSUPPORTED_RESPONSE_FIELDS:
            value = getattr(self, name)
            if value is not None and not (name == "reasoning" and value == {}):
                raise FieldRuleError(
                    f"'{name}' is not supported by this server", param=name, code="unsupported_parameter"
                )
        if self.include:
            raise FieldRuleError(
                f"include: {self.include[0]!r} is not supported by this server (nothing extra to include)",
                param="include",
                code="unsupported_parameter",
            )
        names = [tool.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise FieldRuleError("tool names must be unique", param="tools")
        if isinstance(self.tool_choice, FunctionToolChoice) and self.tool_choice.name not in names:
            raise FieldRuleError(
                f"tool_choice names the function {self.tool_choice.name!r}, which is not in tools",
                param="tool_choice",
            )
        if not self.tools and self.tool_choice not in (None, "none", "auto"):
            raise FieldRuleError("tool_choice is only allowed when tools are specified", param="tool_choice")
        return self

    def input_items(self) -> list[InputItem]:
        """`input` as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [InputMessage(role="user", content=self.input)]
        return list(self.input)
