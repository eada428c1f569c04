"""The POST endpoints this server answers, in one table: the ASGI routes (`routes.py`), batch
validation (`BatchService(endpoints=...)`), batch execution (`batch_execution.py`) and the
OpenAPI document (`ingress.py`) all read `ENDPOINTS`.

Each endpoint names its request model (the JSON body, validated), the handler that answers a
validated body (a JSON body, or the SSE events to stream), the error shape its clients parse
(OpenAI's, or Anthropic's on `/v1/messages`), how its JSON body states usage (for batch lines'
metering) and whether a batch file may hold it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel

from tandem.deployments.anthropic.api import MessagesAPI
from tandem.deployments.anthropic.errors import anthropic_error_body
from tandem.deployments.anthropic.requests import CountTokensRequest, MessagesRequest
from tandem.deployments.openai.embeddings import EmbeddingsAPI
from tandem.deployments.openai.mapping import ResponseTiming
from tandem.deployments.openai.requests import ChatCompletionRequest, CompletionRequest, EmbeddingsRequest
from tandem.deployments.openai.response_api import ResponsesAPI
from tandem.deployments.openai.response_requests import ResponsesRequest
from tandem.engine.request import Priority

if TYPE_CHECKING:
    from tandem.deployments.openai.server import OpenAIServer

Answer = dict[str, object] | AsyncIterator[str]
Handler = Callable[..., Awaitable[Answer]]


@dataclass(frozen=True)
class UsageCounts:
    """What a JSON body says it cost: input tokens (of which `cached` came from the prefix
    cache) and output tokens."""

    input: int = 0
    output: int = 0
    cached: int = 0


def _int(value: object) -> int:
    return value if isinstance(value, int) else 0


def openai_usage(body: Mapping[str, object]) -> UsageCounts:
    """Chat and text completions' `usage` (`prompt_tokens`, `completion_tokens`)."""
    usage = body.get("usage")
    counts = usage if isinstance(usage, dict) else {}
    details = counts.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    return UsageCounts(_int(counts.get("prompt_tokens")), _int(counts.get("completion_tokens")), _int(cached))


def input_output_usage(body: Mapping[str, object]) -> UsageCounts:
    """Responses' and Anthropic's `usage` (`input_tokens`, `output_tokens`)."""
    usage = body.get("usage")
    counts = usage if isinstance(usage, dict) else {}
    details = counts.get("input_tokens_details")
    cached = (
        details.get("cached_tokens") if isinstance(details, dict) else counts.get("cache_read_input_tokens")
    )
    return UsageCounts(_int(counts.get("input_tokens")), _int(counts.get("output_tokens")), _int(cached))


def openai_error(status: int, body: Mapping[str, object]) -> dict[str, object]:
    """OpenAI's error body, as the routes build it."""
    return dict(body)


@dataclass(frozen=True)
class Endpoint:
    path: str
    request_model: type[BaseModel]  # validates the JSON body (extra fields forbidden)
    summary: str  # the OpenAPI operation's
    handler: Callable[[OpenAIServer], Handler]  # the server's method that answers a validated body
    error_body: Callable[[int, Mapping[str, object]], dict[str, object]] = openai_error
    usage: Callable[[Mapping[str, object]], UsageCounts] = openai_usage
    batchable: bool = True  # a batch file may hold lines for it

    async def run(
        self,
        server: OpenAIServer,
        body: BaseModel,
        tenant: str,
        priority: Priority = Priority.INTERACTIVE,
        *,
        timing: ResponseTiming | None = None,
        api_key_id: str | None = None,
    ) -> Answer:
        """Answer a validated body (`request_model`): a JSON body, or the SSE events to stream."""
        assert isinstance(body, self.request_model), f"{self.path} takes {self.request_model.__name__}"
        return await self.handler(server)(body, tenant, priority, timing=timing, api_key_id=api_key_id)


ENDPOINTS: dict[str, Endpoint] = {
    endpoint.path: endpoint
    for endpoint in (
        Endpoint(
            "/v1/chat/completions",
            ChatCompletionRequest,
            "Create a chat completion",
            lambda server: server.chat,
        ),
        Endpoint(
            "/v1/completions", CompletionRequest, "Create a completion", lambda server: server.completions
        ),
        Endpoint(
            "/v1/responses",
            ResponsesRequest,
            "Create a model response (OpenAI's Responses API)",
            lambda server: ResponsesAPI(server).create,
            usage=input_output_usage,
        ),
        Endpoint(
            "/v1/embeddings",
            EmbeddingsRequest,
            "Create embeddings",
            lambda server: EmbeddingsAPI(server).create,
        ),
        Endpoint(
            "/v1/messages",
            MessagesRequest,
            "Create a message (Anthropic's Messages API)",
            lambda server: MessagesAPI(server).create,
            error_body=anthropic_error_body,
            usage=input_output_usage,
            batchable=False,
        ),
        Endpoint(
            "/v1/messages/count_tokens",
            CountTokensRequest,
            "Count the input tokens of a message (Anthropic's Messages API)",
            lambda server: MessagesAPI(server).count_tokens,
            error_body=anthropic_error_body,
            batchable=False,
        ),
    )
}

# The endpoints a batch file may name (`BatchService(endpoints=...)`).
BATCH_ENDPOINTS: tuple[str, ...] = tuple(path for path, endpoint in ENDPOINTS.items() if endpoint.batchable)
