"""`AppConfig`: everything the Serve application takes (`build_app`, `tandem serve`, the `args:`
of a Serve config file), validated at the edge; and `Placement` of each deployment's replicas."""

from __future__ import annotations

from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tandem.batch.service import BatchLimits
from tandem.deployments.adapters import check_source_prefix
from tandem.deployments.autoscaling import AutoscalingConfig, BatchQueueTargets, PrefillQueueTargets
from tandem.deployments.routing import RoutingConfig
from tandem.platform.config import EngineConfig


class Placement(BaseModel):
    """Where a deployment's replicas may run: Ray resources each replica requests, on top of its
    CPUs. A GPU engine asks `num_gpus`; a CPU-only cluster pins engines to the nodes meant for them
    with a custom resource those nodes declare (`ray start --resources '{"tandem_engine": 4}'`)."""

    model_config = ConfigDict(extra="forbid")

    num_gpus: float = Field(0.0, ge=0.0, description="GPUs per replica")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources per replica, e.g. {'tandem_engine': 1}"
    )

    def actor_options(self, num_cpus: float) -> dict[str, object]:
        options: dict[str, Any] = {"num_cpus": num_cpus}
        if self.num_gpus:
            options["num_gpus"] = self.num_gpus
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


DeploymentName = Literal[
    "LLMReplica", "PrefillReplica", "OpenAIIngress", "BatchWorker", "FleetState", "TenantBudget"
]


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
        default_factory=lambda: RoutingConfig.model_validate({}),
        description="Which replica serves a request (adapter, prefix, load)",
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
    tenant_budget_shards: int | None = Field(
        None,
        ge=1,
        le=256,
        description="With several ingress replicas, tenant limits are kept in this many TenantBudget "
        "deployments, each tenant in one (default: one per 32 ingress replicas)",
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
        description="'key1,key2': keys that may read /metrics and use /v1/admin (tenant keys cannot); "
        "default: $TANDEM_OPERATOR_KEYS; with none, both are closed",
    )
    tenant_refresh_s: float = Field(
        1.0,
        gt=0.0,
        le=60.0,
        description="How often each ingress replica re-reads the tenant directory in the object store "
        "(tenants, keys, limits changed through /v1/admin take effect everywhere within this)",
    )
    meter_usage: bool = Field(
        True,
        description="Record each request's usage in the object store (needs one); off: the usage API is 404",
    )
    usage_commit_interval_s: float = Field(
        1.0,
        ge=0.0,
        le=60.0,
        description="Usage metering (with an object store): a response's usage record is on the "
        "replica's local disk (a write-ahead spool) before the client sees it; each ingress replica "
        "ships its spooled records to the object store when 2,000 wait or the oldest has waited this "
        "long (an idle replica makes no store call)",
    )
    adapter_source_prefixes: list[str] = Field(
        default_factory=list,
        description="Per-tenant folder URIs an adapter upload may name as 'source' instead of sending "
        "files, each with '{tenant}' in it (s3://adapters/{tenant}/, file:///srv/adapters/{tenant}/); "
        "read with the server's credentials, only under the caller's own folder. Default: none",
    )

    max_adapter_bytes: int = 256 << 20
    max_adapters_per_tenant: int | None = Field(
        64, ge=1, description="Adapters one tenant may store (None: no limit)"
    )
    max_adapter_bytes_per_tenant: int | None = Field(
        4 << 30, ge=1, description="Adapter weight bytes one tenant may store in all (None: no limit)"
    )

    @field_validator("prefill_engine")
    @classmethod
    def _prefill_engine_fields(cls, overrides: dict[str, object]) -> dict[str, object]:
        """Only `EngineConfig` fields, each valid on its own (checked again over `engine` when
        the prefill replicas are built); the model and its served name are `engine`'s."""
        unknown = sorted(set(overrides) - set(EngineConfig.model_fields))
        if unknown:
            raise ValueError(f"prefill_engine: {', '.join(unknown)} are not engine settings")
        fixed = sorted(set(overrides) & {"model", "served_model_name"})
        if fixed:
            raise ValueError(f"prefill_engine: {', '.join(fixed)} come from `engine`")
        EngineConfig.model_validate({"model": "check", **overrides})
        return overrides

    @field_validator("adapter_source_prefixes")
    @classmethod
    def _per_tenant_prefixes(cls, prefixes: list[str]) -> list[str]:
        for prefix in prefixes:
            check_source_prefix(prefix)
        return prefixes

    @property
    def num_tenant_budget_shards(self) -> int:
        """`tenant_budget_shards`, resolved: one per 32 ingress replicas unless set."""
        if self.tenant_budget_shards is not None:
            return self.tenant_budget_shards
        return max(1, -(-self.ingress_num_replicas // 32))

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
