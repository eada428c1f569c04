"""One line of a batch file, run through the same `OpenAIServer` code as real-time requests.

`BatchWorker` (batch/worker.py) takes `functools.partial(execute_batch_line, server)` as its
executor, in the Serve batch-worker replicas and in `tandem batch run` alike.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pydantic import ValidationError

from tandem.batch.lines import Backpressure, ExecutedRequest, RetryLater
from tandem.deployments.openai.endpoints import ENDPOINTS
from tandem.deployments.openai.errors import error_body, validation_error_body
from tandem.deployments.openai.requests import reject_unsupported
from tandem.deployments.openai.responses import new_id
from tandem.deployments.openai.server import OpenAIServer
from tandem.engine.request import Priority
from tandem.platform.errors import (
    InvalidRequestError,
    OverloadedError,
    RequestFailedError,
    ServiceUnavailableError,
    TandemError,
)

logger = logging.getLogger("tandem.batch")

# A line that fails through no fault of its own is retried after these pauses; if it still
# fails, its shard is left for a later run (`RetryLater`), never answered with that failure.
RETRY_BACKOFF_S = (0.5, 1.0, 2.0, 4.0)


def is_retryable(exc: TandemError) -> bool:
    """Not the request's fault: its replica died or none could take it (503), every queue was
    full (429), its engine failed or its KV blocks were reassigned under it (500
    `engine_failed`, `kv_integrity`). A 500 `request_failed` is the request's own (an adapter's
    non-finite logits): answered, not retried."""
    if isinstance(exc, ServiceUnavailableError | OverloadedError):
        return True
    return isinstance(exc, RequestFailedError) and exc.code in ("engine_failed", "kv_integrity")


async def execute_batch_line(
    server: OpenAIServer, endpoint: str, body: dict[str, Any], tenant: str
) -> ExecutedRequest:
    """Run one line of a batch file at batch priority: the same code path and response body
    as the real-time endpoint, with errors captured in OpenAI's shape instead of raised. A
    retryable failure (`is_retryable`) is retried, then raises `RetryLater`; a replica with no
    seat left for batch work raises `Backpressure` (the worker waits and sends the line again)."""
    try:
        spec = ENDPOINTS.get(endpoint)
        if spec is None or not spec.batchable:
            raise InvalidRequestError(f"endpoint {endpoint!r} is not supported in a batch", param="url")
        reject_unsupported(body)
        if body.get("stream"):
            raise InvalidRequestError("stream is not supported in a batch", param="stream")
        request = spec.request_model.model_validate(body)  # validated once, before any attempt
        for attempt in range(1 + len(RETRY_BACKOFF_S)):
            try:
                result = await spec.run(server, request, tenant, Priority.BATCH)
                break
            except TandemError as exc:
                if exc.code == "batch_capacity":  # every seat for batch work is taken: wait, not a failure
                    raise Backpressure(exc.message, getattr(exc, "retry_after_s", 1.0)) from exc
                if not is_retryable(exc):
                    raise
                if attempt == len(RETRY_BACKOFF_S):
                    raise RetryLater(f"{exc.code}: {exc.message}") from exc
                logger.warning(
                    "batch request failed through no fault of its own; retrying",
                    extra={"attempt": attempt + 1, "code": exc.code},
                )
                await asyncio.sleep(RETRY_BACKOFF_S[attempt])
    except TandemError as exc:
        # The request got an HTTP answer: like OpenAI, the line's `response` holds the error
        # body and its top-level `error` stays null (that is for requests that never ran).
        body_out = error_body(exc.message, exc.error_type, exc.param, exc.code)
        return ExecutedRequest(exc.status_code, new_id("req"), body_out, None)
    except ValidationError as exc:
        return ExecutedRequest(400, new_id("req"), validation_error_body(exc.errors()), None)
    assert isinstance(result, dict), "batch requests never stream"
    counts = spec.usage(result)
    request_id = result.get("id")
    return ExecutedRequest(
        200,
        str(request_id) if request_id is not None else new_id("req"),
        result,
        None,
        input_tokens=counts.input,
        output_tokens=counts.output,
        cached_tokens=counts.cached,
    )
