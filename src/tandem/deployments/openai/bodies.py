"""The JSON a finished request answers with, and the chunks of one choice's update in a request
with tools: what `OpenAIServer` returns and `streaming.sse_events` sends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.deployments.openai.mapping import TokenNames, sse_event, usage
from tandem.deployments.openai.responses import chat_choice, chat_chunk, chat_completion, now, text_completion
from tandem.deployments.openai.structured_output import ToolCallStream, new_call_id, parse_tool_calls
from tandem.engine.protocol import CompletionOutput, GenerationRequest, RequestOutput


@dataclass(frozen=True)
class Answer:
    """How one request is answered: `model` is the name the client asked for (`base:adapter`
    for an adapter), `names` the token names logprobs carry, `chat` the endpoint's shape, and
    `tool_calls` whether text is parsed into tool calls (a chat request with tools)."""

    gen: GenerationRequest
    model: str
    names: TokenNames
    chat: bool
    tool_calls: bool = False

    @property
    def num_top_logprobs(self) -> int:
        return self.gen.sampling_params.logprobs or 0

    @property
    def constraint_param(self) -> str | None:
        """The request field its output constraint came from (`response_format`, `tools`)."""
        structured = self.gen.sampling_params.structured
        return structured.param if structured is not None else None


def final_body(answer: Answer, last: RequestOutput) -> dict[str, object]:
    """The JSON body of a finished request: one choice per `last.outputs` (every choice's final
    output), usage counting the prompt once."""
    gen, names = answer.gen, answer.names
    if not answer.chat:
        body = text_completion(
            request_id=gen.request_id,
            model=answer.model,
            created=now(),
            text="",
            finish_reason=None,
            usage=usage(last),
            no_choices=True,
        )
        body["choices"] = [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": names.completion_logprobs(c.token_ids, c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for c in last.outputs
        ]
        return body
    choices = []
    for completion in last.outputs:
        content: str | None = completion.text
        calls: list[dict[str, Any]] = []
        finish_reason = completion.finish_reason
        if answer.tool_calls:
            content, parsed = parse_tool_calls(completion.text, cut=finish_reason == "length")
            calls = [call.as_openai(new_call_id()) for call in parsed]
            if calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        choices.append(
            chat_choice(
                index=completion.index,
                text=content,
                finish_reason=finish_reason,
                tool_calls=calls,
                stop_reason=completion.stop_reason,
                logprobs=names.chat_logprobs(
                    completion.token_ids, completion.logprobs, answer.num_top_logprobs
                ),
            )
        )
    return chat_completion(request_id=gen.request_id, model=answer.model, choices=choices, usage=usage(last))


def tool_call_events(
    answer: Answer, completion: CompletionOutput, calls: ToolCallStream, created: int
) -> list[str]:
    """The chunks of one choice's update in a request with tools: its text as content and
    tool-call deltas (`ToolCallStream`), then, at the end, the finish reason (`tool_calls` when
    it made calls and stopped by itself). Logprobs ride on the update's first chunk."""
    finish = completion.finish_reason
    deltas = calls.feed(completion.delta_text, final=finish is not None, cut=finish == "length")
    if finish is not None:
        deltas.append({})
    logprobs = answer.names.chat_logprobs(
        completion.delta_token_ids, completion.delta_logprobs, answer.num_top_logprobs
    )
    events = []
    for position, delta in enumerate(deltas):
        last = finish is not None and position == len(deltas) - 1
        finish_reason = ("tool_calls" if calls.num_calls and finish == "stop" else finish) if last else None
        events.append(
            sse_event(
                chat_chunk(
                    request_id=answer.gen.request_id,
                    model=answer.model,
                    created=created,
                    delta=delta,
                    finish_reason=finish_reason,
                    logprobs=logprobs if position == 0 else None,
                    index=completion.index,
                    stop_reason=completion.stop_reason,
                )
            )
        )
    return events


def usage_event(answer: Answer, last: RequestOutput, created: int) -> str:
    """A stream's usage chunk (`stream_options.include_usage`): no choices, the request's usage."""
    kwargs: dict[str, Any] = {
        "request_id": answer.gen.request_id,
        "model": answer.model,
        "created": created,
        "finish_reason": None,
        "usage": usage(last),
        "no_choices": True,
    }
    if answer.chat:
        return sse_event(chat_chunk(delta={}, **kwargs))
    return sse_event(text_completion(text="", **kwargs))
