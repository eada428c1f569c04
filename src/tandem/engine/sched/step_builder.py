"""Building one step (no torch): `StepBuilder` hands running requests their tokens.

Each scheduled request gets `num_new` of its own tokens (a prompt chunk, or one decode token)
and, when they reach its end, this step's planned drafts; when blocks run out a running request
of the same pool is preempted (`RequestQueues.victim_in_pool`) and gives back its share of the
step. `StepInProgress` is what one `Scheduler.schedule()` call has handed out so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.request import Priority, Request, RequestStatus
from tandem.engine.sched.batch_policy import BatchPolicy
from tandem.engine.sched.queues import RequestQueues
from tandem.engine.sched.step import ScheduledRequest
from tandem.engine.spec.planner import Proposal

NO_PROPOSAL = Proposal()  # frozen: one shared instance for the requests without drafts


@dataclass
class StepInProgress:
    """What one `schedule()` call has handed out so far."""

    budget: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    scheduled_ids: set[str] = field(default_factory=set)
    preempted: list[str] = field(default_factory=list)
    # an interactive request's prompt chunk was handed out (it may have been taken back since)
    may_hold_interactive_prompt: bool = False


class StepBuilder:
    def __init__(self, queues: RequestQueues, batch: BatchPolicy, max_num_batched_tokens: int) -> None:
        self.queues = queues
        self.batch = batch
        self.max_num_batched_tokens = max_num_batched_tokens
        self.planned_drafts: dict[str, Proposal] = {}  # this step's drafts, by request id

    @staticmethod
    def num_uncomputed(request: Request) -> int:
        return max(1, request.num_tokens - request.num_computed_tokens)

    def chunk(self, request: Request, cap: int) -> int:
        """The request's tokens this step within `cap` (a batch prompt's chunks are capped); 0
        for a whole-prompt request (an encoder's) whose prompt does not fit."""
        remaining = request.num_tokens - request.num_computed_tokens
        if request.whole_prompt:  # all of it or nothing (never cut to a batch chunk)
            return remaining if remaining <= cap else 0
        num_new = min(remaining, cap)
        if request.priority is Priority.BATCH:
            num_new = min(num_new, self.batch.prefill_cap(self.max_num_batched_tokens))
        return num_new

    def schedule_one(
        self,
        request: Request,
        num_new: int,
        step: StepInProgress,
        drafts: Proposal | None = None,
    ) -> None:
        """Schedule `num_new` of the request's own tokens, then `drafts` (only when they reach its
        end; with a draft model, as many slots for the runner's own drafts)."""
        num_draft_slots = drafts.num_model_drafts if drafts is not None else 0
        start = request.num_computed_tokens
        end = start + num_new
        draft_token_ids = list(drafts.token_ids) if drafts is not None else []
        repeats = request.sampling_params.repetition_penalty != 1.0  # penalises the prompt's tokens too
        item = ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_ids_slice(start, end) + draft_token_ids,
            start_position=start,
            block_ids=[],
            sample=end == request.num_tokens,
            sampling_params=request.sampling_params,
            output_token_ids=request.output_token_ids,
            is_new=self.queues.mark_seen(request.request_id),
            lora_name=request.lora_name,
            draft_token_ids=draft_token_ids,
            num_draft_slots=num_draft_slots,
            prompt_token_ids=request.prompt_token_ids if num_draft_slots or repeats else [],
            embed=request.embed,
        )
        step.scheduled.append(item)
        if request.priority is Priority.INTERACTIVE and start < request.num_tokens - 1:
            step.may_hold_interactive_prompt = True
        self.queues.layout(request).describe(item, request)
        step.scheduled_ids.add(request.request_id)
        step.budget -= num_new + (len(drafts) if drafts is not None else 0)

    def schedule_running(self, candidates: list[Request], step: StepInProgress, cap: int) -> int:
        """Schedule these running requests, in this order, within `cap` tokens; when blocks run
        out, preempt (`victim_in_pool`: lowest priority, tenant most over its share, latest
        arrival). Returns what is left of `cap`. A request that decodes without drafts in the
        shared layout, its blocks holding its token or one more block free (most requests of most
        steps), gets its item here, without the general path's chunking and draft checks."""
        planned, running = self.planned_drafts, RequestStatus.RUNNING
        decode_block_ids, mark_seen = self.queues.shared.decode_block_ids, self.queues.mark_seen
        scheduled, scheduled_ids = step.scheduled, step.scheduled_ids
        for request in candidates:
            if cap <= 0:
                break
            if request.status is not running:  # preempted for an earlier one
                continue
            request_id = request.request_id
            output_token_ids, prompt_token_ids = request.output_token_ids, request.prompt_token_ids
            num_tokens = len(prompt_token_ids) + len(output_token_ids)
            start = request.num_computed_tokens
            block_ids = None
            if start + 1 == num_tokens and not request.compressed and not (planned and request_id in planned):
                block_ids = decode_block_ids(request_id, num_tokens)  # None: blocks are short
            if block_ids is None:
                cap = self.schedule_chunk(request, step, cap)
                continue
            params = request.sampling_params
            item = ScheduledRequest(
                request_id,
                [output_token_ids[-1] if output_token_ids else prompt_token_ids[-1]],
                start,
                block_ids,
                True,
                params,
                output_token_ids,
                mark_seen(request_id),
                request.lora_name,
                prompt_token_ids=prompt_token_ids if params.repetition_penalty != 1.0 else [],
                embed=request.embed,
            )
            scheduled.append(item)
            scheduled_ids.add(request_id)
            step.budget -= 1
            cap -= 1
        return cap

    def schedule_chunk(self, request: Request, step: StepInProgress, cap: int) -> int:
        """Schedule a running request's next chunk (a prompt chunk, or a decode with its drafts)
        within `cap`, preempting while blocks are short; returns what is left of `cap`."""
        num_new = self.chunk(request, cap)
        if num_new == 0 and request.whole_prompt:  # a whole prompt that does not fit this step: it waits
            return cap
        drafts = self.planned_drafts.get(request.request_id, NO_PROPOSAL)
        if drafts and request.num_computed_tokens + num_new == request.num_tokens:
            drafts = drafts.truncated(max(0, cap - num_new))
        else:
            drafts = NO_PROPOSAL
        while not self.queues.allocate(request, request.num_computed_tokens + num_new + len(drafts)):
            victim = self.queues.victim_in_pool(request)
            # The victim may already hold a share of this step: it gives it back (to the cap
            # too, when it is of this class).
            returned = self.preempt_in_step(victim, step)
            if victim.priority is request.priority:
                cap += returned
            if victim is request:
                return cap
        self.schedule_one(request, num_new, step, drafts)
        return cap - num_new - len(drafts)

    def preempt_in_step(self, request: Request, step: StepInProgress) -> int:
        """Preempt a running request, giving back its share of this step if it had one (its
        tokens and draft slots, returned)."""
        returned = 0
        if request.request_id in step.scheduled_ids:
            index = next(i for i, s in enumerate(step.scheduled) if s.request_id == request.request_id)
            item = step.scheduled.pop(index)
            returned = len(item.token_ids) + item.num_draft_slots  # explicit drafts are in token_ids
            step.budget += returned
            step.scheduled_ids.discard(request.request_id)
        self.queues.preempt(request)
        step.preempted.append(request.request_id)
        return returned
