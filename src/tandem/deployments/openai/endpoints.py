"""The OpenAI endpoints this server answers, in one table: the ASGI routes (`routes.py`), batch
validation (`BatchService(endpoints=...)`), batch execution (`batch_execution.py`) and the
OpenAPI document (`ingress.py`) all read `ENDPOINTS`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel

from tandem.deployments.openai.mapping import ResponseTiming
from tandem.deployments.openai.requests import ChatCompletionRequest, CompletionRequest
from tandem.engine.request import Priority

if TYPE_CHECKING:
    from tandem.deployments.openai.server import OpenAIServer


@dataclass(frozen=True)
class Endpoint:
    path: str
    request_model: type[BaseModel]  # validates the JSON body (extra fields forbidden)
    summary: str  # the OpenAPI operation's

    async def run(
        self,
        server: OpenAIServer,
        body: BaseModel,
        tenant: str,
        priority: Priority = Priority.INTERACTIVE,
        *,
        timing: ResponseTiming | None = None,
        api_key_id: str | None = None,
    ) -> dict[str, object] | AsyncIterator[str]:
        """Answer a validated body (`request_model`): a JSON body, or the SSE events to stream."""
        if isinstance(body, ChatCompletionRequest):
            return await server.chat(body, tenant, priority, timing=timing, api_key_id=api_key_id)
        assert isinstance(body, CompletionRequest), f"{self.path} takes {self.request_model.__name__}"
        return await server.completions(body, tenant, priority, timing=timing, api_key_id=api_key_id)


ENDPOINTS: dict[str, Endpoint] = {
    endpoint.path: endpoint
    for endpoint in (
        Endpoint("/v1/chat/completions", ChatCompletionRequest, "Create a chat completion"),
        Endpoint("/v1/completions", CompletionRequest, "Create a completion"),
    )
}
