"""Try to reproduce a replica death: long prompts near the context limit beside other tenants' streams.

Through `tandem serve` on its defaults with two tenant keys: tenant B keeps `--streams` chat
streams of `--stream-tokens` tokens going; tenant A sends `--rounds` prompts of about
`--prompt-tokens` tokens (`max_tokens` 4), one after another. After each round the LLM
replica's process (the one whose title names `LLMReplica`) is found again: a new pid means it
died and Serve replaced it. Every status code, the replica's peak RSS (VmHWM) and the server's
log (Ray's and the replicas' stderr, copied beside `--out`) are kept.

    python benchmarks/long_prompt_soak.py --rounds 10
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from common import free_port, log, start_server, stop_server, write_result

KEY_A, KEY_B = "sk-soak-a", "sk-soak-b"
OPERATOR_KEY = "sk-op-soak"
MODEL = "smollm2-135m-instruct"


def replica_process() -> psutil.Process | None:
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "ServeReplica:tandem:LLMReplica" in " ".join(proc.info["cmdline"] or []):
                return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def peak_rss_mib(proc: psutil.Process) -> float:
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def soak(base: str, args: argparse.Namespace) -> dict[str, Any]:
    headers_a, headers_b = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}
    stop = asyncio.Event()
    statuses: dict[str, int] = {}
    # A prompt of about `prompt_tokens` tokens: " apple" is one token of the default model's vocabulary.
    prompt = " ".join(["apple"] * (args.prompt_tokens - 8))
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:

        async def streamer(i: int) -> None:
            body = {"model": MODEL, "stream": True, "max_tokens": args.stream_tokens, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"Tell a story ({i})."}]}  # fmt: skip
            while not stop.is_set():
                try:
                    async with client.stream(
                        "POST", "/chat/completions", json=body, headers=headers_b
                    ) as reply:
                        statuses[f"b_{reply.status_code}"] = statuses.get(f"b_{reply.status_code}", 0) + 1
                        async for _ in reply.aiter_lines():
                            pass
                except httpx.HTTPError as exc:
                    statuses[f"b_{type(exc).__name__}"] = statuses.get(f"b_{type(exc).__name__}", 0) + 1
                    await asyncio.sleep(1.0)

        streams = [asyncio.ensure_future(streamer(i)) for i in range(args.streams)]
        rounds = []
        proc = replica_process()
        first_pid = proc.pid if proc else None
        for i in range(args.rounds):
            started = time.perf_counter()
            reply = await client.post(
                "/completions", headers=headers_a,
                json={"model": MODEL, "prompt": f"{i} {prompt}", "max_tokens": 4},
            )  # fmt: skip
            usage = reply.json().get("usage", {}) if reply.status_code == 200 else {}
            proc = replica_process()
            rounds.append({
                "status": reply.status_code, "seconds": time.perf_counter() - started,
                "prompt_tokens": usage.get("prompt_tokens"), "replica_pid": proc.pid if proc else None,
                "replica_peak_rss_mib": peak_rss_mib(proc) if proc else None,
                "error": None if reply.status_code == 200 else reply.text[:300],
            })  # fmt: skip
            log(f"round {i}: {rounds[-1]}")
        stop.set()
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    pids = {r["replica_pid"] for r in rounds}
    return {"rounds": rounds, "stream_statuses": statuses, "replica_restarted": pids != {first_pid}}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--prompt-tokens", type=int, default=7200)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=300)
    parser.add_argument("--out", default="benchmarks/results/long_prompt_soak.json")
    args = parser.parse_args()
    env = {"TANDEM_API_KEYS": f"{KEY_A}=tenant-a,{KEY_B}=tenant-b", "TANDEM_OPERATOR_KEYS": OPERATOR_KEY}
    with tempfile.TemporaryDirectory(prefix="tandem-soak-") as data_dir:
        server, base = start_server(data_dir, free_port(), env)
        try:
            result = asyncio.run(soak(base, args))
        finally:
            stop_server(server)
            kept = Path(args.out).with_suffix(".serve.log")
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(Path(data_dir) / "serve.log", kept)
            log(f"server log kept in {kept}")
    write_result(args.out, {"args": vars(args), **result})


if __name__ == "__main__":
    main()
