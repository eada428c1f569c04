"""What every benchmark script shares: progress logging, percentiles and the JSON result file."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__}


def write_result(path: str | Path, result: dict[str, Any]) -> None:
    """Write `result` (with this machine's description added) as JSON to `path`."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**result, "machine": machine()}, indent=2))
    log(f"wrote {out}")
