"""`tandem generate` end to end in a subprocess; `tandem serve`'s refusals before it starts Ray."""

from __future__ import annotations

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


def test_serve_refuses_a_port_in_use(tiny_model_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_serve(tiny_model_dir, "--port", str(port))
    assert result.returncode == 2
    assert '"param": "port"' in result.stderr and "choose another --port" in result.stderr
