"""OpenAI's structured outputs and tool calls, mapped onto the engine's output constraints.

`response_format` becomes a `StructuredOutput`: `json_object` any JSON object, `json_schema` that
schema (`strict` or not: the constraint is always enforced; a schema the grammar library refuses
is a 400 naming `response_format`).

Tool calls use one text format, Hermes' (the one Qwen2.5, Hermes and SmolLM3 are trained on):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, blocks separated by a newline. The tools are described to the model in a
system message (`tool_prompt`), earlier calls and results are written into the conversation in
the same format (`chat_messages`), and the output is held to it by a grammar (`tool_constraint`):

- `tool_choice: "none"`: no constraint (a response format still applies); no calls are parsed.
- `"auto"` (the default with tools): free text (or the response format's JSON), or text followed by
  call blocks. The text is free until the model writes `<tool_call>`; from there the blocks are
  fully constrained: a name among the tools and arguments that match its parameters' schema.
- `"required"`: only call blocks, at least one.
- a named function: one block calling that function.
`parallel_tool_calls: false` allows one block. The response's `content` is the text before the
first block (None when blank), `tool_calls` the blocks, `finish_reason` `tool_calls` when there
are calls and the request was not cut short. `ToolCallStream` does the same incrementally, as
OpenAI's indexed `tool_calls` deltas.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from tandem.deployments.openai.requests import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    ToolDefinition,
)
from tandem.engine.sampling_params import JSON_GRAMMAR_OPTIONS, StructuredOutput
from tandem.engine.structured.schema_check import finite_value_problem
from tandem.platform.errors import InvalidRequestError

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
# A call block is CALL_OPEN "\n" CALL_PREFIX<name>CALL_ARGS<arguments>"}" "\n" CALL_CLOSE.
CALL_PREFIX = '{"name": "'
CALL_ARGS = '", "arguments": '
CALL_END = "}\n" + CALL_CLOSE
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def response_format_constraint(req: ChatCompletionRequest | CompletionRequest) -> StructuredOutput | None:
    """The constraint of `req.response_format` alone (None for none or `text`)."""
    schema = _response_schema(req)
    return (
        None
        if schema is None
        else StructuredOutput("json_schema", json.dumps(schema), param="response_format")
    )


def _response_schema(req: ChatCompletionRequest | CompletionRequest) -> dict[str, object] | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return dict(ANY_OBJECT)
    schema = fmt.json_schema.json_schema
    return dict(ANY_OBJECT) if schema is None else schema


def tool_mode(req: ChatCompletionRequest) -> str | None:
    """ "auto", "required", "named" or None (no tools, or `tool_choice: "none"`)."""
    if not req.tools or req.tool_choice == "none":
        return None
    if isinstance(req.tool_choice, NamedToolChoice):
        return "named"
    return req.tool_choice or "auto"


def request_constraint(req: ChatCompletionRequest) -> StructuredOutput | None:
    """The output constraint of a chat request: its tools' grammar, else its response format."""
    mode = tool_mode(req)
    if mode is None:
        return response_format_constraint(req)
    assert req.tools is not None
    tools = req.tools
    for position, tool in enumerate(tools):
        problem = finite_value_problem(tool.function.parameters or {})
        if problem is not None:
            param = f"tools.{position}.function.parameters"
            raise InvalidRequestError(f"{param} ({tool.function.name}): {problem}", param=param)
    if isinstance(req.tool_choice, NamedToolChoice):
        name = req.tool_choice.function.name
        tools = [tool for tool in tools if tool.function.name == name]
    repeat = "" if req.parallel_tool_calls is False or mode == "named" else f" ({json.dumps(chr(10))} call)*"
    lines = [
        "%llguidance {}",
        f"call: {json.dumps(CALL_OPEN)} body",
        f"body: {json.dumps(chr(10))} %json {json.dumps(call_schema(tools))} {json.dumps(chr(10) + CALL_CLOSE)}",
    ]
    text_schema = _response_schema(req) if mode == "auto" else None
    if mode != "auto":
        lines.append(f"start: call{repeat}")
    elif text_schema is None:  # free text, or text then calls: the text ends where CALL_OPEN is written
        lines.append(f"start: TEXT | prefix body{repeat}")
        lines.append(r"TEXT: /(.|\n)*/")
        lines.append(f"prefix[lazy]: TEXT {json.dumps(CALL_OPEN)}")
    else:  # the response format's JSON, or calls
        problem = finite_value_problem(text_schema)
        if problem is not None:
            raise InvalidRequestError(f"response_format: {problem}", param="response_format")
        lines.append(f"start: answer | call{repeat}")
        lines.append(f"answer: %json {json.dumps({**text_schema, 'x-guidance': JSON_GRAMMAR_OPTIONS})}")
    return StructuredOutput("lark", "\n".join(lines), param="tools")


