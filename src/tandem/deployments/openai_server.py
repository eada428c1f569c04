"""OpenAI-compatible request handling, independent of Ray: the ingress delegates here.

`OpenAIServer` turns validated OpenAI bodies into `GenerationRequest`s, runs them through an
injected `EngineClient` (the local `AsyncEngine` in tests, a Serve deployment handle in a
cluster) and streams or returns the responses `openai_mapping` shapes. Errors raised before the first token become HTTP
errors; a stream that has started ends with an error event instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from tandem.batch.service import BatchService
from tandem.deployments.adapters import AdapterStore
from tandem.deployments.engine_clients import EngineClient
from tandem.deployments.openai_mapping import (
    NO_TOKEN_NAMES,
    ResponseTiming,
    TokenNames,
    engine_error,
    failed_choice,
    num_tokens,
    sampling_params_from,
    sse_event,
    stream_chunks,
    unsent_choices,
    usage,
)
from tandem.deployments.orphans import UsageTag
from tandem.deployments.structured_output import (
    ToolCallStream,
    chat_messages,
    new_call_id,
    parse_tool_calls,
    tool_mode,
)
from tandem.deployments.usage_metering import RequestMeter
from tandem.engine.protocol import CompletionOutput, GenerationRequest, RequestOutput
from tandem.engine.request import Priority
from tandem.platform.errors import InvalidRequestError, NotFoundError, ShuttingDownError, TandemError
from tandem.platform.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    chat_choice,
    chat_chunk,
    chat_completion,
    internal_error_body,
    new_id,
    now,
    tandem_error_body,
    text_completion,
)
from tandem.platform.telemetry import get_telemetry
from tandem.platform.tenancy import CONCURRENCY_LIMITED, RateLimitError, TenantRegistry
from tandem.platform.usage_log import UsageLog
from tandem.platform.usage_records import UsageStatus

logger = logging.getLogger("tandem.api")


class TenantLimiter(Protocol):
    """Admits a tenant's real-time requests under its limits (429 `RateLimitError` when over)."""

    async def acquire(self, tenant: str) -> None: ...

    def release(self, tenant: str, num_tokens: int) -> None:
        """Give the slot back. Never waits and never raises: it runs in `finally` blocks, also
        under cancellation (a client that went away)."""
        ...

    async def refusals(self) -> dict[str, dict[str, int]]:
        """Requests refused by tenant limits (429) in the last hour, per tenant and error code."""
        ...


class LocalTenantLimiter:
    """`TenantLimiter` of one API process: the registry's own counts (exact when this process
    admits every request, as a single ingress replica does).

    A request over its tenant's concurrency limit waits its turn, first come first served per
    tenant, up to `max_wait_s` for one of that tenant's requests to end, and only then gets the
    429 (0: at once). Waiting costs an idle connection, where an immediate 429 invites a retry
    loop that keeps the API process busy for everyone. A token-rate refusal is immediate."""

    def __init__(self, tenants: TenantRegistry, max_wait_s: float = 0.0) -> None:
        self.tenants = tenants
        self.max_wait_s = max_wait_s
        self._waiters: dict[str, deque[asyncio.Future[None]]] = {}  # per tenant, in arrival order

    async def acquire(self, tenant: str) -> None:
        waiters = self._waiters.setdefault(tenant, deque())
        if not waiters:
            try:
                self.tenants.acquire(tenant)
                return
            except RateLimitError as exc:
                if exc.code != CONCURRENCY_LIMITED or self.max_wait_s <= 0:
                    raise
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        turn: asyncio.Future[None] = loop.create_future()
        waiters.append(turn)
        try:
            while True:
                if waiters[0] is turn:  # first in line: a slot may be free
                    try:
                        self.tenants.acquire(tenant)
                        return
                    except RateLimitError as exc:
                        if exc.code != CONCURRENCY_LIMITED:
                            raise
                    if turn.done():
                        turn = waiters[0] = loop.create_future()
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise RateLimitError(
                        f"tenant {tenant!r} is at its limit of concurrent requests and none of them "
                        f"ended within {self.max_wait_s:g} s; retry when one finishes",
                        retry_after_s=1.0,
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(turn), remaining)
        finally:
            was_first = waiters[0] is turn
            waiters.remove(turn)
            if was_first and waiters:
                self._wake(tenant)  # the next in line tries (the slot may still be free)
            if not waiters:
                self._waiters.pop(tenant, None)

    def _wake(self, tenant: str) -> None:
        waiters = self._waiters.get(tenant)
        if waiters and not waiters[0].done():
            waiters[0].set_result(None)

    def release(self, tenant: str, num_tokens: int) -> None:
        self.tenants.release(tenant, num_tokens)
        self._wake(tenant)

    async def refusals(self) -> dict[str, dict[str, int]]:
        return self.tenants.refusals()


