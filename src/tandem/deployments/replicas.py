"""`LLMReplica`: a thin shim between Ray Serve and an `AsyncEngine` (injected, so testable alone).

Serve calls `generate` as a streaming method; cancelling the caller (client disconnect)
cancels this generator, which aborts the request in the engine and frees its KV blocks.
`record_autoscaling_stats` feeds the KV-occupancy/queue-depth autoscaling policy;
`record_routing_stats` feeds the request router (routing.py) and, on the way, sends the engine's
stats to the application's `FleetState` (fleet.py) for `/metrics`.

Every message a replica streams costs CPU in three processes (this one, the ingress, the HTTP
proxy), and on a small CPU node that CPU comes out of the model's cores. `stream_interval` sends
one message per that many new tokens (the first token and the end always go at once), the
knob SGLang calls `--stream-interval`.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, cast

import ray
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle

from tandem.deployments.adapters import AdapterStore, load_into_engine
from tandem.deployments.embedding_runs import run_embeddings
from tandem.deployments.orphans import CallerRef, OrphanWatch
from tandem.engine.kv.transfer import KVPrefixEvictedError, KVTransfer
from tandem.engine.protocol import GenerationRequest, RequestOutput
from tandem.engine.request import Priority
from tandem.platform.errors import BatchCapacityError, ServiceUnavailableError, TandemError
from tandem.platform.store_guard import open_object_store
from tandem.platform.usage_log import UsageLog

if TYPE_CHECKING:  # the engine (and torch) loads in the replica's process only, not in the ingress's
    from tandem.engine.async_engine import AsyncEngine

# The Serve deployment name of the LLM replicas (the batch worker looks it up).
LLM_DEPLOYMENT = "LLMReplica"

# Adapters Serve tracks per replica for routing; the engine's own LRU (`max_cpu_loras`) decides
# what stays in memory, and unloading here only drops the engine's copy when no request uses it.
MAX_ADAPTERS_PER_REPLICA = 16


class _LoadedAdapter:
    """What `@serve.multiplexed` caches per adapter; Serve calls `__del__` when it evicts one."""

    def __init__(self, engine: AsyncEngine, lora_id: str) -> None:
        self.engine, self.lora_id = engine, lora_id

    def __del__(self) -> None:
        self.engine.engine.adapters.remove(self.lora_id)


# The young generation's threshold in a replica (CPython's default is 700 allocations): an engine
# step allocates thousands of short-lived objects, and each collection also walks the survivors.
REPLICA_GC_THRESHOLD = 10_000


def settle_heap() -> None:
    """In a Serve replica's process, once its engine is loaded: move every object alive now (the
    model, the tokenizer, Ray's and the libraries' own) out of the cyclic collector's reach
    (`gc.freeze`) and collect young objects less often, so that the engine's steps do not pay
    for walking them (docs/performance.md, issue 63). Nothing happens outside an actor (a test that
    builds a replica in its own process keeps its collector as it is)."""
    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        freeze_loaded_heap()


def freeze_loaded_heap() -> None:
    """`settle_heap`'s work, in any process (benchmarks/platform_overhead.py measures an engine as a
    replica runs it)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(REPLICA_GC_THRESHOLD, *gc.get_threshold()[1:])


