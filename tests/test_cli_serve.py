"""`tandem serve`, the README's run command, end to end: a subprocess with a Ray of its own."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from .conftest import free_port, make_tiny_model, sse_lines
from .test_serve import (
    KEY,
    OPERATOR_KEY,
    check_disconnect_frees_kv_blocks,
    check_errors,
    check_openai_client,
    scraped_engine_stats,
)

pytestmark = pytest.mark.ray

STARTUP_TIMEOUT_S = 240


def listener_cmdline(port: int) -> str:
    """The command line of the process listening on 127.0.0.1:`port` (Ray names its actors there)."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            return " ".join(psutil.Process(conn.pid).cmdline())
    raise AssertionError(f"nothing listens on port {port}")


def read_lines(stream: object, lines: queue.Queue[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.put(line)
    lines.put("")  # end of output: the process exited


class ServeProcess:
    """`tandem serve` on a tiny model in a subprocess with a Ray of its own; its stderr lines are
    read as they come."""

    def __init__(
        self, tmp_path: Path, *args: str, port: int | None = None, model: str | None = None, served_name: str = "tiny",
        pinned_precision: bool = True,
    ) -> None:  # fmt: skip
        """`model`: a checkpoint (default: a tiny random one made here); `pinned_precision=False`
        serves with the precision defaults (no `TANDEM_AUTO_PRECISION` pin of the test suite)."""
        if model is None:
            model_dir = tmp_path / "model"
            if not (model_dir / "config.json").exists():
                make_tiny_model(model_dir, max_positions=4096)
            model = str(model_dir)
        self.port = port or free_port()
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        if not pinned_precision:
            env.pop("TANDEM_AUTO_PRECISION", None)
        env["TANDEM_API_KEYS"] = f"{KEY}=acme"
        env["TANDEM_OPERATOR_KEYS"] = OPERATOR_KEY
        command = [sys.executable, "-m", "tandem.cli", "serve", "--model", model]
        command += ["--served-model-name", served_name, "--port", str(self.port)]
        command += ["--data-dir", str(tmp_path / "data"), "--kv-cache-memory", str(8 << 20), *args]
        self.process = subprocess.Popen(
            command, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=read_lines, args=(self.process.stderr, self.lines), daemon=True).start()

    def wait_for(self, pattern: str) -> re.Match[str]:
        """The first line from now on that matches `pattern`; fails if the process exits first."""
        while True:
            line = self.lines.get(timeout=STARTUP_TIMEOUT_S)
            self.output.append(line)
            assert line, "tandem serve exited:\n" + "".join(self.output[-40:])
            if match := re.search(pattern, line):
                return match

    def stop(self) -> None:
        """SIGTERM, as a user's Ctrl-C or a service manager; SIGKILL the group if it hangs."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def replica_pids(server: ServeProcess, deployment: str) -> list[int]:
    """PIDs of `server`'s replicas of `deployment` (its Ray runs under it; Ray titles them by
    name), not those of other `tandem serve` processes on this machine."""
    pids = []
    for proc in psutil.Process(server.process.pid).children(recursive=True):
        try:
            if f"ServeReplica:tandem:{deployment}" in " ".join(proc.cmdline()):
                pids.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return pids


def check_serve_mode(server: ServeProcess) -> None:
    """Serve's controller, proxy and every replica of `server` run in the mode `tandem serve`
    sets (`serve_config.SERVE_ENV_VARS`: Serve reads it from each process's environment)."""
    from tandem.cli.serve_config import SERVE_ENV_VARS

    checked = []
    for proc in psutil.Process(server.process.pid).children(recursive=True):
        try:
            cmdline = " ".join(proc.cmdline())
            if not any(role in cmdline for role in ("ServeController", "ProxyActor", "ServeReplica:tandem:")):
                continue
            env = proc.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        assert {name: env.get(name) for name in SERVE_ENV_VARS} == SERVE_ENV_VARS, cmdline
        checked.append(cmdline)
    assert any("ServeController" in c for c in checked) and any("ProxyActor" in c for c in checked), checked
    assert sum("ServeReplica:tandem:" in c for c in checked) >= 4, checked


def check_logs(server: ServeProcess, base_url: str) -> None:
    """A 400 from the engine is one structured INFO line (route, status, code, param, tenant,
    request id) and no traceback; then an idle server writes nothing for a while (no per-second
    lines from internal calls)."""
    import time

    import httpx

    reply = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": "tiny", "prompt": "word " * 5000, "max_tokens": 2},
        headers={"Authorization": f"Bearer {KEY}", "X-Request-ID": "log-check-400"},
        timeout=60,
    )
    assert reply.status_code == 400
    line = server.wait_for(r"log-check-400").string
    assert re.search(r"\bINFO \S+ tandem\.api request refused ", line) and line.count("log-check-400") == 1, (
        line
    )
    for field in (
        "route=/v1/completions",
        "status=400",
        "code=context_length_exceeded",
        "param=prompt",
        "tenant=acme",
    ):
        assert field in line, (field, line)
    idle: list[str] = []
    quiet_from = time.monotonic()
    while (left := 12.0 - (time.monotonic() - quiet_from)) > 0:
        try:
            idle.append(server.lines.get(timeout=left))
        except queue.Empty:
            break
    server.output += idle
    assert not any("Traceback" in out for out in server.output), "".join(server.output[-40:])
    assert not any("log-check-400" in out for out in idle), idle  # one line for the request
    assert len(idle) <= 2, f"an idle server wrote {len(idle)} lines in 12 s: {idle[:5]}"


def test_serve_runs_the_app_graph_survives_a_killed_engine_replica_and_stops_on_sigterm(
    tmp_path: Path,
) -> None:
    """`tandem serve` runs the one application graph: Serve's proxy on the user's port, the
    ingress deployment, the LLM replica and the batch worker; `kill -KILL` of the LLM replica
    mid-stream ends the stream and a replacement answers (`check_answers_after_a_replica_kill`);
    SIGTERM then stops it cleanly."""
    server = ServeProcess(tmp_path)
    try:
        server.wait_for(r"serving .* at http://")
        port = server.port
        assert "ProxyActor" in listener_cmdline(port)
        for deployment in ("OpenAIIngress", "LLMReplica", "BatchWorker", "FleetState"):
            assert replica_pids(server, deployment), deployment
        check_serve_mode(server)
        base_url = f"http://127.0.0.1:{port}"
        check_openai_client(base_url)
        check_errors(base_url)
        check_logs(server, base_url)
        # `tandem serve`'s replicas report every second (RoutingConfig.stats_period_s).
        check_disconnect_frees_kv_blocks(base_url, lambda: scraped_engine_stats(base_url), staleness_s=2.0)
        check_answers_after_a_replica_kill(server, base_url)

        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=90) == 0
        with pytest.raises(AssertionError, match="nothing listens"):
            listener_cmdline(port)
    finally:
        server.stop()