class OpenAIServer:
    def __init__(
        self,
        client: EngineClient,
        tenants: TenantRegistry,
        *,
        max_tokens_default: int = 256,
        batches: BatchService | None = None,
        adapters: AdapterStore | None = None,
        limiter: TenantLimiter | None = None,
        usage_log: UsageLog | None = None,
    ) -> None:
        """`usage_log`: where real-time requests' usage records go (None: not metered)."""
        self.client = client
        self.usage_log = usage_log
        self.tenants = tenants
        self.limiter = limiter if limiter is not None else LocalTenantLimiter(tenants)
        self.model_name = client.model_name
        self.max_tokens_default = max_tokens_default
        self.batches = batches  # files + batches API; None when no object store is configured
        self.on_batch_created: Callable[[], None] | None = None  # e.g. wake a batch worker
        self.adapters = adapters  # per-tenant LoRA adapters; None when no object store is configured
        self._lora_info: dict[str, Any] | None = None
        self._model_info: dict[str, Any] | None = None
        self._token_names: TokenNames | None = None  # from the engine's table, once logprobs are asked
        # Graceful stop (`begin_drain`): requests running now, and the drain's end, once set.
        self.num_in_flight = 0
        self.draining = False
        self._drain_deadline: float | None = None  # time.monotonic()

    # -- graceful stop --------------------------------------------------------------------
    def begin_drain(self, timeout_s: float) -> None:
        """Stop admitting (new requests: 503 `shutting_down` with Retry-After) and give requests
        in flight `timeout_s` seconds to finish; then each still running ends with that error (a
        stream: an error event, then `[DONE]`) at its next output. Any thread may call it; a
        later call can only bring the end closer (a second signal: stop sooner)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        if self._drain_deadline is not None and self._drain_deadline <= deadline:
            return
        self._drain_deadline = deadline
        self.draining = True
        logger.info("draining", extra={"timeout_s": timeout_s, "in_flight": self.num_in_flight})

    def _check_admitting(self) -> None:
        if self.draining:
            raise ShuttingDownError("the server is shutting down; retry the request on another one shortly")

    async def _next_output(self, outputs: AsyncGenerator[RequestOutput, None]) -> RequestOutput | None:
        """The engine's next output (None at the end), or, once a drain's time is up,
        `ShuttingDownError` (the caller's cleanup closes the engine stream, aborting it)."""
        deadline = self._drain_deadline
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

    async def refresh_engine_stats(self) -> int:
        """Pull every replica's engine gauges (KV occupancy, queue) into telemetry; called on each
        scrape. Returns how many replicas reported (0 while every replica is still loading)."""
        stats = await self.client.replica_stats()
        get_telemetry().set_engine_stats(self.model_name, stats)
        return len(stats)

    def _record(
        self,
        gen: GenerationRequest,
        tenant: str,
        last: RequestOutput,
        started: float,
        started_ns: int,
        first_at: float,
    ) -> None:
        finish_reason = last.outputs[0].finish_reason if last.outputs else None
        num_output_tokens = sum(len(c.token_ids) for c in last.outputs)  # every choice's
        get_telemetry().record_request(
            tenant=tenant,
            model=self.model_name,
            request_id=gen.request_id,
            finish_reason=finish_reason,
            num_prompt_tokens=len(last.prompt_token_ids),
            num_output_tokens=num_output_tokens,
            ttft_s=first_at - started,
            e2e_s=time.monotonic() - started,
            phases=last.metrics.phase_durations(),
            started_ns=started_ns,
        )
        logger.info(
            "request finished",
            extra={
                "tenant": tenant,
                "request_id": gen.request_id,
                "finish_reason": finish_reason,
                "completion_tokens": num_output_tokens,
            },
        )

    # -- routes ---------------------------------------------------------------------------
    def models(self, tenant: str, info: dict[str, Any] | None = None) -> dict[str, Any]:
        """The base model (with `info`, `model_info`'s precision and generation defaults) and this
        tenant's adapters (as `base:adapter`)."""
        cards = [ModelCard(id=self.model_name, tandem=info)]
        if self.adapters is not None:
            cards += [
                ModelCard(id=f"{self.model_name}:{a.name}", created=a.created_at, owned_by=tenant)
                for a in self.adapters.list(tenant)
            ]
        return ModelList(data=cards).model_dump(exclude_none=True)

    def model(self, tenant: str, model_id: str, info: dict[str, Any] | None = None) -> dict[str, Any]:
        """One model card (`GET /v1/models/{model}`): the base model or one of this tenant's
        adapters; 404 otherwise, including another tenant's adapter."""
        for card in self.models(tenant, info)["data"]:
            if card["id"] == model_id:
                return dict(card)
        raise NotFoundError(f"The model {model_id!r} does not exist", param="model", code="model_not_found")

    async def _resolve_model(self, model: str, tenant: str) -> str | None:
        """The engine's LoRA id for `model`, None for the base model; 404 for anything else,
        including another tenant's adapter. Only adapters cost a (threaded) store lookup."""
        if model == self.model_name:
            return None
        base, sep, adapter = model.partition(":")
        if sep and base == self.model_name and self.adapters is not None:
            record = await asyncio.to_thread(self.adapters.get, tenant, adapter)
            return record.lora_id
        raise NotFoundError(
            f"The model {model!r} does not exist; available: {self.model_name!r} and your adapters "
            f"as '{self.model_name}:<adapter>'",
            param="model",
            code="model_not_found",
        )

    def _api_model(self, gen: GenerationRequest) -> str:
        if gen.lora_name is None:
            return self.model_name
        return f"{self.model_name}:{gen.lora_name.rpartition('@')[0].rpartition('/')[2]}"

    async def load_token_table(self) -> None:
        """Fetch the engine's token bytes table (once) so logprobs can name tokens."""
        if self._token_names is None:
            self._token_names = TokenNames(await self.client.token_table())

    def _names(self) -> TokenNames:
        """Token names for logprobs (loaded by `load_token_table` before any request that asks)."""
        return self._token_names or NO_TOKEN_NAMES

    async def model_info(self) -> dict[str, Any]:
        """The served model's precision and generation defaults (asked once, then cached: every
        replica of a served name runs the same)."""
        if self._model_info is None:
            self._model_info = await self.client.model_info()
        return self._model_info

    async def lora_info(self) -> dict[str, Any]:
        """The engine's LoRA limits and base-model shape (asked once, then cached)."""
        if self._lora_info is None:
            self._lora_info = await self.client.lora_info()
        return self._lora_info

    def _max_tokens_default_for(self, tenant: str, max_tokens: int | None) -> int:
        """`max_tokens` for a request that sets none, within the tenant's `max_tokens` limit;
        a request asking for more than that limit is a 400 naming `max_tokens`."""
        cap = self.tenants.max_tokens_for(tenant)
        if cap is None:
            return self.max_tokens_default
        if max_tokens is not None and max_tokens > cap:
            raise InvalidRequestError(
                f"max_tokens {max_tokens} is over this tenant's limit of {cap}; ask for at most {cap}",
                param="max_tokens",
                code="max_tokens_limit",
            )
        return min(cap, self.max_tokens_default)

    async def chat(
        self,
        req: ChatCompletionRequest,
        tenant: str,
        priority: Priority = Priority.INTERACTIVE,
        timing: ResponseTiming | None = None,
        api_key_id: str | None = None,
    ) -> dict[str, Any] | AsyncIterator[str]:
        lora_id = await self._resolve_model(req.model, tenant)
        messages = chat_messages(req)
        params = sampling_params_from(req)
        gen = GenerationRequest(
            request_id=new_id("chatcmpl"),
            messages=messages,
            sampling_params=params,
            default_max_tokens=self._max_tokens_default_for(tenant, params.max_tokens),
            tenant_id=tenant,
            tenant_weight=self.tenants.weight_for(tenant),
            priority=priority,
            lora_name=lora_id,
            stream=bool(req.stream),
        )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await self._run(
            gen,
            tenant,
            stream=req.stream,
            chat=True,
            include_usage=include_usage,
            timing=timing,
            tool_calls=tool_mode(req) is not None,
            api_key_id=api_key_id,
        )

    async def completions(
        self,
        req: CompletionRequest,
        tenant: str,
        priority: Priority = Priority.INTERACTIVE,
        timing: ResponseTiming | None = None,
        api_key_id: str | None = None,
    ) -> dict[str, Any] | AsyncIterator[str]:
        lora_id = await self._resolve_model(req.model, tenant)
        prompt_is_text = isinstance(req.prompt, str)
        params = sampling_params_from(req)
        gen = GenerationRequest(
            request_id=new_id("cmpl"),
            prompt=req.prompt if prompt_is_text else None,  # type: ignore[arg-type]
            prompt_token_ids=None if prompt_is_text else list(req.prompt),  # type: ignore[arg-type]
            sampling_params=params,
            default_max_tokens=self._max_tokens_default_for(tenant, params.max_tokens),
            tenant_id=tenant,
            tenant_weight=self.tenants.weight_for(tenant),
            priority=priority,
            lora_name=lora_id,
            stream=bool(req.stream),
        )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await self._run(
            gen,
            tenant,
            stream=req.stream,
            chat=False,
            include_usage=include_usage,
            timing=timing,
            api_key_id=api_key_id,
        )

    # -- running a request --------------------------------------------------------------
    async def _run(
        self,
        gen: GenerationRequest,
        tenant: str,
        *,
        stream: bool,
        chat: bool,
        include_usage: bool,
        timing: ResponseTiming | None = None,
        tool_calls: bool = False,
        api_key_id: str | None = None,
    ) -> dict[str, Any] | AsyncIterator[str]:
        """Start `gen` and await its first output (so errors are HTTP errors); then a JSON body,
        or the SSE events to stream. `timing`, when given, is filled at the first output. With
        `tool_calls` (a chat request with tools), the text is parsed into tool calls.

        A real-time request is metered (`usage_log`) once the engine has it: a response's usage
        is stored before the client sees it (the JSON body, or a stream's usage chunk and
        `[DONE]`); a request that ends otherwise is recorded `cancelled` or `failed` without
        waiting."""
        if timing is not None:
            timing.request_id = gen.request_id
        self._check_admitting()
        if gen.sampling_params.logprobs is not None:
            await self.load_token_table()
        accounted = gen.priority is Priority.INTERACTIVE  # batch work has its own flow control
        if accounted:
            await self.limiter.acquire(tenant)
        started, started_ns = time.monotonic(), time.time_ns()
        meter = None
        if accounted and self.usage_log is not None:
            meter = RequestMeter(
                gen.request_id, tenant, api_key_id, self._api_model(gen), self._adapter_name(gen)
            )
        usage = None if meter is None else UsageTag(meter.api_key_id, meter.model, meter.adapter)
        outputs = self.client.generate(gen, usage)
        self.num_in_flight += 1
        try:
            first = await self._next_output(
                outputs
            )  # validation errors surface here, before any byte is sent
            if first is None:
                raise RuntimeError(f"the engine stream of {gen.request_id} ended without an output")
            first_at = time.monotonic()
            if meter is not None:
                meter.see(first)
            if failed_choice(first):  # failed before its first token: HTTP error
                raise engine_error(first, _constraint_param(gen))
        except BaseException as exc:
            self.num_in_flight -= 1
            if accounted:
                self.limiter.release(tenant, 0)
            self._meter_end(meter, exc)
            await outputs.aclose()
            raise
        if timing is not None:
            timing.first_output_at = first_at
            timing.engine_queue_s = first.metrics.phase_durations().get("queue")
            timing.engine_ttft_s = first.metrics.ttft
        if stream:
            events = self._sse(
                gen,
                tenant,
                first,
                outputs,
                chat=chat,
                include_usage=include_usage,
                times=(started, started_ns, first_at),
                tool_calls=tool_calls,
                meter=meter,
            )

            async def close_unstarted() -> None:  # what `_sse`'s own `finally` would have done
                self.num_in_flight -= 1
                self.limiter.release(tenant, 0)
                self._meter_end(meter, asyncio.CancelledError())
                await outputs.aclose()

            return _Events(events, close_unstarted)
        last = first
        try:
            while (out := await self._next_output(outputs)) is not None:
                last = out
                if meter is not None:
                    meter.see(out)
        except BaseException as exc:
            self._meter_end(meter, exc)
            raise
        finally:
            self.num_in_flight -= 1
            await outputs.aclose()  # at a drain's end the stream is still open: this aborts it
            if accounted:
                self.limiter.release(tenant, num_tokens(last))
        self._record(gen, tenant, last, started, started_ns, first_at)
        if failed_choice(last):
            self._meter_end(meter, None, failed=True)
            raise engine_error(last, _constraint_param(gen))
        body = self._final_body(gen, last, chat=chat, tool_calls=tool_calls)
        await self._meter_completed(meter, last)
        return body

    def _adapter_name(self, gen: GenerationRequest) -> str | None:
        if gen.lora_name is None:
            return None
        return self._api_model(gen).partition(":")[2]

    async def _meter_completed(self, meter: RequestMeter | None, last: RequestOutput) -> None:
        """Store a finished request's record before its usage is reported (its body returned,
        its usage chunk sent)."""
        if meter is None or self.usage_log is None or meter.recorded:
            return
        finish_reason = last.outputs[0].finish_reason if last.outputs else None
        await self.usage_log.commit(meter.record("completed", finish_reason))

    def _meter_end(
        self, meter: RequestMeter | None, exc: BaseException | None, *, failed: bool = False
    ) -> None:
        """Record a request that ends without reporting usage: `cancelled` when its client went
        away (a cancellation) or the server drained, `failed` otherwise. Never waits or raises."""
        if meter is None or self.usage_log is None or meter.recorded:
            return
        status: UsageStatus = "failed"
        if not failed and isinstance(exc, asyncio.CancelledError | GeneratorExit | ShuttingDownError):
            status = "cancelled"
        self.usage_log.submit(meter.record(status, "abort" if status == "cancelled" else "error"))

    def _final_body(
        self, gen: GenerationRequest, last: RequestOutput, *, chat: bool, tool_calls: bool
    ) -> dict[str, Any]:
        """The JSON body of a finished request: one choice per `last.outputs` (every choice's final
        output), usage counting the prompt once."""
        num_top = gen.sampling_params.logprobs or 0
        names = self._names()
        if not chat:
            body = text_completion(
                request_id=gen.request_id,
                model=self._api_model(gen),
                created=now(),
                text="",
                finish_reason=None,
                usage=usage(last),
                no_choices=True,
            )
            body["choices"] = [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": names.completion_logprobs(c.token_ids, c.logprobs),
                    "finish_reason": c.finish_reason,
                }
                for c in last.outputs
            ]
            return body
        choices = []
        for completion in last.outputs:
            content: str | None = completion.text
            calls: list[dict[str, Any]] = []
            finish_reason = completion.finish_reason
            if tool_calls:
                content, parsed = parse_tool_calls(completion.text, cut=finish_reason == "length")
                calls = [call.as_openai(new_call_id()) for call in parsed]
                if calls and finish_reason == "stop":
                    finish_reason = "tool_calls"
            choices.append(
                chat_choice(
                    index=completion.index,
                    text=content,
                    finish_reason=finish_reason,
                    tool_calls=calls,
                    logprobs=names.chat_logprobs(completion.token_ids, completion.logprobs, num_top),
                )
            )
        return chat_completion(
            request_id=gen.request_id, model=self._api_model(gen), choices=choices, usage=usage(last)
        )

    def _tool_call_events(
        self, completion: CompletionOutput, calls: ToolCallStream, gen: GenerationRequest, created: int
    ) -> list[str]:
        """The chunks of one choice's update in a request with tools: its text as content and
        tool-call deltas (`ToolCallStream`), then, at the end, the finish reason (`tool_calls` when
        it made calls and stopped by itself). Logprobs ride on the update's first chunk."""
        finish = completion.finish_reason
        deltas = calls.feed(completion.delta_text, final=finish is not None, cut=finish == "length")
        if finish is not None:
            deltas.append({})
        logprobs = self._names().chat_logprobs(
            completion.delta_token_ids, completion.delta_logprobs, gen.sampling_params.logprobs or 0
        )
        events = []
        for position, delta in enumerate(deltas):
            last = finish is not None and position == len(deltas) - 1
            events.append(
                sse_event(
                    chat_chunk(
                        request_id=gen.request_id,
                        model=self._api_model(gen),
                        created=created,
                        delta=delta,
                        finish_reason=("tool_calls" if calls.num_calls and finish == "stop" else finish)
                        if last
                        else None,
                        logprobs=logprobs if position == 0 else None,
                        index=completion.index,
                    )
                )
            )
        return events

    async def _sse(
        self,
        gen: GenerationRequest,
        tenant: str,
        first: RequestOutput,
        outputs: AsyncGenerator[RequestOutput, None],
        *,
        chat: bool,
        include_usage: bool,
        times: tuple[float, int, float],  # started (monotonic), started (ns since epoch), first output
        tool_calls: bool = False,
        meter: RequestMeter | None = None,
    ) -> AsyncGenerator[str, None]:
        created = now()
        last = first
        num_choices = gen.sampling_params.n
        calls = {index: ToolCallStream() for index in range(num_choices)} if tool_calls else None
        ended: set[int] = set()  # choices whose finish was sent
        try:
            if chat:
                for index in range(num_choices):
                    yield sse_event(
                        chat_chunk(
                            request_id=gen.request_id,
                            model=self._api_model(gen),
                            created=created,
                            delta={"role": "assistant", "content": ""},
                            finish_reason=None,
                            index=index,
                        )
                    )
            out: RequestOutput | None = first
            while out is not None:
                last = out
                if meter is not None and out is not first:
                    meter.see(out)
                if failed_choice(out):  # the engine ended it: no more text
                    raise engine_error(out, _constraint_param(gen))
                if calls is not None:
                    for completion in unsent_choices(out, ended):
                        for event in self._tool_call_events(
                            completion, calls[completion.index], gen, created
                        ):
                            yield event
                    out = await self._next_output(outputs)
                    continue
                for chunk in stream_chunks(
                    out,
                    model=self._api_model(gen),
                    created=created,
                    chat=chat,
                    num_top=gen.sampling_params.logprobs or 0,
                    names=self._names(),
                    ended=ended,
                ):
                    yield sse_event(chunk)
                out = await self._next_output(outputs)
            await self._meter_completed(meter, last)  # stored before the client sees its usage
            if include_usage:
                last_usage = usage(last)
                if chat:
                    yield sse_event(
                        chat_chunk(
                            request_id=gen.request_id,
                            model=self._api_model(gen),
                            created=created,
                            delta={},
                            finish_reason=None,
                            usage=last_usage,
                            no_choices=True,
                        )
                    )
                else:
                    yield sse_event(
                        text_completion(
                            request_id=gen.request_id,
                            model=self._api_model(gen),
                            created=created,
                            text="",
                            finish_reason=None,
                            usage=last_usage,
                            no_choices=True,
                        )
                    )
        except TandemError as exc:  # the stream has started: report in-band, then end it as usual
            self._meter_end(meter, exc)
            yield sse_event(tandem_error_body(exc, gen.request_id))
        except Exception as exc:
            self._meter_end(meter, exc)
            logger.exception("stream failed", extra={"tenant": tenant, "request_id": gen.request_id})
            yield sse_event(internal_error_body(gen.request_id))
        except BaseException as exc:  # cancelled, or closed (the client went away)
            self._meter_end(meter, exc)
            raise
        finally:
            # The slot first: on a client disconnect this block runs under cancellation, and an
            # await may be interrupted; `release` never waits.
            self.num_in_flight -= 1
            self.limiter.release(tenant, num_tokens(last))
            await outputs.aclose()  # on client disconnect this aborts the request in the engine
            if last.finished:
                self._record(gen, tenant, last, *times)
        yield "data: [DONE]\n\n"  # after an error event too: every stream ends the same way


def _constraint_param(gen: GenerationRequest) -> str | None:
    """The request field its output constraint came from (`response_format`, `tools`)."""
    structured = gen.sampling_params.structured
    return structured.param if structured is not None else None


class _Events:
    """A started request's SSE events. An async generator closed before its first step never runs
    its `finally`: closing this one before the first event (a client gone before the response
    started) still closes the engine stream and gives the tenant's slot back."""

    def __init__(
        self, events: AsyncGenerator[str, None], close_unstarted: Callable[[], Awaitable[None]]
    ) -> None:
        self.events, self.close_unstarted, self.started = events, close_unstarted, False

    def __aiter__(self) -> _Events:
        return self

    async def __anext__(self) -> str:
        self.started = True
        return await self.events.__anext__()

    async def aclose(self) -> None:
        if not self.started:
            self.started = True  # once
            await self.close_unstarted()
        await self.events.aclose()
