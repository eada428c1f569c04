"""A Ray cluster of two nodes on this machine, as an operator runs one: the app deployed from its
Serve YAML (infra/serve/colocated.yaml) with `serve deploy`, the engine replicas pinned to the
second node by the custom resource that node declares; then that node is lost and comes back.

Both nodes are `ray start --block` processes this test starts (loopback, free ports, their own
temp dir) and stops by PID; nothing here touches the test session's own Ray instance."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from .conftest import free_ports

pytestmark = pytest.mark.ray  # starts a Ray cluster of its own (two `ray start` nodes)

KEY, OPERATOR_KEY = "sk-cluster", "sk-op-cluster"
RAY = str(Path(sys.executable).parent / "ray")
SERVE = str(Path(sys.executable).parent / "serve")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_AUTH_MODE"] = "disabled"  # a loopback-only test cluster; `serve deploy` needs no token
    return env


class RayNode:
    """One `ray start --block` process (and, in its process group, what it starts)."""

    PORT_FLAGS = (
        "--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port",
    )  # fmt: skip

    def __init__(self, args: list[str], log: Path, node_ports: list[int]) -> None:
        """`node_ports`: one per `PORT_FLAGS`, distinct from each other and from any port in `args`
        (ports picked one by one may repeat, and Ray refuses a port given to two of its components)."""
        self.log = log
        ports = [
            arg for flag, port in zip(self.PORT_FLAGS, node_ports, strict=True) for arg in (flag, str(port))
        ]
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                [
                    RAY,
                    "start",
                    "--block",
                    "--node-ip-address",
                    "127.0.0.1",
                    "--disable-usage-stats",
                    *ports,
                    *args,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=_env(),
                start_new_session=True,
            )

    def log_tail(self, num_lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-num_lines:])

    def kill(self) -> None:
        """Lose the node: SIGKILL to its whole process group, nothing shut down cleanly."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM to the node's processes, SIGKILL to what is left after a few seconds (a head's
        `ray start --block` spent the whole 30 s it was given stopping its processes one by one)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)
        if self.process.poll() is None or _group_alive(self.process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _until(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval_s)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, Any]]:
    # Ray's session dir holds AF_UNIX sockets (paths of at most 107 bytes): a short root of its own.
    ray_root = Path(tempfile.mkdtemp(prefix="tr-", dir="/tmp"))
    # Every port this cluster is given, picked at once or checked against the others: a port
    # picked but not yet bound (a node still starting, Serve's proxy not yet deployed) is free to
    # be picked again.
    gcs_port, dashboard_port, client_server_port, http_port, *node_ports = free_ports(
        4 + len(RayNode.PORT_FLAGS)
    )
    given = {gcs_port, dashboard_port, client_server_port, http_port, *node_ports}
    head = RayNode(
        [
            "--head",
            "--port", str(gcs_port),
            "--dashboard-host", "127.0.0.1",
            "--dashboard-port", str(dashboard_port),
            "--ray-client-server-port", str(client_server_port),
            "--num-cpus", "2",
            "--resources", json.dumps({"tandem_service": 100}),
            "--temp-dir", str(ray_root),
        ],
        tmp_path / "head.log",
        node_ports,
    )  # fmt: skip
    nodes: list[RayNode] = [head]
    dashboard = f"http://127.0.0.1:{dashboard_port}"

    def add_engine_node() -> RayNode:
        while (engine_ports := free_ports(len(RayNode.PORT_FLAGS))) and given & set(engine_ports):
            pass
        given.update(engine_ports)
        node = RayNode(
            [
                "--address",
                f"127.0.0.1:{gcs_port}",
                "--num-cpus",
                "2",
                "--resources",
                json.dumps({"tandem_engine": 1}),
            ],
            tmp_path / f"engine-{len(nodes)}.log",
            engine_ports,
        )
        nodes.append(node)
        return node

    try:

        def head_up() -> bool:
            assert head.process.poll() is None, f"ray start --head exited:\n{head.log_tail()}"
            return _get(f"{dashboard}/api/version") is not None

        _until(head_up, 120, "the head's dashboard")
        yield {
            "dashboard": dashboard,
            "http_port": http_port,
            "add_engine_node": add_engine_node,
            "tmp": tmp_path,
        }
    finally:
        for node in reversed(nodes):
            node.stop()
        shutil.rmtree(ray_root, ignore_errors=True)


def _get(url: str) -> Any:
    try:
        response = httpx.get(url, timeout=10)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


