"""llama.cpp's convert-time q/k row permutation for Llama, undone (shared by the GGUF reader,
`gguf_arch.py`, and the stored-weights reader, `gguf_stored.py`, which permutes codes and block
parameters alike). Tensor names come from the `gguf` package's own table (`gguf_arch.py`)."""

from __future__ import annotations

import numpy as np


def unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time q/k permutation (interleaved -> HF rotate_half layout)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )
