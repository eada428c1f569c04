"""The engine clients the OpenAI server is built on (`EngineClient`): `LocalEngineClient` over an
in-process `AsyncEngine` (tests, the batch CLI), `HandleEngineClient` over the LLM replicas'
Serve deployment handle (the ingress and the batch workers). Ray is imported only by the latter,
when it runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, Protocol, cast

from tandem.deployments.adapters import AdapterStore, load_into_engine
from tandem.deployments.embedding_runs import run_embeddings
from tandem.deployments.orphans import CallerRef, UsageTag, current_caller
from tandem.engine.protocol import GenerationRequest, RequestOutput
from tandem.platform.errors import OverloadedError, ReplicaLostError, ServiceUnavailableError, TandemError

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

    from tandem.engine.async_engine import AsyncEngine

logger = logging.getLogger("tandem.api")


class EngineClient(Protocol):
    """What the server needs from an engine, all async: a streaming `generate`, the model name, and
    the engine's stats, LoRA limits and token bytes table. `LocalEngineClient` serves an
    in-process `AsyncEngine`; `HandleEngineClient` the replicas through Serve."""

    @property
    def model_name(self) -> str: ...

    def generate(
        self, request: GenerationRequest, usage: UsageTag | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs. `usage`: what to meter it as should this process die while the
        engine runs it (a replica in another process meters it then: orphans.py)."""
        ...

    async def stats(self) -> dict[str, object]:
        """One engine's stats (whichever answers): proves an engine is up."""
        ...

    async def replica_stats(self) -> dict[str, dict[str, object]]:
        """Every engine replica's stats, by replica id."""
        ...

    async def scaling_history(self) -> list[dict[str, object]]:
        """The last hour's autoscaling samples (`FleetState.scaling_history`; [] in one process)."""
        ...

    async def lora_info(self) -> dict[str, object]: ...

    async def model_info(self) -> dict[str, object]:
        """The served model's precision and generation defaults (`LLMEngine.model_info`)."""
        ...

    async def token_table(self) -> list[bytes]: ...

    async def embed(self, requests: list[GenerationRequest]) -> list[RequestOutput]:
        """The final outputs of embedding requests (`GenerationRequest.embed`), in order, run at
        once on one engine (`embedding_runs.run_embeddings`); a client's error raises."""
        ...

    async def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """The number of tokens `request`'s prompt is (its chat template applied), validated as
        the engine would validate it, without running it."""
        ...


LOCAL_REPLICA_ID = "local"  # the replica label of an in-process engine's figures