def test_sigterm_during_start_up_stops_ray_and_serve_cleanly(tmp_path: Path) -> None:
    """SIGTERM (a service manager's stop, a Ctrl-C) while the replicas start: the command says
    so, stops Serve and the Ray it started (no process of it left), frees the port and exits 0,
    with no traceback or signal dump."""
    import time

    server = ServeProcess(tmp_path)
    try:
        server.wait_for(r"Started Serve")  # Ray is up; the app's replicas are starting
        ray_processes = psutil.Process(server.process.pid).children(recursive=True)
        assert ray_processes
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=90) == 0
        server.wait_for(r"\[tandem\] stopped")
        assert any("start-up interrupted" in line for line in server.output), server.output[-20:]
        assert not any("Traceback" in line or "SIGTERM received" in line for line in server.output), "".join(
            server.output[-40:]
        )
        deadline = time.monotonic() + 30
        while (
            left := [p for p in ray_processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        ) and (time.monotonic() < deadline):
            time.sleep(0.5)  # Ray's processes exit on their own schedule after ray.shutdown()
        assert not left, [p.pid for p in left]
        with pytest.raises(AssertionError, match="nothing listens"):
            listener_cmdline(server.port)
    finally:
        server.stop()


def check_answers_after_a_replica_kill(server: ServeProcess, base_url: str) -> None:
    """`kill -KILL` of the LLM replica while it streams: the stream ends (it does not hang), Serve
    starts a new replica, and a chat request succeeds again within 60 s."""
    import time

    import httpx
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=30)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}]}
    [victim] = replica_pids(server, "LLMReplica")
    stream = client.chat.completions.create(
        **chat, max_tokens=3000, stream=True, extra_body={"ignore_eos": True}
    )
    assert next(iter(stream)) is not None  # streaming now
    os.kill(victim, signal.SIGKILL)
    with pytest.raises((openai.APIError, httpx.HTTPError)):  # the stream ends, with an error
        for _ in stream:
            pass
    killed_at = time.monotonic()
    last_error: Exception | None = None
    while time.monotonic() - killed_at < 60:  # retry until the replacement answers
        try:
            reply = client.chat.completions.create(**chat, max_tokens=4)
            break
        except (openai.APIError, httpx.HTTPError) as exc:
            last_error = exc
            time.sleep(0.5)  # back off while Serve starts the replacement
    else:
        raise AssertionError(f"no answer within 60 s of the kill: {last_error!r}")
    print(f"\nanswered again {time.monotonic() - killed_at:.1f} s after the kill")
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert replica_pids(server, "LLMReplica") and victim not in replica_pids(server, "LLMReplica")


