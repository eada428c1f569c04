"""Tandem: LLM inference for real-time chat and asynchronous batch jobs from one fleet."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem.engine.protocol import CompletionOutput, GenerationRequest, LoRARequest, RequestOutput
from tandem.engine.request import Priority
from tandem.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.engine.async_engine import AsyncEngine
    from tandem.engine.llm import LLM

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "GenerationRequest",
    "LoRARequest",
    "Priority",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    # torch-heavy classes load on first use, so `import tandem` stays cheap for tools and the CLI.
    if name == "LLM":
        from tandem.engine.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from tandem.engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
