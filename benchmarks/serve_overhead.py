"""What Ray Serve + HTTP add on top of the engine: TTFT and throughput, side by side in one run.

One process holds an in-process `AsyncEngine` ("direct") and starts a local Ray with the Serve
app (`tandem.deployments.app.build_app`, the same engine options) once per `--stream-intervals`
value and `--topologies` value ("ingress": proxy -> ingress deployment -> LLM replica;
"direct": proxy -> LLM replica serving HTTP itself, `direct_streaming`; "direct_ingress": the
same app called on the replica's own port, with no proxy, as `tandem serve` runs it; "uvicorn":
the same app under plain uvicorn in a process of its own, no Ray, `plain_uvicorn_server.py`: what
an HTTP server and our routes cost without Serve), plus once with the engine's admission wait off
(what a burst's TTFT was before it). `--client raw` (the default) sends every request of a wave
together from connections opened beforehand, so the load generator adds next to nothing;
`--client httpx` calls as an application would. Each round runs every phase once,
in a shuffled order: the direct engine and each app over HTTP (streaming completions, the same
prompt token ids, greedy, EOS ignored). Only one phase runs at a time, and idle engines sleep, so
phases do not compete for CPUs. Rounds and medians keep a noisy shared machine from favouring
whichever phase ran in a quiet minute; Ray's workers run at `--worker-niceness` (0, as `tandem
serve` starts them), the same as this process's direct engine.

Each phase runs every `--streams` value (all requests start together) and reports p50/p99 TTFT,
tokens/s, each request's TTFT outside the engine (its TTFT minus the engine's arrival-to-first-token
time, which the server sends in `Server-Timing`: what the path to the engine added, without the
prefill's run-to-run noise), and two diagnostics:
- `engine_step_wall_s` vs `engine_step_cpu_s`: the engine thread's wall and CPU seconds inside
  steps. Wall above CPU is time the step waited: for its other OpenMP thread or for the GIL,
  because something else ran on its cores.
- `cpu_s_by_process`: CPU seconds each process of this machine used during the phase (replica,
  ingress, HTTP proxy, Ray's own, the load generator).

    python benchmarks/serve_overhead.py                  # 16 and 1 streams, 3 rounds -> results/
    python benchmarks/serve_overhead.py --streams 16 --rounds 1 --stream-intervals 1
    python benchmarks/serve_overhead.py --engine-threads 1   # a core left to Serve (2-core machine)
    python benchmarks/serve_overhead.py --topologies ingress direct --no-no-admission-wait-app

With "direct_ingress" among the topologies, Ray starts with Serve's direct ingress on (every app's
ingress replica also listens on a port of its own); the other topologies still go through the
proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import torch

from common import log, percentile, write_result

# result key -> the engine stats() counter it is the difference of, over a phase
STEP_COUNTERS = {
    "engine_steps": "num_steps",
    "engine_step_wall_s": "step_wall_s",
    "engine_step_cpu_s": "step_thread_cpu_s",
}


def summarise(
    ttfts: list[float], app_ttfts: list[float], engine_ttfts: list[float], tokens: int, wall: float
) -> dict[str, Any]:
    """A phase's figures. Outside-engine time is each request's TTFT seen by the client minus its
    TTFT inside the engine (arrival -> first token; from `Server-Timing` over HTTP): what the path
    between client and engine added to that request, free of the prefill's own noise. It splits
    into time in the route (`app` minus `engine-ttft`: our code, and the event loop taking the
    request to the engine and the first output back) and before and after it (client, HTTP and
    Serve, up to the route and from it back to the client)."""
    outside = [t - e for t, e in zip(ttfts, engine_ttfts, strict=True)]
    in_route = [a - e for a, e in zip(app_ttfts, engine_ttfts, strict=True)]
    return {
        "ttfts_ms": sorted(round(t * 1000) for t in ttfts),  # a burst split over steps shows here
        "ttft_p50_ms": percentile(ttfts, 0.5) * 1000,
        "ttft_p99_ms": percentile(ttfts, 0.99) * 1000,
        "engine_ttft_p50_ms": percentile(engine_ttfts, 0.5) * 1000,
        "outside_engine_ms": sorted(round(t * 1000, 1) for t in outside),
        "outside_engine_p50_ms": percentile(outside, 0.5) * 1000,
        "in_route_p50_ms": percentile(in_route, 0.5) * 1000,
        "outside_route_p50_ms": percentile([o - r for o, r in zip(outside, in_route, strict=True)], 0.5)
        * 1000,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
    }


def process_role(proc: psutil.Process, cmdline: str) -> str:
    for marker, role in (
        ("plain_uvicorn_server", "uvicorn_server"),
        ("LLMReplica", "replica"),
        ("OpenAIIngress", "ingress"),
        ("ProxyActor", "http_proxy"),
        ("ServeController", "serve_controller"),
    ):
        if marker in cmdline:
            return role
    return "load_generator" if proc.pid == os.getpid() else "ray_other"


def cpu_seconds_by_role() -> dict[str, float]:
    """CPU seconds so far of this process and every process under the same Ray session."""
    me = psutil.Process()
    out: dict[str, float] = {}
    for proc in psutil.process_iter():
        try:
            cmdline = " ".join(proc.cmdline())
            if proc.pid != me.pid and "ray" not in cmdline and "plain_uvicorn_server" not in cmdline:
                continue
            times = proc.cpu_times()
            role = process_role(proc, cmdline)
            out[role] = out.get(role, 0.0) + times.user + times.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


# TTFTs seen by the client, by the route (the engine's for the in-process engine), inside the engine;
# tokens; wall seconds of requests started together
Wave = tuple[list[float], list[float], list[float], int, float]


async def drive_direct(engine: Any, prompts: list[list[int]], new_tokens: int, tag: str) -> Wave:
    from tandem import GenerationRequest, SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> tuple[float, float, int]:
        start = time.perf_counter()
        ttft, engine_ttft, count = 0.0, 0.0, 0
        request = GenerationRequest(f"{tag}-{i}", prompt_token_ids=prompt, sampling_params=params)
        async for out in engine.generate(request):
            if not ttft and out.outputs[0].delta_token_ids:
                ttft, engine_ttft = time.perf_counter() - start, out.metrics.ttft
            count += len(out.outputs[0].delta_token_ids)
        return ttft, engine_ttft, count

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - start
    engine_ttfts = [r[1] for r in results]
    return [r[0] for r in results], engine_ttfts, engine_ttfts, sum(r[2] for r in results), wall


def server_timing_s(header: str, name: str) -> float:
    """`name`'s duration in seconds from a `Server-Timing` header (`app;dur=12.5, ...`)."""
    for part in header.split(","):
        metric, _, duration = part.strip().partition(";dur=")
        if metric == name:
            return float(duration) / 1000
    raise ValueError(f"no {name} in Server-Timing {header!r}")


