"""`tandem serve`'s flags and environment, turned into the application's config in one place:
tenant limits and weights, the Serve config file, and the keys the environment holds."""

from __future__ import annotations

import argparse
import os
from typing import Any

from tandem.platform.api_keys import env_api_keys
from tandem.platform.config import EngineConfig
from tandem.platform.errors import InvalidRequestError

# Ray Serve's variables for every Ray worker of the app (the Serve controller, proxies and
# replicas; not the driver). Serve's documented throughput-optimized mode is on: gRPC between the
# replicas (`engine_clients.made_here`: the handles that carry requests are made in the replicas),
# a handle's router on its caller's event loop, the collector frozen at start. Three of its parts
# are off:
# - Direct ingress (the ingress replica serving HTTP on a port of its own, 30000-31000, for a load
#   balancer in front of the replicas, such as Serve's HAProxy mode): Serve's proxy carries our
#   HTTP, and a direct-ingress replica waits out a 30 s window for that balancer when it stops, so
#   every stop of `tandem serve` (Ctrl-C, SIGTERM) took 34 s instead of 9, and `serve.delete` of
#   an idle app 31 s instead of 1 (docs/performance.md).
# - User code keeps an event loop of its own, apart from the one where Ray reports a stream's
#   outputs (`RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=1`, Serve's default outside that mode):
#   with both on one loop (and the handles on Ray's actor calls), a killed batch worker stalled a
#   real-time stream for 2 s once in CI, a stall not diagnosed (docs/performance.md).
# - Serve's access log is written per request, as by default (that mode buffers 1,000 lines: a
#   quiet server's log would lag by hours).
# Streamed tokens cost about a third of the CPU they cost in Serve's default mode
# (docs/performance.md, issue 63). Each variable is overridden by the environment of `tandem
# serve` (`RAY_SERVE_THROUGHPUT_OPTIMIZED=0`: Serve's default mode). Every handle call of ours is
# made from an event loop, which that mode requires.
SERVE_ENV_VARS = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
}


def runtime_env() -> dict[str, Any]:
    """The app's Ray runtime env: every worker process (the Serve replicas) writes tandem's logs as
    structured lines (platform/logs.py; set up when the process starts, not in the classes'
    constructors, which tests also run in their own process), and Serve's variables are
    `SERVE_ENV_VARS`, each overridden by this process's environment where it sets one
    (`RAY_SERVE_THROUGHPUT_OPTIMIZED=0 tandem serve` runs Serve's default mode)."""
    return {
        "worker_process_setup_hook": "tandem.platform.logs.configure_logging",
        "env_vars": {name: os.environ.get(name, default) for name, default in SERVE_ENV_VARS.items()},
    }


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    try:
        return int(value)
    except ValueError:
        raise InvalidRequestError(f"${name} must be a whole number, not {value!r}", param=name) from None


def _tenant_weights(specs: list[str]) -> dict[str, float]:
    """'TENANT=WEIGHT' pairs (flags, then comma-separated $TANDEM_TENANT_WEIGHTS) -> weights."""
    weights: dict[str, float] = {}
    for spec in [*os.environ.get("TANDEM_TENANT_WEIGHTS", "").split(","), *specs]:
        if not spec.strip():
            continue
        tenant, _, weight = spec.partition("=")
        try:
            value = float(weight)
        except ValueError:
            value = 0.0
        if not tenant.strip() or not value > 0:  # also NaN
            raise InvalidRequestError(
                f"tenant weight {spec!r} must look like TENANT=WEIGHT with WEIGHT > 0", param="tenant_weight"
            )
        weights[tenant.strip()] = value
    return weights


