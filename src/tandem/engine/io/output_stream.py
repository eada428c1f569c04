"""`OutputStream`: one request's outputs, from the engine's loop thread to its consumer's event
loop (torch-free). The loop thread hands a step's outputs to each event loop at once
(`put_all`, one wake-up of that loop per step); the consumer coalesces what queued up meanwhile
and holds updates back to `stream_interval` new tokens (`outputs`)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from tandem.engine.protocol import RequestOutput, merge_outputs

Item = RequestOutput | BaseException


class Mailbox:
    """An unbounded queue with one consumer on one event loop (`asyncio.Queue`'s `put_nowait`,
    `get`, `get_nowait` and `empty`, without its task counting and putters): a put wakes the
    consumer only when it waits. Used from its loop's thread only."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Item] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Item) -> None:
        self._items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> Item:
        """The oldest item (the caller checked `empty`)."""
        return self._items.popleft()

    async def get(self) -> Item:
        while not self._items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:  # cancelled, or woken by something else
                    self._waiter = None
        return self._items.popleft()


@dataclass
class OutputStream:
    loop: asyncio.AbstractEventLoop
    queue: Mailbox = field(default_factory=Mailbox)
    stream: bool = True  # False: first output and final output only (`GenerationRequest.stream`)
    cumulative: bool = True  # False: running outputs carry only deltas (`GenerationRequest.cumulative`)

    @classmethod
    def here(cls, stream: bool = True, cumulative: bool = True) -> OutputStream:
        """A stream consumed on the running event loop."""
        return cls(asyncio.get_running_loop(), Mailbox(), stream, cumulative)

    async def outputs(
        self, stream_interval: int, on_leave: Callable[[], None], num_yielded: int = 0
    ) -> AsyncGenerator[RequestOutput, None]:
        """The consumer side: coalesce, hold back to `stream_interval` new tokens (the first output
        and the end go at once), raise an exception put in the queue, and call `on_leave` (abort
        the request) when the consumer leaves before the end."""
        finished = False
        pending: RequestOutput | BaseException | None = None
        held: RequestOutput | None = None  # not yielded yet: fewer than stream_interval new tokens
        try:
            while True:
                item = pending if pending is not None else await self.queue.get()
                pending = None
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if held is not None:
                    merge_outputs(held, item)
                    held = None
                # Coalesce updates that queued up while the consumer was busy into one.
                while not item.finished and not self.queue.empty():
                    following = self.queue.get_nowait()
                    if isinstance(following, BaseException):
                        pending = following
                        break
                    merge_outputs(item, following)
                    item = following
                finished = item.finished
                if not finished and num_yielded and item.num_new_tokens() < stream_interval:
                    held = item
                    continue
                yield item
                num_yielded += 1
                if finished:
                    return
        finally:
            if not finished:
                on_leave()


def put_all(batch: list[tuple[OutputStream, RequestOutput]]) -> None:
    """On the consumers' event loop: each output into its stream's queue."""
    for stream, output in batch:
        stream.queue.put_nowait(output)
