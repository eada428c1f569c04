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

from .conftest import free_port, make_tiny_model
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

    def __init__(self, tmp_path: Path, *args: str) -> None:
        model_dir = make_tiny_model(tmp_path / "model", max_positions=4096)
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["TANDEM_API_KEYS"] = f"{KEY}=acme"
        env["TANDEM_OPERATOR_KEYS"] = OPERATOR_KEY
        command = [sys.executable, "-m", "tandem.cli", "serve", "--model", str(model_dir)]
        command += ["--served-model-name", "tiny", "--port", str(self.port)]
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


def test_serve_runs_the_app_graph_and_stops_on_sigterm(tmp_path: Path) -> None:
    """`tandem serve` runs the one application graph: Serve's proxy on the user's port, the
    ingress deployment, the LLM replica and the batch worker; SIGTERM stops it cleanly."""
    server = ServeProcess(tmp_path)
    try:
        server.wait_for(r"serving .* at http://")
        port = server.port
        assert "ProxyActor" in listener_cmdline(port)
        for deployment in ("OpenAIIngress", "LLMReplica", "BatchWorker", "FleetState"):
            assert replica_pids(server, deployment), deployment
        base_url = f"http://127.0.0.1:{port}"
        check_openai_client(base_url)
        check_errors(base_url)
        # `tandem serve`'s replicas report every second (RoutingConfig.stats_period_s).
        check_disconnect_frees_kv_blocks(base_url, lambda: scraped_engine_stats(base_url), staleness_s=2.0)

        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=90) == 0
        with pytest.raises(AssertionError, match="nothing listens"):
            listener_cmdline(port)
    finally:
        server.stop()


def test_serve_answers_again_after_the_engine_replica_is_killed(tmp_path: Path) -> None:
    """`kill -KILL` of the LLM replica while it streams: the stream ends (it does not hang), Serve
    starts a new replica, and a chat request succeeds again within 60 s."""
    import time

    import httpx
    import openai

    server = ServeProcess(tmp_path)
    try:
        server.wait_for(r"serving .* at http://")
        base_url = f"http://127.0.0.1:{server.port}"
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
    finally:
        server.stop()
