"""`NullRunner`: a runner with no model, for measuring what the rest of the platform costs.

Every request that samples gets one token per step, read from a fixed cycle of ordinary tokens
(`token_ids`, each its own text), so detokenisation, stop strings and streaming do their real
work. With `step_s > 0` each step waits that long with the GIL free (as a host waits on a device),
so the engine's bookkeeping shows up as the time beyond it. Imports no torch: an engine built on
it (`EngineConfig.null_model_step_ms`) loads only the checkpoint's config and tokenizer.
"""

from __future__ import annotations

import time

from tandem.engine.sched.step import RunnerResult, RunnerStats, SchedulerOutput


class NullRunner:
    def __init__(self, token_ids: list[int], step_s: float = 0.0) -> None:
        if not token_ids:
            raise ValueError("NullRunner needs at least one token id to emit")
        self.token_ids = token_ids
        self.step_s = step_s
        self.num_steps = 0

    @property
    def has_draft(self) -> bool:
        return False

    @property
    def overlappable(self) -> bool:
        """Its steps may run on a thread of their own, reading only their `SchedulerOutput`: the
        engine schedules the next step meanwhile (`step_pipeline.py`)."""
        return True

    def execute(self, sched: SchedulerOutput) -> RunnerResult:
        """The step's tokens: the token at position p of a request (prompt included) is
        `token_ids[p % len(token_ids)]` (a function of the position only: the same whatever the
        batch, and whether or not the engine schedules ahead); drafts are never accepted."""
        deadline = time.perf_counter() + self.step_s  # the step takes step_s, its own work included
        self.num_steps += 1
        cycle = self.token_ids
        num = len(cycle)
        sampled = {
            item.request_id: [
                cycle[(item.start_position + len(item.token_ids) - len(item.draft_token_ids)) % num]
            ]
            for item in sched.scheduled
            if item.sample
        }
        if self.step_s > 0:  # the result is ready: the rest of the step is the device's
            time.sleep(max(0.0, deadline - time.perf_counter()))
        return RunnerResult(sampled)

    def stats(self) -> RunnerStats:
        return RunnerStats()

    def export_pages(self, block_ids: list[int], num_tokens: int, dtype_name: str) -> list[bytes]:
        raise NotImplementedError("a null runner holds no KV to export")

    def import_pages(self, block_ids: list[int], pages: list[tuple[int, bytes]]) -> None:
        raise NotImplementedError("a null runner holds no KV to import")

    def imported_prompt(self, request_id: str, first_position: int, num_tokens: int) -> None:
        raise NotImplementedError("a null runner holds no KV to import")
