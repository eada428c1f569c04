"""Request bodies of Anthropic's Messages API: `POST /v1/messages` and
`POST /v1/messages/count_tokens`, validated, and their chat conversation.

Accepted: `system` (text or text blocks), messages with text, `tool_use` and `tool_result`
blocks, client tools (`input_schema`) and `tool_choice`, `stop_sequences`, `max_tokens`,
`temperature`, `top_p`, `top_k`, `stream`, `metadata`. Images, documents, server tools and
extended thinking are a 400 naming the field. Fields a client may send on blocks that change
nothing here (`cache_control`, `citations`) are accepted and dropped.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.deployments.openai.requests import (
    MAX_INT32,
    MAX_STOP_STRINGS,
    FieldRuleError,
    Name,
    NonEmptyText,
    StopText,
    Text,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class TextBlock(_Block):
    type: Literal["text"]
    text: Text


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: NonEmptyText
    name: Name
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: NonEmptyText
    content: Text | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            text = self.content or ""
        else:
            text = "".join(block.text for block in self.content)
        return f"Error: {text}" if self.is_error else text


Block = TextBlock | ToolUseBlock | ToolResultBlock
_BLOCK_TYPES = {"text", "tool_use", "tool_result"}


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: NonEmptyText | Annotated[list[Block], Field(min_length=1)]

    def blocks(self) -> list[Block]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class Tool(_Block):
    type: Literal["custom"] | None = None
    name: Name
    description: Text | None = None
    input_schema: dict[str, Any]


class JSONOutputFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: JSONOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # refused when set


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Name | None = None
    disable_parallel_tool_use: bool | None = None


def _refuse_unsupported_blocks(data: object) -> object:
    """Images, documents and server tools are refused naming the block, before a union's type
    error would."""
    if not isinstance(data, dict):
        return data
    messages, tools = data.get("messages"), data.get("tools")  # other shapes: the schema's own error
    for position, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for index, block in enumerate(content if isinstance(content, list) else []):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in _BLOCK_TYPES:
                raise FieldRuleError(
                    f"{kind!r} blocks are not supported by this server (text, tool_use and tool_result are)",
                    param=f"messages.{position}.content.{index}.type",
                    code="unsupported_parameter",
                )
    for position, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise FieldRuleError(
                f"the server tool {kind!r} is not supported by this server (client tools are)",
                param=f"tools.{position}.type",
                code="unsupported_parameter",
            )
    return data


class CountTokensRequest(_Strict):
    model: Text
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Text | Annotated[list[TextBlock], Field(min_length=1)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None  # only {"type": "disabled"}
    output_config: OutputConfig | None = None  # `format`: the answer is JSON of that schema
    # Accepted, changing nothing here: prompt caching is automatic (the prefix cache), and there
    # is one speed, one region, one workspace.
    cache_control: dict[str, Any] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: Text | None = None
    user_profile_id: Text | None = None
    workspace_id: Text | None = None
    diagnostics: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _supported_blocks(cls, data: object) -> object:
        return _refuse_unsupported_blocks(data)

    @model_validator(mode="after")
    def _rules(self) -> CountTokensRequest:
        if self.output_config is not None and self.output_config.effort is not None:
            raise FieldRuleError(
                "output_config.effort is not supported by this server",
                param="output_config.effort",
                code="unsupported_parameter",
            )
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            raise FieldRuleError(
                "thinking is not supported by this server", param="thinking", code="unsupported_parameter"
            )
        names = [tool.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise FieldRuleError("tool names must be unique", param="tools")
        if (
            self.tool_choice is not None
            and self.tool_choice.type == "tool"
            and self.tool_choice.name not in names
        ):
            raise FieldRuleError(
                f"tool_choice names {self.tool_choice.name!r}, which is not in tools",
                param="tool_choice.name",
            )
        if self.tool_choice is not None and self.tool_choice.type in ("any", "tool") and not self.tools:
            raise FieldRuleError("tool_choice needs tools", param="tool_choice")
        return self

    def chat_body(self) -> dict[str, object]:
        """This request as a chat completion's body (no sampling fields)."""
        messages: list[dict[str, object]] = []
        if self.system is not None:
            text = self.system if isinstance(self.system, str) else "\n\n".join(b.text for b in self.system)
            messages.append({"role": "system", "content": text or " "})
        for message in self.messages:
            messages += _chat_messages(message)
        body: dict[str, object] = {"model": self.model, "messages": messages}
        output_format = self.output_config.format if self.output_config is not None else None
        if output_format is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": output_format.json_schema},
            }
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
                }
                for t in self.tools
            ]
            choice = self.tool_choice
            if choice is not None:
                kinds = {"auto": "auto", "any": "required", "none": "none"}
                body["tool_choice"] = kinds.get(choice.type) or {
                    "type": "function",
                    "function": {"name": choice.name},
                }
                if choice.disable_parallel_tool_use is not None:
                    body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        return body


def _chat_messages(message: Message) -> list[dict[str, object]]:
    """One Anthropic turn as chat messages: a user turn's tool results as tool messages (then its
    text), an assistant turn's `tool_use` blocks as tool calls."""
    blocks = message.blocks()
    text = "".join(block.text for block in blocks if isinstance(block, TextBlock))
    if message.role == "assistant":
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
            for b in blocks
            if isinstance(b, ToolUseBlock)
        ]
        turn: dict[str, object] = {"role": "assistant", "content": text or (None if calls else " ")}
        return [{**turn, "tool_calls": calls}] if calls else [turn]
    results: list[dict[str, object]] = [
        {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text() or " "}
        for b in blocks
        if isinstance(b, ToolResultBlock)
    ]
    return [*results, {"role": "user", "content": text}] if text or not results else results


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=MAX_INT32)
    stop_sequences: Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=MAX_INT32)
    metadata: dict[str, Any] | None = None  # user_id: accepted, not used
    service_tier: Literal["auto", "standard_only"] | None = None

    def chat_body(self) -> dict[str, object]:
        body = super().chat_body()
        body |= {"max_tokens": self.max_tokens, "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        optional = {
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }
        body |= {name: value for name, value in optional.items() if value is not None}
        return body
