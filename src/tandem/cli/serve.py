"""`tandem serve`: start a local Ray (or join one) and run the application graph on it."""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import ModuleType
from typing import Any

from tandem.cli.banner import banner, dev_tenant_key, model_line
from tandem.cli.serve_config import app_config_args, first_env_api_key, runtime_env, serve_config
from tandem.platform.api_keys import env_api_keys, env_operator_keys
from tandem.platform.config import DEFAULT_MODEL, EngineConfig
from tandem.platform.errors import InvalidRequestError


def add_parser(sub: Any) -> None:
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API on Ray Serve")
    srv.add_argument("--model", default=DEFAULT_MODEL)
    srv.add_argument(
        "--served-model-name", default=None, help="the model id clients send (default: from --model)"
    )
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--address", default=None, help="join an existing Ray cluster (default: start a local one)"
    )
    srv.add_argument("--data-dir", default=os.path.expanduser("~/.local/share/tandem"))
    srv.add_argument("--keys-file", default=None, help="file of KEY=TENANT lines (else $TANDEM_API_KEYS)")
    srv.add_argument(
        "--adapter-source-prefix",
        action="append",
        default=[],
        metavar="URI",
        help="a per-tenant folder adapter uploads may name as 'source' instead of sending files, "
        "with {tenant} in it (e.g. s3://adapters/{tenant}/); repeatable; default: none (uploads only)",
    )
    srv.add_argument("--num-replicas", type=int, default=1)
    srv.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C: new requests get 503 and requests in flight get this long to finish "
        "before they end with an error (default 30; a second signal stops at once)",
    )
    srv.add_argument(
        "--mode",
        choices=["colocated", "disaggregated"],
        default="colocated",
        help="disaggregated: a prefill replica computes prompts and hands their KV to the LLM replicas",
    )
    srv.add_argument(
        "--print-config",
        action="store_true",
        help="print the Serve config file (serve deploy / serve run) for this app and exit",
    )
    _tenant_flags(srv)
    _engine_flags(srv)
    _process_flags(srv)
    srv.set_defaults(run=run)


def _process_flags(srv: argparse.ArgumentParser) -> None:
    """Streaming, the local Ray's workers, the object store and usage metering."""
    srv.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens per streamed message (first token and end at once); >1 saves CPU per token",
    )
    srv.add_argument(
        "--worker-niceness",
        type=int,
        default=0,
        help="niceness of the local Ray's workers, the engine's included (Ray's default is 15); "
        "$RAY_worker_niceness wins; ignored with --address",
    )
    srv.add_argument(
        "--object-store",
        default=None,
        help="file:///path or s3://bucket/prefix for files and batches (default: DATA_DIR/objects)",
    )
    srv.add_argument(
        "--usage-commit-interval",
        type=float,
        default=None,
        help="seconds between usage-record writes of an ingress replica at most (default 0.1); "
        "a response's usage is stored before it is sent",
    )
    srv.add_argument(
        "--no-usage-metering", action="store_true", help="record no usage (the usage API then answers 404)"
    )


def _tenant_flags(srv: argparse.ArgumentParser) -> None:
    """Per-tenant limits and weights (each also from the environment: `serve_config.tenant_limits`)."""
    srv.add_argument(
        "--max-concurrent-per-tenant",
        type=int,
        default=None,
        metavar="N",
        help="requests one tenant may have in flight; more get 429 with Retry-After "
        "($TANDEM_MAX_CONCURRENT_PER_TENANT; default: half of the replicas' engine seats; 0: no limit)",
    )
    srv.add_argument(
        "--tokens-per-minute-per-tenant",
        type=int,
        default=None,
        metavar="N",
        help="prompt + completion tokens one tenant may use per minute "
        "($TANDEM_TOKENS_PER_MINUTE_PER_TENANT; default and 0: no limit)",
    )
    srv.add_argument(
        "--max-adapters-per-tenant",
        type=int,
        default=None,
        metavar="N",
        help="LoRA adapters one tenant may store ($TANDEM_MAX_ADAPTERS_PER_TENANT; default 64; 0: no limit)",
    )
    srv.add_argument(
        "--max-adapter-bytes-per-tenant",
        type=int,
        default=None,
        metavar="BYTES",
        help="adapter weight bytes one tenant may store in all "
        "($TANDEM_MAX_ADAPTER_BYTES_PER_TENANT; default 4 GiB; 0: no limit)",
    )
    srv.add_argument(
        "--tenant-weight",
        action="append",
        default=[],
        metavar="TENANT=WEIGHT",
        help="a tenant's fair-share weight in the engines (default 1 each); repeatable; also "
        "$TANDEM_TENANT_WEIGHTS='a=2,b=1'",
    )


