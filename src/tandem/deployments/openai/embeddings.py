"""`/v1/embeddings`: each input runs through the engine as an embedding request (prefill only,
batched with whatever else runs, nothing kept), pooled as the model declares (`LLMEngine.pooling`),
then L2-normalised, as OpenAI's embeddings are. `dimensions` keeps the first that many values and
normalises again (Matryoshka truncation); `encoding_format: "base64"` sends each vector as
little-endian float32 bytes.

One call holds one tenant slot and is metered as one request (its inputs' tokens as input
tokens, none as output); its inputs go to one engine in one call (`EngineClient.embed`), run
there at once, and the first that fails cancels the others.
"""

from __future__ import annotations

import base64
import math
import struct
from typing import TYPE_CHECKING

from tandem.deployments.openai.mapping import ResponseTiming, engine_error, failed_choice
from tandem.deployments.openai.requests import EmbeddingsRequest
from tandem.deployments.openai.responses import new_id
from tandem.engine.protocol import GenerationRequest
from tandem.engine.request import Priority
from tandem.platform.errors import InvalidRequestError

if TYPE_CHECKING:
    from tandem.deployments.openai.server import OpenAIServer


def encoded(vector: list[float], dimensions: int | None, encoding_format: str) -> list[float] | str:
    """`vector` truncated to `dimensions`, L2-normalised, as floats or base64 float32 bytes."""
    kept = vector[:dimensions] if dimensions is not None else vector
    norm = math.sqrt(math.fsum(x * x for x in kept)) or 1.0
    unit = [x / norm for x in kept]
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(unit)}f", *unit)).decode()
    return unit


class EmbeddingsAPI:
    def __init__(self, server: OpenAIServer) -> None:
        self.server = server

    async def _requests(
        self, req: EmbeddingsRequest, tenant: str, priority: Priority
    ) -> list[GenerationRequest]:
        """An embedding request per input, for the model `req` names (404 otherwise), with
        `dimensions` within the model's (400 otherwise)."""
        server = self.server
        lora_id = await server.resolve_model(req.model, tenant)
        num_dimensions = (await server.model_info()).get("embedding_dimensions")
        if req.dimensions is not None and isinstance(num_dimensions, int) and req.dimensions > num_dimensions:
            raise InvalidRequestError(
                f"dimensions {req.dimensions} is more than this model's {num_dimensions}", param="dimensions"
            )
        server.drain.check_admitting()
        return [
            GenerationRequest(
                request_id=new_id("embd"),
                prompt=item if isinstance(item, str) else None,
                prompt_token_ids=item if isinstance(item, list) else None,
                priority=priority,
                tenant_id=tenant,
                tenant_weight=server.tenants.weight_for(tenant),
                lora_name=lora_id,
                stream=False,
                embed=True,
            )
            for item in req.inputs()
        ]

    async def create(
        self,
        req: EmbeddingsRequest,
        tenant: str,
        priority: Priority = Priority.INTERACTIVE,
        *,
        timing: ResponseTiming | None = None,
        api_key_id: str | None = None,
    ) -> dict[str, object]:
        server = self.server
        gens = await self._requests(req, tenant, priority)
        if timing is not None:
            timing.request_id = gens[0].request_id
        scope = server.request_scope(gens[0], tenant, api_key_id)
        await scope.acquire()
        async with scope:
            with server.in_flight.track():
                outputs = await server.client.embed(gens)
            for out in outputs:
                if failed_choice(out):
                    raise engine_error(out)
            num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
            scope.num_tokens_used = num_tokens
            if scope.meter is not None:
                scope.meter.num_prompt_tokens = num_tokens
                scope.meter.num_cached_tokens = sum(out.metrics.num_cached_tokens for out in outputs)
            await scope.commit_usage(outputs[-1])
        data = [
            {
                "object": "embedding",
                "index": index,
                "embedding": encoded(out.embedding or [], req.dimensions, req.encoding_format),
            }
            for index, out in enumerate(outputs)
        ]
        return {
            "object": "list",
            "data": data,
            "model": req.model,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }
