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
