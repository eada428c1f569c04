"""Token-budget scheduler (no torch).

One scheduling model, as in vLLM v1: each request has `num_computed_tokens`; each step hands out
`num_scheduled_tokens` per request against `max_num_batched_tokens`. A prompt is computed in
chunks when the budget is short, decodes (one token) and prefill chunks share a batch, and a
preempted request simply restarts from `num_computed_tokens = 0` (recompute).

Order of service, per priority class (`interactive`, then `batch`): the class's decoding
requests, then its running prompts' chunks and its waiting requests' admissions in one fair order
between tenants (`fair_share.py`: virtual token counters, weighted; first-come first-served
within a tenant); so a waiting interactive request gets tokens before any batch request does,
and one tenant's long prompts or many requests do not hold another's back. Seats
(`max_num_seqs`) are shared by weight among the tenants with live requests: when all are taken, a
request of a tenant under its share takes the seat of the tenant most over it. When a running
request needs a block and none is free, the lowest-priority class's tenant most over its share
gives up its latest-arriving running request (with one tenant: the latest arrival). Batch requests fill idle capacity
only: one is admitted while the KV cache stays under `batch_kv_occupancy_limit` with its whole
prompt counted, its prefill chunks are capped at `batch_max_prefill_tokens`, and while any
interactive request runs or waits all batch requests together get at most
`batch_tokens_under_load` tokens per step (the others keep their KV and wait a step), and for
`interactive_quiet_s` after the last one left at most `batch_tokens_after_interactive` (short
steps: what an arriving interactive request waits for is the step in flight). A step that computes
an interactive prompt chunk gives batch requests at most `batch_tokens_beside_interactive_prompt`
(the engine's default 0: a prompt's steps, and so its time to first token, are as without batch
traffic).
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.engine.kv.block_manager import KVCacheManager
from tandem.engine.kv.head_cache import HeadKVCacheManager
from tandem.engine.kv.layout import HeadLayout, SharedLayout
from tandem.engine.request import Priority, Request, RequestStatus
from tandem.engine.sched.admission import Admission
from tandem.engine.sched.batch_policy import BatchPolicy
from tandem.engine.sched.fair_share import FairShare
from tandem.engine.sched.queues import RequestQueues
from tandem.engine.sched.step import RequestUpdate, RunnerResult, ScheduledRequest, SchedulerOutput
from tandem.engine.sched.step_builder import StepBuilder, StepInProgress
from tandem.engine.sched.step_updates import StepUpdates
from tandem.engine.spec.drafts import SpeculationSettings
from tandem.engine.spec.planner import SpeculationPlanner

__all__ = ["RequestUpdate", "RunnerResult", "ScheduledRequest", "Scheduler", "SchedulerOutput"]


class Scheduler:
    """Composes the parts of scheduling, each owning its state: `RequestQueues` (requests, queues,
    held KV, fair shares, KV layouts), `StepBuilder` (running requests' tokens), `Admission`
    (waiting requests), `StepUpdates` (the runner's results) and the `SpeculationPlanner`.

    `batch`: how batch requests fill idle capacity (`batch_policy.py`). `kv_hold_ttl_s`: held KV
    (`Request.hold_kv`) not collected this long is freed at the next `schedule()`.
    `check_kv_integrity`: `schedule()` leaves out requests holding a block whose generation changed
    (`SchedulerOutput.stale_request_ids`). `on_finish` is called with every request that finishes,
    whatever ends it (`finish_request` is the one path)."""

    def __init__(
        self,
        kv_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        batch: BatchPolicy | None = None,
        max_loras: int = 0,
        share_prefix_cache_across_tenants: bool = False,
        speculation: SpeculationSettings | None = None,
        head_kv: HeadKVCacheManager | None = None,
        eviction_interval: int = 0,
        eviction_window: int = 16,
        fair_share: FairShare | None = None,
        kv_hold_ttl_s: float | None = None,
        check_kv_integrity: bool = False,
        on_finish: Callable[[Request], None] | None = None,
    ) -> None:
        self.kv = kv_manager
        self.kv_hold_ttl_s = kv_hold_ttl_s
        self.check_kv_integrity = check_kv_integrity
        self.on_finish = on_finish
        # Where requests' KV lives (`kv/layout.py`): the shared paged cache, and for compressed
        # requests (`Request.compressed`) the per-head layout (None: the engine runs none).
        head_layout = None
        if head_kv is not None:
            head_layout = HeadLayout(
                head_kv, kv_manager, eviction_interval=eviction_interval, eviction_window=eviction_window
            )
        self.queues = RequestQueues(
            SharedLayout(kv_manager),
            head_layout,
            fair_share or FairShare(),  # tenants' shares inside a priority class
            share_prefix_cache_across_tenants=share_prefix_cache_across_tenants,
        )
        # The queues' containers, shared (never rebound): what callers and tests read.
        self.requests, self.waiting, self.running = (
            self.queues.requests,
            self.queues.waiting,
            self.queues.running,
        )
        self.held, self.fair = self.queues.held, self.queues.fair
        self.shared, self.head_layout = self.queues.shared, self.queues.head_layout
        # Speculation (None: off): the planner decides each step's drafts and learns from verdicts.
        self.speculation = SpeculationPlanner(
            speculation, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len
        )
        self.batch = batch or BatchPolicy()
        self.max_num_seqs = max_num_seqs  # seats
        self.max_loras = max_loras  # distinct adapters among running requests (the device slots)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.builder = StepBuilder(self.queues, self.batch, max_num_batched_tokens)
        self.admission = Admission(
            self.queues, self.builder, self.batch, max_num_seqs=max_num_seqs, max_loras=max_loras
        )
        self.updates = StepUpdates(
            self.queues, self.speculation, max_model_len=max_model_len, finish=self.finish_request
        )

    # -- queue management ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.queues.add(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Stop a request (abort, stop string, error); its blocks are free when this returns,
        unless it asked to keep them (`Request.hold_kv`, KV to hand over) and ended normally:
        then they stay in `held` until `release_held`."""
        request = self.queues.remove(request_id, status)
        if request is None:
            return None
        self.speculation.forget(request_id)
        if self.on_finish is not None:
            self.on_finish(request)
        return request

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_preemptions_total(self) -> int:
        return self.queues.num_preemptions_total

    @property
    def num_output_tokens_total(self) -> dict[Priority, int]:
        return self.updates.num_output_tokens_total

    def num_uncomputed_prompt_tokens(self) -> int:
        """Prompt tokens of live requests whose KV is not computed yet (the prefill backlog); a
        parallel-sampling choice waiting for its leader's blocks counts only what it will compute."""
        forked = self.admission.num_forked_tokens
        return sum(
            max(0, r.num_prompt_tokens - max(r.num_computed_tokens, forked(r) if r.fork_of else 0))
            for r in (*self.waiting, *self.running)
        )

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def release_held(self, request_id: str) -> Request | None:
        """Free a held request's blocks (after its KV was exported, or its lease ran out)."""
        return self.queues.release_held(request_id)

    def cache_salt(self, request: Request) -> tuple[str | None, str | None]:
        """What besides the tokens keys a cached block (`RequestQueues.cache_salt`)."""
        return self.queues.cache_salt(request)

    # -- scheduling ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """One step: per priority class (interactive, then batch), first its running requests,
        then its waiting ones; so a waiting interactive request is admitted before any batch
        request gets tokens. While interactive requests exist, batch requests share at most
        `batch_tokens_under_load` tokens per step (the rest keep their KV and wait), and at most
        `batch_tokens_beside_interactive_prompt` in a step that computes an interactive prompt.
        Held KV past its lease is freed first; with `check_kv_integrity`, requests holding a
        reassigned block are left out of the step (`stale_request_ids`) for the engine to end."""
        if self.held and self.kv_hold_ttl_s is not None:
            self.queues.expire_held(self.kv_hold_ttl_s)
        step = StepInProgress(budget=self.max_num_batched_tokens)
        interactive_active = any(r.priority is Priority.INTERACTIVE for r in self.running) or bool(
            self.waiting and self.waiting[0].priority is Priority.INTERACTIVE
        )
        batch_cap = self.batch.step_cap(interactive_active)  # None: the budget
        self.builder.planned_drafts = self.speculation.plan(self.running, batch_cap)
        for priority in Priority:
            if (
                priority is Priority.BATCH
                and step.may_hold_interactive_prompt
                and self._computes_interactive_prompt(step)
            ):
                batch_cap = self.batch.cap_beside_prompt(batch_cap)
            throttled = priority is Priority.BATCH and batch_cap is not None
            cap = min(step.budget, batch_cap or 0) if throttled else step.budget
            self._schedule_class(priority, step, cap, prompts_wait=throttled)
        finished_ids = self.queues.take_finished_ids()
        move_src, move_dst = self.head_layout.take_moves() if self.head_layout is not None else ([], [])
        stale = self._stale_requests(step.scheduled)
        return SchedulerOutput(
            scheduled=[s for s in step.scheduled if s.request_id not in stale] if stale else step.scheduled,
            num_scheduled_tokens=self.max_num_batched_tokens - step.budget,
            preempted_request_ids=step.preempted,
            finished_request_ids=finished_ids,
            head_move_src_slots=move_src,
            head_move_dst_slots=move_dst,
            stale_request_ids=stale,
        )

    def _stale_requests(self, scheduled: list[ScheduledRequest]) -> list[str]:
        """KV-page integrity: scheduled requests holding a block whose generation changed (it was
        reassigned: an allocator bug, a late KV transfer), in either layout."""
        if not self.check_kv_integrity or not scheduled:
            return []
        stale = self.shared.stale_requests(s.request_id for s in scheduled)  # read only if any is stale
        if self.head_layout is not None:  # compressed requests' head blocks carry the same tags
            stale += self.head_layout.stale_requests(
                [s.request_id for s in scheduled if s.request_id not in stale]
            )
        return stale

    def _computes_interactive_prompt(self, step: StepInProgress) -> bool:
        """Whether the step so far holds a chunk of an interactive request's prompt (not only
        decodes: a decoding request has computed all its tokens but the last)."""
        for item in step.scheduled:
            request = self.requests[item.request_id]
            if request.priority is Priority.INTERACTIVE and item.start_position < request.num_tokens - 1:
                return True
        return False

    def _schedule_class(
        self, priority: Priority, step: StepInProgress, cap: int, prompts_wait: bool = False
    ) -> None:
        """One priority class within `cap` tokens: first its decoding requests (one token each,
        plus drafts), then its running prompts' chunks and its waiting requests' admissions in
        one fair order (`FairShare.order`), so a tenant's long prompt shares the budget with
        another tenant's newly arrived one instead of going first. With `prompts_wait` (throttled
        batch tokens) running prompts' chunks come before admissions (the few tokens go to work
        already started: decodes first, so a step of decodes only stays small and fast)."""
        decoding: list[Request] = []
        prompting: list[Request] = []
        for r in self.running:
            if r.priority is priority:  # decoding: all its tokens but the last computed
                decodes = r.num_computed_tokens + 1 >= len(r.prompt_token_ids) + len(r.output_token_ids)
                (decoding if decodes else prompting).append(r)
        waiting = [r for r in self.waiting if r.priority is priority and self.admission.may_start(r)]
        if prompts_wait:
            cap = self.builder.schedule_running(
                self.fair.order(decoding, self.builder.num_uncomputed), step, cap
            )
            cap = self.builder.schedule_running(
                self.fair.order(prompting, self.builder.num_uncomputed), step, cap
            )
            self.admission.admit_waiting(self.fair.order(waiting, self.builder.num_uncomputed), step, cap)
            return
        queue = self.fair.order(
            sorted(prompting + waiting, key=Request.sort_key), self.builder.num_uncomputed
        )
        if priority is Priority.INTERACTIVE and self.admission.prompt_first(decoding, queue, step, cap):
            return
        cap = self.builder.schedule_running(self.fair.order(decoding, self.builder.num_uncomputed), step, cap)
        self.admission.admit_waiting(queue, step, cap)

    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before the running one's results are in
        (`in_flight.py`): it cannot preempt (the free blocks cover every running request's share of
        a full step), and no running request is compressed (its eviction needs the results) or
        embeds (its pooled state is its result)."""
        if self.queues.num_running_needing_results:
            return False
        bound = self.max_num_batched_tokens // self.kv.block_size + 1 + len(self.running)
        return self.kv.pool.num_free_blocks >= bound

    # -- applying the runner's result -------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, result: RunnerResult) -> list[RequestUpdate]:
        """Apply a step's results (`StepUpdates.update_from_output`)."""
        return self.updates.update_from_output(output, result)

    def add_handed_over(self, request: Request, first_token_id: int) -> RequestUpdate:
        """Admit a request whose prompt KV another engine computed, with its first token
        (`StepUpdates.add_handed_over`)."""
        return self.updates.add_handed_over(request, first_token_id)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        head_kv = self.head_layout.head_kv if self.head_layout is not None else None
        if head_kv is not None:
            head_kv.check_integrity()
            assert set(head_kv.tables) <= set(self.requests) | set(self.held), "orphan head tables"
        live = {r.request_id for r in self.running} | {r.request_id for r in self.waiting}
        assert not set(self.held) & set(self.requests), "a held request is still live"
        assert live == set(self.requests), "queues disagree with the request map"
        assert len(self.running) + len(self.waiting) == len(self.requests), "request in two queues"
        assert len(self.running) <= self.max_num_seqs
        num_loras = len({r.lora_name for r in self.running if r.lora_name is not None})
        assert num_loras <= self.max_loras, "more running adapters than LoRA slots"
        for request in self.running:
            assert request.status is RequestStatus.RUNNING
            assert request.num_computed_tokens <= request.num_tokens
            self.queues.layout(request).check_request(request)
        needing_results = sum(r.compressed or r.embed for r in self.running)
        assert needing_results == self.queues.num_running_needing_results, (
            "count of running requests needing results"
        )
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            if request.num_computed_tokens == 0:
                assert request.request_id not in self.kv.tables, "waiting request holds blocks"
                assert head_kv is None or request.request_id not in head_kv.tables
