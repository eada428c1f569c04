"""What the platform costs per token, measured with a null model (`EngineConfig.null_model_step_ms`:
no model runs; each step waits a given time with the GIL free, as a host waits on a device, and
samples a fixed cycle of ordinary tokens; the default model's config and tokenizer).

Phases (`--phase`, default all):
- `core`: `LLMEngine.step()` in this thread at each `--requests` value (all added at once, prompts
  of `--prompt-len` distinct random tokens, `--new-tokens` each, EOS ignored, streamed text, running
  outputs with only their deltas, as the serving routes ask for them): ms per step for prefill steps, for the middle half of the decode steps that hold every request, and the whole run; the
  growth from the first to the last `--requests` value.
- `core-serial`: the same with steps in series with the runner (`async_scheduling` off): the path a
  CPU model runner takes.
- `async`: the same through `AsyncEngine.generate` (one asyncio consumer per request), with a
  runner step of 0 and of `--step-ms`: decode steps per second against the ideal 1000 / step-ms,
  and the device's busy fraction over those steps (each runner call's own time over the time from
  its start to the next one's: 1.0 when the device never waits for the engine, whatever its
  calls took; a sleeping null runner overshoots its step by the host's timer slack, which the
  first ratio counts against the engine and the second does not).
- `serve`: `tandem serve` (its own local Ray) with a null-model replica, `--streams` concurrent
  streamed completions through the `openai`-shaped HTTP API (httpx): streamed tok/s (tokens as
  each stream's usage chunk counts them: a chunk carries several when the replica merged outputs
  its caller had not taken yet), the gap between chunks carrying text p50 / p99, and CPU
  microseconds per streamed token of each process of the server (replica, ingress, proxy, the
  rest of Ray), read from /proc before and after the wave. The load generator's own CPU is
  reported apart.

    python benchmarks/platform_overhead.py                                   # -> benchmarks/results/
    python benchmarks/platform_overhead.py --phase core --requests 32 256 1024
    python benchmarks/platform_overhead.py --phase serve --streams 64 256 --step-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import cpu, free_port, log, percentile, start_server, stop_server, write_result
from tandem.engine.async_engine import AsyncEngine
from tandem.engine.engine import LLMEngine
from tandem.engine.protocol import GenerationRequest
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sched.step import RunnerResult, SchedulerOutput
from tandem.platform.config import EngineConfig

KEY = "sk-bench"
# Outputs as the serving routes ask for them: deltas while running (`GenerationRequest.cumulative`;
# an older tree, measured for comparison, has no such field and always sends the output so far)
SERVING_OUTPUTS = {"cumulative": False} if "cumulative" in GenerationRequest.__dataclass_fields__ else {}
REPLICA_GC = {"on": True}  # --gc replica: the collector as a Serve replica sets it (`replicas.settle_heap`)


def null_engine(
    num_requests: int, step_ms: float, prompt_len: int, new_tokens: int, serial: bool = False
) -> LLMEngine:
    """`serial`: steps in series with the runner (`async_scheduling` off: what a CPU model runner
    gets), else the next step scheduled while the runner's thread computes the current one."""
    config = EngineConfig(
        async_scheduling=not serial,
        null_model_step_ms=step_ms,
        max_num_seqs=num_requests,
        max_num_batched_tokens=max(2048, num_requests),
        max_model_len=prompt_len + new_tokens + 16,
    )
    engine = LLMEngine.from_config(config)
    if REPLICA_GC["on"]:  # what `settle_heap` does in a replica's process once its engine is loaded
        from tandem.deployments.replicas import freeze_loaded_heap  # here: an older tree has none

        freeze_loaded_heap()
    return engine


def prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size - 100) for _ in range(length)] for _ in range(num)]


