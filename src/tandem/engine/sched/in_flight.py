"""A step in flight (no torch): what lets the engine schedule step N+1 while step N runs.

When step N is handed to the device, its requests advance as if its results were in: each
request's computed count moves past the step's tokens and each sampling request gets one
`PLACEHOLDER_TOKEN` at the end of its output (`InFlightStep.begin`). The scheduler then builds
step N+1 from that state. When step N's results arrive, the tokens go where the placeholders are
(`fill`), which says who ends there (a stop token, the length, a failure); step N+1 loses those
requests and takes the real tokens as it begins (`begin` with `ending`, in the same pass over
its items that advances them) and goes to the device; only then is the rest of
step N's bookkeeping done (`StepUpdates.apply_filled`: fair shares, the prefix cache, finishing).
The state a request reaches this way is the serial engine's, token for token.

Only a step that cannot preempt is scheduled ahead (`Scheduler.can_schedule_ahead`). While steps
are in flight a request's output ends with at most one placeholder, the newest token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tandem.engine.request import Request, RequestStatus
from tandem.engine.sched.step import PLACEHOLDER_TOKEN, RunnerResult, SchedulerOutput


@dataclass
class InFlightStep:
    """A step handed to the device whose results are not applied yet."""

    scheduled: SchedulerOutput  # each item's `start_position` is its request's computed count before the step
    placeholders: list[tuple[Request, int]]  # each sampling request, and where its placeholder is

    @classmethod
    def begin(
        cls,
        scheduled: SchedulerOutput,
        requests: dict[str, Request],
        ending: dict[str, RequestStatus | None] | None = None,
    ) -> InFlightStep:
        """Advance the step's requests as if its results were in (one placeholder per sampling
        request; a step scheduled ahead carries no drafts). With `ending` (the step was scheduled
        ahead of the one just filled: `fill`'s answer), it is rebased first: without the requests
        that end there or finished meanwhile (their blocks are freed when they end), and with the
        real token where a request was scheduled with a placeholder (its last token). The result's
        `scheduled` is the step to run (empty when none of its requests is left)."""
        placeholders = []
        kept = []
        running = RequestStatus.RUNNING  # everything a step schedules runs; the others ended meanwhile
        for item in scheduled.scheduled:
            request = requests.get(item.request_id)
            if ending is not None:
                if request is None or request.status is not running or (ending and item.request_id in ending):
                    continue
                kept.append(item)
                token_ids = item.token_ids
                if token_ids and token_ids[-1] == PLACEHOLDER_TOKEN:  # only the newest token can be one
                    position = item.start_position + len(token_ids) - 1
                    token_ids[-1] = request.output_token_ids[position - request.num_prompt_tokens]
            elif request is None:
                continue
            assert not item.draft_token_ids and not item.num_draft_slots, (
                "a step scheduled ahead has no drafts"
            )
            request.num_computed_tokens = item.start_position + len(item.token_ids)
            if item.sample:
                output_token_ids = request.output_token_ids
                placeholders.append((request, len(output_token_ids)))
                output_token_ids.append(PLACEHOLDER_TOKEN)
        return cls(scheduled.with_items(kept) if ending is not None else scheduled, placeholders)

    def fill(
        self, result: RunnerResult, stop_status: Callable[[Request, int], RequestStatus | None]
    ) -> dict[str, RequestStatus | None]:
        """Put the device's tokens where the placeholders are, for the requests still running (a
        request a stop string or an abort ended meanwhile keeps its placeholder: its output is
        final). Returns the requests that end here: those whose token stops them (`stop_status`,
        read before the next step is begun) and those the device failed (None)."""
        ending: dict[str, RequestStatus | None] = dict.fromkeys(result.failed)
        sampled = result.sampled_token_ids
        running = RequestStatus.RUNNING
        for request, index in self.placeholders:
            if request.status is not running or (ending and request.request_id in ending):
                continue
            token_ids = sampled.get(request.request_id)
            if not token_ids:
                ending[request.request_id] = None
                continue
            request.output_token_ids[index] = token_ids[0]
            status = stop_status(request, token_ids[0])
            if status is not None:
                ending[request.request_id] = status
        return ending


def with_tokens_of(
    scheduled: SchedulerOutput, sampled: dict[str, list[int]], output_ends: dict[str, int]
) -> SchedulerOutput:
    """A step queued on the device behind the one before it (`StepPipeline`'s chained steps), as
    the device thread runs it once that one is done: each placeholder (always an item's newest
    token: the step before's token for that request) becomes the token the step before sampled,
    in place (the engine thread writes the same value when it rebases the step: `InFlightStep.begin`),
    and a request the step before sampled none for (it failed there) is left out. An item in
    `output_ends` (a request whose penalties read its output so far: how many of its output tokens
    were known when the step was queued) reads its own copy of its output, that token included:
    the engine thread fills in and appends to the request's own list meanwhile."""
    kept = []
    for item in scheduled.scheduled:
        token_ids = item.token_ids
        new_ids: list[int] = []
        if token_ids[-1] == PLACEHOLDER_TOKEN:
            new_ids = sampled.get(item.request_id) or []
            if not new_ids:
                continue
            token_ids[-1] = new_ids[0]
        end = output_ends.get(item.request_id)
        if end is not None:
            item.output_token_ids = item.output_token_ids[:end] + new_ids[:1]
        kept.append(item)
    return scheduled.with_items(kept)
