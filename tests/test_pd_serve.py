"""Disaggregated prefill and decode on Ray Serve: a prefill replica killed mid-prefill, a client
that leaves during the hand-over, and both pools scaling up under load and back down after it
(Ray started by the test session)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import openai
import psutil
import pytest

from .test_serve import KEY, deploy

pytestmark = pytest.mark.ray


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def replica_pids(app: str, deployment: str) -> list[int]:
    """This test session's replica processes of `deployment` (Ray names them after it)."""
    return [
        proc.pid
        for proc in psutil.Process().children(recursive=True)
        if f"ServeReplica:{app}:{deployment}" in " ".join(proc.cmdline())
    ]


def busy_prefill_pid(app: str) -> int | None:
    """The prefill replica process computing a prompt now (the engine's busy thread keeps the
    replica's own event loop from answering promptly, so this asks the OS, not the replica)."""
    processes = [psutil.Process(pid) for pid in replica_pids(app, "PrefillReplica")]
    for proc in processes:
        proc.cpu_percent()
    time.sleep(0.3)
    usage = sorted(((proc.cpu_percent(), proc.pid) for proc in processes), reverse=True)
    if len(usage) == 2 and usage[0][0] > 25.0 and usage[0][0] > 3 * usage[1][0]:
        return usage[0][1]
    return None


def running_replicas(app: str, deployment: str) -> int:
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None or deployment not in status.deployments:
        return 0
    return int(status.deployments[deployment].replica_states.get("RUNNING", 0))


