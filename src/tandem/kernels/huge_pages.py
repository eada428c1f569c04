"""Large, long-lived CPU tensors in 2 MiB pages (Linux transparent huge pages, `madvise`).

A decode step streams the whole KV cache of its requests and every weight from memory; with 4 KiB
pages each 4 KiB costs a TLB miss (two-level page walks under a hypervisor), and the KV cache's
blocks are scattered over a pool of gigabytes. `empty` maps fresh anonymous memory of its own and
asks the kernel for huge pages on it before anything touches it, where the system allows them on
request (`/sys/kernel/mm/transparent_hugepage/enabled` is `always` or `madvise`); elsewhere
(another OS, `never`, a GPU tensor, under 2 MiB) it is `torch.empty`. Its own mapping, not the
allocator's: memory the allocator hands out again was touched before, and pages already there stay
4 KiB. The values are never affected: only how the memory is mapped.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20


@functools.cache
def available() -> bool:
    """Whether huge pages can be asked for here (Linux, transparent huge pages not `never`)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised contiguous tensor `[*shape]` of `dtype`; on a CPU, from 2 MiB up where
    `available()`, in a private anonymous mapping of its own, starting on a 2 MiB boundary, its
    whole 2 MiB pages marked for huge pages before any is touched (the first write faults each in as
    one huge page, when the kernel has one). The mapping reserves up to 2 MiB more address space
    than the tensor uses, never touched (never resident); it is unmapped with the tensor's storage."""
    device = torch.device(device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or num_bytes < HUGE_PAGE_BYTES or not available():
        return torch.empty(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    # a refusal (an old kernel, a seccomp filter) leaves 4 KiB pages: the same values
    with contextlib.suppress(OSError):
        region.madvise(mmap.MADV_HUGEPAGE, offset, num_bytes - num_bytes % HUGE_PAGE_BYTES)
    return raw[offset : offset + num_bytes].view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """`empty`, zeroed (every page touched now: the memory is taken at allocation, not later)."""
    return empty(shape, dtype, device).zero_()
