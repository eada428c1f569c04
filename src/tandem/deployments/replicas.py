"""`LLMReplica`: a thin shim between Ray Serve and an `AsyncEngine` (injected, so testable alone).

Serve calls `generate` as a streaming method; cancelling the caller (client disconnect)
cancels this generator, which aborts the request in the engine and frees its KV blocks.
`record_autoscaling_stats` feeds the KV-occupancy/queue-depth autoscaling policy.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from tandem.engine.async_engine import AsyncEngine
from tandem.engine.protocol import GenerationRequest, RequestOutput


class LLMReplica:
    def __init__(
        self,
        engine_options: dict[str, Any] | None = None,
        engine_factory: Callable[[], AsyncEngine] | None = None,
    ) -> None:
        if engine_factory is not None:
            self.engine = engine_factory()
        else:
            self.engine = AsyncEngine.from_options(**(engine_options or {}))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        async for output in self.engine.generate(request):
            yield output.without_cumulative()  # cumulative fields cross processes once, at the end

    async def model_name(self) -> str:
        return self.engine.model_name

    async def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metrics (Ray Serve calls this on each replica periodically)."""
        stats = self.engine.stats()
        return {
            "kv_occupancy": float(stats["kv_occupancy"]),
            "num_waiting": float(stats["num_waiting"]),
            "num_running": float(stats["num_running"]),
        }

    def check_health(self) -> None:
        if not self.engine.is_alive():
            raise RuntimeError("engine loop thread has stopped")
