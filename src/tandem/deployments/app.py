"""Builders for the Serve application, used by `tandem serve` and by `serve run`/`serve deploy`
(infra/serve/colocated.yaml points at `tandem.deployments.app:build_app`)."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any, cast

from ray import serve
from ray.serve.handle import DeploymentHandle

from tandem.batch.service import BatchService
from tandem.deployments.adapters import AdapterStore
from tandem.deployments.app_config import AppConfig
from tandem.deployments.autoscaling import AutoscalingConfig
from tandem.deployments.batch_worker import BatchWorkerReplica
from tandem.deployments.engine_clients import EngineClient, HandleEngineClient
from tandem.deployments.fleet import FLEET_STATE_DEPLOYMENT, FleetState, watch_drain
from tandem.deployments.ingress import create_app, install_server
from tandem.deployments.openai.endpoints import BATCH_ENDPOINTS
from tandem.deployments.openai.limiter import LocalTenantLimiter, TenantLimiter
from tandem.deployments.openai.response_store import ResponseStore
from tandem.deployments.openai.server import OpenAIServer
from tandem.deployments.replicas import (
    LLM_DEPLOYMENT,
    PREFILL_DEPLOYMENT,
    DecodeReplica,
    LLMReplica,
    PrefillReplica,
)
from tandem.deployments.tenant_leases import TENANT_BUDGET_DEPLOYMENT, LeasedTenantLimiter, TenantBudgetShard
from tandem.platform.api_keys import env_api_keys, env_operator_keys, parse_keys, parse_operator_keys
from tandem.platform.cpu import usable_cpus
from tandem.platform.local_state import SavedDocument, state_path
from tandem.platform.object_store import ObjectStore
from tandem.platform.store_guard import open_object_store
from tandem.platform.telemetry import get_telemetry
from tandem.platform.tenancy import TenantLimits, TenantRegistry
from tandem.platform.tenant_directory import TenantDirectory
from tandem.platform.usage_log import UsageLog

fastapi_app = create_app()


@serve.deployment(name="OpenAIIngress")
@serve.ingress(fastapi_app)
class OpenAIIngress:
    def __init__(
        self,
        llm: DeploymentHandle,
        fleet: DeploymentHandle,
        config: dict[str, Any],
        batch_worker: DeploymentHandle | None = None,
        budget_shards: list[DeploymentHandle] | None = None,
    ) -> None:
        cfg = AppConfig(**config)
        client = HandleEngineClient(llm, cfg.engine.api_model_name, fleet)
        server = openai_server(cfg, client, batch_worker, budget_shards)
        install_server(server)
        # A graceful stop: the fleet's drain stops admission here and ends what is still
        # running when its time is up (`OpenAIServer.begin_drain`).
        # The same poll brings the tenant directory's version: it is read only when it changed.
        self._drain_watch = asyncio.get_event_loop().create_task(
            watch_drain(
                fleet,
                lambda: server.num_in_flight,
                server.begin_drain,
                lambda view: server.tenants.directory_seen(view.directory_etag),
            )
        )
        self._server = server

    def __del__(self) -> None:
        """Serve stops the replica: store the usage records still queued."""
        usage_log = getattr(getattr(self, "_server", None), "usage_log", None)
        if usage_log is not None:
            usage_log.close(timeout_s=10.0)


def _tenant_registry(cfg: AppConfig, store: ObjectStore | None) -> TenantRegistry:
    """Tenants and keys: the bootstrap keys (config, keys file, environment), the operator keys,
    and with a store the live tenant directory."""
    spec = cfg.api_keys if cfg.api_keys is not None else env_api_keys()
    if cfg.keys_file:
        with open(cfg.keys_file) as f:
            spec = f.read() + "," + spec
    operator_spec = cfg.operator_keys if cfg.operator_keys is not None else env_operator_keys()
    directory = None
    if store is not None:
        directory = TenantDirectory(store, saved=SavedDocument(state_path("tenancy", store.url, ".json")))
        # The keys issued before this replica started work from its first request: read now, or,
        # with the store down, the copy saved on this machine (the API serves without the store).
        directory.warm_start()
    return TenantRegistry(
        parse_keys(spec),
        TenantLimits(cfg.max_concurrent_requests_per_tenant, cfg.tokens_per_minute_per_tenant),
        operator_keys=parse_operator_keys(operator_spec),
        directory=directory,
    )


def _usage_log(cfg: AppConfig, store: ObjectStore | None) -> UsageLog | None:
    if store is None or not cfg.meter_usage:
        return None
    usage_log = UsageLog(
        store, commit_interval_s=cfg.usage_commit_interval_s, on_committed=get_telemetry().record_usage
    )
    usage_log.start()  # ships what a stopped process of this store left spooled on this machine
    return usage_log


def openai_server(
    cfg: AppConfig,
    client: EngineClient,
    batch_worker: DeploymentHandle | None,
    budget_shards: list[DeploymentHandle] | None = None,
) -> OpenAIServer:
    """The OpenAI routes' server over `client`: tenants and keys (limits kept with the
    `budget_shards` when there are several ingress replicas), files, batches and adapters."""
    store = open_object_store(cfg.object_store) if cfg.object_store is not None else None
    tenants = _tenant_registry(cfg, store)
    tenants.start_refresh(cfg.tenant_refresh_s)
    batches = adapters = None
    if store is not None:
        batches = BatchService(
            store,
            {client.model_name},
            cfg.batch,
            default_max_tokens=cfg.max_tokens_default,
            endpoints=BATCH_ENDPOINTS,
        )
        adapters = AdapterStore(
            store,
            client.model_name,
            source_prefixes=tuple(cfg.adapter_source_prefixes),
            max_adapter_bytes=cfg.max_adapter_bytes,
            max_adapters_per_tenant=cfg.max_adapters_per_tenant,
            max_adapter_bytes_per_tenant=cfg.max_adapter_bytes_per_tenant,
            tenant_limits=tenants.adapter_limits_for,
        )
    limiter: TenantLimiter = LocalTenantLimiter(tenants, max_wait_s=cfg.tenant_queue_wait_s)
    if budget_shards:
        limiter = LeasedTenantLimiter(budget_shards, tenants)
    usage_log = _usage_log(cfg, store)
    server = OpenAIServer(
        client,
        tenants,
        max_tokens_default=cfg.max_tokens_default,
        batches=batches,
        adapters=adapters,
        limiter=limiter,
        usage_log=usage_log,
        response_store=ResponseStore(store) if store is not None else None,
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
# A replica Serve stops (scale-down, `serve.delete`, `serve.shutdown`) waits this long before it
# first counts its requests in flight, then again at this interval until none is left (Serve's
# default: 2 s). Routers learn of a removed replica within milliseconds; the 2 s wait was most of
# stopping an idle `tandem serve`, whose replicas are stopped one deployment after another
# (figures: docs/performance.md, "Serve stops in seconds"). Requests in flight still finish.
SHUTDOWN_WAIT_LOOP_S = 0.5
# Options every deployment of the graph takes.
COMMON_OPTIONS: dict[str, Any] = {
    "logging_config": QUIET_LOGGING,
    "graceful_shutdown_wait_loop_s": SHUTDOWN_WAIT_LOOP_S,
}


def replica_options(cfg: AppConfig) -> dict[str, Any]:
    """Serve options of the `LLMReplica` deployment: resources, environment, backpressure and
    scaling."""
    actor_options = cfg.placement_of(LLM_DEPLOYMENT).actor_options(cfg.replica_num_cpus)
    if cfg.replica_env_vars:
        actor_options["runtime_env"] = {"env_vars": dict(cfg.replica_env_vars)}
    options: dict[str, Any] = {
        "ray_actor_options": actor_options,
        **COMMON_OPTIONS,
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
        **COMMON_OPTIONS,
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
        engine["num_threads"] = cpus if cpus >= 1 else usable_cpus()
    return engine


def batch_worker_options(cfg: AppConfig) -> dict[str, Any]:
    """Serve options of the `BatchWorker` deployment: no CPU reserved (it waits on the LLM replicas
    and the object store), scaled on queued shards."""
    targets = cfg.batch_workers
    return {
        "ray_actor_options": cfg.placement_of("BatchWorker").actor_options(0),
        **COMMON_OPTIONS,
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


def _llm_deployment(cfg: AppConfig, fleet: serve.Application) -> serve.Application:
    """The LLM replicas: one kind, or in `disaggregated` mode decode replicas over prefill ones."""
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
    return llm


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
            **COMMON_OPTIONS,
        )
        .bind(
            max(10.0, 5 * cfg.routing.stats_period_s),
            scaling_targets=asdict(cfg.autoscaling.targets()) if cfg.autoscaling else None,
            object_store=cfg.object_store,
            directory_poll_s=cfg.tenant_refresh_s,
        )
    )
    llm = _llm_deployment(cfg, fleet)
    shards = None
    if cfg.ingress_num_replicas > 1:  # tenant limits across them: budget shards
        shards = [
            serve.deployment(name=f"{TENANT_BUDGET_DEPLOYMENT}-{index}")(TenantBudgetShard)
            .options(
                num_replicas=1,
                ray_actor_options=cfg.placement_of(TENANT_BUDGET_DEPLOYMENT).actor_options(0),
                **COMMON_OPTIONS,
            )
            .bind()
            for index in range(cfg.num_tenant_budget_shards)
        ]
    ingress = cast(serve.Deployment, OpenAIIngress).options(
        num_replicas=cfg.ingress_num_replicas,
        **COMMON_OPTIONS,
        ray_actor_options=cfg.placement_of("OpenAIIngress").actor_options(0),
        max_ongoing_requests=cfg.ingress_max_ongoing_requests,
    )
    if cfg.object_store is None:
        return ingress.bind(llm, fleet, cfg.model_dump(), None, shards)
    batch_worker = worker.bind(
        llm, *worker_args, fleet, max_batch_requests(cfg), cfg.engine.tenant_weights, cfg.tenant_refresh_s
    )
    return ingress.bind(llm, fleet, cfg.model_dump(), batch_worker, shards)
