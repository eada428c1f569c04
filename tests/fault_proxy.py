"""A TCP proxy that breaks the connection to a server on purpose (the fault suite's object store).

Modes, switched at any time (`set_mode`):
- `pass`: bytes flow both ways, each answer chunk after `delay_s` (a slow store when > 0);
- `stop`: the port refuses connections (the server process is gone), open connections are cut;
- `freeze`: connections are accepted and requests read, nothing is answered (a process stopped
  with SIGSTOP, or a store stalled under load: the kernel still accepts).

It runs its own event loop on a daemon thread and listens on a free loopback port.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Literal

Mode = Literal["pass", "stop", "freeze"]


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.mode: Mode = "pass"
        self.delay_s = 0.0
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        self._call(self._listen())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _call(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)  # type: ignore[arg-type]

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)

    async def _unlisten(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    def set_mode(self, mode: Mode, *, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        previous, self.mode = self.mode, mode
        if mode == "stop" and previous != "stop":
            self._call(self._unlisten())
        elif mode != "stop" and previous == "stop":
            self._call(self._listen())
        elif mode == "pass" and previous == "freeze":
            self._call(self._cut())  # frozen connections never answer: clients time them out anyway

    async def _cut(self) -> None:
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    @contextlib.contextmanager
    def fault(self, mode: Mode, *, delay_s: float = 0.0) -> Iterator[None]:
        self.set_mode(mode, delay_s=delay_s)
        try:
            yield
        finally:
            self.set_mode("pass")

    def close(self) -> None:
        self._call(self._unlisten())
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._writers.add(client_writer)
        try:
            if self.mode == "freeze":
                await self._swallow(client_reader)
                return
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
            self._writers.add(upstream_writer)
            asked = asyncio.Event()  # a request went up since the last answer: delay the next one
            await asyncio.gather(
                self._pipe(client_reader, upstream_writer, asked, answers=False),
                self._pipe(upstream_reader, client_writer, asked, answers=True),
                return_exceptions=True,
            )
        except OSError:
            pass
        finally:
            self._writers.discard(client_writer)
            client_writer.close()

    async def _swallow(self, reader: asyncio.StreamReader) -> None:
        while await reader.read(65536):
            pass

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        asked: asyncio.Event,
        *,
        answers: bool,
    ) -> None:
        try:
            while data := await reader.read(65536):
                if self.mode == "freeze":
                    await self._swallow(reader)
                    return
                if not answers:
                    asked.set()
                elif asked.is_set():
                    asked.clear()
                    if self.delay_s > 0:
                        await asyncio.sleep(self.delay_s)  # once per answer, before its first bytes
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()
            self._writers.discard(writer)
