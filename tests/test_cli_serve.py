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
    scraped_samples,
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


def replica_http_ports() -> list[int]:
    """The ports on which this machine's `tandem` LLM replicas answer HTTP (direct ingress)."""
    import httpx

    ports = []
    for proc in psutil.process_iter():
        try:
            if "ServeReplica:tandem:LLMReplica" not in " ".join(proc.cmdline()):
                continue
            listening = [c.laddr.port for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for port in listening:  # Ray's own gRPC ports among them do not answer HTTP
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    ports.append(port)
            except httpx.HTTPError:
                continue
    return ports


def requests_served(base_url: str) -> float:
    """Finished requests of tenant acme counted by the replica answering at `base_url`."""
    return sum(
        value
        for name, labels, value in scraped_samples(base_url)
        if name == "tandem_requests_total" and 'tenant="acme"' in labels
    )


def completion_request_id(base_url: str) -> str:
    """Whether a completion's `X-Request-ID` is the completion's own id or another one."""
    import httpx

    reply = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": "tiny", "prompt": "Paged attention", "max_tokens": 2},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return "completion id" if reply.headers["x-request-id"] == reply.json()["id"] else "another id"


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


def test_serve_answers_on_the_replica_itself_and_stops_on_sigterm(tmp_path: Path) -> None:
    server = ServeProcess(tmp_path)
    try:
        # the line `tandem serve` prints once the app is running
        proxy_port = int(server.wait_for(r"direct ingress: .* Serve's proxy is on (\d+)").group(1))

        # Direct ingress: the LLM replica itself, not Serve's proxy, owns the user's port.
        port = server.port
        assert "ServeReplica:tandem:LLMReplica" in listener_cmdline(port)
        assert "ProxyActor" in listener_cmdline(proxy_port)
        base_url = f"http://127.0.0.1:{port}"
        check_openai_client(base_url)
        check_errors(base_url)
        check_disconnect_frees_kv_blocks(base_url, lambda: scraped_engine_stats(base_url))
        # The replica answers completions in front of Serve's request handling (its request id
        # is the completion's); through the proxy, Serve's handling runs and gives its own id.
        assert completion_request_id(base_url) == "completion id"
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        assert completion_request_id(proxy_url) == "another id"
        check_openai_client(proxy_url)  # the proxy path still works

        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=90) == 0
        with pytest.raises(AssertionError, match="nothing listens"):
            listener_cmdline(port)
    finally:
        server.stop()


def test_serve_balances_several_replicas_through_haproxy(tmp_path: Path) -> None:
    """`--num-replicas 2`: HAProxy owns the user's port and both replicas answer through it."""
    import openai

    server = ServeProcess(tmp_path, "--num-replicas", "2")
    try:
        server.wait_for(r"direct ingress: HAProxy on \d+ balances over 2 replicas")
        assert "haproxy" in listener_cmdline(server.port)
        base_url = f"http://127.0.0.1:{server.port}"
        check_openai_client(base_url)
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)
        for _ in range(6):
            client.completions.create(model="tiny", prompt="Paged attention", max_tokens=2)
        # Each replica counts the requests it served; its own port answers its own /metrics.
        served = {port: requests_served(f"http://127.0.0.1:{port}") for port in replica_http_ports()}
        assert len(served) == 2 and all(n >= 1 for n in served.values()), served
        assert sum(served.values()) >= 7, served  # the six above and the client checks
    finally:
        server.stop()