def kv_blocks_used(app: str, deployment: str) -> list[int]:
    """Each replica's `kv_blocks_used`, asked through the handle until every pid has answered."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=app)
    pids = set(replica_pids(app, deployment))
    seen: dict[int, int] = {}
    deadline = time.monotonic() + 30
    while set(seen) != pids:
        assert time.monotonic() < deadline, (seen, pids)
        stats = handle.stats.remote().result()
        seen[stats["pid"]] = stats["kv_blocks_used"]
    return list(seen.values())


def send_raw_completion(base_url: str, path: str, prompt: str) -> socket.socket:
    """Send a streaming completion request on a plain socket (closing it is a client leaving)."""
    host, port = base_url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8, "stream": True}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


PD_ENGINE = {"weight_dtype": "auto", "kv_cache_dtype": "auto", "speculative": None}
LONG_PROMPT = "Paged attention keeps the cache in blocks. " * 170  # about 3,750 tokens of the tiny model


def test_a_prefill_replica_killed_mid_prefill_costs_no_request(
    ray_serve: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Two prefill replicas computing a long prompt in small chunks; the one holding it is
    SIGKILLed mid-prefill: the decode replica retries on the other and the client gets the
    colocated answer; a request running meanwhile is untouched; blocks return to baseline on the
    decode replica and the surviving prefill replica. A client that leaves during the hand-over
    leaves nothing behind either."""
    from ray import serve

    app = "tandem-pd-kill"
    deploy(
        tmp_path_factory,
        app,
        "/pdkill",
        mode="disaggregated",
        engine=PD_ENGINE,
        num_prefill_replicas=2,
        # Small prefill chunks: the long prompt takes hundreds of steps, time to find its replica.
        # (no prefix cache there: every request computes the whole prompt)
        prefill_engine={
            "max_num_batched_tokens": 8,
            "max_num_seqs": 4,
            "kv_hold_ttl_s": 2.0,
            "enable_prefix_caching": False,
        },
    )
    try:
        client = openai.OpenAI(base_url=f"{ray_serve}/pdkill/v1", api_key=KEY, max_retries=0)
        kwargs: dict[str, Any] = dict(
            model="tiny", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        want = client.completions.create(prompt=LONG_PROMPT, **kwargs).choices[0].text  # nobody killed
        results: dict[str, Any] = {}

        def ask(name: str, prompt: str) -> None:
            try:
                results[name] = client.completions.create(prompt=prompt, **kwargs).choices[0].text
            except Exception as exc:  # noqa: BLE001 - reported by the asserts below
                results[name] = exc

        victim_thread = threading.Thread(target=ask, args=("victim", LONG_PROMPT))
        victim_thread.start()

        pid = wait_until(lambda: busy_prefill_pid(app), 60, "the long prompt to be prefilled")
        bystander = threading.Thread(target=ask, args=("bystander", "A short question"))
        bystander.start()
        os.kill(pid, signal.SIGKILL)
        victim_thread.join(120)
        bystander.join(120)
        assert results["victim"] == want, results
        assert isinstance(results["bystander"], str), results
        decode = serve.get_deployment_handle("LLMReplica", app_name=app)
        assert decode.stats.remote().result()["num_prefill_retries"] == 1  # it was the victim's prefill

        # A client that goes away while its prompt is prefilled: its connection is closed.
        wait_until(
            lambda: running_replicas(app, "PrefillReplica") == 2,
            120,
            "the killed prefill replica's replacement",
        )
        leaver = send_raw_completion(ray_serve, "/pdkill/v1/completions", LONG_PROMPT + " again")
        wait_until(lambda: busy_prefill_pid(app), 60, "the prefill to start")
        leaver.close()
        wait_until(lambda: kv_blocks_used(app, "LLMReplica") == [0], 30, "decode blocks back to baseline")
        wait_until(
            lambda: kv_blocks_used(app, "PrefillReplica") == [0, 0], 30, "prefill blocks back to baseline"
        )
        assert client.completions.create(prompt=LONG_PROMPT, **kwargs).choices[0].text == want
    finally:
        serve.delete(app)


def test_both_pools_scale_up_under_load_and_back_down(
    ray_serve: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Long generations push the decode replicas' KV occupancy past its target and long prompts
    queue on the prefill replica: each pool grows to its maximum (2). When the load stops both go
    back to 1, and a request streaming while they shrink finishes."""
    from ray import serve

    app = "tandem-pd-scale"
    deploy(
        tmp_path_factory,
        app,
        "/pdscale",
        mode="disaggregated",
        engine={**PD_ENGINE, "kv_cache_memory": 4 << 20},  # about 5,400 tokens
        autoscaling={
            # Well under what six long answers hold (about 0.5 when all decode): each also waits
            # its turn on the busy prefill pool, so the faster decoding gets, the less of its time
            # it holds KV (at 0.2 the decode pool once stayed at 1 for 180 s in a loaded CI run).
            "target_kv_occupancy": 0.1,
            "min_replicas": 1,
            "max_replicas": 2,
            "upscale_delay_s": 0.0,
            "downscale_delay_s": 3.0,
            "look_back_period_s": 1.0,
        },
        prefill_autoscaling={"target_prompt_tokens_per_replica": 512, "min_replicas": 1, "max_replicas": 2},
        prefill_engine={"max_num_batched_tokens": 64, "max_num_seqs": 8},
    )
    try:
        client = openai.OpenAI(base_url=f"{ray_serve}/pdscale/v1", api_key=KEY, max_retries=0)
        stop = threading.Event()
        failures: list[BaseException] = []

        def generate_long() -> None:  # long answers hold KV blocks
            while not stop.is_set():
                try:
                    for _ in client.completions.create(
                        model="tiny",
                        prompt="Count with me:",
                        max_tokens=600,
                        stream=True,
                        extra_body={"ignore_eos": True},
                    ):
                        if stop.is_set():
                            break
                except Exception as exc:  # noqa: BLE001
                    failures.append(exc)
                    return

        counter = iter(range(1_000_000))

        def prefill_long() -> None:  # long prompts (each its own: no prefix hits) queue on the prefill pool
            while not stop.is_set():
                try:
                    prompt = f"Request {next(counter)}: " + "Paged attention keeps the cache in blocks. " * 45
                    client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
                except Exception as exc:  # noqa: BLE001
                    failures.append(exc)
                    return

        # Six long answers: their KV stays well over the target while each also waits its turn on
        # the busy prefill pool (four barely did once decoding got faster: it spent less of each
        # answer's time holding KV)
        threads = [threading.Thread(target=generate_long) for _ in range(6)]
        threads += [threading.Thread(target=prefill_long) for _ in range(4)]
        for thread in threads:
            thread.start()
        try:
            wait_until(lambda: running_replicas(app, "LLMReplica") == 2, 180, "a second decode replica")
            wait_until(lambda: running_replicas(app, "PrefillReplica") == 2, 180, "a second prefill replica")
        finally:
            stop.set()
            for thread in threads:
                thread.join(120)
        assert not failures, failures[:3]
        # One more request streams while the pools shrink; it must finish.
        late: dict[str, Any] = {}

        def stream_late() -> None:
            for chunk in client.completions.create(
                model="tiny", prompt="Late", max_tokens=200, stream=True, extra_body={"ignore_eos": True}
            ):
                if chunk.choices and chunk.choices[0].finish_reason:
                    late["finish"] = chunk.choices[0].finish_reason

        streamer = threading.Thread(target=stream_late)
        streamer.start()
        wait_until(lambda: running_replicas(app, "LLMReplica") == 1, 180, "the decode pool back at 1")
        wait_until(lambda: running_replicas(app, "PrefillReplica") == 1, 180, "the prefill pool back at 1")
        streamer.join(120)
        assert late.get("finish") == "length", late
    finally:
        serve.delete(app)
