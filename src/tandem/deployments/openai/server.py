"""OpenAI-compatible request handling, independent of Ray: the ingress delegates here.

`OpenAIServer` turns validated OpenAI bodies into `GenerationRequest`s, runs them through an
injected `EngineClient` (the local `AsyncEngine` in tests, a Serve deployment handle in a
cluster) and streams or returns the responses `openai_mapping` shapes. Errors raised before the first token become HTTP
errors; a stream that has started ends with an error event instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from tandem.batch.service import BatchService
from tandem.deployments.adapters import AdapterStore
from tandem.deployments.engine_clients import EngineClient
from tandem.deployments.openai.bodies import Answer, final_body
from tandem.deployments.openai.drain import Drain
from tandem.deployments.openai.limiter import LocalTenantLimiter, TenantLimiter
from tandem.deployments.openai.mapping import (
    NO_TOKEN_NAMES,
    ResponseTiming,
    TokenNames,
    engine_error,
    failed_choice,
    sampling_params_from,
)
from tandem.deployments.openai.requests import ChatCompletionRequest, CompletionRequest
from tandem.deployments.openai.response_store import ResponseStore
from tandem.deployments.openai.responses import (
    ModelCard,
    ModelList,
    new_id,
)
from tandem.deployments.openai.scope import InFlight, RequestScope
from tandem.deployments.openai.streaming import Events, sse_events
from tandem.deployments.openai.structured_output import (
    chat_messages,
    tool_mode,
)
from tandem.deployments.orphans import UsageTag
from tandem.deployments.usage_metering import RequestMeter
from tandem.engine.protocol import GenerationRequest, RequestOutput
from tandem.engine.request import Priority
from tandem.platform.errors import InvalidRequestError, NotFoundError
from tandem.platform.telemetry import get_telemetry
from tandem.platform.tenancy import TenantRegistry
from tandem.platform.usage_log import UsageLog

logger = logging.getLogger("tandem.api")


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
        response_store: ResponseStore | None = None,
    ) -> None:
        """`usage_log`: where real-time requests' usage records go (None: not metered);
        `response_store`: where `/v1/responses` keeps responses (None: nothing is stored)."""
        self.response_store = response_store
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
        self.in_flight = InFlight()
        self.drain = Drain()

    @property
    def num_in_flight(self) -> int:
        """Requests running now (what a drain waits for)."""
        return self.in_flight.count

    # -- graceful stop (`drain.Drain`) -----------------------------------------------------
    def begin_drain(self, timeout_s: float) -> None:
        """Stop admitting and end what still runs after `timeout_s` (`Drain.begin`)."""
        self.drain.begin(timeout_s, self.num_in_flight)

    @property
    def draining(self) -> bool:
        return self.drain.draining

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
    def models(self, tenant: str, info: dict[str, object] | None = None) -> dict[str, object]:
        """The base model (with `info`, `model_info`'s precision and generation defaults) and this
        tenant's adapters (as `base:adapter`)."""
        return ModelList(data=self._cards(tenant, info)).model_dump(exclude_none=True)

    def model(self, tenant: str, model_id: str, info: dict[str, object] | None = None) -> dict[str, object]:
        """One model card (`GET /v1/models/{model}`): the base model or one of this tenant's
        adapters; 404 otherwise, including another tenant's adapter."""
        for card in self._cards(tenant, info):
            if card.id == model_id:
                return card.model_dump(exclude_none=True)
        raise NotFoundError(f"The model {model_id!r} does not exist", param="model", code="model_not_found")

    def _cards(self, tenant: str, info: dict[str, object] | None) -> list[ModelCard]:
        cards = [ModelCard(id=self.model_name, tandem=info)]
        if self.adapters is not None:
            cards += [
                ModelCard(id=f"{self.model_name}:{a.name}", created=a.created_at, owned_by=tenant)
                for a in self.adapters.list(tenant)
            ]
        return cards

    async def resolve_model(self, model: str, tenant: str) -> str | None:
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

    async def model_info(self) -> dict[str, object]:
        """The served model's precision and generation defaults (asked once, then cached: every
        replica of a served name runs the same)."""
        if self._model_info is None:
            self._model_info = await self.client.model_info()
        return self._model_info

    async def lora_info(self) -> dict[str, object]:
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
    ) -> dict[str, object] | AsyncIterator[str]:
        """`/v1/chat/completions`: a JSON body, or the SSE events to stream."""
        gen = await self._generation_request(req, tenant, priority, "chatcmpl", messages=chat_messages(req))
        return await self._run(
            gen,
            tenant,
            chat=True,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            timing=timing,
            tool_calls=tool_mode(req) is not None,
            api_key_id=api_key_id,
        )

    async def count_prompt_tokens(self, req: ChatCompletionRequest, tenant: str) -> int:
        """The tokens `req`'s conversation is as the model reads it (tools and template included),
        without running it."""
        gen = await self._generation_request(
            req, tenant, Priority.INTERACTIVE, "cnt", messages=chat_messages(req)
        )
        return await self.client.count_prompt_tokens(gen)

    async def completions(
        self,
        req: CompletionRequest,
        tenant: str,
        priority: Priority = Priority.INTERACTIVE,
        timing: ResponseTiming | None = None,
        api_key_id: str | None = None,
    ) -> dict[str, object] | AsyncIterator[str]:
        """`/v1/completions`: a JSON body, or the SSE events to stream."""
        if isinstance(req.prompt, str):
            gen = await self._generation_request(req, tenant, priority, "cmpl", prompt=req.prompt)
        else:
            gen = await self._generation_request(
                req, tenant, priority, "cmpl", prompt_token_ids=list(req.prompt)
            )
        return await self._run(
            gen,
            tenant,
            chat=False,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            timing=timing,
            api_key_id=api_key_id,
        )

    async def _generation_request(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        tenant: str,
        priority: Priority,
        id_prefix: str,
        **prompt: Any,
    ) -> GenerationRequest:
        """What the engine runs for an OpenAI request: its prompt (`messages`, `prompt` or
        `prompt_token_ids`), sampling, the tenant's defaults and limits, and its adapter."""
        lora_id = await self.resolve_model(req.model, tenant)
        params = sampling_params_from(req)
        return GenerationRequest(
            request_id=new_id(id_prefix),
            sampling_params=params,
            default_max_tokens=self._max_tokens_default_for(tenant, params.max_tokens),
            tenant_id=tenant,
            tenant_weight=self.tenants.weight_for(tenant),
            priority=priority,
            lora_name=lora_id,
            stream=bool(req.stream),
            cumulative=False,  # the routes read deltas, and the final output whole
            **prompt,
        )

    # -- running a request --------------------------------------------------------------
    async def _run(
        self,
        gen: GenerationRequest,
        tenant: str,
        *,
        chat: bool,
        include_usage: bool,
        timing: ResponseTiming | None = None,
        tool_calls: bool = False,
        api_key_id: str | None = None,
    ) -> dict[str, object] | AsyncIterator[str]:
        """Start `gen` and await its first output (so errors are HTTP errors); then a JSON body,
        or the SSE events to stream. `timing`, when given, is filled at the first output. With
        `tool_calls` (a chat request with tools), the text is parsed into tool calls.

        A real-time request is metered (`usage_log`) once the engine has it: a response's usage
        is stored before the client sees it (the JSON body, or a stream's usage chunk and
        `[DONE]`); a request that ends otherwise is recorded `cancelled` or `failed` without
        waiting. Its `RequestScope` gives back what it holds once, whatever ends it."""
        if timing is not None:
            timing.request_id = gen.request_id
        self.drain.check_admitting()
        if gen.sampling_params.logprobs is not None:
            await self.load_token_table()
        answer = Answer(gen, self._api_model(gen), self._names(), chat, tool_calls)
        scope = self.request_scope(gen, tenant, api_key_id)
        await scope.acquire()
        started, started_ns = time.monotonic(), time.time_ns()
        try:
            scope.start(self.client.generate(gen, self.usage_tag(scope)))
            assert scope.outputs is not None
            first = await self.drain.next_output(scope.outputs)  # validation errors surface here
            if first is None:
                raise RuntimeError(f"the engine stream of {gen.request_id} ended without an output")
            first_at = time.monotonic()
            scope.see(first)
            if failed_choice(first):  # failed before its first token: HTTP error
                raise engine_error(first, answer.constraint_param)
        except BaseException as exc:
            await scope.close(exc)
            raise
        if timing is not None:
            timing.first_output_at = first_at
            timing.engine_queue_s = first.metrics.phase_durations().get("queue")
            timing.engine_ttft_s = first.metrics.ttft
        times = (started, started_ns, first_at)
        if gen.stream:
            events = sse_events(
                answer,
                scope,
                first,
                self.drain.next_output,
                include_usage=include_usage,
                on_finished=lambda last: self._record(gen, tenant, last, *times),
            )
            return Events(events, scope)
        return await self._complete(answer, scope, first, times)

    async def _complete(
        self, answer: Answer, scope: RequestScope, first: RequestOutput, times: tuple[float, int, float]
    ) -> dict[str, object]:
        """Wait for the request to finish; its JSON body, its usage stored first."""
        assert scope.outputs is not None
        async with scope:
            scope.last = first
            while (out := await self.drain.next_output(scope.outputs)) is not None:
                scope.last = out
                scope.see(out)
        last = scope.last
        self._record(answer.gen, scope.tenant, last, *times)
        if failed_choice(last):
            scope.end_usage(None, failed=True)
            raise engine_error(last, answer.constraint_param)
        body = final_body(answer, last)
        await scope.commit_usage(last)
        return body

    def request_scope(self, gen: GenerationRequest, tenant: str, api_key_id: str | None) -> RequestScope:
        """What the request holds: interactive requests a tenant slot and, with a usage log, a
        meter (batch work has its own flow control and metering)."""
        accounted = gen.priority is Priority.INTERACTIVE
        meter = None
        if accounted and self.usage_log is not None:
            meter = RequestMeter(
                gen.request_id, tenant, api_key_id, self._api_model(gen), self._adapter_name(gen)
            )
        return RequestScope(
            self.in_flight, self.limiter, tenant, accounted=accounted, meter=meter, usage_log=self.usage_log
        )

    @staticmethod
    def usage_tag(scope: RequestScope) -> UsageTag | None:
        meter = scope.meter
        return None if meter is None else UsageTag(meter.api_key_id, meter.model, meter.adapter)

    def _adapter_name(self, gen: GenerationRequest) -> str | None:
        if gen.lora_name is None:
            return None
        return self._api_model(gen).partition(":")[2]