class StepLog:
    """Wraps the engine's runner: when each step reached it and its shape (decode: one token per
    request, all sampling; and how many requests it holds). A step's time is from its start to the
    next one's: what the device would see, whether the engine schedules steps in series or ahead
    (`step_pipeline.py`)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.is_decode: list[bool] = []
        self.num_rows: list[int] = []
        self.started: list[float] = []
        self.busy: list[float] = []  # each call's own time: the device's work on the step
        inner = engine.runner.execute

        def execute(sched: SchedulerOutput) -> RunnerResult:
            start = time.perf_counter()
            self.started.append(start)
            self.num_rows.append(len(sched.scheduled))
            self.is_decode.append(
                sched.num_scheduled_tokens == len(sched.scheduled) and all(s.sample for s in sched.scheduled)
            )
            result = inner(sched)
            self.busy.append(time.perf_counter() - start)
            return result

        engine.runner.execute = execute  # type: ignore[method-assign]

    def figures(self, end: float) -> dict[str, Any]:
        """Step figures from the starts, the last step ending at `end`."""
        walls = [b - a for a, b in zip(self.started, [*self.started[1:], end], strict=True)]
        return step_figures(walls, self.is_decode, self.busy, self.num_rows)


def step_figures(
    walls: list[float], is_decode: list[bool], busy: list[float], num_rows: list[int]
) -> dict[str, Any]:
    """Decode figures come from the decode steps that hold every request (the most rows any decode
    step held): prompts are admitted a step's token budget at a time, so the first requests finish
    while the last are still decoding, and the steps around those hold fewer requests."""
    most = max((r for r, d in zip(num_rows, is_decode, strict=True) if d), default=0)
    full = [d and r == most for r, d in zip(num_rows, is_decode, strict=True)]
    decode = [w for w, d in zip(walls, full, strict=True) if d]
    decode_busy = [b for b, d in zip(busy, full, strict=True) if d]
    prefill = [w for w, d in zip(walls, is_decode, strict=True) if not d]
    middle_steps = slice(len(decode) // 4, max(len(decode) // 4 + 1, 3 * len(decode) // 4))
    middle = decode[middle_steps]
    return {
        "num_rows_per_decode_step": most,
        "num_full_decode_steps": len(decode),
        "device_busy_fraction_decode": sum(decode_busy[middle_steps]) / sum(middle) if middle else None,
        "ms_device_per_decode_step": 1000 * statistics.mean(decode_busy[middle_steps]) if middle else None,
        "num_steps": len(walls),
        "num_prefill_steps": len(prefill),
        "ms_per_prefill_step": 1000 * statistics.mean(prefill) if prefill else None,
        "ms_per_decode_step": 1000 * statistics.mean(middle) if middle else None,
        "ms_per_decode_step_p90": 1000 * percentile(middle, 0.9) if middle else None,
        "ms_per_step_whole_run": 1000 * statistics.mean(walls),
    }


def run_core(num_requests: int, prompt_len: int, new_tokens: int, serial: bool = False) -> dict[str, Any]:
    engine = null_engine(num_requests, 0.0, prompt_len, new_tokens, serial)
    steps = StepLog(engine)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts(num_requests, prompt_len, engine.model_config.vocab_size)):
        engine.add_request(
            GenerationRequest(f"r{i}", prompt_token_ids=prompt, sampling_params=params, **SERVING_OUTPUTS),
            stream_text=True,
        )
    num_tokens = 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        num_tokens += sum(len(o.outputs[0].delta_token_ids) for o in outputs)
    ended = time.perf_counter()
    assert num_tokens == num_requests * new_tokens, (num_tokens, num_requests * new_tokens)
    return {
        "requests": num_requests,
        "serial": serial,
        "generated_tokens": num_tokens,
        "tokens_per_s": num_tokens / (ended - started),
        **steps.figures(ended),
    }


async def _consume(engine: AsyncEngine, request: GenerationRequest) -> int:
    count = 0
    async for out in engine.generate(request):
        count += len(out.outputs[0].delta_token_ids)
    return count


def run_async(num_requests: int, step_ms: float, prompt_len: int, new_tokens: int) -> dict[str, Any]:
    engine = null_engine(num_requests, step_ms, prompt_len, new_tokens)
    steps = StepLog(engine)
    served = AsyncEngine(engine)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    requests = [
        GenerationRequest(f"a{i}", prompt_token_ids=prompt, sampling_params=params, **SERVING_OUTPUTS)
        for i, prompt in enumerate(prompts(num_requests, prompt_len, engine.model_config.vocab_size))
    ]

    async def wave() -> tuple[int, float]:
        started = time.perf_counter()
        counts = await asyncio.gather(*(_consume(served, r) for r in requests))
        return sum(counts), time.perf_counter() - started

    num_tokens, wall = asyncio.run(wave())
    figures = steps.figures(time.perf_counter())
    served.shutdown()
    pipeline = getattr(engine, "pipeline", None)  # None: an engine that schedules in series
    decode_ms = figures["ms_per_decode_step"]
    result = {
        "requests": num_requests,
        "step_ms": step_ms,
        "scheduled_ahead": pipeline is not None,
        # the engine thread's wait for the device per step: near 0, the engine is the bottleneck
        "engine_wait_ms_per_step": 1000 * pipeline.wait_s / max(1, pipeline.num_steps) if pipeline else None,
        # steps queued on the device behind the running one (`StepPipeline`'s chained steps)
        "steps_chained_fraction": getattr(pipeline, "num_steps_chained", 0) / max(1, pipeline.num_steps)
        if pipeline
        else None,
        "generated_tokens": num_tokens,
        "tokens_per_s": num_tokens / wall,
        **figures,
    }
    if step_ms > 0 and decode_ms:
        result["decode_steps_per_s_over_ideal"] = step_ms / decode_ms
        # The whole loop: decode tokens per request per second against one per step_ms.
        result["tokens_per_s_over_ideal"] = (num_tokens / wall) / (num_requests * 1000 / step_ms)
    return result


# -- serve ------------------------------------------------------------------------------------------
def process_cpu(root_pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of `root_pid` and every process below it, with a role for each."""
    import psutil

    found: dict[int, tuple[str, float]] = {}
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return found
    for proc in procs:
        try:
            times = proc.cpu_times()
            found[proc.pid] = (role(" ".join(proc.cmdline())), times.user + times.system)
        except psutil.Error:
            continue
    return found