def call_schema(tools: list[ToolDefinition]) -> dict[str, object]:
    """One call's JSON: the name of one of `tools` and arguments matching its parameters."""
    options = []
    for tool in tools:
        parameters = tool.function.parameters
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool.function.name},
                    "arguments": parameters if parameters else dict(ANY_OBJECT),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_GRAMMAR_OPTIONS}


def tool_prompt(tools: list[ToolDefinition]) -> str:
    """The system text that tells the model its tools and the call format."""
    described = "\n".join(
        json.dumps(
            {
                "name": tool.function.name,
                "description": tool.function.description or "",
                "parameters": tool.function.parameters or ANY_OBJECT,
            },
            ensure_ascii=False,
        )
        for tool in tools
    )
    return (
        "You can call functions. These are the functions available, one JSON object each:\n"
        f"{described}\n"
        "To call a function, answer with a JSON object holding its name and arguments inside "
        f"{CALL_OPEN}{CALL_CLOSE} tags:\n"
        f'{CALL_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{CALL_CLOSE}'
    )


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, object]]:
    """The conversation for the chat template: plain role/content messages, with earlier tool
    calls and results written in the call format and the tools described in a system message
    (merged into the first system message when there is one)."""
    messages = [_plain(message) for message in req.messages]
    if req.tools:
        prompt = tool_prompt(req.tools)
        if messages and messages[0]["role"] in ("system", "developer"):
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages


def _plain(message: ChatMessage) -> dict[str, object]:
    if message.role == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{message.text()}\n</tool_response>"}
    if message.tool_calls:
        blocks = [
            f"{CALL_OPEN}\n{CALL_PREFIX}{call.function.name}{CALL_ARGS}{call.function.arguments}{CALL_END}"
            for call in message.tool_calls
        ]
        text = message.text()
        return {"role": "assistant", "content": "\n".join([text, *blocks] if text else blocks)}
    return {"role": message.role, "content": message.text()}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    name: str
    arguments: str  # the model's JSON text

    def as_openai(self, call_id: str) -> dict[str, object]:
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def parse_tool_calls(text: str, *, cut: bool = False) -> tuple[str | None, list[ParsedCall]]:
    """The content before the first call block (None when blank) and the complete blocks. Text
    with no complete block (no call) is all content. With `cut` (generation stopped by
    max_tokens), a call block cut short is a call too, with the arguments text written so far (a
    block cut before its name ends is left out), and the start of a call marker is not content:
    tool-call markup is never returned as text."""
    start = text.find(CALL_OPEN)
    if start < 0:
        if cut:
            text = text[: len(text) - _partial_suffix(text, CALL_OPEN)]
        return text, []
    calls: list[ParsedCall] = []
    position = start
    while True:
        call, end = _parse_block(text, position)
        if call is None:
            break
        calls.append(call)
        position = text.find(CALL_OPEN, end)
        if position < 0:
            break
    if cut and position >= 0:
        partial = _cut_call(text[position:])
        if partial is not None:
            calls.append(partial)
    if not calls and not cut:
        return text, []
    content = text[:start]
    return (content if content.strip() else None), calls


def _cut_call(block: str) -> ParsedCall | None:
    """A call block cut short: its name and the arguments text so far; None before the name
    ends. A cut closing marker's first character (the `}` that ends the call object) is left out
    of the arguments when the arguments are whole JSON without it."""
    head = f"{CALL_OPEN}\n{CALL_PREFIX}"
    if not block.startswith(head):
        return None
    name_end = block.find(CALL_ARGS, len(head))
    if name_end < 0:
        return None
    return ParsedCall(block[len(head) : name_end], _cut_arguments(block[name_end + len(CALL_ARGS) :]))


