"""Where the Triton kernels run, decided in one place.

Contract: `uses_triton(device)` is True on CUDA whenever Triton imports (it ships with CUDA builds
of torch), and on CPU only when a test asks for it: `TANDEM_TRITON_ON_CPU=1` together with
`TRITON_INTERPRET=1`, which makes Triton run the same `@triton.jit` kernels on CPU tensors in
its interpreter (slowly: tiny shapes only). Everything else on CPU uses the torch reference and
the native C kernels. Kernels dispatch on this themselves; callers never branch on the device.

`TRITON_INTERPRET` is read when a kernel module is imported (`triton.jit` decides then), so it is
set before the first import of `tandem.kernels.triton_*` (the test suite's conftest does so on
machines without CUDA).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

TRITON_ON_CPU_ENV = "TANDEM_TRITON_ON_CPU"


@functools.cache
def triton_unavailable_reason() -> str:
    """Why Triton cannot be used here ("" when it can)."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: no Triton
        return f"triton failed to import: {type(exc).__name__}: {exc}"
    return ""


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def uses_triton(device: torch.device) -> bool:
    """Whether tensors on `device` go through the Triton kernels (module docstring)."""
    if triton_unavailable_reason():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and interpreting() and os.environ.get(TRITON_ON_CPU_ENV) == "1"


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
