"""`tandem serve` through an object-store outage: the store stopped for a while, then frozen, with
streams running, a batch queued, and the ingress killed during each phase.

A real S3 server (SeaweedFS) sits behind a fault-injecting TCP proxy (tests/fault_proxy.py);
`tandem serve --object-store s3://...` reaches it through the proxy. Closed-loop streaming clients
(`--streams`, each asking `--max-tokens` with usage) run throughout; every few seconds a probe
uploads a file and lists batches. Phases: `--baseline-s` with the store up, `--stop-s` with the
store refusing connections, `--freeze-s` with it accepting and never answering, then up again
until the batch completes. In each fault phase, after a third of it, every ingress replica is
killed (SIGKILL) and the time until a new request succeeds is measured.

Reported (JSON): streamed request latency p50 per phase and its ratio to the baseline; the
probes' statuses, Retry-After and answer times; the ingress's recovery times; the batch's lines
(each once?); usage metered for the tenant against what the clients were told (completed
responses) plus what the cut streams received.

    python benchmarks/store_outage.py --out benchmarks/results/store_outage.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import openai  # noqa: E402
import psutil  # noqa: E402
from tests.fault_proxy import FaultProxy  # noqa: E402
from tests.seaweed import ACCESS_KEY, BUCKET, SECRET_KEY, SeaweedFS  # noqa: E402

from common import free_port, log, percentile, start_server, stop_server, write_result  # noqa: E402

OPERATOR_KEY = "sk-outage-operator"
MODEL = ["tandem"]  # the served model's name, read from /v1/models at start


class Clients:
    """Closed-loop streaming clients; every request's outcome, tagged with the phase it began in."""

    def __init__(self, base_url: str, key: str, num_streams: int, max_tokens: int) -> None:
        self.base_url, self.key, self.max_tokens = base_url, key, max_tokens
        self.phase = "baseline"
        self.results: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(num_streams)
        ]
        for thread in self._threads:
            thread.start()

    def _loop(self, index: int) -> None:
        api = openai.OpenAI(base_url=self.base_url, api_key=self.key, max_retries=0, timeout=60)
        n = 0
        while not self._stop.is_set():
            n += 1
            phase, started = self.phase, time.monotonic()
            result: dict[str, Any] = {"phase": phase, "started": started, "chunks": 0}
            try:
                stream = api.chat.completions.create(
                    model=MODEL[0], messages=[{"role": "user", "content": f"Say something about {index}-{n}."}],
                    max_tokens=self.max_tokens, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                for chunk in stream:
                    result["id"] = chunk.id
                    if chunk.choices and chunk.choices[0].delta.content:
                        result["chunks"] += 1
                    if chunk.usage is not None:
                        result["usage"] = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
                result["ok"] = "usage" in result
            except Exception as exc:  # noqa: BLE001 - a cut stream or a refused request: recorded
                result["ok"] = False
                result["error"] = type(exc).__name__
            result["latency_s"] = time.monotonic() - started
            self.results.append(result)
            if not result["ok"]:
                time.sleep(0.5)  # a refused client backs off a little

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)


def probe(base_url: str, key: str) -> list[dict[str, Any]]:
    """An upload and a batch listing: status, error code, Retry-After, seconds to answer."""
    out = []
    headers = {"Authorization": f"Bearer {key}"}
    for method, path, kwargs in (
        ("POST", "/files", {"files": {"file": ("p.jsonl", b"{}\n")}, "data": {"purpose": "batch"}}),
        ("GET", "/batches", {}),
    ):
        started = time.monotonic()
        try:
            reply = httpx.request(method, base_url + path, headers=headers, timeout=60, **kwargs)
            code = reply.json().get("error", {}).get("code") if reply.status_code >= 400 else None
            out.append({"call": f"{method} {path}", "status": reply.status_code, "code": code,
                        "retry_after": reply.headers.get("retry-after"), "seconds": time.monotonic() - started})  # fmt: skip
        except httpx.HTTPError as exc:
            out.append({"call": f"{method} {path}", "status": None, "error": type(exc).__name__,
                        "seconds": time.monotonic() - started})  # fmt: skip
    return out


def kill_ingress(server_pid: int) -> int:
    pids = [
        p.pid for p in psutil.Process(server_pid).children(recursive=True)
        if "ServeReplica:tandem:OpenAIIngress" in " ".join(p.cmdline())
    ]  # fmt: skip
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return len(pids)


