"""`LoopCall`: a function the `AsyncEngine`'s loop thread runs on the engine between steps, its
result (or exception) handed back to the caller's event loop through a future."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

from tandem.engine.engine import LLMEngine

T = TypeVar("T")


@dataclass
class LoopCall(Generic[T]):
    """`fn(engine)` to run in the loop thread; `future` (of the caller's event loop) gets its result."""

    fn: Callable[[LLMEngine], T]
    future: asyncio.Future[T]

    def run(self, engine: LLMEngine) -> None:
        loop = self.future.get_loop()
        try:
            result = self.fn(engine)
        except Exception as exc:  # the caller's error (a bad transfer): raised in its task
            loop.call_soon_threadsafe(self._settle, None, exc)
            return
        loop.call_soon_threadsafe(self._settle, result, None)

    def fail(self, exc: BaseException) -> None:
        """End the call with `exc` without running it (the engine failed first)."""
        self.future.get_loop().call_soon_threadsafe(self._settle, None, exc)

    def _settle(self, result: T | None, exc: BaseException | None) -> None:
        if self.future.done():  # the caller was cancelled meanwhile
            return
        if exc is not None:
            self.future.set_exception(exc)
        else:
            self.future.set_result(cast(T, result))