class LLMReplica:
    def __init__(
        self,
        engine_options: dict[str, Any] | None = None,
        engine_factory: Callable[[], AsyncEngine] | None = None,
        object_store: str | None = None,
        stream_interval: int = 1,
        fleet: DeploymentHandle | None = None,
        max_batch_requests: int | None = None,
    ) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.stream_interval = stream_interval
        # Batch requests this replica takes at once (None: no limit); more are refused at once
        # with `BatchCapacityError`, so they never fill Serve's `max_ongoing_requests` seats that
        # real-time requests need, nor queue in the engine past what it can run.
        self.max_batch_requests = max_batch_requests
        self.num_batch_requests = 0
        self.num_batch_requests_refused = 0
        if engine_factory is not None:
            self.engine = engine_factory()
        else:
            from tandem.engine.async_engine import AsyncEngine

            self.engine = AsyncEngine.from_options(**(engine_options or {}))
        settle_heap()
        self.adapters = (
            AdapterStore(open_object_store(object_store), self.engine.model_name) if object_store else None
        )
        self.fleet = fleet
        # Requests whose caller died: aborted here, metered with what was streamed (orphans.py).
        self.object_store = object_store
        self._usage_log: UsageLog | None = None
        self.orphans = OrphanWatch(self.engine.abort, self._orphan_usage_log)

    def _orphan_usage_log(self) -> UsageLog | None:
        if self._usage_log is None and self.object_store is not None:
            self._usage_log = UsageLog(open_object_store(self.object_store))
        return self._usage_log

    @serve.multiplexed(max_num_models_per_replica=MAX_ADAPTERS_PER_REPLICA)
    async def load_adapter(self, lora_id: str) -> _LoadedAdapter:
        """Fetch an adapter from the object store into this replica's engine (first use only)."""
        if self.adapters is None:
            raise RuntimeError("this replica has no object store to load adapters from")
        await asyncio.to_thread(load_into_engine, self.engine.engine, self.adapters, lora_id)
        return _LoadedAdapter(self.engine, lora_id)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """The request's outputs, every `stream_interval` tokens, after loading its adapter."""
        if request.lora_name is not None:
            await self.load_adapter(request.lora_name)
        async for output in self.engine.generate(request, self.stream_interval):
            yield output

    async def generate(
        self, request: GenerationRequest, caller: CallerRef | None = None
    ) -> AsyncIterator[RequestOutput | TandemError]:
        """`stream` for callers in other processes (ingress, batch workers). A batch request over
        `max_batch_requests` is refused before it starts (`BatchCapacityError`). A client's error
        (a 4xx: bad input, a prompt too long) is sent as the only value, for the caller to raise:
        raised here, Serve would log it as a replica failure with its traceback. With `caller`,
        the request is aborted (and metered, with its usage tag) if that process dies first, and
        the stream closes only once `OrphanWatch.settle` allows: the caller ends its side at the
        final output, not at the stream's end."""
        is_batch = request.priority is Priority.BATCH
        if is_batch:
            if self.max_batch_requests is not None and self.num_batch_requests >= self.max_batch_requests:
                self.num_batch_requests_refused += 1
                yield BatchCapacityError(
                    f"this replica runs {self.num_batch_requests} batch requests, its limit; send it again later"
                )
                return
            self.num_batch_requests += 1
        started = False
        if caller is not None:
            self.orphans.start(request.request_id, request.tenant_id, caller)
        try:
            try:
                async for output in self.stream(request):
                    # cumulative fields and the prompt cross processes once (`RequestOutput.for_the_wire`)
                    yield output.for_the_wire(first=not started)
                    started = True
                    if caller is not None:
                        self.orphans.streamed(request.request_id, output)
            except TandemError as exc:
                if started or exc.status_code >= 500:
                    raise
                yield exc
            finally:
                if is_batch:
                    self.num_batch_requests -= 1
            if caller is not None:
                await self.orphans.settle(request.request_id)
        except (GeneratorExit, asyncio.CancelledError):
            if caller is not None:  # closed from the caller's side: by its death too, over gRPC
                self.orphans.cut(request.request_id)
            raise
        finally:
            if caller is not None:
                self.orphans.end(request.request_id)

    async def model_name(self) -> str:
        return self.engine.model_name

    async def stats(self) -> dict[str, Any]:
        """The engine's stats, this replica's process id and its batch seats."""
        return {
            **self.engine.stats(),
            "pid": os.getpid(),
            "num_batch_requests": self.num_batch_requests,
            "num_batch_requests_refused": self.num_batch_requests_refused,
        }

    async def lora_info(self) -> dict[str, object]:
        return self.engine.engine.adapters.info()

    async def model_info(self) -> dict[str, object]:
        return self.engine.engine.model_info()

    async def token_table(self) -> list[bytes]:
        return self.engine.token_table()

    async def embed(self, requests: list[GenerationRequest]) -> list[RequestOutput] | TandemError:
        """One embeddings call's inputs (`EngineClient.embed`). A batch call over
        `max_batch_requests` is refused (`BatchCapacityError`) and counts as one batch request
        while it runs; a client's error is returned as a value, as `generate` sends it."""
        is_batch = bool(requests) and requests[0].priority is Priority.BATCH
        if is_batch:
            if self.max_batch_requests is not None and self.num_batch_requests >= self.max_batch_requests:
                self.num_batch_requests_refused += 1
                return BatchCapacityError(
                    f"this replica runs {self.num_batch_requests} batch requests, its limit; send it again later"
                )
            self.num_batch_requests += 1
        try:
            return await run_embeddings(self.engine, requests)
        except TandemError as exc:
            if exc.status_code >= 500:
                raise
            return exc
        finally:
            if is_batch:
                self.num_batch_requests -= 1

    async def count_prompt_tokens(self, request: GenerationRequest) -> int | TandemError:
        """The prompt's length in tokens (`EngineClient.count_prompt_tokens`); a client's error
        is returned as a value, as `generate` sends it."""
        try:
            return len((await self.engine.with_prompt_token_ids(request)).prompt_token_ids or [])
        except TandemError as exc:
            if exc.status_code >= 500:
                raise
            return exc

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metrics (Ray Serve calls this on each replica periodically)."""
        return _load_figures(self.engine.stats())

    async def record_routing_stats(self) -> dict[str, float]:
        """What the request router weighs (Serve calls this every `RoutingConfig.stats_period_s`);
        also reports the full stats to the fleet state (for /metrics). On the replica's event loop
        (async): a handle call from Serve's thread pool is refused where Serve runs the handle's
        router on the caller's loop (`RAY_SERVE_THROUGHPUT_OPTIMIZED`)."""
        stats = self.engine.stats()
        if self.fleet is not None:
            stats["reported_at"] = time.time()
            replica_id = serve.get_replica_context().replica_id.unique_id
            self.fleet.report.remote(replica_id, stats)  # fire and forget: the next one replaces it
        return _load_figures(stats)

    def check_health(self) -> None:
        if not self.engine.is_alive():
            raise RuntimeError("engine loop thread has stopped")


