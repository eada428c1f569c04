"""Builders for the Serve application, used by `tandem serve` and by `serve run`/`serve deploy`
(infra/serve/colocated.yaml points at `tandem.deployments.app:build_app`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import asdict
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from tandem.batch.service import BatchLimits, BatchService
from tandem.deployments.adapters import AdapterStore, check_source_prefix
from tandem.deployments.autoscaling import AutoscalingConfig, BatchQueueTargets, PrefillQueueTargets
from tandem.deployments.batch_worker import BatchWorkerReplica
from tandem.deployments.fleet import FLEET_STATE_DEPLOYMENT, FleetState, FleetTenantLimiter, watch_drain
from tandem.deployments.ingress import create_app, install_server
from tandem.deployments.openai_server import EngineClient, LocalTenantLimiter, OpenAIServer, TenantLimiter
from tandem.deployments.replicas import (
    LLM_DEPLOYMENT,
    PREFILL_DEPLOYMENT,
    DecodeReplica,
    LLMReplica,
    PrefillReplica,
)
from tandem.deployments.routing import RoutingConfig
from tandem.engine.protocol import GenerationRequest, RequestOutput
from tandem.platform.config import EngineConfig
from tandem.platform.errors import OverloadedError, ReplicaLostError, ServiceUnavailableError, TandemError
from tandem.platform.object_store import open_object_store
from tandem.platform.tenancy import TenantLimits, TenantRegistry, parse_keys, parse_operator_keys


class Placement(BaseModel):
    """Where a deployment's replicas may run: Ray resources each replica requests, on top of its
    CPUs. A GPU engine asks `num_gpus`; a CPU-only cluster pins engines to the nodes meant for them
    with a custom resource those nodes declare (`ray start --resources '{"tandem_engine": 4}'`)."""

    model_config = ConfigDict(extra="forbid")

    num_gpus: float = Field(0.0, ge=0.0, description="GPUs per replica")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources per replica, e.g. {'tandem_engine': 1}"
    )

    def actor_options(self, num_cpus: float) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": num_cpus}
        if self.num_gpus:
            options["num_gpus"] = self.num_gpus
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


DeploymentName = Literal["LLMReplica", "PrefillReplica", "OpenAIIngress", "BatchWorker", "FleetState"]


class AppConfig(BaseModel):
    """Everything `build_app` takes (also the `args:` of a Serve config file)."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(
        default_factory=lambda: EngineConfig.model_validate({}), description="The LLM replicas' engine"
    )
    mode: Literal["colocated", "disaggregated"] = Field(
        "colocated",
        description="'disaggregated': prompts are computed by a pool of prefill replicas (16-bit) and "
        "handed, verified, to the LLM replicas, which decode (INT4 + FP8 by default)",
    )
    prefill_engine: dict[str, Any] = Field(
        default_factory=dict,
        description="Disaggregated mode: EngineConfig fields of the prefill replicas that differ from "
        "`engine` (model and served name always come from `engine`)",
    )
    num_prefill_replicas: int = Field(1, ge=1, description="Disaggregated mode: prefill replicas")
    prefill_autoscaling: PrefillQueueTargets | None = Field(
        None,
        description="Disaggregated mode: when set, the prefill replicas scale on queued prompt tokens "
        "(target_prompt_tokens_per_replica, min_replicas, max_replicas) instead of num_prefill_replicas",
    )
    api_keys: str | None = Field(None, description="'key=tenant,...'; default: $TANDEM_API_KEYS")
    keys_file: str | None = Field(None, description="file of key=tenant lines")
    max_concurrent_requests_per_tenant: int | None = None
    tokens_per_minute_per_tenant: int | None = None
    tenant_queue_wait_s: float = Field(
        30.0,
        ge=0.0,
        description="A request over its tenant's concurrency limit waits this long for one of the "
        "tenant's requests to end (first come first served per tenant) before its 429 (0: at once). "
        "With several ingress replicas the 429 is immediate",
    )
    max_tokens_default: int = 256
    num_replicas: int = 1
    routing: RoutingConfig = Field(
        default_factory=lambda: RoutingConfig.model_validate({}), description="Which replica serves a request (adapter, prefix, load)"
    )
    autoscaling: AutoscalingConfig | None = Field(
        None, description="When set, the LLM replicas scale on KV occupancy and queue depth"
    )
    replica_num_cpus: float = 1.0
    placement: dict[DeploymentName, Placement] = Field(
        default_factory=dict,
        description="Per deployment, the GPUs and custom resources each replica requests (e.g. "
        "engines on GPU nodes, or pinned by a custom resource; ingress and batch workers on CPU nodes)",
    )
    replica_env_vars: dict[str, str] = Field(
        default_factory=dict,
        description="Environment of the LLM replicas' processes (Ray's runtime_env env_vars), for "
        "settings read at process start: Ray Serve's RAY_SERVE_* flags, OMP_* and the like",
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description="Tokens per streamed message from a replica (first token and end always at once); "
        "higher costs less CPU per token on small nodes, at coarser streaming",
    )
    max_ongoing_requests: int = Field(
        128, ge=1, description="Requests one LLM replica takes at once (Serve); more queue in the callers"
    )
    max_queued_requests: int = 128
    max_batch_requests_per_replica: int | None = Field(
        None,
        ge=1,
        description="Batch requests one LLM replica takes at once; more wait in the batch workers. "
        "Default: the engine's max_num_seqs, at most half of max_ongoing_requests, so real-time "
        "requests always find a seat in Serve and in the engine",
    )
    ingress_max_ongoing_requests: int = 1024
    ingress_num_replicas: int = Field(
        1,
        ge=1,
        description="Ingress replicas (Serve's proxy spreads requests over them); with more than one, "
        "tenant limits are kept by the FleetState deployment, one round trip per limited request",
    )
    object_store: str | None = Field(
        None,
        description="file:///path or s3://bucket/prefix for files, batches and adapters; "
        "None disables the files and batches API",
    )
    batch: BatchLimits = Field(default_factory=BatchLimits)
    batch_workers: BatchQueueTargets = Field(
        default_factory=BatchQueueTargets, description="The batch workers' scaling on queued shards"
    )
    batch_poll_interval_s: float = 1.0
    operator_keys: str | None = Field(
        None,
        description="'key1,key2': keys that may read /metrics (tenant keys cannot); "
        "default: $TANDEM_OPERATOR_KEYS; with none, /metrics is closed",
    )
    adapter_source_prefixes: list[str] = Field(
        default_factory=list,
        description="Per-tenant folder URIs an adapter upload may name as 'source' instead of sending "
        "files, each with '{tenant}' in it (s3://adapters/{tenant}/, file:///srv/adapters/{tenant}/); "
        "read with the server's credentials, only under the caller's own folder. Default: none",
    )

    max_adapter_bytes: int = 256 << 20
    max_adapters_per_tenant: int | None = Field(64, ge=1, description="Adapters one tenant may store (None: no limit)")
    max_adapter_bytes_per_tenant: int | None = Field(
        4 << 30, ge=1, description="Adapter weight bytes one tenant may store in all (None: no limit)"
    )

    @field_validator("adapter_source_prefixes")
    @classmethod
    def _per_tenant_prefixes(cls, prefixes: list[str]) -> list[str]:
        for prefix in prefixes:
            check_source_prefix(prefix)
        return prefixes

    def placement_of(self, deployment: str) -> Placement:
        """`placement[deployment]`, or no GPUs and no custom resources."""
        return self.placement.get(cast(DeploymentName, deployment)) or Placement.model_validate({})

    @model_validator(mode="after")
    def _seats_left_for_real_time(self) -> AppConfig:
        limit = self.max_batch_requests_per_replica
        if limit is not None and limit >= self.max_ongoing_requests:
            raise ValueError(
                f"max_batch_requests_per_replica ({limit}) must be below max_ongoing_requests "
                f"({self.max_ongoing_requests}): batch work must leave seats for real-time requests"
            )
        return self


