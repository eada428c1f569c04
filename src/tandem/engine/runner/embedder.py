"""`Embedder`: the rows of a step's embedding requests, and their pooled hidden states.

An embedding request's chunks run in a forward of their own through the full model (the same
weights as a prompt's prefill, never a decode fast path); at the prompt's end (`sample`) its
embedding is pooled from the final hidden states (`CausalLM.final_hidden`: the decoder's final
norm, an encoder's last layer) at the model's pooling (`models.pooling`): its last row, the
mean of its rows, or its first ([CLS]). Mean and CLS pooling see the whole prompt in one step
(`Request.whole_prompt`).
"""

from __future__ import annotations

import torch

from tandem.engine.models.interface import CausalLM
from tandem.engine.models.pooling import Pooling
from tandem.engine.sched.step import ScheduledRequest


def step_rows(items: list[ScheduledRequest]) -> tuple[list[int], list[int], list[int]]:
    """A step's input ids and positions, request after request, and the rows whose logits are
    sampled: each sampling request's last token, and one per draft token before it."""
    input_ids: list[int] = []
    positions: list[int] = []
    logits_rows: list[int] = []
    for item in items:
        input_ids.extend(item.token_ids)
        positions.extend(range(item.start_position, item.start_position + len(item.token_ids)))
        if item.sample:
            logits_rows.extend(range(len(input_ids) - 1 - item.num_draft_tokens, len(input_ids)))
    return input_ids, positions, logits_rows


class Embedder:
    def __init__(self, model: CausalLM, pooling: Pooling, device: torch.device) -> None:
        self.model = model
        self.pooling = pooling
        self.device = device

    def rows(self, items: list[ScheduledRequest]) -> tuple[list[int], list[int], torch.Tensor]:
        """The step's input ids and positions, request after request, and no logits rows."""
        input_ids, positions, _ = step_rows(items)
        return input_ids, positions, torch.empty(0, dtype=torch.int64, device=self.device)

    def pool(self, items: list[ScheduledRequest], hidden: torch.Tensor) -> dict[str, list[float]]:
        """`hidden` [T, hidden]: the forward's last-layer states of `items`' rows, in order. The
        embedding [hidden] (float32, not normalised) of each request whose prompt ended."""
        pooled: dict[str, list[float]] = {}
        end = 0
        for item in items:
            start, end = end, end + len(item.token_ids)
            if not item.sample:
                continue
            states = self.model.final_hidden(hidden[start:end]).float()  # [n, hidden]
            if self.pooling.mode == "last":
                vector = states[-1]
            elif self.pooling.mode == "cls":
                vector = states[0]
            else:
                vector = states.mean(dim=0)
            pooled[item.request_id] = vector.tolist()
        return pooled