def recovery_s(base_url: str, key: str, since: float, timeout_s: float = 120.0) -> float | None:
    """Seconds from `since` until a new chat request succeeds."""
    api = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=10)
    while time.monotonic() - since < timeout_s:
        try:
            api.chat.completions.create(
                model=MODEL[0], messages=[{"role": "user", "content": "up?"}], max_tokens=2
            )
            return time.monotonic() - since
        except Exception:  # noqa: BLE001 - not yet
            time.sleep(0.25)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline-s", type=float, default=30.0)
    parser.add_argument("--stop-s", type=float, default=60.0)
    parser.add_argument("--freeze-s", type=float, default=60.0)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-lines", type=int, default=200)
    parser.add_argument("--serve-args", default="", help="more `tandem serve` arguments")
    parser.add_argument("--out", default="benchmarks/results/store_outage.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tandem-outage-"))
    (work / "seaweed").mkdir()
    (work / "serve").mkdir()
    seaweed = SeaweedFS(work / "seaweed")
    host, port = (seaweed.settings.endpoint_url or "").removeprefix("http://").rsplit(":", 1)
    proxy = FaultProxy(host, int(port))
    env = {
        "TANDEM_S3_ENDPOINT_URL": proxy.url, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "TANDEM_OPERATOR_KEYS": OPERATOR_KEY, "TANDEM_STATE_DIR": str(work / "state"),
    }  # fmt: skip
    server, base_url = start_server(
        str(work / "serve"),
        free_port(),
        env,
        ("--object-store", f"s3://{BUCKET}/outage", *args.serve_args.split()),
    )
    result: dict[str, Any] = {"settings": vars(args)}
    try:
        admin = {"Authorization": f"Bearer {OPERATOR_KEY}"}
        assert (
            httpx.post(
                f"{base_url}/admin/tenants", json={"id": "bench"}, headers=admin, timeout=30
            ).status_code
            == 200
        )
        key = httpx.post(f"{base_url}/admin/tenants/bench/keys", headers=admin, timeout=30).json()["key"]
        api = openai.OpenAI(base_url=base_url, api_key=key, max_retries=2, timeout=60)
        MODEL[0] = api.models.list().data[0].id
        lines = [
            json.dumps(
                {
                    "custom_id": f"line-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": MODEL[0],
                        "messages": [{"role": "user", "content": f"Line {i}"}],
                        "max_tokens": 16,
                    },
                }
            )  # fmt: skip
            for i in range(args.batch_lines)
        ]
        file_id = api.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch").id
        batch = api.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        started_epoch = time.time()
        clients = Clients(base_url, key, args.streams, args.max_tokens)
        time.sleep(args.baseline_s)  # the phase's length: the clients run meanwhile
        probes: dict[str, list[Any]] = {}
        recoveries: dict[str, float | None] = {}
        for mode, length in (("stop", args.stop_s), ("freeze", args.freeze_s)):
            log(f"store {mode} for {length:g} s")
            proxy.set_mode(mode)  # type: ignore[arg-type]
            clients.phase = mode
            phase_end = time.monotonic() + length
            killed = False
            while time.monotonic() < phase_end:
                probes.setdefault(mode, []).extend(probe(base_url, key))
                if not killed and time.monotonic() > phase_end - length * 2 / 3:
                    killed = True
                    num = kill_ingress(server.pid)
                    killed_at = time.monotonic()
                    recoveries[mode] = recovery_s(base_url, key, killed_at)
                    log(f"killed {num} ingress replica(s); serving again after {recoveries[mode]} s")
                time.sleep(max(0.0, min(3.0, phase_end - time.monotonic())))
            proxy.set_mode("pass")
        clients.phase = "after"
        log("store back; waiting for the batch")
        deadline = time.monotonic() + 900
        while (done := api.batches.retrieve(batch.id)).status not in (
            "completed",
            "failed",
            "expired",
            "cancelled",
        ):
            assert time.monotonic() < deadline, done
            time.sleep(2.0)
        clients.stop()
        output = [json.loads(x) for x in api.files.content(done.output_file_id or "").text.splitlines()]
        ids = Counter(o["custom_id"] for o in output)
        batch_tokens = [
            sum(o["response"]["body"]["usage"][k] for o in output)
            for k in ("prompt_tokens", "completion_tokens")
        ]
        time.sleep(5.0)  # the last usage records ship (1 s interval) before the query
        usage = httpx.get(
            f"{base_url}/organization/usage/completions", headers=admin, timeout=120,
            params={"start_time": int(started_epoch) - 60, "bucket_width": "1d", "project_ids": "bench"},
        ).json()  # fmt: skip
        metered = [
            sum(r[k] for b in usage["data"] for r in b["results"]) for k in ("input_tokens", "output_tokens")
        ]
        completed = [r for r in clients.results if r["ok"]]
        cut = [r for r in clients.results if not r["ok"] and r.get("id")]
        baseline = [r["latency_s"] for r in completed if r["phase"] == "baseline"]
        phases = {}
        for phase in ("baseline", "stop", "freeze", "after"):
            mine = [r["latency_s"] for r in completed if r["phase"] == phase]
            phases[phase] = {
                "completed": len(mine), "failed": sum(1 for r in clients.results if r["phase"] == phase and not r["ok"]),
                "p50_s": percentile(mine, 0.5) if mine else None,
                "p50_over_baseline": percentile(mine, 0.5) / percentile(baseline, 0.5) if mine else None,
            }  # fmt: skip
        result.update({
            "phases": phases,
            "probes": probes,
            "probe_max_seconds": {m: max(p["seconds"] for p in ps) for m, ps in probes.items()},
            "probe_statuses": {m: dict(Counter(f"{p['status']} {p.get('code')}" for p in ps)) for m, ps in probes.items()},
            "ingress_recovery_s": recoveries,
            "batch": {"status": done.status, "lines": len(output), "unique": len(ids), "duplicates": sum(n - 1 for n in ids.values()),
                      "counts": done.request_counts.model_dump() if done.request_counts else None},
            "usage": {
                "metered_input_output": metered,
                "clients_completed_input_output": [sum(r["usage"][0] for r in completed), sum(r["usage"][1] for r in completed)],
                "batch_input_output": batch_tokens,
                "cut_streams": len(cut), "cut_streams_chunks_received": sum(r["chunks"] for r in cut),
            },
        })  # fmt: skip
        expected_out = result["usage"]["clients_completed_input_output"][1] + batch_tokens[1]
        result["usage"]["metered_output_minus_completed_and_batch"] = metered[1] - expected_out
    finally:
        stop_server(server)
        proxy.close()
        seaweed.stop()
    write_result(args.out, result)
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "phases",
                    "probe_max_seconds",
                    "probe_statuses",
                    "ingress_recovery_s",
                    "batch",
                    "usage",
                )
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
