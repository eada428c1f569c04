"""Resident memory of each process of the serving graph (`tandem serve`'s deployments), and
whether it imported torch: only the LLM replicas should hold the model and torch.

    python benchmarks/process_memory.py [--model PATH] [--out benchmarks/results/process_memory.json]

Starts a Ray of its own, deploys the application (object store in a temp dir, so the batch
worker runs too), sends one chat completion and one /metrics scrape, and reads each Serve
replica's RSS with psutil.
"""

from __future__ import annotations

import argparse
import socket
import tempfile

import httpx
import psutil
import ray
from ray import serve

from common import log, write_result
from tandem.deployments.app import build_app

OPERATOR_KEY = "sk-bench-operator"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the packaged SmolLM2)")
    parser.add_argument("--out", default="benchmarks/results/process_memory.json")
    args = parser.parse_args()
    engine = {"model": args.model} if args.model else {}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as store:
        ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            app = build_app(
                {
                    "engine": engine,
                    "api_keys": "sk-bench=bench",
                    "operator_keys": OPERATOR_KEY,
                    "replica_num_cpus": 0,
                    "object_store": f"file://{store}",
                }
            )
            log("deploying")
            serve.run(app, name="tandem", route_prefix="/")  # returns once every replica is ready
            base = f"http://127.0.0.1:{port}"
            auth = {"Authorization": "Bearer sk-bench"}
            model = httpx.get(f"{base}/v1/models", headers=auth, timeout=60).json()["data"][0]["id"]
            chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}]}
            reply = httpx.post(
                f"{base}/v1/chat/completions",
                json={**chat, "max_tokens": 4},
                headers=auth,
                timeout=300,
            )
            reply.raise_for_status()
            metrics = httpx.get(
                f"{base}/metrics", headers={"Authorization": f"Bearer {OPERATOR_KEY}"}, timeout=60
            )
            metrics.raise_for_status()
            processes = {}
            for proc in psutil.Process().children(recursive=True):
                try:
                    cmdline = " ".join(proc.cmdline())
                except psutil.NoSuchProcess:
                    continue
                if "ServeReplica:tandem:" in cmdline:
                    deployment = cmdline.split("ServeReplica:tandem:")[1].split()[0]
                    maps = "".join(m.path for m in proc.memory_maps(grouped=True))
                    processes[deployment] = {
                        "rss_mib": round(proc.memory_info().rss / 2**20, 1),
                        "torch_loaded": "libtorch" in maps,
                    }
            for name, figures in sorted(processes.items()):
                log(f"{name}: {figures}")
            write_result(args.out, {"processes": processes})
        finally:
            serve.shutdown()
            ray.shutdown()


if __name__ == "__main__":
    main()
