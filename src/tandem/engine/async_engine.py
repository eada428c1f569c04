"""`AsyncEngine`: the engine loop in a background thread, streaming outputs to asyncio callers.

The model runs in its own thread (torch releases the GIL during compute), so an event loop
serving HTTP stays responsive. Adds and aborts are handed to the loop thread through a
condition variable and applied between steps; when idle the thread sleeps on that condition.

Contract: `async for out in engine.generate(request)` yields `RequestOutput`s whose
`outputs[k].delta_text` / `delta_token_ids` are new since the previous one (with n > 1 choices,
`outputs` holds the choices that changed, each with its `index`); the last has `finished=True`
and every choice's final output. Leaving the loop early (client disconnect, cancellation) aborts the request,
and its KV blocks are freed before the next step runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

from tandem.engine.engine import LLMEngine
from tandem.engine.io.output_stream import OutputStream, put_all
from tandem.engine.io.tokenizer import Tokenizer
from tandem.engine.kv.handover import with_token_ids
from tandem.engine.kv.transfer import KVTransfer
from tandem.engine.loop_call import LoopCall
from tandem.engine.protocol import GenerationRequest, RequestOutput
from tandem.engine.request import Request, RequestStatus
from tandem.platform.errors import InvalidRequestError, RequestFailedError, ServiceUnavailableError

logger = logging.getLogger("tandem.engine")

T = TypeVar("T")

STATS_INTERVAL_S = 0.05  # most seconds between stats snapshots while requests run


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, start: bool = True) -> None:
        """Serve `engine` from a new loop thread (`start=False`: the caller's thread runs `_loop`
        itself, as `from_options` does)."""
        self.engine = engine
        self._cv = threading.Condition()
        self._pending_adds: list[tuple[tuple[Request, str | None], OutputStream]] = []
        self._pending_aborts: list[str] = []
        # Work on the engine itself (KV hand-over), run by the loop thread between steps.
        self._pending_calls: list[LoopCall[Any]] = []
        self._streams: dict[str, OutputStream] = {}
        self._stopped = False
        self._broken = False  # a failure no single request explained: health checks fail from then on
        self._stats: dict[str, Any] = engine.stats()
        self._stats_time = time.monotonic()
        self._thread = threading.current_thread()
        if start:
            self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
            self._thread.start()

    @classmethod
    def from_options(cls, model: str | None = None, **options: Any) -> AsyncEngine:
        """Load the model in the thread that will run it, and run it there.

        Why not load here and hand the engine to a new thread: torch's CPU kernels run in OpenMP
        teams, one per thread that calls them, and once a second thread of the process has run an
        OpenMP region (model loading does), the engine thread's kernels ran markedly slower for
        the rest of the process (figures: docs/performance.md, "the engine thread"). Keep the threads that
        call an `AsyncEngine` free of torch work."""
        built: queue.Queue[AsyncEngine | BaseException] = queue.Queue(maxsize=1)

        def build_then_run() -> None:
            try:
                engine = cls(LLMEngine.from_options(model, **options), start=False)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
                built.put(exc)
                return
            built.put(engine)
            engine._loop()

        threading.Thread(target=build_then_run, name="tandem-engine", daemon=True).start()
        result = built.get()
        if isinstance(result, BaseException):
            raise result
        return result

    @property
    def model_name(self) -> str:
        return self.engine.served_model_name

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    async def generate(
        self, request: GenerationRequest, stream_interval: int = 1
    ) -> AsyncGenerator[RequestOutput, None]:
        """With `stream_interval` k > 1, updates after the first are held back and merged until they
        carry k new tokens (the end always goes at once): fewer messages where each costs CPU."""
        # A new output constraint compiles in a worker thread (milliseconds, up to a second for a
        # large schema), not on the caller's event loop; then it is a cache hit in make_request.
        spec = request.sampling_params.structured
        grammars = self.engine.grammars
        if spec is not None and grammars is not None and not grammars.is_cached(spec):
            await asyncio.to_thread(grammars.compile, spec)
        # Validate and tokenise in the caller's thread: bad input raises here, before anything is queued.
        prepared = self.engine.make_request(request)
        stream = OutputStream.here(request.stream, request.cumulative)
        with self._cv:
            if self._stopped or self._broken:
                raise ServiceUnavailableError("this engine is shut down or being replaced; retry the request")
            if request.request_id in self._streams or any(
                r.request_id == request.request_id for (r, _), _ in self._pending_adds
            ):
                raise InvalidRequestError(
                    f"request id {request.request_id!r} is already running", param="request_id"
                )
            self._pending_adds.append((prepared, stream))
            self._cv.notify()
        async for output in self._outputs(request.request_id, stream, stream_interval):
            yield output

    async def with_prompt_token_ids(self, request: GenerationRequest) -> GenerationRequest:
        """`request` validated (`LLMEngine.make_request`) and carrying its prompt as token ids:
        what a decode engine passes on to its prefill engine and back to itself, so that a
        handed-over prompt is tokenised once."""

        def tokenized(engine: LLMEngine) -> GenerationRequest:
            prepared, _ = engine.make_request(request, compress=False)
            return with_token_ids(request, prepared.prompt_token_ids)

        return await self._call(tokenized)

    async def cached_prefix_pages(self, request: GenerationRequest) -> int:
        """`KVHandover.cached_prefix_pages`: leading prompt pages a sender need not send here."""
        return await self._call(lambda engine: engine.handover.cached_prefix_pages(request))

    async def prefill(
        self, request: GenerationRequest, cache_dtype: str | None = None, skip_pages: int = 0
    ) -> KVTransfer:
        """Compute the prompt and first token here and return its KV pages (`KVHandover.export_kv`,
        from page `skip_pages` on) for a decode engine; this engine's blocks are free when it returns."""
        last: RequestOutput | None = None
        async for output in self._start(self.engine.handover.make_prefill_request(request)):
            last = output
        assert last is not None and last.finished
        if last.outputs[0].finish_reason == "error":
            raise RequestFailedError(
                last.error or "the prefill failed", code=last.error_code or "request_failed"
            )
        export = self.engine.handover.export_kv
        transfer = await self._call(lambda _: export(request.request_id, cache_dtype, skip_pages))
        return transfer

    async def generate_from_kv(
        self, request: GenerationRequest, transfer: KVTransfer, stream_interval: int = 1
    ) -> AsyncGenerator[RequestOutput, None]:
        """`generate` for a request whose prompt KV another engine computed (`prefill`): the
        transfer is verified and imported (a bad one raises here), then decoding streams on."""
        stream = OutputStream.here()

        def add(engine: LLMEngine) -> RequestOutput:
            first = engine.handover.add_request_with_kv(request, transfer, stream_text=True)
            if not first.finished:
                self._streams[request.request_id] = stream
            return first

        try:
            first = await self._call(add)
        except asyncio.CancelledError:  # the add may have happened meanwhile: undo it
            self.abort(request.request_id)
            raise
        streaming = False
        try:
            yield first
            if first.finished:
                return
            streaming = True  # from here `_outputs` aborts the request if we are left
            async for output in self._outputs(request.request_id, stream, stream_interval, num_yielded=1):
                yield output
        finally:
            if not streaming and not first.finished:
                self.abort(request.request_id)

    async def _start(self, prepared: tuple[Request, str | None]) -> AsyncGenerator[RequestOutput, None]:
        """Queue a prepared request and stream its outputs (one per step)."""
        request = prepared[0]
        stream = OutputStream.here()
        with self._cv:
            if self._stopped or self._broken:
                raise ServiceUnavailableError("this engine is shut down or being replaced; retry the request")
            self._pending_adds.append((prepared, stream))
            self._cv.notify()
        async for output in self._outputs(request.request_id, stream, 1):
            yield output

    async def _call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` in the loop thread between steps; its result, or its exception."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        with self._cv:
            if self._stopped or self._broken:
                raise ServiceUnavailableError("this engine is shut down or being replaced; retry the request")
            self._pending_calls.append(LoopCall(fn, future))
            self._cv.notify()
        return await future

    def _outputs(
        self, request_id: str, stream: OutputStream, stream_interval: int, num_yielded: int = 0
    ) -> AsyncGenerator[RequestOutput, None]:
        """The stream's outputs (`OutputStream.outputs`); leaving early aborts the request."""
        return stream.outputs(stream_interval, lambda: self.abort(request_id), num_yielded)

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._pending_aborts.append(request_id)
            self._cv.notify()

    def stats(self) -> dict[str, object]:
        """Snapshot taken by the loop thread before a step's outputs were delivered: after the latest
        step that ended a request or left the engine idle, and at most `STATS_INTERVAL_S` old."""
        return dict(self._stats)

    def token_table(self) -> list[bytes]:
        """Each token id's bytes (`Tokenizer.token_bytes_table`), for logprobs' text and bytes."""
        return self.engine.tokenizer.token_bytes_table()

    def is_alive(self) -> bool:
        """False once the loop stopped or broke: the replica reports unhealthy and is replaced."""
        return self._thread.is_alive() and not self._stopped and not self._broken

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=30)

    # -- loop thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not (
                    self._stopped
                    or self._pending_adds
                    or self._pending_aborts
                    or self._pending_calls
                    or engine.has_unfinished_requests()
                ):
                    self._cv.wait()
                if self._stopped:
                    break
                if self._pending_adds and not engine.has_unfinished_requests():
                    self._gather_burst()
                adds, self._pending_adds = self._pending_adds, []
                aborts, self._pending_aborts = self._pending_aborts, []
                calls, self._pending_calls = self._pending_calls, []
            self._run_calls(calls)
            try:
                self._iterate(adds, aborts)
            except Exception:  # nothing runs on an engine that failed this way
                self._break()
                break
        self._fail_all(ServiceUnavailableError("the engine was shut down; retry the request"))

    def _run_calls(self, calls: list[LoopCall[Any]]) -> None:
        for call in calls:
            call.run(self.engine)

    def _break(self) -> None:
        """Called from an `except` block in the loop thread: a failure that no single request
        explains (the engine fails requests it can attribute itself). Every request in flight ends
        with an error, new ones are refused, and `is_alive` turns False so the replica is replaced."""
        logger.exception("engine loop failed; failing every request in flight and reporting unhealthy")
        with self._cv:
            self._broken = True
            adds, self._pending_adds = self._pending_adds, []
            calls, self._pending_calls = self._pending_calls, []
        for call in calls:
            call.fail(ServiceUnavailableError("this engine failed; retry the request"))
        error = RequestFailedError(
            "the engine serving this request failed and is being replaced; retry the request",
            code="engine_failed",
        )
        for (request, _), stream in adds:
            self._send(request.request_id, stream, error)
        self._fail_all(error)

    def _gather_burst(self) -> None:
        """Called with the condition held, when requests reach an idle engine: wait while more keep
        arriving (each within `admission_wait_ms` of the previous, for at most
        `admission_max_wait_ms`), so a burst that reaches the engine spread over a few
        milliseconds (HTTP parsing, routing) is prefilled in one step. Without this the first
        arrival's step runs alone and the rest of the burst queues behind it: on CPU a prefill
        step takes hundreds of milliseconds."""
        config = self.engine.config
        quiet_s = config.admission_wait_ms / 1000
        deadline = time.monotonic() + config.admission_max_wait_ms / 1000
        while quiet_s > 0 and not self._stopped:
            num_pending = len(self._pending_adds)
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return
            self._cv.wait(min(quiet_s, remaining_s))
            if len(self._pending_adds) == num_pending:  # quiet (or only an abort arrived)
                return

    def _iterate(
        self, adds: list[tuple[tuple[Request, str | None], OutputStream]], aborts: list[str]
    ) -> None:
        """Apply queued adds and aborts, then run one step and deliver its outputs."""
        engine = self.engine
        for (request, prompt), stream in adds:
            try:
                engine.add_prepared(
                    request,
                    prompt,
                    stream_text=stream.stream,
                    final_only=not stream.stream,
                    cumulative=stream.cumulative,
                )
                self._streams[request.request_id] = stream
            except Exception as exc:  # validated already; a race (duplicate id) lands here
                self._send(request.request_id, stream, exc)
        for request_id in aborts:
            engine.abort_request(request_id)
            self._streams.pop(request_id, None)
        # step() raises only for failures no single request explains
        outputs = engine.step() if engine.has_unfinished_requests() else []
        self._refresh_stats(outputs)  # before delivering
        self._deliver(outputs)

    def _refresh_stats(self, outputs: list[RequestOutput]) -> None:
        """A new stats snapshot after a step that ended a request or left the engine idle (whoever
        sees a final output sees its step), else every `STATS_INTERVAL_S` (its cost: docs/performance.md)."""
        now, engine = time.monotonic(), self.engine
        ended = not engine.has_unfinished_requests() or any(output.finished for output in outputs)
        if ended or now - self._stats_time >= STATS_INTERVAL_S:
            self._stats = engine.stats()
            self._stats_time = now

    def _send(self, request_id: str, stream: OutputStream, item: RequestOutput | BaseException) -> None:
        """Hand `item` to the consumer's event loop. A consumer whose loop is gone (closed without
        leaving its stream) is treated like a disconnect: its request is aborted."""
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # "Event loop is closed"
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)  # nothing when it has finished

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their consumers: one hand-over per event loop (a wake-up of that
        loop per step, not per request)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if output.finished:
                self._streams.pop(output.request_id, None)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream, output))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(put_all, batch)
            except RuntimeError:  # "Event loop is closed": its consumers are gone, as on a disconnect
                for _, output in batch:
                    self._streams.pop(output.request_id, None)
                    self.engine.abort_request(output.request_id)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(request_id, RequestStatus.FINISHED_ERROR)
            except Exception:
                logger.exception(
                    "could not abort request after a failed step", extra={"request_id": request_id}
                )
            self._send(request_id, stream, exc)
        self._streams.clear()
