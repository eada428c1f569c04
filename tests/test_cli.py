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


def test_serve_tenant_limits_from_flags_environment_and_defaults(tiny_model_dir: Path) -> None:
    """`--print-config` shows the per-tenant limits `tandem serve` runs with: by default a tenant
    holds at most half of the engines' seats; the environment and then the flags override."""
    import os

    import yaml

    def app_args(*args: str, **env: str) -> dict:
        result = run_serve(tiny_model_dir, "--print-config", *args, env={**os.environ, **env})
        assert result.returncode == 0, result.stderr
        return yaml.safe_load(result.stdout)["applications"][0]["args"]

    default = app_args()
    assert default["max_concurrent_requests_per_tenant"] == 32  # 64 seats of one replica / 2
    assert "tokens_per_minute_per_tenant" not in default
    assert app_args("--num-replicas", "3")["max_concurrent_requests_per_tenant"] == 96
    from_env = app_args(
        TANDEM_MAX_CONCURRENT_PER_TENANT="5", TANDEM_TOKENS_PER_MINUTE_PER_TENANT="900",
        TANDEM_TENANT_WEIGHTS="gold=3,silver=1.5", TANDEM_MAX_ADAPTERS_PER_TENANT="9",
    )  # fmt: skip
    assert (
        from_env["max_adapters_per_tenant"] == 9 and "max_adapter_bytes_per_tenant" not in from_env
    )  # default
    assert from_env["max_concurrent_requests_per_tenant"] == 5
    assert from_env["tokens_per_minute_per_tenant"] == 900
    assert from_env["engine"]["tenant_weights"] == {"gold": 3.0, "silver": 1.5}
    flags = app_args(
        "--max-concurrent-per-tenant", "7", "--tokens-per-minute-per-tenant", "0", "--tenant-weight", "gold=2",
        "--max-adapter-bytes-per-tenant", "1000",
        TANDEM_MAX_CONCURRENT_PER_TENANT="5", TANDEM_TOKENS_PER_MINUTE_PER_TENANT="900",
    )  # fmt: skip
    assert flags["max_concurrent_requests_per_tenant"] == 7 and flags["max_adapter_bytes_per_tenant"] == 1000
    assert "tokens_per_minute_per_tenant" not in flags  # 0: no limit
    assert flags["engine"]["tenant_weights"] == {"gold": 2.0}
    result = run_serve(tiny_model_dir, "--print-config", "--tenant-weight", "gold=-1")
    assert result.returncode == 2 and '"param": "tenant_weight"' in result.stderr
    # precision and batch invariance pass through to the engine; unset: the engine's defaults
    assert "batch_invariant" not in default["engine"] and "weight_dtype" not in default["engine"]
    engine = app_args("--no-batch-invariant", "--weight-dtype", "int8")["engine"]
    assert engine["batch_invariant"] is False and engine["weight_dtype"] == "int8"


def test_the_serve_config_carries_serves_mode_and_the_environment_overrides_it(
    tiny_model_dir: Path,
) -> None:
    """The printed config's `runtime_env` carries Serve's mode (`SERVE_ENV_VARS`, what `tandem
    serve` gives its Ray workers: the throughput-optimized mode on, user code on a loop of its
    own); a value in the environment overrides it (the mode off)."""
    import os

    import yaml

    def env_vars(**env: str) -> dict:
        base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
        result = run_serve(tiny_model_dir, "--print-config", env={**base, **env})
        assert result.returncode == 0, result.stderr
        return yaml.safe_load(result.stdout)["applications"][0]["runtime_env"]["env_vars"]

    assert env_vars() == {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1",
        "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    }
    assert env_vars(RAY_SERVE_THROUGHPUT_OPTIMIZED="0")["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "0"


def test_the_dev_key_belongs_to_a_tenant_of_the_directory(tmp_path: Path) -> None:
    """The key `tandem serve` prints without TANDEM_API_KEYS is a key of tenant "dev" in the tenant
    directory (so `tandem tenants show dev` and the console know it); a new run revokes the last."""
    import hashlib

    from tandem.cli.banner import DEV_TENANT, banner, dev_tenant_key
    from tandem.platform.store_guard import open_object_store
    from tandem.platform.tenant_directory import TenantDirectory

    url = f"file://{tmp_path / 'objects'}"
    first = dev_tenant_key(url)
    second = dev_tenant_key(url)
    directory = TenantDirectory(open_object_store(url))
    assert directory.get_tenant(DEV_TENANT).id == "dev"
    directory.refresh()
    digest = lambda key: hashlib.sha256(key.encode()).hexdigest()  # noqa: E731
    assert directory.snapshot.tenant_for_digest(digest(second)) == "dev"
    assert directory.snapshot.tenant_for_digest(digest(first)) is None  # revoked
    assert len(directory.list_keys(DEV_TENANT)) == 1
    text = banner("folder", "http://127.0.0.1:1", second, None, "ready")
    assert '"model": "folder"' in text and second in text