fastapi_app = create_app()


class HandleEngineClient:
    """`EngineClient` over a Serve deployment handle to `LLMReplica` (streaming)."""

    def __init__(
        self,
        handle: DeploymentHandle,
        model_name: str,
        fleet: DeploymentHandle | None = None,
        liveness_check_s: float = 5.0,
    ) -> None:
        self.unary = handle
        self.handle = handle.options(stream=True)
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

    async def stats(self) -> dict[str, Any]:
        return cast(dict[str, Any], await self.unary.stats.remote())

    async def replica_stats(self) -> dict[str, dict[str, Any]]:
        """From the fleet state, which every replica reports to each routing-stats period."""
        if self.fleet is None:
            raise RuntimeError("this client has no fleet state to read replicas' stats from")
        return cast(dict[str, dict[str, Any]], await self.fleet.snapshot.remote())

    async def lora_info(self) -> dict[str, Any]:
        return cast(dict[str, Any], await self.unary.lora_info.remote())

    async def token_table(self) -> list[bytes]:
        return cast(list[bytes], await self.unary.token_table.remote())

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        response: DeploymentResponseGenerator | None = None
        try:
            # Inside a replica, `.remote()` itself may raise BackPressureError; outside, iterating does.
            handle = self.handle
            if request.lora_name is not None:  # route to replicas that already hold the adapter
                handle = handle.options(multiplexed_model_id=request.lora_name)
            response = cast(DeploymentResponseGenerator, handle.generate.remote(request))
            outputs = aiter(response)
            first: RequestOutput | TandemError = await self._first_output(outputs)
            if isinstance(first, TandemError):  # a client error the replica sent as a value
                raise first
            yield first
            async for output in outputs:
                yield output
        except BackPressureError as exc:  # every replica's queue is full: 429, never a hang
            raise OverloadedError(
                f"all replicas are busy ({exc.message}); retry shortly",
                retry_after_s=exc.retry_after_s or 1.0,
            ) from exc
        except RayActorError as exc:  # the replica died (Serve replaces it): not the request's fault
            raise ReplicaLostError() from exc
        finally:
            if response is not None:
                # Aborts the request on the replica if it is still running. On a response that
                # failed to be assigned, cancel() re-raises that failure: it must not replace ours.
                with contextlib.suppress(Exception):
                    response.cancel()