def _deployment_statuses(dashboard: str) -> dict[str, str]:
    apps = (_get(f"{dashboard}/api/serve/applications/") or {}).get("applications", {})
    app = apps.get("tandem") or {}
    return {name: d["status"] for name, d in (app.get("deployments") or {}).items()}


def _batch_lines(n: int) -> bytes:
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"Line {i}"}],
                "max_tokens": 48,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for i in range(n)
    ]
    return ("\n".join(json.dumps(line) for line in lines) + "\n").encode()


def test_engines_on_a_second_node_survive_its_loss(cluster: dict[str, Any], tiny_model_dir: Path) -> None:
    dashboard, tmp = cluster["dashboard"], cluster["tmp"]
    engine_node = cluster["add_engine_node"]()
    # The operator's Serve YAML, with this test's model, object store, keys and port.
    config = yaml.safe_load((Path(__file__).parents[1] / "infra" / "serve" / "colocated.yaml").read_text())
    http_port = cluster["http_port"]
    config["proxy_location"] = "HeadOnly"  # one proxy: both nodes share this machine's ports
    config["http_options"] = {"host": "127.0.0.1", "port": http_port}
    args = config["applications"][0]["args"]
    assert args["placement"]["LLMReplica"] == {"resources": {"tandem_engine": 1.0}}
    args.update(
        engine={"model": str(tiny_model_dir), "served_model_name": "tiny", "kv_cache_memory": 4 << 20},
        object_store=f"file://{tmp / 'objects'}",
        api_keys=f"{KEY}=acme",
        operator_keys=OPERATOR_KEY,
        replica_num_cpus=0,
        batch={"shard_size": 4, "lease_ttl_s": 10},
        batch_poll_interval_s=0.2,
    )
    config_path = tmp / "serve.yaml"
    config_path.write_text(yaml.safe_dump(config))
    subprocess.run(
        [SERVE, "deploy", str(config_path), "--address", dashboard], check=True, env=_env(), timeout=120
    )
    _until(
        lambda: (
            (_get(f"{dashboard}/api/serve/applications/") or {})
            .get("applications", {})
            .get("tandem", {})
            .get("status")
            == "RUNNING"
        ),
        300,
        "the app to run",
        interval_s=1.0,
    )
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{http_port}/v1", api_key=KEY, max_retries=0, timeout=120
    )

    def chat(text: str) -> str:
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": text}], max_tokens=48, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return reply.choices[0].message.content or ""

    before = chat("Line 0")
    assert before
    # The engine replica runs on the engine node (its pid is one of that node's process group).
    stats = httpx.get(
        f"http://127.0.0.1:{http_port}/metrics",
        headers={"Authorization": f"Bearer {OPERATOR_KEY}"},
        timeout=30,
    )
    assert stats.status_code == 200 and "tandem_num_requests_running" in stats.text

    num_lines = 160
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(_batch_lines(num_lines))), purpose="batch").id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    _until(
        lambda: (
            (b := client.batches.retrieve(batch.id)).request_counts is not None
            and b.request_counts.completed > 0
        ),
        180,
        "the batch to make progress",
        interval_s=0.2,
    )

    engine_node.kill()  # the node is lost mid-batch
    counts = client.batches.retrieve(batch.id).request_counts
    assert counts is not None and counts.completed < num_lines, "the batch ended before the node was lost"
    _until(
        lambda: _deployment_statuses(dashboard).get("LLMReplica") not in (None, "HEALTHY"),
        120,
        "Serve to report the lost engine replica",
    )
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as outage:
        chat("during the outage")
    assert outage.value.status_code == 503, outage.value
    assert time.monotonic() - started < 60, "the outage answer must come promptly, not after a hang"
    assert client.batches.retrieve(batch.id).status == "in_progress"

    cluster["add_engine_node"]()  # a node with the resource returns: Serve places the replica there
    _until(
        lambda: _deployment_statuses(dashboard).get("LLMReplica") == "HEALTHY", 300, "a new engine replica"
    )
    done = _until(
        lambda: (
            (b := client.batches.retrieve(batch.id)).status in ("completed", "failed", "expired", "cancelled")
            and b
        ),
        300,
        "the batch to end",
    )
    assert (
        done.status == "completed"
        and done.request_counts.completed == num_lines
        and done.request_counts.failed == 0
    )
    output = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == sorted(f"c{i}" for i in range(num_lines))  # each once
    assert all(o["response"]["status_code"] == 200 for o in output)
    by_id = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in output}
    assert by_id["c0"] == before == chat("Line 0")  # answered by the model, greedy, as in real time
