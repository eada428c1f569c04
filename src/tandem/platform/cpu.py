"""The host CPU's feature flags, for choices that depend on the instruction set (which kernels
build and run, which compute dtype is fast)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags line of /proc/cpuinfo (empty where it cannot be read: not Linux, or no x86 flags)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPUs this process's cgroup may use per second (its CFS quota / period: `cpu.max` on
    cgroup v2, `cpu/cpu.cfs_quota_us` on v1), or None when unlimited or unreadable."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def usable_cpus(root: Path = Path("/sys/fs/cgroup")) -> int:
    """How many CPUs this process can actually run on: the CPUs its affinity allows, capped by
    its cgroup's quota rounded up (a pod limited to 1.5 CPUs on a 64-core node: 2), at least 1.
    Thread pools sized by `os.cpu_count()` instead oversubscribe such a pod."""
    import math
    import os

    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        allowed = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        allowed = min(allowed, max(1, math.ceil(limit)))
    return max(1, allowed)
