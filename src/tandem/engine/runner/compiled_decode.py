"""`CompiledDecode`: the decode model's forward under `torch.compile` (`compile_decode`), warmed up
before the first request; a backend that fails to compile leaves decode steps eager."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from tandem.engine.models.interface import KVLayer
from tandem.engine.runner.draft import PagedDraftCache
from tandem.kernels.attention_metadata import build_attention_metadata

logger = logging.getLogger("tandem.engine.runner")


class CompiledDecode:
    def __init__(self, forward: Callable[..., Any], device: torch.device) -> None:
        self.forward = torch.compile(forward, dynamic=True)
        self.device = device

    @torch.inference_mode()
    def warm_up(
        self,
        kv_caches: list[KVLayer],
        num_kv_heads: int,
        block_size: int,
        draft: PagedDraftCache | None,
        batch_sizes: tuple[int, ...] = (1, 2),
    ) -> bool:
        """Compile the graph before the first request (batch 1 and batch >= 2 are separate
        graphs: torch specialises sizes 0 and 1). Writes one dummy token into block 0, which holds
        no request's KV before the engine starts. False on any compile error (stay eager)."""
        started = time.perf_counter()
        try:
            for batch in batch_sizes:
                metadata = build_attention_metadata(
                    [[0, 0]] * batch, [1] * batch, [2] * batch, block_size, num_kv_heads, self.device
                )
                self.forward(
                    torch.zeros(batch, dtype=torch.int64, device=self.device),
                    torch.ones(batch, dtype=torch.int64, device=self.device),
                    kv_caches,
                    metadata,
                    torch.arange(batch, dtype=torch.int64, device=self.device),
                    return_hidden=draft is not None and draft.wants_hidden,
                    hidden_layers=draft.hidden_layers if draft is not None else (),
                )
        except Exception as exc:  # noqa: BLE001 - any backend failure means: stay eager
            logger.warning(
                "decode compilation failed; decode steps run eagerly",
                extra={"error": f"{type(exc).__name__}: {exc}"[:500]},
            )
            return False
        logger.info("decode graph compiled", extra={"seconds": round(time.perf_counter() - started, 1)})
        return True
