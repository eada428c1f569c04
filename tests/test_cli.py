"""`tandem generate` end to end in a subprocess."""

from __future__ import annotations

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