def role(cmdline: str) -> str:
    if "ProxyActor" in cmdline:
        return "proxy"
    if "ServeReplica" in cmdline and ("LLM" in cmdline or "Engine" in cmdline):
        return "replica"
    if "ServeReplica" in cmdline and "Ingress" in cmdline:
        return "ingress"
    if "ServeReplica" in cmdline:
        return "other_replicas"
    if "tandem.cli" in cmdline:
        return "cli"
    return "ray"


async def stream_one(
    client: Any, base: str, prompt: list[int], new_tokens: int
) -> tuple[int, int, list[float]]:
    """One streamed completion: its tokens (the usage chunk's count: a chunk may carry several
    tokens when the consumer fell behind and the replica merged them), its chunks with text, and
    the gaps between those chunks."""
    body = {
        "model": "smollm2-135m-instruct",
        "prompt": prompt,
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    count, num_tokens, gaps, last = 0, 0, [], None
    async with client.stream(
        "POST", f"{base}/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                count += 1
    return num_tokens, count, gaps


def serve_wave(base: str, server_pid: int, streams: int, prompt_len: int, new_tokens: int) -> dict[str, Any]:
    import httpx

    batch = prompts(streams, prompt_len, 49152, seed=streams)

    async def wave() -> tuple[list[tuple[int, int, list[float]]], float]:
        limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            started = time.perf_counter()
            results = await asyncio.gather(*(stream_one(client, base, p, new_tokens) for p in batch))
            return list(results), time.perf_counter() - started

    before = process_cpu(server_pid)
    client_before = time.process_time()
    results, wall = asyncio.run(wave())
    client_cpu = time.process_time() - client_before
    after = process_cpu(server_pid)
    num_tokens = sum(t for t, _, _ in results)
    num_chunks = sum(c for _, c, _ in results)
    gaps = [g for _, _, gs in results for g in gs]
    by_role: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        by_role[name] = by_role.get(name, 0.0) + seconds - before.get(pid, (name, 0.0))[1]
    per_token = {name: 1e6 * seconds / max(1, num_tokens) for name, seconds in sorted(by_role.items())}
    return {
        "streams": streams,
        "streamed_tokens": num_tokens,
        "streamed_chunks": num_chunks,
        "tokens_per_s": num_tokens / wall,
        "inter_token_gap_p50_ms": 1000 * percentile(gaps, 0.5) if gaps else None,
        "inter_token_gap_p99_ms": 1000 * percentile(gaps, 0.99) if gaps else None,
        "cpu_us_per_token": per_token,
        "cpu_us_per_token_server": sum(per_token.values()),
        "cpu_us_per_token_client": 1e6 * client_cpu / max(1, num_tokens),
    }


def run_serve(streams: list[int], step_ms: float, prompt_len: int, new_tokens: int) -> list[dict[str, Any]]:
    most = max(streams)
    with tempfile.TemporaryDirectory(prefix="tandem-overhead-") as data_dir:
        args = (
            "--null-model-step-ms", str(step_ms), "--max-num-seqs", str(most),
            "--max-num-batched-tokens", str(max(2048, most)), "--max-concurrent-per-tenant", "0",
            "--max-model-len", str(prompt_len + new_tokens + 16), "--no-usage-metering",
        )  # fmt: skip
        server, base = start_server(data_dir, free_port(), {"TANDEM_API_KEYS": f"{KEY}=bench"}, args)
        try:
            serve_wave(base, server.pid, 8, prompt_len, 8)  # warm up every hop
            rows = []
            for n in streams:
                row = serve_wave(base, server.pid, n, prompt_len, new_tokens)
                row["step_ms"] = step_ms
                log(json.dumps(row))
                rows.append(row)
            return rows
        finally:
            stop_server(server)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--phase",
        choices=["core", "core-serial", "async", "serve"],
        nargs="+",
        default=["core", "core-serial", "async", "serve"],
    )
    parser.add_argument("--requests", type=int, nargs="+", default=[32, 256, 1024])
    parser.add_argument("--async-requests", type=int, nargs="+", default=[256])
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--serve-new-tokens", type=int, default=64)
    parser.add_argument(
        "--output", type=Path, default=Path(__file__).parent / "results" / "platform_overhead.json"
    )
    parser.add_argument(
        "--gc", choices=["replica", "default"], default="replica",
        help="replica (default): freeze the heap after loading and collect young objects every 10,000 "
        "allocations, as a Serve replica does; default: CPython's collector as it is",
    )  # fmt: skip
    args = parser.parse_args()
    REPLICA_GC["on"] = args.gc == "replica"
    result: dict[str, Any] = {
        "benchmark": "platform_overhead",
        "cpu": cpu(),
        "args": vars(args) | {"output": str(args.output)},
    }
    if "core" in args.phase:
        rows = []
        for n in args.requests:
            rows.append(run_core(n, args.prompt_len, args.new_tokens))
            log(json.dumps(rows[-1]))
        first, last = rows[0], rows[-1]
        result["core"] = rows
        if first["ms_per_decode_step"] and last["ms_per_decode_step"]:
            result["core_decode_growth"] = {
                "from": first["requests"],
                "to": last["requests"],
                "requests_ratio": last["requests"] / first["requests"],
                "time_ratio": last["ms_per_decode_step"] / first["ms_per_decode_step"],
            }
    if "core-serial" in args.phase:
        rows = []
        for n in args.requests:
            rows.append(run_core(n, args.prompt_len, args.new_tokens, serial=True))
            log(json.dumps(rows[-1]))
        result["core_serial"] = rows
    if "async" in args.phase:
        rows = []
        for n in args.async_requests:
            for step_ms in (0.0, args.step_ms):
                rows.append(run_async(n, step_ms, args.prompt_len, args.new_tokens))
                log(json.dumps(rows[-1]))
        result["async"] = rows
    if "serve" in args.phase:
        result["serve"] = run_serve(args.streams, args.step_ms, args.prompt_len, args.serve_new_tokens)
    write_result(args.output, result)


if __name__ == "__main__":
    main()
