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


def test_serve_answers_on_the_replica_itself_and_stops_on_sigterm(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "model", max_positions=4096)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["TANDEM_API_KEYS"] = f"{KEY}=acme"
    command = [sys.executable, "-m", "tandem.cli", "serve", "--model", str(model_dir)]
    command += ["--served-model-name", "tiny", "--port", str(port), "--data-dir", str(tmp_path / "data")]
    command += ["--kv-cache-memory", str(8 << 20)]
    server = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=read_lines, args=(server.stderr, lines), daemon=True).start()
    output: list[str] = []
    try:
        proxy_port = None
        while proxy_port is None:  # the line `tandem serve` prints once the app is running
            line = lines.get(timeout=STARTUP_TIMEOUT_S)
            output.append(line)
            assert line, "tandem serve exited before serving:\n" + "".join(output[-40:])
            if match := re.search(r"direct ingress: .* Serve's proxy is on (\d+)", line):
                proxy_port = int(match.group(1))

        # Direct ingress: the LLM replica itself, not Serve's proxy, owns the user's port.
        assert "ServeReplica:tandem:LLMReplica" in listener_cmdline(port)
        assert "ProxyActor" in listener_cmdline(proxy_port)
        base_url = f"http://127.0.0.1:{port}"
        check_openai_client(base_url)
        check_errors(base_url)
        check_disconnect_frees_kv_blocks(base_url, lambda: scraped_engine_stats(base_url))
        check_openai_client(f"http://127.0.0.1:{proxy_port}")  # the proxy path still works

        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=90) == 0
        with pytest.raises(AssertionError, match="nothing listens"):
            listener_cmdline(port)
    finally:
        if server.poll() is None:  # a failed assertion above: stop what this test started
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