def _engine_flags(srv: argparse.ArgumentParser) -> None:
    """The engine's context, cache and precision."""
    srv.add_argument("--max-model-len", type=int, default=None)
    srv.add_argument("--kv-cache-memory", type=int, default=None, help="bytes")
    srv.add_argument(
        "--max-num-seqs", type=int, default=None, help="most requests in one engine step (default 64)"
    )
    srv.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of one engine step (default 1024)",
    )
    srv.add_argument(
        "--null-model-step-ms", type=float, default=None, metavar="MS",
        help="benchmarks only: run no model, each engine step waits MS milliseconds and emits fixed tokens "
        "(benchmarks/platform_overhead.py)",
    )  # fmt: skip
    srv.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
        help="compute dtype (default auto: measured fastest here, held to the quality bound)",
    )  # fmt: skip
    srv.add_argument(
        "--weight-dtype", choices=["auto", "dense", "int4", "int8", "hybrid", "gguf"], default=None,
        help="weights (default auto: INT4, else INT8, only where measured faster and within the quality bound)",
    )  # fmt: skip
    srv.add_argument(
        "--no-batch-invariant", dest="batch_invariant", action="store_false", default=None,
        help="let a request's last bits (sometimes its tokens) depend on its batch, for throughput "
        "(default: batch-invariant; the cost is in docs/performance.md)",
    )  # fmt: skip
    srv.add_argument(
        "--generation-config", choices=["auto", "none"], default=None,
        help="auto (default): unset sampling fields take the checkpoint's generation defaults; none: neutral",
    )  # fmt: skip


def _free_port(host: str, port: int = 0) -> int:
    """`port` on `host` if it is free (a free one of the system's choosing for 0). With
    SO_REUSEADDR, as servers bind: a server that just stopped leaves its connections in
    TIME-WAIT for a minute, which blocks a plain bind but not a new server's listening socket."""
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise InvalidRequestError(
                f"cannot listen on {host}:{port} ({exc.strerror}): choose another --port, or stop "
                "what is listening there",
                param="port",
            ) from exc
        return int(sock.getsockname()[1])


def run(args: argparse.Namespace) -> int:
    """Start a local Ray (or join `--address`) and run the application graph on it: Serve's proxy
    on `--port` -> the ingress deployment -> the LLM replicas, and the batch workers. SIGTERM or
    Ctrl-C before the banner stops what was started (exit 0); after it, drains first."""
    if args.print_config:
        import yaml

        config = serve_config(app_config_args(args), host=args.host, port=args.port)
        print(yaml.safe_dump(config, sort_keys=False), end="")
        return 0
    import signal

    signal.signal(signal.SIGTERM, _raise_interrupt)  # a stop during start-up stops cleanly too
    try:
        ready_lines = _start(args)
    except KeyboardInterrupt:  # before the banner: nothing was served, nothing to drain
        print("[tandem] start-up interrupted: stopping", file=sys.stderr, flush=True)
        _stop_ray()
        print("[tandem] stopped", file=sys.stderr)
        return 0
    from ray import serve

    _serve_until_stopped(serve, args.drain_timeout, ready_lines)
    return 0


def _raise_interrupt(signum: int, frame: object) -> None:
    """SIGTERM as Ctrl-C: the start-up or the wait that is running ends with KeyboardInterrupt."""
    raise KeyboardInterrupt


def _stop_ray() -> None:
    """Stop Serve, and Ray: the local Ray processes this command started, or its connection to
    `--address`'s cluster (nothing when Ray was not started yet)."""
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


