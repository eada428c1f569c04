"""`tandem generate` end to end in a subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_generate_streams_text(tiny_model_dir: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "generate",
            "--model",
            str(tiny_model_dir),
            "--prompt",
            "Hello there",
            "--max-tokens",
            "5",
            "--raw",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "5 tokens" in result.stderr and "finish_reason=length" in result.stderr
    assert result.stdout.strip()


def test_generate_reports_bad_input_as_json_error(tiny_model_dir: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "generate",
            "--model",
            str(tiny_model_dir),
            "--prompt",
            "hi",
            "--temperature",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert '"param": "temperature"' in result.stderr