def tenant_limits(args: argparse.Namespace) -> dict[str, int | None]:
    """Per-tenant limits for `tandem serve`: the flag, else $TANDEM_MAX_CONCURRENT_PER_TENANT /
    $TANDEM_TOKENS_PER_MINUTE_PER_TENANT / $TANDEM_MAX_ADAPTERS_PER_TENANT /
    $TANDEM_MAX_ADAPTER_BYTES_PER_TENANT, else the defaults: a tenant holds at most half of the
    fleet's engine seats (so another tenant always finds some), has no token rate limit, and
    stores at most 64 adapters of 4 GiB in all. 0 means no limit."""
    concurrent = args.max_concurrent_per_tenant
    if concurrent is None:
        concurrent = _env_int("TANDEM_MAX_CONCURRENT_PER_TENANT")
    if concurrent is None:
        seats = args.num_replicas * EngineConfig.model_fields["max_num_seqs"].default
        concurrent = max(1, seats // 2)
    tokens = args.tokens_per_minute_per_tenant
    if tokens is None:
        tokens = _env_int("TANDEM_TOKENS_PER_MINUTE_PER_TENANT")
    adapters = args.max_adapters_per_tenant
    if adapters is None:
        adapters = _env_int("TANDEM_MAX_ADAPTERS_PER_TENANT")
    if adapters is None:
        adapters = 64
    adapter_bytes = args.max_adapter_bytes_per_tenant
    if adapter_bytes is None:
        adapter_bytes = _env_int("TANDEM_MAX_ADAPTER_BYTES_PER_TENANT")
    if adapter_bytes is None:
        adapter_bytes = 4 << 30
    for name, value in (
        ("max_concurrent_per_tenant", concurrent),
        ("tokens_per_minute_per_tenant", tokens),
        ("max_adapters_per_tenant", adapters),
        ("max_adapter_bytes_per_tenant", adapter_bytes),
    ):
        if value is not None and value < 0:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be >= 0 (0: no limit)", param=name)
    return {
        "max_concurrent_requests_per_tenant": concurrent or None,
        "tokens_per_minute_per_tenant": tokens or None,
        "max_adapters_per_tenant": adapters or None,
        "max_adapter_bytes_per_tenant": adapter_bytes or None,
    }


def app_config_args(args: argparse.Namespace) -> dict[str, Any]:
    """`AppConfig` fields from `tandem serve`'s flags (keys come from the environment at run time)."""
    engine: dict[str, object] = {"model": args.model}
    weights = _tenant_weights(args.tenant_weight)
    if weights:
        engine["tenant_weights"] = weights
    if args.served_model_name:
        engine["served_model_name"] = args.served_model_name
    if args.max_model_len:
        engine["max_model_len"] = args.max_model_len
    if args.kv_cache_memory:
        engine["kv_cache_memory"] = args.kv_cache_memory
    for option in (
        "dtype", "weight_dtype", "generation_config", "batch_invariant",
        "max_num_seqs", "max_num_batched_tokens", "null_model_step_ms",
    ):  # fmt: skip
        if getattr(args, option) is not None:
            engine[option] = getattr(args, option)
    return {
        "engine": engine,
        "keys_file": args.keys_file,
        "num_replicas": args.num_replicas,
        "mode": args.mode,
        "stream_interval": args.stream_interval,
        "replica_num_cpus": 0 if args.address is None else 1,
        "object_store": args.object_store
        or "file://" + os.path.join(os.path.abspath(args.data_dir), "objects"),
        "adapter_source_prefixes": args.adapter_source_prefix,
        **({"meter_usage": False} if args.no_usage_metering else {}),
        **(
            {}
            if args.usage_commit_interval is None
            else {"usage_commit_interval_s": args.usage_commit_interval}
        ),
        **tenant_limits(args),
    }


def serve_config(app_args: dict[str, Any], *, host: str = "0.0.0.0", port: int = 8000) -> dict[str, Any]:
    """The Serve config file (`serve deploy` / `serve run`) for the app `tandem serve` runs with
    `app_args`: the same builder and arguments, validated, with defaults left out."""
    from tandem.deployments.app import AppConfig

    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": host, "port": port},
        "applications": [
            {
                "name": "tandem",
                "route_prefix": "/",
                "import_path": "tandem.deployments.app:build_app",
                "runtime_env": runtime_env(),
                "args": AppConfig(**app_args).model_dump(mode="json", exclude_defaults=True),
            }
        ],
    }


def first_env_api_key() -> str | None:
    """The first key of `$TANDEM_API_KEYS` (what the banner's example request uses), if any."""
    key = env_api_keys().replace("\n", ",").split(",")[0].partition("=")[0].strip()
    return key or None
