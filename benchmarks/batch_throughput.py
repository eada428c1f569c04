"""A batch job through the API vs the same requests through the offline `LLM.generate`, one run.

`--num-requests` chat requests (varied prompts, `--new-tokens` each, greedy, EOS ignored so both
sides generate the same tokens) are run:
- as a batch job, once per `--shards-in-flight` value: uploaded with the official `openai` client
  to the app (FastAPI in-process, a local object store), a `BatchWorker` in the app's event loop
  running `execute_batch_line` (the real-time code path at batch priority) on an `AsyncEngine`
  with the same options, timed from `batches.create` to `completed`;
- offline: `LLM.chat` on all of them at once (the engine's best case: nothing but the engine).
Tokens/s is output tokens over that wall time; the ratio is batch over offline.

    python benchmarks/batch_throughput.py                    # 512 requests -> benchmarks/results/
    python benchmarks/batch_throughput.py --num-requests 64 --shards-in-flight 1 2
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import openai
from fastapi.testclient import TestClient

from common import log, write_result
from tandem import LLM, AsyncEngine, SamplingParams
from tandem.batch.service import BatchLimits
from tandem.deployments.ingress import create_app
from tandem.deployments.local import local_platform
from tandem.platform.api_keys import parse_keys
from tandem.platform.object_store import FileObjectStore
from tandem.platform.tenancy import TenantRegistry

TOPICS = [
    "the ocean",
    "a city at night",
    "old trains",
    "mountain weather",
    "bread baking",
    "chess openings",
    "bees",
    "the moon",
    "jazz",
    "rivers",
    "volcanoes",
    "libraries",
    "winter",
    "robots",
    "tea",
    "bridges",
]
KEY = "sk-bench"


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a few sentences about {TOPICS[i % len(TOPICS)]} (note {i})."}]


def run_offline(options: dict[str, Any], num_requests: int, new_tokens: int) -> dict[str, Any]:
    llm = LLM(**options)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.chat([messages(0)], SamplingParams(max_tokens=4))  # warm-up
    started = time.perf_counter()
    outs = llm.chat([messages(i) for i in range(num_requests)], params)
    wall = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall}


def run_batch(
    engine: AsyncEngine,
    model: str,
    num_requests: int,
    new_tokens: int,
    shards_in_flight: int,
    shard_size: int,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tandem-batch-bench-") as root:
        local = local_platform(
            engine,
            FileObjectStore(root),
            TenantRegistry(parse_keys(f"{KEY}=bench")),
            batch_limits=BatchLimits(shard_size=shard_size, max_shards_in_flight=shards_in_flight),
            model=model,
            worker_id="bench",
        )
        worker = local.worker
        with TestClient(create_app(local.server)) as http:
            running = http.portal.start_task_soon(worker.run_forever)
            client = openai.OpenAI(
                base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0
            )
            lines = [
                {
                    "custom_id": f"r{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": model,
                        "messages": messages(i),
                        "max_tokens": new_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                }
                for i in range(num_requests)
            ]
            data = "".join(json.dumps(line) + "\n" for line in lines).encode()
            file_id = client.files.create(file=("bench.jsonl", io.BytesIO(data)), purpose="batch").id
            started = time.perf_counter()
            batch = client.batches.create(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            last_report = 0.0
            while batch.status not in ("completed", "failed", "expired", "cancelled"):
                time.sleep(0.2)
                batch = client.batches.retrieve(batch.id)
                if time.perf_counter() - last_report > 5:
                    last_report = time.perf_counter()
                    done = batch.request_counts.completed if batch.request_counts else 0
                    log(f"  {shards_in_flight} shards in flight: {done}/{num_requests} done")
            wall = time.perf_counter() - started
            running.cancel()
        assert batch.status == "completed", batch.errors
        assert batch.request_counts is not None and batch.request_counts.completed == num_requests
        tokens = batch.usage.output_tokens if batch.usage else 0
        return {
            "shards_in_flight": shards_in_flight,
            "shard_size": shard_size,
            "wall_s": wall,
            "output_tokens": tokens,
            "tokens_per_s": tokens / wall,
        }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--shard-size", type=int, default=32)
    parser.add_argument("--shards-in-flight", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "batch_throughput.json"))
    args = parser.parse_args()
    options: dict[str, Any] = {}

    # The batch runs first: its engine thread must be the only one of the process that has run
    # torch kernels (AsyncEngine.from_options says why); the offline LLM runs in this thread after.
    engine = AsyncEngine.from_options(**options)
    model = engine.model_name
    batches = []
    try:
        for shards in args.shards_in_flight:
            log(f"batch, {shards} shard(s) of {args.shard_size} in flight")
            batches.append(
                run_batch(engine, model, args.num_requests, args.new_tokens, shards, args.shard_size)
            )
            log(f"batch, {shards} in flight: {batches[-1]['tokens_per_s']:.1f} tok/s")
    finally:
        engine.shutdown()
    log(f"offline: {args.num_requests} requests")
    offline = run_offline(options, args.num_requests, args.new_tokens)
    log(f"offline: {offline['tokens_per_s']:.1f} tok/s")
    for run in batches:
        run["ratio_to_offline"] = run["tokens_per_s"] / offline["tokens_per_s"]
        log(f"batch, {run['shards_in_flight']} in flight: {run['ratio_to_offline']:.3f}x offline")
    result = {
        "num_requests": args.num_requests,
        "new_tokens": args.new_tokens,
        "offline": offline,
        "batch": batches,
    }
    write_result(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
