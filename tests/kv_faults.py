"""Simulated KV faults for the integrity tests (`Request`s whose blocks are reassigned or
overwritten). Test code only: it acts, through the engine's public parts, as a buggy allocator or
a late KV transfer would."""

from __future__ import annotations

import torch

from tandem.engine.engine import LLMEngine
from tandem.engine.runner.model_runner import ModelRunner


def inject_kv_fault(
    engine: LLMEngine, request_id: str, block_index: int = 0, *, overwrite: bool = False
) -> int:
    """Hand a running request's block out again (its generation changes) and, with `overwrite`,
    scribble over its KV. Returns the physical block id. For a compressed request: its head
    blocks, in table order over all its heads, and the head-block pool."""
    request = engine.scheduler.requests.get(request_id)
    compressed = request is not None and request.compressed and engine.head_kv is not None
    if compressed:
        assert engine.head_kv is not None
        head_block_ids = [b for table in engine.head_kv.head_tables(request_id) for b in table.block_ids]
        block_id = head_block_ids[block_index]
        engine.head_kv.pool.generations[block_id] += 1
    else:
        block_id = engine.kv_manager.block_table(request_id).block_ids[block_index]
        engine.kv_manager.pool.generations[block_id] += 1
    if overwrite:
        runner = engine.runner
        assert isinstance(runner, ModelRunner)
        if compressed:
            tensors = list(runner.heads.pool[:2]) if runner.heads is not None else []
        else:
            tensors = [t for layer in runner.kv_caches for t in layer[:2]]
        for tensor in tensors:
            tensor[block_id].view(torch.uint8).fill_(0x7F)
    return block_id
