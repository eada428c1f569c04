"""`Drain`: one server's graceful stop. New requests get a 503 `shutting_down` (with Retry-After);
requests in flight get until the drain's deadline, then each still running ends with that error
(a stream: an error event, then `[DONE]`) at its next output."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator

from tandem.engine.protocol import RequestOutput
from tandem.platform.errors import ShuttingDownError

logger = logging.getLogger("tandem.api")


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self._deadline: float | None = None  # time.monotonic()

    def begin(self, timeout_s: float, num_in_flight: int = 0) -> None:
        """Stop admitting and give requests in flight `timeout_s` seconds to finish. Any thread
        may call it; a later call can only bring the end closer (a second signal: stop sooner)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        if self._deadline is not None and self._deadline <= deadline:
            return
        self._deadline = deadline
        self.draining = True
        logger.info("draining", extra={"timeout_s": timeout_s, "in_flight": num_in_flight})

    def check_admitting(self) -> None:
        if self.draining:
            raise ShuttingDownError("the server is shutting down; retry the request on another one shortly")

    async def next_output(self, outputs: AsyncGenerator[RequestOutput, None]) -> RequestOutput | None:
        """The engine's next output (None at the end), or, once a drain's time is up,
        `ShuttingDownError` (the caller's cleanup closes the engine stream, aborting it)."""
        deadline = self._deadline
        if deadline is None:
            return await anext(outputs, None)
        remaining = deadline - time.monotonic()
        if remaining > 0:
            following = asyncio.ensure_future(anext(outputs, None))
            done, _ = await asyncio.wait({following}, timeout=remaining)
            if done:
                return following.result()
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
        raise ShuttingDownError("the server shut down before this request finished; retry it")
