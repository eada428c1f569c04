"""`DraftSteps`: a step's work with a draft model or head: its drafts appended to the requests
that have draft slots (their distributions kept for rejection sampling), then, after sampling,
what was accepted and the target's hidden states handed back to the draft."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from tandem.engine.runner.draft import PagedDraftCache
from tandem.engine.sched.step import RunnerResult, ScheduledRequest

GeneratorFor = Callable[[ScheduledRequest], torch.Generator | None]


class DraftSteps:
    def __init__(self, draft: PagedDraftCache) -> None:
        self.draft = draft
        self.draft_wall_s = 0.0  # wall seconds spent proposing

    def observe(
        self, items: list[ScheduledRequest], result: RunnerResult, hidden: torch.Tensor | None
    ) -> None:
        """After sampling: tell the draft what was accepted; hand a draft head its states."""
        for item in items:
            tokens = result.sampled_token_ids.get(item.request_id)
            if item.draft_token_ids and tokens:
                self.draft.accepted(
                    item.request_id, item.start_position, len(item.draft_token_ids), len(tokens) - 1
                )
        if hidden is not None:
            self._record_states(items, hidden, result)

    def _record_states(
        self, items: list[ScheduledRequest], hidden: torch.Tensor, result: RunnerResult
    ) -> None:
        """Hand the draft head the target's states [T, hidden] of the positions each request
        keeps: its own tokens and its accepted drafts (none of a failed request)."""
        hidden = self.draft.prepare_states(hidden)  # once for the step's rows
        offset = 0
        for item in items:
            num_rows = len(item.token_ids)
            num_kept = num_rows
            if item.sample:
                tokens = result.sampled_token_ids.get(item.request_id)
                num_kept = num_rows - item.num_draft_tokens + len(tokens) - 1 if tokens else 0
            if num_kept > 0 and item.request_id not in result.failed:
                self.draft.record(item.request_id, item.start_position, hidden[offset : offset + num_kept])
            offset += num_rows

    def propose(
        self, items: list[ScheduledRequest], generator_for: GeneratorFor
    ) -> tuple[list[ScheduledRequest], dict[str, torch.Tensor]]:
        """The draft model's drafts appended to the items that have draft slots, and the draft
        distributions of sampled requests (for rejection sampling)."""
        started = time.perf_counter()
        proposals = self.draft.propose([item for item in items if item.num_draft_slots], generator_for)
        self.draft_wall_s += time.perf_counter() - started
        filled, draft_probs = [], {}
        for item in items:
            if not item.num_draft_slots:
                filled.append(item)
                continue
            tokens, probs = proposals[item.request_id]
            if probs is not None:
                draft_probs[item.request_id] = probs
            filled.append(
                dataclasses.replace(
                    item, token_ids=item.token_ids + tokens, draft_token_ids=tokens, num_draft_slots=0
                )
            )
        return filled, draft_probs