def test_sigterm_drains_streams_and_releases_batch_leases_and_the_port_is_free_again(tmp_path: Path) -> None:
    """SIGTERM during two streams and a batch: new requests get 503 `shutting_down`, the streams
    end with `[DONE]` (the short one finished, the long one with an error event at the drain's
    end), the process exits 0, a new `tandem serve` on the same port starts and answers, and the
    batch completes there with every line exactly once."""
    import json
    import time

    import httpx
    import openai

    server = ServeProcess(tmp_path, "--drain-timeout", "4")
    port = server.port
    try:
        server.wait_for(r"serving .* at http://")
        base_url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
        lines = [
            json.dumps(
                {
                    "custom_id": f"line-{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {"model": "tiny", "prompt": f"count {i}", "max_tokens": 400, "ignore_eos": True},
                }
            )  # fmt: skip
            for i in range(24)
        ]
        file_id = client.files.create(
            file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch"
        ).id
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
        )
        short: list[str] = []
        long: list[str] = []
        events = [threading.Event(), threading.Event()]
        streams = [
            threading.Thread(target=sse_lines, args=(base_url, KEY, 20, short, events[0])),
            threading.Thread(target=sse_lines, args=(base_url, KEY, 3500, long, events[1])),
        ]
        for thread in streams:
            thread.start()
        assert all(event.wait(60) for event in events)
        status = client.batches.retrieve(batch.id)
        assert status.status in ("validating", "in_progress"), status.status  # still running

        server.process.send_signal(signal.SIGTERM)
        server.wait_for(r"stopping: draining")
        refused = None
        while server.process.poll() is None:  # the drain reaches the ingress within a poll
            reply = httpx.post(
                f"{base_url}/v1/completions",
                json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=30,
            )
            if reply.status_code == 503:
                refused = reply
                break
        assert refused is not None and refused.json()["error"]["code"] == "shutting_down"
        assert refused.headers.get("retry-after")
        for thread in streams:
            thread.join(60)
        assert short[-1] == "data: [DONE]", short[-3:]
        assert long[-1] == "data: [DONE]", long[-3:]
        assert json.loads(long[-2][6:])["error"]["code"] == "shutting_down"
        assert server.process.wait(timeout=90) == 0
        exited_at = time.monotonic()
    finally:
        server.stop()

    restarted = ServeProcess(tmp_path, port=port)  # the same port and data folder
    try:
        ready = restarted.wait_for(r"serving .* at http://").string.strip()
        reply = client.completions.create(model="tiny", prompt="again", max_tokens=2)
        answered_s = time.monotonic() - exited_at
        print(f"\nthe new server answered {answered_s:.1f} s after the old one exited; {ready}")
        assert reply.choices[0].text is not None
        deadline = time.monotonic() + 180
        while (status := client.batches.retrieve(batch.id)).status != "completed":
            assert status.status in ("validating", "in_progress", "finalizing"), status.status
            assert time.monotonic() < deadline, "the batch did not complete on the new server"
            time.sleep(0.5)
        assert status.output_file_id is not None
        output = client.files.content(status.output_file_id).text.splitlines()
        assert sorted(json.loads(line)["custom_id"] for line in output) == sorted(
            f"line-{i}" for i in range(24)
        )
    finally:
        restarted.stop()