def completion_body(model: str, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """A streamed greedy completion of exactly `new_tokens` tokens, with the usage chunk."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": new_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }


def after_chunk(chunk: dict[str, Any], start: float, ttft: float, tokens: int) -> tuple[float, int]:
    """A stream's (TTFT, tokens) after one streamed chunk: the first chunk with choices sets the
    TTFT (seconds since `start`), the usage chunk the token count."""
    if not ttft and chunk.get("choices"):
        ttft = time.perf_counter() - start
    if chunk.get("usage"):
        tokens = chunk["usage"]["completion_tokens"]
    return ttft, tokens


def http_wave(results: list[tuple[float, float, float, int]], wall: float) -> Wave:
    """Per request (client TTFT, route TTFT, engine TTFT, tokens) -> the wave's figures."""
    return (
        [r[0] for r in results],
        [r[1] for r in results],
        [r[2] for r in results],
        sum(r[3] for r in results),
        wall,
    )


async def drive_http(base_url: str, model: str, prompts: list[list[int]], new_tokens: int) -> Wave:
    import httpx

    headers = {"Authorization": "Bearer sk-bench"}

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> tuple[float, float, float, int]:
        body = completion_body(model, prompt, new_tokens)
        start = time.perf_counter()
        ttft, tokens = 0.0, 0
        async with client.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers) as resp:
            resp.raise_for_status()
            app_ttft = server_timing_s(resp.headers["server-timing"], "app")
            engine_ttft = server_timing_s(resp.headers["server-timing"], "engine-ttft")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ttft, tokens = after_chunk(json.loads(line[6:]), start, ttft, tokens)
        return ttft, app_ttft, engine_ttft, tokens

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, p) for p in prompts))
        wall = time.perf_counter() - start
    return http_wave(results, wall)