class LocalEngineClient:
    """`EngineClient` over an in-process `AsyncEngine` that loads adapters from the store on first
    use (what a Serve replica does through `@serve.multiplexed`); for tests and single-process use."""

    def __init__(self, engine: AsyncEngine, adapters: AdapterStore | None = None) -> None:
        self.engine = engine
        self.adapters = adapters

    @property
    def model_name(self) -> str:
        return str(self.engine.model_name)

    async def stats(self) -> dict[str, object]:
        return dict(self.engine.stats())

    async def replica_stats(self) -> dict[str, dict[str, object]]:
        return {LOCAL_REPLICA_ID: await self.stats()}

    async def scaling_history(self) -> list[dict[str, object]]:
        return []  # one engine in this process: nothing scales

    async def lora_info(self) -> dict[str, object]:
        return dict(self.engine.engine.adapters.info())

    async def model_info(self) -> dict[str, object]:
        return dict(self.engine.engine.model_info())

    async def token_table(self) -> list[bytes]:
        return list(self.engine.token_table())

    async def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return len((await self.engine.with_prompt_token_ids(request)).prompt_token_ids or [])

    async def embed(self, requests: list[GenerationRequest]) -> list[RequestOutput]:
        return await run_embeddings(self.engine, requests)

    async def generate(
        self, request: GenerationRequest, usage: UsageTag | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        if request.lora_name is not None and self.adapters is not None:  # store reads block: a thread
            await asyncio.to_thread(load_into_engine, self.engine.engine, self.adapters, request.lora_name)
        async for output in self.engine.generate(request):
            yield output


@contextlib.contextmanager
def replica_errors() -> Iterator[None]:
    """Serve's failures as the API's: every replica's queue full (`BackPressureError`) is a 429,
    never a hang; a replica that died (`RayActorError`; Serve replaces it) a 503, not the
    request's fault."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError

    try:
        yield
    except BackPressureError as exc:
        raise OverloadedError(
            f"all replicas are busy ({exc.message}); retry shortly", retry_after_s=exc.retry_after_s or 1.0
        ) from exc
    except RayActorError as exc:
        raise ReplicaLostError() from exc


def made_here(handle: DeploymentHandle) -> DeploymentHandle:
    """A handle to the same deployment made in this process, so that its transport is this
    process's Serve mode: a handle bound into the app graph is made where the graph is built (the
    CLI, a test) and carries that process's choice, by Ray object reference there, while in
    Serve's throughput-optimized mode the replicas' own handles speak gRPC to each other."""
    from ray import serve

    return serve.get_deployment_handle(handle.deployment_name, handle.app_name)


class HandleEngineClient:
    """`EngineClient` over a Serve deployment handle to `LLMReplica` (streaming)."""

    def __init__(
        self,
        handle: DeploymentHandle,
        model_name: str,
        fleet: DeploymentHandle | None = None,
        liveness_check_s: float = 5.0,
    ) -> None:
        handle = made_here(handle)
        self.unary = handle
        self.handle = handle.options(stream=True)
        self._caller: CallerRef | None = None  # this process as a caller (orphans.py)
        self._caller_known = False
        self.model_name = model_name
        self.fleet = fleet
        # A request with no first output after this long asks the fleet state whether any LLM
        # replica still reports; with none (their node was lost, none restarted yet) it is a
        # 503, not a wait for as long as the outage lasts.
        self.liveness_check_s = liveness_check_s

    async def _first_output(self, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
        first = asyncio.ensure_future(anext(outputs))
        try:
            while True:
                done, _ = await asyncio.wait({first}, timeout=self.liveness_check_s)
                if done:
                    return first.result()
                if self.fleet is not None and not await self.fleet.snapshot.remote():
                    raise ServiceUnavailableError(
                        "no model replica is running (a node may have been lost and not replaced yet); "
                        "retry shortly",
                        code="no_replica",
                    )
        finally:
            if not first.done():
                first.cancel()
                with contextlib.suppress(BaseException):
                    await first

    async def stats(self) -> dict[str, object]:
        return cast(dict[str, Any], await self.unary.stats.remote())

    async def replica_stats(self) -> dict[str, dict[str, object]]:
        """From the fleet state, which every replica reports to each routing-stats period."""
        if self.fleet is None:
            raise RuntimeError("this client has no fleet state to read replicas' stats from")
        return cast(dict[str, dict[str, Any]], await self.fleet.snapshot.remote())

    async def scaling_history(self) -> list[dict[str, object]]:
        if self.fleet is None:
            return []
        return cast(list[dict[str, Any]], await self.fleet.scaling_history.remote())

    async def lora_info(self) -> dict[str, object]:
        return cast(dict[str, Any], await self.unary.lora_info.remote())

    async def model_info(self) -> dict[str, object]:
        return cast(dict[str, Any], await self.unary.model_info.remote())

    async def token_table(self) -> list[bytes]:
        return cast(list[bytes], await self.unary.token_table.remote())

    async def embed(self, requests: list[GenerationRequest]) -> list[RequestOutput]:
        """One call to one replica for all of them (they batch there, in one hop)."""
        with replica_errors():
            result = await self.unary.embed.remote(requests)
        if isinstance(result, TandemError):  # a client error the replica sent as a value
            raise result
        return cast(list[RequestOutput], result)

    async def count_prompt_tokens(self, request: GenerationRequest) -> int:
        counted = await self.unary.count_prompt_tokens.remote(request)
        if isinstance(counted, TandemError):  # a client error the replica sent as a value
            raise counted
        return int(counted)

    def _start(self, request: GenerationRequest, usage: UsageTag | None) -> DeploymentResponseGenerator:
        """Send `request` to a replica (one that holds its adapter, where any does), with this
        process as its caller (`orphans.py`) and `usage` to meter it as should this process die."""
        handle = self.handle
        if request.lora_name is not None:  # route to replicas that already hold the adapter
            handle = handle.options(multiplexed_model_id=request.lora_name)
        if not self._caller_known:  # this process as a caller, looked up once
            self._caller, self._caller_known = current_caller(None), True
        caller = self._caller
        if caller is not None and usage is not None:
            caller = CallerRef(caller.actor_name, caller.namespace, usage)
        return cast("DeploymentResponseGenerator", handle.generate.remote(request, caller))

    async def generate(
        self, request: GenerationRequest, usage: UsageTag | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        response: DeploymentResponseGenerator | None = None
        finished = False
        try:
            with replica_errors():  # inside a replica `.remote()` itself may raise BackPressureError
                response = self._start(request, usage)
                outputs = aiter(response)
                first: RequestOutput | TandemError = await self._first_output(outputs)
                if isinstance(first, TandemError):  # a client error the replica sent as a value
                    raise first
                finished = first.finished
                yield first
                # Done at the final output: the replica's stream closes a little later (`orphans.py`)
                if not finished:
                    async for output in outputs:  # the replica sent the prompt with the first only
                        finished = output.finished
                        yield output.with_prompt_of(first)
                        if finished:
                            break
        finally:
            if response is not None and not finished:
                # Aborts the request on the replica if it is still running. On a response that
                # failed to be assigned, cancel() re-raises that failure: it must not replace ours.
                try:
                    response.cancel()
                except Exception as cancel_exc:  # noqa: BLE001 - the request's own outcome stands
                    logger.debug(
                        "cancelling a replica response failed", extra={"error": str(cancel_exc)[:200]}
                    )
