"""Admission: which waiting requests start this step, and what they start with (no torch).

`Admission` admits waiting requests within seats, LoRA slots, the batch policy's room and free
blocks, preempting where the policy allows (`scheduler.py`'s docstring); a parallel-sampling
choice starts from its leader's prompt blocks, any other request from what the prefix cache
holds. The scheduler composes it over its `RequestQueues` and `StepBuilder`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.request import Priority, Request, RequestStatus
from tandem.engine.sched.batch_policy import BatchPolicy
from tandem.engine.sched.queues import RequestQueues
from tandem.engine.sched.step_builder import StepBuilder, StepInProgress

_SKIP = -1  # `try_admit`: the request waits; later ones may go ahead
_RETRY = -2  # `try_admit`: look at the same request again (a victim was preempted, or admission stopped)


@dataclass
class _Admitting:
    active_loras: set[str]  # adapters of running requests (each holds a slot)
    admitting: bool = True  # False once memory is tight: admission stops for the step
    seatless: set[str | None] = field(default_factory=set)  # tenants found at their seat share while full


class Admission:
    def __init__(
        self,
        queues: RequestQueues,
        builder: StepBuilder,
        batch: BatchPolicy,
        *,
        max_num_seqs: int,
        max_loras: int,
    ) -> None:
        """`max_num_seqs`: seats; `max_loras`: distinct adapters among running requests."""
        self.queues = queues
        self.builder = builder
        self.batch = batch
        self.max_num_seqs = max_num_seqs
        self.max_loras = max_loras

    def may_start(self, request: Request) -> bool:
        """False for a parallel-sampling choice whose leader is still computing the prompt it will
        share (`Request.fork_of`); a choice whose leader is gone forgets it and starts alone."""
        if request.fork_of is None:
            return True
        leader = self.queues.requests.get(request.fork_of)
        if leader is None or leader.status.is_finished:
            request.fork_of = None
            return True
        return (
            leader.status is RequestStatus.RUNNING
            and leader.num_computed_tokens >= self.num_forked_tokens(request)
        )

    def num_forked_tokens(self, request: Request) -> int:
        """Tokens of the prompt a choice shares with its leader: its full blocks, leaving at least
        one token to compute (the choice samples its own first token from its logits)."""
        return (
            (request.num_prompt_tokens - 1) // self.queues.shared.block_size * self.queues.shared.block_size
        )

    def prompt_first(
        self, decoding: list[Request], queue: list[Request], step: StepInProgress, cap: int
    ) -> bool:
        """A step of its own for a lighter tenant's short new prompt: when a waiting request's
        whole prompt fits this step and a seat is free, and other tenants hold more running
        requests per weight (`FairShare.heavier_tenants`), prompts and admissions go first (the
        decoders' tokens held in reserve); if such a request was admitted, the heavier tenants'
        decodes sit out this step. `queue`: the class's running prompts and waiting requests in
        fair order. Returns whether it scheduled the class (False: nothing to do)."""
        if len(self.queues.running) >= self.max_num_seqs:
            return False
        reserve = len(decoding)
        newcomers = [
            r
            for r in queue
            if r.status is not RequestStatus.RUNNING and r.num_tokens - r.num_computed_tokens <= cap - reserve
        ]
        interactive = [r for r in self.queues.running if r.priority is Priority.INTERACTIVE]
        heavier = self.queues.fair.heavier_tenants(interactive, newcomers)  # batch work is no weight here
        if not heavier or all(r.tenant_id in heavier for r in newcomers):
            return False
        first = len(step.scheduled)
        cap = self.admit_waiting(queue, step, cap - reserve) + reserve
        started = any(
            item.is_new and item.sample and self.queues.requests[item.request_id].tenant_id not in heavier
            for item in step.scheduled[first:]
        )
        if started:
            decoding = [r for r in decoding if r.tenant_id not in heavier]
        self.builder.schedule_running(
            self.queues.fair.order(decoding, self.builder.num_uncomputed), step, cap
        )
        return True

    def admit_waiting(self, candidates: list[Request], step: StepInProgress, cap: int) -> int:
        """Admit waiting requests of one class, in this order, within `cap` tokens,
        `max_num_seqs` and free blocks; running requests among `candidates` (prompts) get their
        next chunk at their place. A waiting request may preempt a running one of lower priority,
        or, for a seat or for room, one of its own class whose tenant is over its share while its
        own tenant is under. Admission stops for the step when memory is tight (a running request
        had to be preempted, or a request found no room). Returns what is left of `cap`."""
        state = _Admitting(self.active_loras(), admitting=not step.preempted)
        position = 0  # requests before it wait for a LoRA slot or a seat; later ones may go ahead
        while position < len(candidates) and cap > 0:
            request = candidates[position]
            if request.status is RequestStatus.RUNNING:  # a prompt's next chunk
                num_preempted = len(step.preempted)
                cap = self.builder.schedule_running([request], step, cap)
                state.admitting = state.admitting and len(step.preempted) == num_preempted
                position += 1
                continue
            verdict = self.try_admit(request, step, cap, state)
            if verdict == _SKIP:
                position += 1
            elif verdict != _RETRY:  # admitted with `verdict` tokens this step
                candidates.pop(position)
                cap -= verdict
        return cap

    def active_loras(self) -> set[str]:
        return {r.lora_name for r in self.queues.running if r.lora_name is not None}

    def try_admit(self, request: Request, step: StepInProgress, cap: int, state: _Admitting) -> int:
        """Admit one waiting request (returns its tokens this step), or `_SKIP` it (it waits; a
        later one may go), or `_RETRY` it (a victim was preempted for it, or admission stopped)."""
        if not state.admitting or request.request_id in step.preempted:
            return _SKIP
        if len(self.queues.running) >= self.max_num_seqs:
            return self.take_seat(request, step, state)
        if request.priority is Priority.BATCH and not self.batch_has_room(request):
            state.admitting = False
            return _RETRY
        lora = request.lora_name
        if lora is not None and lora not in state.active_loras and len(state.active_loras) >= self.max_loras:
            return _SKIP  # every LoRA slot is taken by running requests' adapters
        if request.num_computed_tokens == 0 and not self.queues.shared.holds(request.request_id):
            if not self.may_start(request):  # its leader was preempted in this step
                return _SKIP
            if not request.whole_prompt:  # an encoder's KV of a prefix depends on what follows it
                self.take_prefix(request)
        num_new = self.builder.chunk(request, cap)
        if (
            num_new == 0 and request.whole_prompt
        ):  # a whole prompt that does not fit what is left of this step
            return _SKIP
        if not self.queues.allocate(request, request.num_computed_tokens + num_new, admission=True):
            victim = self.lower_priority_victim(request, same_pool=True) or self.queues.fair.seat_victim(
                request,
                (r for r in self.queues.running if r.compressed == request.compressed),
                self.max_num_seqs,
            )
            if victim is None:
                self.queues.free_kv(request.request_id)  # give back any prefix-cache hits
                request.num_computed_tokens = 0
                state.admitting = False
                return _RETRY
            self.builder.preempt_in_step(victim, step)
            state.active_loras = self.active_loras()
            return _RETRY
        self.queues.start(request)  # it holds its blocks now
        if lora is not None:
            state.active_loras.add(lora)
        self.builder.schedule_one(request, num_new, step)
        return num_new

    def take_seat(self, request: Request, step: StepInProgress, state: _Admitting) -> int:
        """Every seat is taken: a request of higher priority than some running one takes its seat
        (an interactive request never waits for batch requests, which are throttled while it
        waits, to finish); so does one whose tenant is under its share of the seats (`_RETRY`).
        Else it waits (`_SKIP`): another tenant's request may still be under its share."""
        victim = None
        if request.tenant_id not in state.seatless:
            victim = self.lower_priority_victim(request) or self.queues.fair.seat_victim(
                request, self.queues.running, self.max_num_seqs
            )
        if victim is None:
            state.seatless.add(request.tenant_id)
            return _SKIP
        self.builder.preempt_in_step(victim, step)
        state.active_loras = self.active_loras()
        return _RETRY

    def take_prefix(self, request: Request) -> None:
        """Before admission: the computed tokens a request starts with, as blocks it shares. A
        parallel-sampling choice shares its leader's full prompt blocks; any other request takes
        what the prefix cache holds of its tokens (a compressed request copies the cached prefix
        into its own heads, and leaves at least the observation window to compute, whose queries
        score its tokens)."""
        if request.fork_of is not None:
            num_blocks = self.num_forked_tokens(request) // self.queues.shared.block_size
            request.num_computed_tokens = self.queues.shared.fork(
                request.request_id, request.fork_of, num_blocks
            )
            request.num_cached_tokens = request.num_computed_tokens
            return
        lookup_tokens = request.num_tokens
        if request.compressed and self.queues.head_layout is not None:
            lookup_tokens = self.queues.head_layout.prefix_lookup_tokens(request)
        cached = self.queues.shared.take_cached_prefix(
            request, lookup_tokens, self.queues.cache_salt(request), whole=request.hold_kv
        )
        request.num_computed_tokens = cached
        if request.num_preemptions == 0:
            request.num_cached_tokens = cached
        if request.compressed and self.queues.head_layout is not None:
            self.queues.head_layout.copy_prefix(request, cached)

    def batch_has_room(self, request: Request) -> bool:
        layout = self.queues.layout(request)
        return self.batch.has_room(layout.pool, layout.num_new_blocks_needed(request))

    def lower_priority_victim(self, request: Request, same_pool: bool = False) -> Request | None:
        """A running request of strictly lower priority, if any: of the lowest class, the tenant
        most over its share, its latest arrival (with `same_pool`, only one whose blocks
        `request` could use: the same KV layout)."""
        lower = [
            r
            for r in self.queues.running
            if r.priority > request.priority and (not same_pool or r.compressed == request.compressed)
        ]
        return self.queues.fair.victim(lower) if lower else None
