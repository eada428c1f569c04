"""Large, long-lived CPU tensors in 2 MiB pages (Linux transparent huge pages, `madvise`).

A decode step streams the whole KV cache of its requests and every weight from memory; with 4 KiB
pages each 4 KiB costs a TLB miss (two-level page walks under a hypervisor), and the KV cache's
blocks are scattered over a pool of gigabytes. `empty` asks the kernel for huge pages where the
system allows them on request (`/sys/kernel/mm/transparent_hugepage/enabled` is `always` or
`madvise`); elsewhere (another OS, `never`, a GPU tensor, under 2 MiB) it is `torch.empty`. The
values are never affected: only how the memory is mapped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import sys
from collections.abc import Callable

import torch

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # Linux <sys/mman.h>


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's `madvise`, or None where huge pages cannot be asked for."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised contiguous tensor `[*shape]` of `dtype`; on a CPU, from 2 MiB up, starting
    on a 2 MiB boundary of memory marked for huge pages before any of it is touched (the first
    write faults it in as huge pages). Its storage holds up to 2 MiB more address space than it
    uses, never touched (so never resident)."""
    device = torch.device(device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise()
    if device.type != "cpu" or num_bytes < HUGE_PAGE_BYTES or madvise is None:
        return torch.empty(shape, dtype=dtype, device=device)
    raw = torch.empty(num_bytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    buffer = raw[offset : offset + num_bytes]
    # Whole huge pages only; a refusal (an old kernel, a seccomp filter) leaves 4 KiB pages.
    madvise(buffer.data_ptr(), num_bytes - num_bytes % HUGE_PAGE_BYTES, _MADV_HUGEPAGE)
    return buffer.view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """`empty`, zeroed."""
    return empty(shape, dtype, device).zero_()


def copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor in huge pages (`empty`); the tensor itself where it is not
    on a CPU or is under 2 MiB."""
    if tensor.device.type != "cpu" or tensor.numel() * tensor.element_size() < HUGE_PAGE_BYTES:
        return tensor
    return empty(tuple(tensor.shape), tensor.dtype).copy_(tensor)
