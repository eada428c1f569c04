"""Running one embeddings call's inputs on an engine: every input an embedding request
(`GenerationRequest.embed`), all at once (the engine batches them with whatever else runs), the
first failure cancelling the others. What `LocalEngineClient.embed` and `LLMReplica.embed` run:
one call per API request, so its inputs travel to one replica together, in one hop."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from tandem.engine.protocol import GenerationRequest, RequestOutput
from tandem.platform.errors import TandemError

if TYPE_CHECKING:  # the engine (and torch) loads in the replica's process only
    from tandem.engine.async_engine import AsyncEngine


def first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error a call answers with: a client's (`TandemError`) before any other."""
    errors = list(group.exceptions)
    return next((e for e in errors if isinstance(e, TandemError)), errors[0])


async def run_embeddings(engine: AsyncEngine, requests: list[GenerationRequest]) -> list[RequestOutput]:
    """Each request's final output, in order (an output may report an error: the caller checks)."""

    async def one(request: GenerationRequest) -> RequestOutput:
        last: RequestOutput | None = None
        async for out in engine.generate(request):
            last = out
        if last is None:
            raise RuntimeError(f"the engine stream of {request.request_id} ended without an output")
        return last

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(request)) for request in requests]
    except BaseExceptionGroup as failed:
        raise first_error(failed) from None
    return [task.result() for task in tasks]
