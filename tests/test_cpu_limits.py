"""Threads sized by the CPUs a process may actually use: affinity, and a cgroup CPU quota (a
Kubernetes pod's CPU limit) read from cgroup v2's `cpu.max` or v1's CFS files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem.platform.cpu import cgroup_cpu_limit, usable_cpus


def _v2(root: Path, text: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cpu.max").write_text(text)
    return root


def test_a_cgroup_quota_caps_the_usable_cpus(tmp_path: Path) -> None:
    allowed = len(os.sched_getaffinity(0))
    assert cgroup_cpu_limit(_v2(tmp_path / "v2", "150000 100000\n")) == 1.5
    assert usable_cpus(tmp_path / "v2") == min(allowed, 2)  # 1.5 CPUs: two threads, never more than allowed
    assert cgroup_cpu_limit(_v2(tmp_path / "tiny", "10000 100000\n")) == 0.1
    assert usable_cpus(tmp_path / "tiny") == 1
    assert cgroup_cpu_limit(_v2(tmp_path / "max", "max 100000\n")) is None
    assert usable_cpus(tmp_path / "max") == allowed
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path / "v1") == 1.0 and usable_cpus(tmp_path / "v1") == 1
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no limit"
    assert cgroup_cpu_limit(tmp_path / "v1") is None
    assert cgroup_cpu_limit(tmp_path / "nothing") is None


def test_the_engine_never_runs_more_threads_than_its_cpus(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no `num_threads`, an engine on a one-CPU quota runs one intra-op thread."""
    import torch

    import tandem.engine.builder as builder
    from tandem import LLM

    before = torch.get_num_threads()
    monkeypatch.setattr(builder, "usable_cpus", lambda: 1)
    try:
        LLM(str(tiny_model_dir), kv_cache_memory=1 << 20)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