@serve.deployment(name="OpenAIIngress")
@serve.ingress(fastapi_app)
class OpenAIIngress:
    def __init__(
        self,
        llm: DeploymentHandle,
        fleet: DeploymentHandle,
        config: dict[str, Any],
        batch_worker: DeploymentHandle | None = None,
    ) -> None:
        cfg = AppConfig(**config)
        client = HandleEngineClient(llm, cfg.engine.api_model_name, fleet)
        server = openai_server(cfg, client, batch_worker, fleet)
        install_server(server)
        # A graceful stop: the fleet's drain stops admission here and ends what is still
        # running when its time is up (`OpenAIServer.begin_drain`).
        self._drain_watch = asyncio.get_event_loop().create_task(
            watch_drain(fleet, lambda: server.num_in_flight, server.begin_drain)
        )


def openai_server(
    cfg: AppConfig,
    client: EngineClient,
    batch_worker: DeploymentHandle | None,
    fleet: DeploymentHandle | None = None,
) -> OpenAIServer:
    """The OpenAI routes' server over `client`: tenants and keys (limits kept by `fleet` when
    there are several ingress replicas), files, batches and adapters."""
    spec = cfg.api_keys if cfg.api_keys is not None else os.environ.get("TANDEM_API_KEYS", "")
    if cfg.keys_file:
        with open(cfg.keys_file) as f:
            spec = f.read() + "," + spec
    operator_spec = cfg.operator_keys if cfg.operator_keys is not None else os.environ.get("TANDEM_OPERATOR_KEYS", "")
    tenants = TenantRegistry(
        parse_keys(spec),
        TenantLimits(cfg.max_concurrent_requests_per_tenant, cfg.tokens_per_minute_per_tenant),
        operator_keys=parse_operator_keys(operator_spec),
    )
    batches = adapters = None
    if cfg.object_store is not None:
        store = open_object_store(cfg.object_store)
        batches = BatchService(store, {client.model_name}, cfg.batch)
        adapters = AdapterStore(
            store,
            client.model_name,
            source_prefixes=tuple(cfg.adapter_source_prefixes),
            max_adapter_bytes=cfg.max_adapter_bytes,
            max_adapters_per_tenant=cfg.max_adapters_per_tenant,
            max_adapter_bytes_per_tenant=cfg.max_adapter_bytes_per_tenant,
        )
    limiter: TenantLimiter = LocalTenantLimiter(tenants, max_wait_s=cfg.tenant_queue_wait_s)
    if fleet is not None and cfg.ingress_num_replicas > 1:
        limiter = FleetTenantLimiter(fleet, tenants)
    server = OpenAIServer(
        client,
        tenants,
        max_tokens_default=cfg.max_tokens_default,
        batches=batches,
        adapters=adapters,
        limiter=limiter,
    )
    if batch_worker is not None:

        def wake_worker() -> None:
            batch_worker.wake.remote()

        server.on_batch_created = wake_worker
    return server


