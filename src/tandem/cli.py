"""`tandem` command line: `generate` (stream one prompt), `serve` (the API on Ray Serve), `batch`
(submit / status / results / cancel batch jobs, or run a standalone batch worker)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

from tandem.batch_cli import add_batch_parser, run_batch_command
from tandem.platform.config import DEFAULT_MODEL, EngineConfig
from tandem.platform.errors import InvalidRequestError, TandemError
from tandem.platform.logs import configure_logging
from tandem.serve_banner import banner, dev_tenant_key, model_line
from tandem.tenants_cli import add_tenants_parser, run_tenants_command


def _generate(args: argparse.Namespace) -> int:
    from tandem.engine.llm import LLM
    from tandem.engine.protocol import RequestOutput
    from tandem.engine.sampling_params import SamplingParams

    started = time.monotonic()
    llm = LLM(model=args.model, max_model_len=args.max_model_len, seed=args.seed)
    print(f"[tandem] loaded {args.model} in {time.monotonic() - started:.1f}s", file=sys.stderr)
    unset = {"top_k", "min_p", "repetition_penalty"} | ({"top_p"} if args.top_p is None else set())
    params = SamplingParams(  # what the flags leave unset, the checkpoint's generation defaults fill
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=1.0 if args.top_p is None else args.top_p,
        seed=args.seed, model_defaults=frozenset(unset),
    )  # fmt: skip

    def show(output: RequestOutput) -> None:
        sys.stdout.write(output.outputs[0].delta_text)
        sys.stdout.flush()

    use_chat = not args.raw and llm.tokenizer.chat_template is not None
    started = time.monotonic()
    if use_chat:
        from tandem.engine.protocol import GenerationRequest

        request = GenerationRequest(
            request_id=llm.engine.new_request_id(),
            messages=[{"role": "user", "content": args.prompt}],
            sampling_params=params,
        )
        results = llm._run([request], show)
    else:
        results = llm.generate([args.prompt], params, on_output=show)
    elapsed = time.monotonic() - started
    out = results[0].outputs[0]
    sys.stdout.write("\n")
    ttft = results[0].metrics.ttft or 0.0
    print(
        f"[tandem] {len(out.token_ids)} tokens in {elapsed:.2f}s ({len(out.token_ids) / max(elapsed, 1e-9):.1f} tok/s), "
        f"ttft {ttft * 1000:.0f} ms, finish_reason={out.finish_reason}",
        file=sys.stderr,
    )
    return 0


# Every Ray worker process of the app (the Serve replicas) writes tandem's logs as structured
# lines (platform/logs.py); set up when the process starts, not in the classes' constructors, which
# tests also run in their own process.
RUNTIME_ENV = {"worker_process_setup_hook": "tandem.platform.logs.configure_logging"}


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


def _app_args(args: argparse.Namespace) -> dict[str, Any]:
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
    for option in ("dtype", "weight_dtype", "generation_config", "batch_invariant"):
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
                "runtime_env": RUNTIME_ENV,
                "args": AppConfig(**app_args).model_dump(mode="json", exclude_defaults=True),
            }
        ],
    }


def _serve(args: argparse.Namespace) -> int:
    """Start a local Ray (or join `--address`) and run the application graph on it: Serve's proxy
    on `--port` -> the ingress deployment -> the LLM replicas, and the batch workers."""
    import secrets
    import signal
    import threading

    import ray
    from ray import serve

    from tandem.deployments.app import build_app

    if args.print_config:
        import yaml

        config = serve_config(_app_args(args), host=args.host, port=args.port)
        print(yaml.safe_dump(config, sort_keys=False), end="")
        return 0
    from tandem.engine.models.loader import check_model

    started = time.monotonic()
    check_model(args.model)  # a model the engine cannot serve exactly: refused now, by name
    if args.address is None:
        _free_port(args.host, args.port)  # fail now, not after minutes of Ray and model start-up
    app_args = _app_args(args)
    dev_key = dev_operator_key = None
    if not os.environ.get("TANDEM_API_KEYS") and not args.keys_file:
        dev_key = dev_tenant_key(app_args["object_store"])
    if not os.environ.get("TANDEM_OPERATOR_KEYS"):
        dev_operator_key = "sk-op-dev-" + secrets.token_hex(12)
        app_args["operator_keys"] = dev_operator_key
    app = build_app(app_args)
    if args.address:
        ray.init(address=args.address, runtime_env=RUNTIME_ENV)
    else:
        os.makedirs(args.data_dir, exist_ok=True)
        # Ray starts workers, and so the engine, at niceness 15 below its own processes and any
        # other program; on a node that exists to run the model, the engine should not yield.
        os.environ.setdefault("RAY_worker_niceness", str(args.worker_niceness))  # noqa: SIM112
        # A Ray of its own ("local"), even with $RAY_ADDRESS set: the settings above apply only to
        # processes this command starts; --address joins a cluster.
        ray.init(address="local", include_dashboard=False, configure_logging=False, runtime_env=RUNTIME_ENV)
    ray_ready = time.monotonic()
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(app, name="tandem", route_prefix="/")
    base = f"http://{args.host}:{args.port}"
    timing = f"ready in {time.monotonic() - started:.1f} s: Ray {ray_ready - started:.1f} s, replicas {time.monotonic() - ray_ready:.1f} s"
    served_name = EngineConfig(**app_args["engine"]).api_model_name
    env_key = os.environ.get("TANDEM_API_KEYS", "").replace("\n", ",").split(",")[0].partition("=")[0].strip()
    model = model_line(base, served_name, dev_key or env_key or None)  # asked before the banner says "ready"
    print(banner(served_name, base, dev_key, dev_operator_key, timing), file=sys.stderr, flush=True)
    print(model, file=sys.stderr, flush=True)

    def _stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        print(
            f"[tandem] stopping: draining requests in flight (up to {args.drain_timeout:g} s)",
            file=sys.stderr,
        )
        try:
            _drain(serve, args.drain_timeout)
        except KeyboardInterrupt:  # a second signal: stop now
            print("[tandem] stopping now", file=sys.stderr)
    finally:
        serve.shutdown()
        ray.shutdown()  # stops the local Ray processes this command started
        print("[tandem] stopped", file=sys.stderr)
    return 0


def _drain(serve: Any, timeout_s: float) -> None:
    """The graceful stop: the fleet stops admitting (503 `shutting_down`), batch workers release
    their shards' leases, and this waits until no ingress has a request in flight, for at most
    `timeout_s` (then the ingress ends what is left with an error) plus a moment to send it."""
    from tandem.deployments.fleet import DRAIN_POLL_S, FLEET_STATE_DEPLOYMENT

    fleet = serve.get_deployment_handle(FLEET_STATE_DEPLOYMENT, app_name="tandem")
    fleet.begin_drain.remote(timeout_s).result(timeout_s=30)
    began = time.monotonic()
    while time.monotonic() - began < timeout_s + 5 * DRAIN_POLL_S + 2:
        num_members, num_reported, num_in_flight = fleet.drain_progress.remote().result(timeout_s=30)
        if num_reported == num_members and num_in_flight == 0 and time.monotonic() - began > 2 * DRAIN_POLL_S:
            break
        time.sleep(DRAIN_POLL_S / 2)
    print(f"[tandem] drained in {time.monotonic() - began:.1f} s", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM inference platform")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streaming to stdout")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--model", default=DEFAULT_MODEL, help="bundled name, HF folder or .gguf file")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument(
        "--top-p", type=float, default=None, help="default: the model's generation default, else 1"
    )
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="plain completion, no chat template")
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
    srv.add_argument("--max-model-len", type=int, default=None)
    srv.add_argument("--kv-cache-memory", type=int, default=None, help="bytes")
    srv.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
        help="compute dtype (default auto: measured fastest here, held to the quality bound)",
    )  # fmt: skip
    srv.add_argument(
        "--weight-dtype", choices=["auto", "dense", "int4", "int8", "hybrid"], default=None,
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
    add_batch_parser(sub)
    add_tenants_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s")
    configure_logging(args.log_level)  # tandem's own lines: structured (platform/logs.py)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "batch":
            return run_batch_command(args)
        if args.command == "tenants":
            return run_tenants_command(args)
    except TandemError as exc:
        print(
            json.dumps({"error": {"message": exc.message, "type": exc.error_type, "param": exc.param}}),
            file=sys.stderr,
        )
        return 2
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