async def drive_http_raw(base_url: str, model: str, prompts: list[list[int]], new_tokens: int) -> Wave:
    """The same requests as `drive_http`, from a load generator that costs next to nothing, as
    `wrk` would: the connections are open before the clock starts, every request's bytes are built
    beforehand, and one write sends each. All requests of a wave are on the wire within about a
    millisecond, so what is left of a request's TTFT outside the engine is the server's: HTTP,
    Serve and our route. (httpx spends about 3 ms of CPU per request on this machine's shared
    cores: in a burst of 16 the last request leaves the client tens of milliseconds after the
    first.) Reads HTTP/1.1 with chunked transfer encoding, as uvicorn streams."""
    url = urlsplit(base_url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    requests = []
    for prompt in prompts:
        body = json.dumps(completion_body(model, prompt, new_tokens)).encode()
        head = (
            f"POST {url.path}/v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Authorization: Bearer sk-bench\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        requests.append(head.encode() + body)

    async def one(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
    ) -> tuple[float, float, float, int]:
        start = time.perf_counter()
        writer.write(request)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        if head[0].split()[1] != "200":
            raise RuntimeError(f"{base_url}: {head[0]}")
        headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in head[1:] if line)}
        if headers.get("transfer-encoding") != "chunked":
            raise RuntimeError(f"{base_url}: expected a chunked stream, got headers {headers}")
        app_ttft = server_timing_s(headers["server-timing"], "app")
        engine_ttft = server_timing_s(headers["server-timing"], "engine-ttft")
        ttft, tokens, pending = 0.0, 0, b""
        while size := int(await reader.readline(), 16):
            pending += (await reader.readexactly(size + 2))[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: {"):
                    continue
                ttft, tokens = after_chunk(json.loads(event[6:]), start, ttft, tokens)
        await reader.readline()  # the terminating chunk's CRLF
        writer.close()
        return ttft, app_ttft, engine_ttft, tokens

    connections = [await asyncio.open_connection(host, port) for _ in prompts]
    start = time.perf_counter()
    results = await asyncio.gather(
        *(one(r, w, req) for (r, w), req in zip(connections, requests, strict=True))
    )
    wall = time.perf_counter() - start
    return http_wave(results, wall)


def measured(run: Callable[[], dict[str, Any]], engine_stats: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`run()`'s figures plus the engine's step time and every process's CPU over it."""
    stats_before, cpu_before = engine_stats(), cpu_seconds_by_role()
    result: dict[str, Any] = dict(run())
    stats_after, cpu_after = engine_stats(), cpu_seconds_by_role()
    for key, counter in STEP_COUNTERS.items():
        result[key] = stats_after[counter] - stats_before[counter]
    result["cpu_s_by_process"] = {
        role: round(cpu_after[role] - cpu_before.get(role, 0.0), 2) for role in sorted(cpu_after)
    }
    return result


def replica_stats(handle: Any) -> dict[str, Any]:
    return dict(handle.stats.remote().result())


def replica_base_url(app_name: str, proxy_port: int) -> str:
    """The app's ingress replica's own HTTP address on this node under Serve's direct ingress (one replica)."""
    import ray
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    assert client is not None, "serve.start() first"
    controller = client._controller
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # a replica reports its port once it is initialised
        for group in ray.get(controller.get_target_groups.remote(app_name=app_name)):
            if group.protocol == "HTTP" and len(group.targets) == 1:
                target = group.targets[0]
                if target.port != proxy_port:
                    return f"http://127.0.0.1:{target.port}{group.route_prefix}"  # this node
        time.sleep(0.5)
    raise RuntimeError(f"no direct-ingress port for {app_name}: is Serve's direct ingress on?")


def variant_arg(text: str) -> tuple[str, dict[str, str]]:
    """`NAME:VAR=VALUE[,VAR=VALUE]` -> (NAME, {VAR: VALUE})."""
    name, sep, assignments = text.partition(":")
    env = dict(a.split("=", 1) for a in assignments.split(",") if "=" in a)
    if not sep or not name.isidentifier() or not env:
        raise argparse.ArgumentTypeError(f"expected NAME:VAR=VALUE[,VAR=VALUE], got {text!r}")
    return name, env


def start_plain_server(port: int, app_config: dict[str, Any], niceness: int) -> subprocess.Popen[bytes]:
    """`plain_uvicorn_server.py` serving `app_config` on `port`, at `niceness` as Ray's workers run."""
    script = Path(__file__).parent / "plain_uvicorn_server.py"
    command = ["nice", "-n", str(niceness), sys.executable, str(script), "--port", str(port)]
    command += ["--config", json.dumps(app_config)]
    # its access log is written, as Serve's is, but not kept
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_until_healthy(base_url: str, timeout_s: float = 600.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{base_url} did not become healthy in {timeout_s:.0f} s")


def plain_server_stats(base_url: str) -> dict[str, Any]:
    import httpx

    return dict(httpx.get(f"{base_url}/bench/stats", timeout=30).json())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def median_of(rounds: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 1])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--shuffle",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run each round's phases in a different (seeded) order",
    )
    parser.add_argument(
        "--lone-requests",
        type=int,
        default=5,
        help="a 1-stream phase sends this many requests one after another (its TTFT p50 is theirs)",
    )
    parser.add_argument("--stream-intervals", type=int, nargs="+", default=[1, 4])
    parser.add_argument(
        "--topologies",
        nargs="+",
        choices=["uvicorn", "ingress", "direct", "direct_ingress"],
        default=["uvicorn", "ingress", "direct", "direct_ingress"],
        help="uvicorn: our app under plain uvicorn, no Ray (benchmarks/plain_uvicorn_server.py: what "
        "any Python HTTP server and our routes add); ingress: a separate ingress deployment calls the "
        "LLM replicas; direct: the replicas serve HTTP themselves (direct_streaming); direct_ingress: "
        "direct_streaming called on the replica's own port, not through Serve's proxy (`tandem "
        "serve`'s default)",
    )
    parser.add_argument(
        "--direct-ingress-variant",
        dest="direct_ingress_variants",
        type=variant_arg,
        action="append",
        default=[],
        metavar="NAME:VAR=VALUE[,VAR=VALUE]",
        help="also run direct ingress with these environment variables in the replica's process "
        "(AppConfig.replica_env_vars), as phase http_direct_ingress_NAME_*; repeatable. Example: "
        "separate_thread:RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=1 (Serve's default; ours is 0), "
        "or serve_wrapper:RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH= (completions through Serve's "
        "per-request handling, as before tandem.deployments.direct_ingress)",
    )
    parser.add_argument(
        "--client",
        choices=["raw", "httpx"],
        default="raw",
        help="raw: pre-built requests on connections opened beforehand, sent together (what the "
        "server adds); httpx: an httpx.AsyncClient per wave, as an application would call (adds "
        "the client's own CPU time, which on a small shared machine delays a burst's later requests)",
    )
    parser.add_argument(
        "--no-admission-wait-app",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also deploy an app whose engine starts steps at once (admission_wait_ms=0)",
    )
    parser.add_argument("--kv-cache-memory", type=int, default=512 << 20)
    parser.add_argument(
        "--admission-wait-ms",
        type=float,
        nargs=2,
        default=None,
        metavar=("QUIET", "MAX"),
        help="every engine's admission_wait_ms and admission_max_wait_ms (default: the engine's)",
    )
    parser.add_argument(
        "--worker-niceness",
        type=int,
        default=0,
        help="niceness of Ray's workers (replicas, ingress, proxy): 0 as `tandem serve` sets, the "
        "same as this process and its direct engine; Ray's own default is 15",
    )
    parser.add_argument(
        "--engine-threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads of every engine, direct and served (default: all cores, what build_app "
        "gives a replica that reserves no CPUs). Fewer than the cores leaves the rest to Serve's "
        "processes, as on a GPU node where the engine does not compute on the CPU",
    )
    parser.add_argument(
        "--output", type=Path, default=Path(__file__).parent / "results" / "serve_overhead.json"
    )
    args = parser.parse_args()

    num_threads = args.engine_threads
    engine_options = {
        "model": args.model,
        "kv_cache_memory": args.kv_cache_memory,
        "served_model_name": "bench",
        "num_threads": num_threads,
        "enable_prefix_caching": False,  # rounds repeat prompts: compare the paths, not cache hits
    }
    if args.admission_wait_ms is not None:
        engine_options["admission_wait_ms"], engine_options["admission_max_wait_ms"] = args.admission_wait_ms
    gen = torch.Generator().manual_seed(0)
    num_prompts = max(*args.streams, args.lone_requests)
    prompts = torch.randint(100, 40000, (num_prompts, args.prompt_len), generator=gen).tolist()

    import ray
    from ray import serve

    from tandem import AsyncEngine
    from tandem.deployments.app import build_app

    log("loading the direct engine")
    direct_engine = AsyncEngine.from_options(**engine_options)
    log("starting local Ray + Serve")
    os.environ["RAY_worker_niceness"] = str(args.worker_niceness)  # noqa: SIM112 (Ray reads this case)
    if "direct_ingress" in args.topologies or args.direct_ingress_variants:
        from tandem.cli import direct_ingress_env

        # a range from a free port: one port per app's ingress replica
        os.environ.update(direct_ingress_env(free_port(), num_ports=64))
    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    phases: dict[str, dict[str, Any]] = {}
    plain_servers: list[subprocess.Popen[bytes]] = []
    try:
        stats_of: dict[str, Callable[[], dict[str, Any]]] = {"direct": direct_engine.stats}
        apps = [
            (f"http_{topology}_stream_interval_{k}", engine_options, k, topology != "ingress")
            for topology in args.topologies
            for k in args.stream_intervals
        ]
        if args.no_admission_wait_app:
            apps.append(("http_no_admission_wait", {**engine_options, "admission_wait_ms": 0.0}, 1, False))
        replica_env_of = {}
        for variant, env in args.direct_ingress_variants:
            for k in args.stream_intervals:
                name = f"http_direct_ingress_{variant}_stream_interval_{k}"
                apps.append((name, engine_options, k, True))
                replica_env_of[name] = env
        base_url_of: dict[str, str] = {}
        for name, options, interval, direct_streaming in apps:
            app_config = {
                "engine": options,
                "api_keys": "sk-bench=bench",
                "replica_num_cpus": 0,
                "stream_interval": interval,
                "direct_streaming": direct_streaming,
                "replica_env_vars": replica_env_of.get(name, {}),
            }
            if "uvicorn" in name:  # loads while the Serve apps deploy; waited for below
                server_port = free_port()
                plain_servers.append(start_plain_server(server_port, app_config, args.worker_niceness))
                base_url_of[name] = f"http://127.0.0.1:{server_port}"
                stats_of[name] = functools.partial(plain_server_stats, base_url_of[name])
                continue
            serve.run(build_app(app_config), name=name, route_prefix=f"/{name}")
            handle = serve.get_deployment_handle("LLMReplica", name)
            stats_of[name] = functools.partial(replica_stats, handle)
            if "direct_ingress" in name:
                base_url_of[name] = replica_base_url(name, port)
            else:
                base_url_of[name] = f"http://127.0.0.1:{port}/{name}"
        for name, url in base_url_of.items():
            if "uvicorn" in name:
                wait_until_healthy(url)

        drive_http_wave = drive_http_raw if args.client == "raw" else drive_http

        def run_phase(phase: str, num_streams: int, tag: str) -> dict[str, Any]:
            """One wave of `num_streams` requests; a lone stream is `--lone-requests` waves in turn."""
            ttfts: list[float] = []
            app_ttfts: list[float] = []
            engine_ttfts: list[float] = []
            tokens, wall = 0, 0.0
            for wave in range(args.lone_requests if num_streams == 1 else 1):
                batch = prompts[wave : wave + num_streams]
                if phase == "direct":
                    result = asyncio.run(drive_direct(direct_engine, batch, args.new_tokens, f"{tag}-{wave}"))
                else:
                    result = asyncio.run(drive_http_wave(base_url_of[phase], "bench", batch, args.new_tokens))
                ttfts += result[0]
                app_ttfts += result[1]
                engine_ttfts += result[2]
                tokens, wall = tokens + result[3], wall + result[4]
            return summarise(ttfts, app_ttfts, engine_ttfts, tokens, wall)

        for phase in stats_of:  # warm-up: first requests pay one-off costs (allocation, imports)
            for num_streams in args.streams:
                run_phase(phase, min(num_streams, 2), f"warm-{phase}-{num_streams}")
        for round_index in range(args.rounds):
            order = list(stats_of.items())
            if args.shuffle:  # no phase always follows the same one (or comes first after a pause)
                random.Random(round_index).shuffle(order)
            for phase, engine_stats in order:
                for num_streams in args.streams:
                    tag = f"r{round_index}-{phase}-{num_streams}"
                    result = measured(functools.partial(run_phase, phase, num_streams, tag), engine_stats)
                    key = f"{phase}/streams_{num_streams}"
                    phases.setdefault(key, {"rounds": []})["rounds"].append(result)
                    log(
                        f"round {round_index + 1}/{args.rounds} {key}: ttft p50 "
                        f"{result['ttft_p50_ms']:.0f} ms, {result['tokens_per_s']:.1f} tok/s, engine step "
                        f"wall/cpu {result['engine_step_wall_s']:.1f}/{result['engine_step_cpu_s']:.1f} s"
                    )
    finally:
        for server in plain_servers:  # ours, by PID
            server.terminate()
            server.wait(60)
        direct_engine.shutdown()
        serve.shutdown()
        ray.shutdown()

    for summary in phases.values():
        rounds = summary["rounds"]
        for key in (
            "ttft_p50_ms",
            "ttft_p99_ms",
            "engine_ttft_p50_ms",
            "outside_engine_p50_ms",
            "in_route_p50_ms",
            "outside_route_p50_ms",
            "tokens_per_s",
            "engine_step_wall_s",
            "engine_step_cpu_s",
        ):
            summary[f"median_{key}"] = median_of(rounds, key)
    comparisons = {}
    for key, summary in phases.items():
        phase, streams = key.split("/")
        if phase == "direct":
            continue
        direct = phases[f"direct/{streams}"]
        per_round = [
            h["tokens_per_s"] / d["tokens_per_s"]
            for h, d in zip(summary["rounds"], direct["rounds"], strict=True)
        ]
        comparisons[key] = {
            "added_ttft_p50_ms": summary["median_ttft_p50_ms"] - direct["median_ttft_p50_ms"],
            "added_ttft_p99_ms": summary["median_ttft_p99_ms"] - direct["median_ttft_p99_ms"],
            # per request, outside the engine: the path's own cost, without the prefill's noise
            "added_outside_engine_p50_ms": summary["median_outside_engine_p50_ms"]
            - direct["median_outside_engine_p50_ms"],
            "added_engine_ttft_p50_ms": summary["median_engine_ttft_p50_ms"]
            - direct["median_engine_ttft_p50_ms"],
            "throughput_ratio_http_over_direct": summary["median_tokens_per_s"]
            / direct["median_tokens_per_s"],
            "throughput_ratio_per_round": per_round,
        }
    report = {
        "benchmark": "serve_overhead",
        "model": args.model,
        "streams": args.streams,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "lone_requests": args.lone_requests,
        "shuffled_phase_order": args.shuffle,
        "torch_threads": num_threads,
        "topologies": args.topologies,
        "client": args.client,
        "worker_niceness": args.worker_niceness,
        "engine_options": engine_options,
        "phases": phases,
        "comparisons": comparisons,
    }
    write_result(args.output, report)
    print(json.dumps(comparisons, indent=2))


if __name__ == "__main__":
    main()
