"""Server-sent events of a started request (`stream: true`).

`sse_events` sends a chat stream's role chunks, then each output's chunks (or, with tools,
`bodies.tool_call_events`), the usage chunk when asked, and `[DONE]`. Once the stream has
started an error is reported in-band (an error event, then `[DONE]`, like every stream's end).
Its `RequestScope` is closed whatever ends it; `Events` closes it too for a stream the client
left before its first event (an async generator closed unstarted never runs its `finally`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable

from tandem.deployments.openai.bodies import Answer, tool_call_events, usage_event
from tandem.deployments.openai.errors import internal_error_body, tandem_error_body
from tandem.deployments.openai.mapping import (
    engine_error,
    failed_choice,
    sse_event,
    stream_chunks,
    unsent_choices,
)
from tandem.deployments.openai.responses import chat_chunk, now
from tandem.deployments.openai.scope import RequestScope
from tandem.deployments.openai.structured_output import ToolCallStream
from tandem.engine.protocol import RequestOutput
from tandem.platform.errors import TandemError

logger = logging.getLogger("tandem.api")

NextOutput = Callable[[AsyncGenerator[RequestOutput, None]], Awaitable[RequestOutput | None]]


async def sse_events(
    answer: Answer,
    scope: RequestScope,
    first: RequestOutput,
    next_output: NextOutput,
    *,
    include_usage: bool,
    on_finished: Callable[[RequestOutput], None],
) -> AsyncGenerator[str, None]:
    """The events of a request whose first output is `first`; `next_output` awaits the next one
    from `scope.outputs` (None at the end); `on_finished` records a request that finished."""
    assert scope.outputs is not None
    created = now()
    scope.last = first
    try:
        for event in _role_events(answer, created):
            yield event
        async for event in _output_events(answer, scope, first, next_output, created):
            yield event
        await scope.commit_usage(scope.last)  # stored before the client sees its usage
        if include_usage:
            yield usage_event(answer, scope.last, created)
    except TandemError as exc:  # the stream has started: report in-band, then end it as usual
        scope.end_usage(exc)
        yield sse_event(tandem_error_body(exc, answer.gen.request_id))
    except Exception as exc:
        scope.end_usage(exc)
        logger.exception("stream failed", extra={"tenant": scope.tenant, "request_id": answer.gen.request_id})
        yield sse_event(internal_error_body(answer.gen.request_id))
    except BaseException as exc:  # cancelled, or closed (the client went away)
        scope.end_usage(exc)
        raise
    finally:
        # The slot first: on a client disconnect this block runs under cancellation, and an
        # await may be interrupted; `release` never waits (`RequestScope.close`).
        await scope.close()
        if scope.last.finished:
            on_finished(scope.last)
    yield "data: [DONE]\n\n"  # after an error event too: every stream ends the same way


def _role_events(answer: Answer, created: int) -> list[str]:
    """A chat stream opens each choice with the assistant's role."""
    if not answer.chat:
        return []
    return [
        sse_event(
            chat_chunk(
                request_id=answer.gen.request_id,
                model=answer.model,
                created=created,
                delta={"role": "assistant", "content": ""},
                finish_reason=None,
                index=index,
            )
        )
        for index in range(answer.gen.sampling_params.n)
    ]


async def _output_events(
    answer: Answer, scope: RequestScope, first: RequestOutput, next_output: NextOutput, created: int
) -> AsyncGenerator[str, None]:
    """Each output's chunks, until the engine stream ends; a failed output raises its error."""
    assert scope.outputs is not None
    num_choices = answer.gen.sampling_params.n
    calls = {index: ToolCallStream() for index in range(num_choices)} if answer.tool_calls else None
    ended: set[int] = set()  # choices whose finish was sent
    out: RequestOutput | None = first
    while out is not None:
        scope.last = out
        if out is not first:
            scope.see(out)
        if failed_choice(out):  # the engine ended it: no more text
            raise engine_error(out, answer.constraint_param)
        if calls is not None:
            for completion in unsent_choices(out, ended):
                for event in tool_call_events(answer, completion, calls[completion.index], created):
                    yield event
        else:
            for chunk in stream_chunks(
                out,
                model=answer.model,
                created=created,
                chat=answer.chat,
                num_top=answer.num_top_logprobs,
                names=answer.names,
                ended=ended,
            ):
                yield sse_event(chunk)
        out = await next_output(scope.outputs)


class Events:
    """A started request's SSE events. An async generator closed before its first step never runs
    its `finally`: closing this one before the first event (a client gone before the response
    started) still closes the request's scope (the engine stream, the tenant's slot)."""

    def __init__(self, events: AsyncGenerator[str, None], scope: RequestScope) -> None:
        self.events, self.scope, self.started = events, scope, False

    def __aiter__(self) -> Events:
        return self

    async def __anext__(self) -> str:
        self.started = True
        return await self.events.__anext__()

    async def aclose(self) -> None:
        if not self.started:
            self.started = True  # once
            await self.scope.close(asyncio.CancelledError())
        await self.events.aclose()
