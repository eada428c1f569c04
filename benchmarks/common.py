"""What every benchmark script shares: progress logging, percentiles and the JSON result file."""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def cpu() -> dict[str, Any]:
    """The CPU's model name and the instruction-set flags that decide which kernels run fastest."""
    model = ""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    return {"model": model, "flags": [f for f in wanted if f in flags]}


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "cpu": cpu(), "torch": torch.__version__}


def write_result(path: str | Path, result: dict[str, Any]) -> None:
    """Write `result` (with this machine's description added) as JSON to `path`."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**result, "machine": machine()}, indent=2))
    log(f"wrote {out}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(
    data_dir: str, port: int, env: dict[str, str], args: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], str]:
    """`tandem serve` (its own local Ray, in its own process group) with `env` added and `args`;
    returns the process and its base URL (`.../v1`) once `/health` answers 200, i.e. an engine
    replica is ready (polled, with a deadline: the first start on a machine dequantises the GGUF)."""
    import httpx

    command = [
        sys.executable,
        "-m",
        "tandem.cli",
        "serve",
        "--port",
        str(port),
        "--data-dir",
        data_dir,
        *args,
    ]
    log(" ".join(command[1:]))
    log_path = os.path.join(data_dir, "serve.log")  # Ray's and the replicas' lines, kept out of the report
    with open(log_path, "ab") as log_file:
        server = subprocess.Popen(
            command,
            env={**os.environ, **env},
            stdout=subprocess.DEVNULL,
            stderr=log_file,
            start_new_session=True,
        )
    deadline = time.monotonic() + 900
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"tandem serve exited with {server.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200:
                return server, f"http://127.0.0.1:{port}/v1"
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("tandem serve did not answer within 900 s")
        time.sleep(1.0)


def stop_server(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the server shuts Serve and its local Ray down), then SIGKILL its process group."""
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