def _start(args: argparse.Namespace) -> list[str]:
    """`run`'s start-up: the checks, Ray, Serve and the app, up and answering; returns the banner's lines."""
    import secrets
    import signal

    from ray import serve

    from tandem.deployments.app import build_app
    from tandem.engine.models.loader import check_model

    started = time.monotonic()
    check_model(args.model)  # a model the engine cannot serve exactly: refused now, by name
    if args.address is None:
        _free_port(args.host, args.port)  # fail now, not after minutes of Ray and model start-up
    app_args = app_config_args(args)
    dev_key = dev_operator_key = None
    if not env_api_keys() and not args.keys_file:
        dev_key = dev_tenant_key(app_args["object_store"])
    if not env_operator_keys():
        dev_operator_key = "sk-op-dev-" + secrets.token_hex(12)
        app_args["operator_keys"] = dev_operator_key
    app = build_app(app_args)
    _start_ray(args)
    # Ray's driver installs its own SIGTERM handler (a stack dump, then abort): ours again
    signal.signal(signal.SIGTERM, _raise_interrupt)
    ray_ready = time.monotonic()
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(app, name="tandem", route_prefix="/")
    base = f"http://{args.host}:{args.port}"
    timing = f"ready in {time.monotonic() - started:.1f} s: Ray {ray_ready - started:.1f} s, replicas {time.monotonic() - ray_ready:.1f} s"
    served_name = EngineConfig(**app_args["engine"]).api_model_name
    model = model_line(
        base, served_name, dev_key or first_env_api_key()
    )  # asked before the banner says "ready"
    return [banner(served_name, base, dev_key, dev_operator_key, timing), model]


def _start_ray(args: argparse.Namespace) -> None:
    """Join `--address`, or start a local Ray of this command's own."""
    import ray

    if args.address:
        ray.init(address=args.address, runtime_env=runtime_env())
        return
    os.makedirs(args.data_dir, exist_ok=True)
    # Ray starts workers, and so the engine, at niceness 15 below its own processes and any
    # other program; on a node that exists to run the model, the engine should not yield.
    os.environ.setdefault("RAY_worker_niceness", str(args.worker_niceness))  # noqa: SIM112
    # A Ray of its own ("local"), even with $RAY_ADDRESS set: the settings above apply only to
    # processes this command starts; --address joins a cluster.
    ray.init(address="local", include_dashboard=False, configure_logging=False, runtime_env=runtime_env())


def _serve_until_stopped(serve: ModuleType, drain_timeout_s: float, ready_lines: list[str]) -> None:
    """Print `ready_lines` (the banner), wait for SIGTERM or Ctrl-C, then drain (a second signal:
    stop at once) and stop Serve and Ray. SIGTERM raises KeyboardInterrupt from before the start
    (`run`): a SIGTERM sent as soon as the banner is read stops gracefully too."""
    import threading

    try:
        for line in ready_lines:
            print(line, file=sys.stderr, flush=True)
        threading.Event().wait()
    except KeyboardInterrupt:
        print(
            f"[tandem] stopping: draining requests in flight (up to {drain_timeout_s:g} s)",
            file=sys.stderr,
        )
        try:
            drain(serve, drain_timeout_s)
        except KeyboardInterrupt:  # a second signal: stop now
            print("[tandem] stopping now", file=sys.stderr)
    finally:
        _stop_ray()
        print("[tandem] stopped", file=sys.stderr)


def drain(serve: ModuleType, timeout_s: float) -> None:
    """The graceful stop: the fleet stops admitting (503 `shutting_down`), batch workers release
    their shards' leases, and this waits until no ingress has a request in flight, for at most
    `timeout_s` (then the ingress ends what is left with an error) plus a moment to send it. The
    handle is called from an event loop of its own: Serve refuses a handle outside one where it
    runs the handle's router on the caller's loop (`RAY_SERVE_THROUGHPUT_OPTIMIZED`)."""
    import asyncio

    began = time.monotonic()
    asyncio.run(_drain(serve, timeout_s))
    print(f"[tandem] drained in {time.monotonic() - began:.1f} s", file=sys.stderr)


async def _drain(serve: ModuleType, timeout_s: float) -> None:
    import asyncio

    from tandem.deployments.fleet import DRAIN_POLL_S, FLEET_STATE_DEPLOYMENT

    fleet = serve.get_deployment_handle(FLEET_STATE_DEPLOYMENT, app_name="tandem")
    await asyncio.wait_for(fleet.begin_drain.remote(timeout_s), timeout=30)
    began = time.monotonic()
    while time.monotonic() - began < timeout_s + 5 * DRAIN_POLL_S + 2:
        progress = await asyncio.wait_for(fleet.drain_progress.remote(), timeout=30)
        num_members, num_reported, num_in_flight = progress
        if num_reported == num_members and num_in_flight == 0 and time.monotonic() - began > 2 * DRAIN_POLL_S:
            break
        await asyncio.sleep(DRAIN_POLL_S / 2)
