"""`tandem batch ...`: submit, watch, fetch and cancel batch jobs with the official openai client,
and `tandem batch worker` to run a standalone worker (own engine, no Ray) on an object store.

Client commands read `--base-url` / `$TANDEM_BASE_URL` (default http://127.0.0.1:8000/v1) and
`--api-key` / `$TANDEM_API_KEY`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from tandem.deployments.batch_execution import execute_batch_line
from tandem.deployments.openai.endpoints import BATCH_ENDPOINTS

TERMINAL = {"completed", "failed", "expired", "cancelled"}

if TYPE_CHECKING:  # the client is imported when a command needs it
    from openai import OpenAI
    from openai.types import Batch


def add_parser(sub: Any) -> None:
    batch = sub.add_parser("batch", help="batch jobs: submit, status, results, cancel, worker")
    batch.set_defaults(run=run)
    batch.add_argument("--base-url", default=os.environ.get("TANDEM_BASE_URL", "http://127.0.0.1:8000/v1"))
    batch.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"))
    cmds = batch.add_subparsers(dest="batch_command", required=True)
    submit = cmds.add_parser("submit", help="upload a JSONL file and start a batch")
    submit.add_argument("file")
    submit.add_argument("--endpoint", default="/v1/chat/completions")
    submit.add_argument("--wait", action="store_true", help="show progress until the batch ends")
    submit.add_argument("--poll-interval", type=float, default=2.0)
    status = cmds.add_parser("status", help="show a batch")
    status.add_argument("batch_id")
    results = cmds.add_parser("results", help="download a batch's output (and errors)")
    results.add_argument("batch_id")
    results.add_argument("-o", "--output", required=True, help="output JSONL path")
    results.add_argument("--errors", default=None, help="error JSONL path (default: OUTPUT.errors.jsonl)")
    results.add_argument(
        "--in-order",
        action="store_true",
        help="write one file: every answered line (output and errors) in the input file's order",
    )
    cancel = cmds.add_parser("cancel", help="cancel a batch (finished requests are kept)")
    cancel.add_argument("batch_id")
    worker = cmds.add_parser("worker", help="run a standalone batch worker with its own engine")
    worker.add_argument("--object-store", required=True, help="file:///path or s3://bucket/prefix")
    worker.add_argument("--model", default=None)
    worker.add_argument("--served-model-name", default=None)
    worker.add_argument("--kv-cache-memory", type=int, default=None)
    worker.add_argument("--lease-ttl", type=float, default=60.0)
    worker.add_argument("--shard-size", type=int, default=32)


def run(args: argparse.Namespace) -> int:
    if args.batch_command == "worker":
        return _worker(args)
    import openai

    if not args.api_key:
        print("[tandem] set --api-key or $TANDEM_API_KEY (printed by `tandem serve`)", file=sys.stderr)
        return 2
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    if args.batch_command == "submit":
        with open(args.file, "rb") as f:
            uploaded = client.files.create(file=(os.path.basename(args.file), f), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint=args.endpoint, completion_window="24h"
        )
        print(batch.id)
        if args.wait:
            batch = _watch(client, batch.id, args.poll_interval)
            return 0 if batch.status == "completed" else 1
        return 0
    if args.batch_command == "status":
        print(client.batches.retrieve(args.batch_id).model_dump_json(indent=2))
        return 0
    if args.batch_command == "cancel":
        print(client.batches.cancel(args.batch_id).status)
        return 0
    if args.batch_command == "results":
        batch = client.batches.retrieve(args.batch_id)
        if batch.status not in TERMINAL:
            print(f"[tandem] batch is {batch.status}; results come when it ends", file=sys.stderr)
            return 1
        if args.in_order:
            num_lines = _write_in_input_order(client, batch, args.output)
            print(f"[tandem] {num_lines} lines in input order: {args.output}", file=sys.stderr)
        else:
            if batch.output_file_id:
                client.files.content(batch.output_file_id).write_to_file(args.output)
                print(f"[tandem] output: {args.output}", file=sys.stderr)
            if batch.error_file_id:
                path = args.errors or args.output + ".errors.jsonl"
                client.files.content(batch.error_file_id).write_to_file(path)
                print(f"[tandem] errors: {path}", file=sys.stderr)
        if batch.errors and batch.errors.data:
            for error in batch.errors.data:
                print(f"[tandem] line {error.line}: {error.code}: {error.message}", file=sys.stderr)
        return 0
    return 1


def _watch(client: OpenAI, batch_id: str, poll_interval: float) -> Batch:
    """Redraw a progress line on stderr until the batch reaches a terminal status."""
    while True:
        batch = client.batches.retrieve(batch_id)
        sys.stderr.write("\r" + progress_line(batch, time.time()))
        sys.stderr.flush()
        if batch.status in TERMINAL:
            sys.stderr.write("\n")
            if batch.errors and batch.errors.data:
                for error in batch.errors.data:
                    sys.stderr.write(f"[tandem] line {error.line}: {error.code}: {error.message}\n")
            return batch
        time.sleep(poll_interval)


def progress_line(batch: Batch, now: float, width: int = 30) -> str:
    """One frame of the progress bar: rows answered of total, status, output tokens/s and an ETA.

    Rates are measured from the batch's `in_progress_at` (server clock, epoch seconds) with the
    counts and `usage` the server reports, which grow as shards commit; the ETA extrapolates rows
    per second and is shown once a row is done and the batch has not ended.
    """
    counts = batch.request_counts
    total = counts.total if counts else 0
    done = (counts.completed + counts.failed) if counts else 0
    filled = int(width * done / total) if total else 0
    bar = "#" * filled + "-" * (width - filled)
    line = f"[{bar}] {done}/{total} {batch.status:<11}"
    started = batch.in_progress_at
    if started is None:
        return line
    ended = next(
        (t for t in (batch.completed_at, batch.failed_at, batch.cancelled_at, batch.expired_at) if t), None
    )
    elapsed = max((ended or now) - started, 1e-3)
    output_tokens = batch.usage.output_tokens if batch.usage else 0
    line += f" {output_tokens / elapsed:7.1f} tok/s {_duration(elapsed)} elapsed"
    if ended is None and 0 < done < total:
        line += f", ETA {_duration((total - done) * elapsed / done)}"
    return line


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _write_in_input_order(client: OpenAI, batch: Batch, path: str) -> int:
    """Merge the output and error files into `path`, one line per answered request, in the order of
    the input file's `custom_id`s (lines never run, e.g. of a cancelled batch, are left out).
    Returns the number of lines written."""
    import json

    answered: dict[str, str] = {}
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id:
            for line in client.files.content(file_id).text.splitlines():
                if line.strip():
                    answered[json.loads(line)["custom_id"]] = line
    num_lines = 0
    with open(path, "w", encoding="utf-8") as out:
        for line in client.files.content(batch.input_file_id).text.splitlines():
            if not line.strip():
                continue
            answer = answered.get(json.loads(line).get("custom_id"))
            if answer is not None:
                out.write(answer + "\n")
                num_lines += 1
    return num_lines


def _worker(args: argparse.Namespace) -> int:
    from tandem.batch.service import BatchLimits, BatchService
    from tandem.batch.worker import BatchWorker
    from tandem.deployments.adapters import AdapterStore
    from tandem.deployments.engine_clients import LocalEngineClient
    from tandem.deployments.openai.server import OpenAIServer
    from tandem.engine.async_engine import AsyncEngine
    from tandem.platform.config import DEFAULT_MODEL
    from tandem.platform.store_guard import open_object_store
    from tandem.platform.tenancy import TenantRegistry

    options: dict[str, Any] = {}
    if args.served_model_name:
        options["served_model_name"] = args.served_model_name
    if args.kv_cache_memory:
        options["kv_cache_memory"] = args.kv_cache_memory
    options["enable_lora"] = True  # lines may name their owner's adapters in the store
    engine = AsyncEngine.from_options(args.model or DEFAULT_MODEL, **options)
    limits = BatchLimits(lease_ttl_s=args.lease_ttl, shard_size=args.shard_size)
    store = open_object_store(args.object_store)
    service = BatchService(store, {engine.model_name}, limits, endpoints=BATCH_ENDPOINTS)
    adapters = AdapterStore(store, engine.model_name)  # lines may name the owner's adapters
    server = OpenAIServer(LocalEngineClient(engine, adapters), TenantRegistry({}), adapters=adapters)
    worker = BatchWorker(service, partial(execute_batch_line, server))
    print(f"[tandem] batch worker {worker.worker_id} on {args.object_store}", file=sys.stderr, flush=True)
    try:
        asyncio.run(worker.run_forever())
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()
    return 0