def _cut_arguments(arguments: str) -> str:
    """Arguments text cut short, without the start of the closing marker when it is there."""
    end = arguments.find(CALL_END)
    if end >= 0:
        return arguments[:end]
    keep = _partial_suffix(arguments, CALL_END)
    if keep and _is_json(arguments[:-keep]):
        return arguments[:-keep]
    return arguments


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _parse_block(text: str, position: int) -> tuple[ParsedCall | None, int]:
    head = f"{CALL_OPEN}\n{CALL_PREFIX}"
    if not text.startswith(head, position):
        return None, position
    name_start = position + len(head)
    name_end = text.find(CALL_ARGS, name_start)
    close = text.find(CALL_END, name_end)
    if name_end < 0 or close < 0:
        return None, position
    arguments = text[name_end + len(CALL_ARGS) : close]
    try:
        json.loads(arguments)
    except json.JSONDecodeError:
        return None, position
    return ParsedCall(text[name_start:name_end], arguments), close + len(CALL_END)


@dataclass
class ToolCallStream:
    """Turns streamed text into OpenAI chat deltas: `content` for text before the first call,
    then per call one delta with its index, id, type and name (and empty arguments), then its
    arguments in pieces. Text that could still turn into a call marker is held back until the
    next piece decides it."""

    buffer: str = ""
    state: str = "text"  # "text" | "head" (in a block, before its arguments) | "args" | "between"
    num_calls: int = 0
    call_ids: list[str] = field(default_factory=list)
    arguments: str = ""  # the current call's arguments sent so far

    def feed(self, text: str, *, final: bool = False, cut: bool = False) -> list[dict[str, object]]:
        """The deltas for `text` (plus anything held back, when `final`). With `cut` (the last
        piece of a generation stopped by max_tokens): a call cut short keeps the arguments sent
        so far (and the last held-back piece, unless it starts the closing marker), and a cut
        call marker is dropped, never sent as content (as `parse_tool_calls(cut=True)`)."""
        self.buffer += text
        deltas: list[dict[str, Any]] = []
        while True:
            progressed = self._step(deltas, final and not cut)
            if not progressed:
                break
        if final and cut:
            self._cut(deltas)
        return deltas

    def _cut(self, deltas: list[dict[str, object]]) -> None:
        """Settle what `_step` held back at a cut: arguments of the open call, not markup."""
        if self.state == "args" and self.buffer:
            whole = _cut_arguments(self.arguments + self.buffer)
            rest = whole[len(self.arguments) :]
            if rest:
                deltas.append({"tool_calls": [{"index": self.num_calls, "function": {"arguments": rest}}]})
        self.buffer = ""

    def _step(self, deltas: list[dict[str, object]], final: bool) -> bool:
        if self.state in ("text", "between"):
            index = self.buffer.find(CALL_OPEN)
            if index >= 0:
                if self.state == "text" and index:
                    deltas.append({"content": self.buffer[:index]})
                self.buffer = self.buffer[index:]
                self.state = "head"
                return True
            keep = 0 if final else _partial_suffix(self.buffer, CALL_OPEN)
            emit = self.buffer[: len(self.buffer) - keep]
            if emit and self.state == "text":
                deltas.append({"content": emit})
            self.buffer = self.buffer[len(emit) :]
            return False
        if self.state == "head":
            head = f"{CALL_OPEN}\n{CALL_PREFIX}"
            name_end = self.buffer.find(CALL_ARGS, len(head))
            if name_end < 0:
                return False
            call_id = new_call_id()
            self.call_ids.append(call_id)
            name = self.buffer[len(head) : name_end]
            deltas.append(
                {
                    "tool_calls": [
                        {
                            "index": self.num_calls,
                            "id": call_id,
                            "type": "function",
                            "function": {"name": name, "arguments": ""},
                        }
                    ]
                }
            )
            self.buffer = self.buffer[name_end + len(CALL_ARGS) :]
            self.state = "args"
            self.arguments = ""
            return True
        # "args": everything up to CALL_END is arguments
        close = self.buffer.find(CALL_END)
        end = (
            close
            if close >= 0
            else len(self.buffer) - (0 if final else _partial_suffix(self.buffer, CALL_END))
        )
        if end > 0:
            self.arguments += self.buffer[:end]
            deltas.append(
                {"tool_calls": [{"index": self.num_calls, "function": {"arguments": self.buffer[:end]}}]}
            )
        self.buffer = self.buffer[end:]
        if close < 0:
            return False
        self.buffer = self.buffer[len(CALL_END) :]
        self.num_calls += 1
        self.state = "between"
        return True


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