def max_batch_requests(cfg: AppConfig) -> int:
    """Batch requests one LLM replica takes at once (`max_batch_requests_per_replica`, resolved)."""
    if cfg.max_batch_requests_per_replica is not None:
        return cfg.max_batch_requests_per_replica
    return max(1, min(cfg.engine.max_num_seqs, cfg.max_ongoing_requests // 2))


# Serve's access log writes a line per call to a replica: the fleet state's reports each second
# and every internal call. Tandem logs its own line per request (`tandem.api`: route, tenant,
# status, code), so Serve's is off everywhere.
QUIET_LOGGING: dict[str, Any] = {"enable_access_log": False}


def replica_options(cfg: AppConfig) -> dict[str, Any]:
    """Serve options of the `LLMReplica` deployment: resources, environment, backpressure and
    scaling."""
    actor_options = cfg.placement_of(LLM_DEPLOYMENT).actor_options(cfg.replica_num_cpus)
    if cfg.replica_env_vars:
        actor_options["runtime_env"] = {"env_vars": dict(cfg.replica_env_vars)}
    options: dict[str, Any] = {
        "ray_actor_options": actor_options,
        "logging_config": QUIET_LOGGING,
        "max_ongoing_requests": cfg.max_ongoing_requests,
        "max_queued_requests": cfg.max_queued_requests,
        "request_router_config": cfg.routing.serve_options(),
    }
    if cfg.autoscaling is None:
        options["num_replicas"] = cfg.num_replicas
        return options
    targets = cfg.autoscaling.targets()
    options["autoscaling_config"] = {
        "min_replicas": targets.min_replicas,
        "max_replicas": targets.max_replicas,
        **cfg.autoscaling.serve_delays(),
        "policy": {
            "policy_function": "tandem.deployments.autoscaling:KVOccupancyPolicy",
            "policy_kwargs": asdict(targets),
        },
    }
    return options


def prefill_replica_options(cfg: AppConfig) -> dict[str, Any]:
    """Serve options of the `PrefillReplica` deployment (disaggregated mode): a fixed count, or
    scaling on queued prompt tokens with Serve's delays as the LLM replicas have them."""
    options: dict[str, Any] = {
        "ray_actor_options": cfg.placement_of(PREFILL_DEPLOYMENT).actor_options(cfg.replica_num_cpus),
        "logging_config": QUIET_LOGGING,
        "max_ongoing_requests": cfg.max_ongoing_requests,
    }
    targets = cfg.prefill_autoscaling
    if targets is None:
        options["num_replicas"] = cfg.num_prefill_replicas
        return options
    options["autoscaling_config"] = {
        "min_replicas": targets.min_replicas,
        "max_replicas": targets.max_replicas,
        **(cfg.autoscaling or AutoscalingConfig()).serve_delays(),
        "policy": {
            "policy_function": "tandem.deployments.autoscaling:PrefillQueuePolicy",
            "policy_kwargs": asdict(targets),
        },
    }
    return options


def replica_engine_options(cfg: AppConfig) -> dict[str, Any]:
    """Engine options for replicas. Ray sets OMP_NUM_THREADS to an actor's CPUs (1 when it
    reserves none), which silently halves a CPU replica on 2 cores; so the thread count is
    explicit: the replica's CPUs, or every core of this machine when it reserves none."""
    engine = cfg.engine.model_dump(exclude_unset=True)
    if cfg.object_store is not None:
        engine.setdefault("enable_lora", True)  # adapters can be uploaded: replicas serve them
    if engine.get("num_threads") is None:
        cpus = int(cfg.replica_num_cpus)
        engine["num_threads"] = cpus if cpus >= 1 else (os.cpu_count() or 1)
    return engine


def batch_worker_options(cfg: AppConfig) -> dict[str, Any]:
    """Serve options of the `BatchWorker` deployment: no CPU reserved (it waits on the LLM replicas
    and the object store), scaled on queued shards."""
    targets = cfg.batch_workers
    return {
        "ray_actor_options": cfg.placement_of("BatchWorker").actor_options(0),
        "logging_config": QUIET_LOGGING,
        "autoscaling_config": {
            "min_replicas": targets.min_replicas,
            "max_replicas": targets.max_replicas,
            **AutoscalingConfig().serve_delays(),  # Serve's delays, the replicas' defaults
            "policy": {
                "policy_function": "tandem.deployments.autoscaling:BatchQueuePolicy",
                "policy_kwargs": asdict(targets),
            },
        },
    }


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    cfg = AppConfig(**(args or {}))
    model_name = cfg.engine.api_model_name
    worker = serve.deployment(name="BatchWorker")(BatchWorkerReplica).options(**batch_worker_options(cfg))
    # after the LLM handle
    worker_args = (
        cfg.object_store,
        model_name,
        cfg.batch.model_dump(),
        cfg.batch_poll_interval_s,
        cfg.max_tokens_default,
    )
    fleet = (
        serve.deployment(name=FLEET_STATE_DEPLOYMENT)(FleetState)
        .options(
            num_replicas=1,
            ray_actor_options=cfg.placement_of(FLEET_STATE_DEPLOYMENT).actor_options(0),
            logging_config=QUIET_LOGGING,
        )
        .bind(max(10.0, 5 * cfg.routing.stats_period_s))
    )
    engine_options = replica_engine_options(cfg)
    if cfg.mode == "disaggregated":
        prefill_options = {**engine_options, **cfg.prefill_engine, "enable_lora": False}
        prefill = (
            serve.deployment(name=PREFILL_DEPLOYMENT)(PrefillReplica)
            .options(**prefill_replica_options(cfg))
            .bind(prefill_options)
        )
        decode = serve.deployment(name=LLM_DEPLOYMENT)(DecodeReplica).options(**replica_options(cfg))
        llm = decode.bind(
            prefill, engine_options, cfg.object_store, cfg.stream_interval, fleet, max_batch_requests(cfg)
        )
    else:
        replica = serve.deployment(name=LLM_DEPLOYMENT)(LLMReplica).options(**replica_options(cfg))
        llm = replica.bind(
            engine_options, None, cfg.object_store, cfg.stream_interval, fleet, max_batch_requests(cfg)
        )
    ingress = cast(serve.Deployment, OpenAIIngress).options(
        num_replicas=cfg.ingress_num_replicas,
        logging_config=QUIET_LOGGING,
        ray_actor_options=cfg.placement_of("OpenAIIngress").actor_options(0),
        max_ongoing_requests=cfg.ingress_max_ongoing_requests,
    )
    if cfg.object_store is None:
        return ingress.bind(llm, fleet, cfg.model_dump())
    batch_worker = worker.bind(llm, *worker_args, fleet, max_batch_requests(cfg), cfg.engine.tenant_weights)
    return ingress.bind(llm, fleet, cfg.model_dump(), batch_worker)