def _load_figures(stats: dict[str, Any]) -> dict[str, float]:
    return {key: float(stats[key]) for key in ("kv_occupancy", "num_waiting", "num_running")}


# The Serve deployment name of the prefill replicas (disaggregated mode).
PREFILL_DEPLOYMENT = "PrefillReplica"


class PrefillReplica:
    """Computes prompts for decode replicas (disaggregated mode): the prompt's KV and first token,
    returned as a verified `KVTransfer` in the decode cache's dtype. Its blocks are freed when the
    transfer is built (or when the hold lease runs out, if the caller went away)."""

    def __init__(self, engine_options: dict[str, Any] | None = None) -> None:
        from tandem.engine.async_engine import AsyncEngine

        self.engine = AsyncEngine.from_options(**{"role": "prefill", **(engine_options or {})})
        settle_heap()

    async def prefill(
        self, request: GenerationRequest, cache_dtype: str | None = None, skip_pages: int = 0
    ) -> KVTransfer:
        return await self.engine.prefill(request, cache_dtype, skip_pages)

    async def stats(self) -> dict[str, Any]:
        """The engine's stats, and this replica's process id."""
        return {**self.engine.stats(), "pid": os.getpid()}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What `PrefillQueuePolicy` scales on."""
        queued = self.engine.stats()["queued_prompt_tokens"]
        assert isinstance(queued, int | float)
        return {"queued_prompt_tokens": float(queued)}

    def check_health(self) -> None:
        if not self.engine.is_alive():
            raise RuntimeError("engine loop thread has stopped")


class DecodeReplica(LLMReplica):
    """An `LLMReplica` whose prompts a prefill replica computes (disaggregated mode): it asks the
    prefill pool for the prompt's KV in its own cache dtype, imports it (verified) and decodes.
    A prefill replica that fails or dies is retried once on another; a LoRA request is computed
    here whole (prefill replicas hold no adapters), and so is a request for n > 1 choices (its
    choices share the prompt's blocks in one engine)."""

    def __init__(
        self,
        prefill: DeploymentHandle,
        engine_options: dict[str, Any] | None = None,
        object_store: str | None = None,
        stream_interval: int = 1,
        fleet: DeploymentHandle | None = None,
        max_batch_requests: int | None = None,
    ) -> None:
        super().__init__(
            {"role": "decode", **(engine_options or {})},
            None,
            object_store,
            stream_interval,
            fleet,
            max_batch_requests,
        )
        self.prefill = prefill
        self.num_prefill_retries = 0  # prefill calls retried after a prefill replica died
        self.num_whole_transfers_after_eviction = 0  # skipped pages evicted before the import

    async def stats(self) -> dict[str, Any]:
        return {
            **await super().stats(),
            "num_prefill_retries": self.num_prefill_retries,
            "num_whole_transfers_after_eviction": self.num_whole_transfers_after_eviction,
        }

    async def stream(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        if request.lora_name is not None or request.sampling_params.n > 1:
            async for output in super().stream(request):
                yield output
            return
        # Tokenised once, here: the prefill replica and the import read the token ids. Pages this
        # replica's prefix cache holds are not sent; should they be evicted before the transfer
        # arrives, the request asks once more for all of them.
        request = await self.engine.with_prompt_token_ids(request)
        skip_pages = await self.engine.cached_prefix_pages(request)
        transfer = await self._remote_prefill(request, skip_pages)
        try:
            async for output in self.engine.generate_from_kv(request, transfer, self.stream_interval):
                yield output
        except KVPrefixEvictedError:
            self.num_whole_transfers_after_eviction += 1
            transfer = await self._remote_prefill(request, 0)
            async for output in self.engine.generate_from_kv(request, transfer, self.stream_interval):
                yield output

    async def _remote_prefill(self, request: GenerationRequest, skip_pages: int) -> KVTransfer:
        """The prompt's KV from a prefill replica, in this cache's dtype; a replica that died is
        retried once (Serve routes the retry to a live one)."""
        cache_dtype = self.engine.engine.kv_cache_dtype
        for attempt in range(2):
            try:
                return cast(KVTransfer, await self.prefill.prefill.remote(request, cache_dtype, skip_pages))
            except RayActorError as exc:
                if attempt == 1:
                    raise ServiceUnavailableError(
                        "the prefill replicas failed twice for this request; retry it", code="prefill_failed"
                    ) from exc
                self.num_prefill_retries += 1
        raise AssertionError("unreachable")
