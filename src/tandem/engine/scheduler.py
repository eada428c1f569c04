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

import bisect
import time
from collections.abc import Callable

from tandem.engine import admission, step_updates
from tandem.engine.admission import StepInProgress
from tandem.engine.batch_policy import BatchPolicy
from tandem.engine.fair_share import FairShare
from tandem.engine.head_kv_cache import HeadKVCacheManager
from tandem.engine.kv_cache import KVCacheManager
from tandem.engine.kv_layout import HeadLayout, KVLayout, SharedLayout
from tandem.engine.request import Priority, Request, RequestStatus
from tandem.engine.speculation_planner import Proposal, SpeculationPlanner
from tandem.engine.speculative import SpeculationSettings
from tandem.engine.step import RequestUpdate, RunnerResult, ScheduledRequest, SchedulerOutput

__all__ = ["RequestUpdate", "RunnerResult", "ScheduledRequest", "Scheduler", "SchedulerOutput"]


class Scheduler:
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
        """`batch`: how batch requests fill idle capacity (`batch_policy.py`). `kv_hold_ttl_s`:
        held KV (`Request.hold_kv`) not collected this long is freed at the next `schedule()`.
        `check_kv_integrity`: `schedule()` leaves out requests holding a block whose generation
        changed (`SchedulerOutput.stale_request_ids`). `on_finish` is called with every request
        that finishes, whatever ends it (`finish_request` is the one path)."""
        self.kv = kv_manager
        self.kv_hold_ttl_s = kv_hold_ttl_s
        self.check_kv_integrity = check_kv_integrity
        self.on_finish = on_finish
        # Tenants' shares inside a priority class: order of service, seats and preemption.
        self.fair = fair_share or FairShare()
        # Where requests' KV lives (`kv_layout.py`): the shared paged cache, and for compressed
        # requests (`Request.compressed`) the per-head layout (None: the engine runs none).
        self.shared = SharedLayout(kv_manager)
        self.head_layout = (
            None
            if head_kv is None
            else HeadLayout(
                head_kv, kv_manager, eviction_interval=eviction_interval, eviction_window=eviction_window
            )
        )
        # Speculation (None: off): the planner decides each step's drafts and learns from verdicts.
        self.speculation = SpeculationPlanner(
            speculation, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len
        )
        self._planned_drafts: dict[str, Proposal] = {}
        self.batch = batch or BatchPolicy()
        # At most this many distinct LoRA adapters among running requests (the device slots).
        self.max_loras = max_loras
        self.share_prefix_cache_across_tenants = share_prefix_cache_across_tenants
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by Request.sort_key()
        self.running: list[Request] = []  # sorted by Request.sort_key()
        self._finished_ids: list[str] = []
        self.held: dict[str, Request] = {}  # finished requests whose blocks are kept for hand-over
        self.held_since: dict[str, float] = {}  # when each was held (time.monotonic())
        self._seen_by_runner: set[str] = set()
        self.num_preemptions_total = 0
        # Tokens appended to requests' outputs, per priority class (batch progress is visible
        # while real-time traffic runs).
        self.num_output_tokens_total = {priority: 0 for priority in Priority}

    # -- queue management ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.fair.add(request)
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=Request.sort_key)

    def add_running(self, request: Request) -> None:
        """Admit a request whose blocks are already allocated and filled (KV handed over from
        another engine): it joins the running batch at once, `num_computed_tokens` as given."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.fair.add(request)
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=Request.sort_key)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Stop a request (abort, stop string, error); its blocks are free when this returns,
        unless it asked to keep them (`Request.hold_kv`, KV to hand over) and ended normally:
        then they stay in `held` until `release_held`."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.fair.remove(request)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        if request.hold_kv and status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.held[request_id] = request
            self.held_since[request_id] = time.monotonic()
        else:
            self._free_kv(request_id)
        self._forget(request_id)
        self.speculation.forget(request_id)
        if self.on_finish is not None:
            self.on_finish(request)
        return request

    def _forget(self, request_id: str) -> None:
        if request_id in self._seen_by_runner:
            self._seen_by_runner.discard(request_id)
            self._finished_ids.append(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_uncomputed_prompt_tokens(self) -> int:
        """Prompt tokens of live requests whose KV is not computed yet (the prefill backlog); a
        parallel-sampling choice waiting for its leader's blocks counts only what it will compute."""
        return sum(
            max(
                0,
                r.num_prompt_tokens
                - max(r.num_computed_tokens, admission.num_forked_tokens(self, r) if r.fork_of else 0),
            )
            for r in (*self.waiting, *self.running)
        )

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def release_held(self, request_id: str) -> Request | None:
        """Free a held request's blocks (after its KV was exported, or its lease ran out)."""
        request = self.held.pop(request_id, None)
        self.held_since.pop(request_id, None)
        if request is not None:
            self._free_kv(request_id)
        return request

    def expire_held(self, max_age_s: float) -> list[str]:
        """Free the blocks of requests held longer than `max_age_s` (a lease nobody collected)."""
        cutoff = time.monotonic() - max_age_s
        expired = [rid for rid, since in self.held_since.items() if since < cutoff]
        for request_id in expired:
            self.release_held(request_id)
        return expired

    # -- scheduling ---------------------------------------------------------------------
    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self._free_kv(victim.request_id)
        victim.kv_evicted = False  # recomputed from scratch, then evicted again
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        if victim.request_id in self._seen_by_runner:
            self._seen_by_runner.discard(victim.request_id)
        bisect.insort(self.waiting, victim, key=Request.sort_key)

    def _layout(self, request: Request) -> KVLayout:
        if not request.compressed:
            return self.shared
        assert self.head_layout is not None, "a compressed request on an engine without a head-block pool"
        return self.head_layout

    def _free_kv(self, request_id: str) -> None:
        """Give back a request's blocks, whichever layout holds them (a compressed request may
        hold shared blocks of a cached prefix too, for its first step)."""
        self.shared.free(request_id)
        if self.head_layout is not None:
            self.head_layout.free(request_id)

    def _allocate(self, request: Request, num_total_tokens: int, admission: bool = False) -> bool:
        """Room for the request's first `num_total_tokens` tokens in its layout (all-or-nothing)."""
        return self._layout(request).allocate(request, num_total_tokens, admission=admission)

    def _victim_in_pool(self, request: Request) -> Request:
        """Whom to preempt when `request` needs blocks: among running requests whose blocks come
        from the same pool (preempting another pool's request frees nothing it can use), the
        lowest priority class, the tenant most over its share, its latest arrival."""
        same_pool = [r for r in self.running if r.compressed == request.compressed]
        return self.fair.victim(same_pool or self.running)

    def _schedule_one(
        self,
        request: Request,
        num_new: int,
        scheduled: list[ScheduledRequest],
        drafts: Proposal | None = None,
    ) -> None:
        """Schedule `num_new` of the request's own tokens, then `drafts` (only when they reach its
        end; with a draft model, as many slots for the runner's own drafts)."""
        num_draft_slots = drafts.num_model_drafts if drafts is not None else 0
        start = request.num_computed_tokens
        end = start + num_new
        is_new = request.request_id not in self._seen_by_runner
        self._seen_by_runner.add(request.request_id)
        draft_token_ids = list(drafts.token_ids) if drafts is not None else []
        token_ids = request.token_ids_slice(start, end) + draft_token_ids
        repeats = request.sampling_params.repetition_penalty != 1.0  # penalises the prompt's tokens too
        scheduled.append(
            ScheduledRequest(
                request_id=request.request_id,
                token_ids=token_ids,
                start_position=start,
                block_ids=[],
                sample=end == request.num_tokens,
                sampling_params=request.sampling_params,
                output_token_ids=request.output_token_ids,
                is_new=is_new,
                lora_name=request.lora_name,
                draft_token_ids=draft_token_ids,
                num_draft_slots=num_draft_slots,
                prompt_token_ids=request.prompt_token_ids if num_draft_slots or repeats else [],
            )
        )
        self._layout(request).describe(scheduled[-1], request)

    def schedule(self) -> SchedulerOutput:
        """One step: per priority class (interactive, then batch), first its running requests,
        then its waiting ones; so a waiting interactive request is admitted before any batch
        request gets tokens. While interactive requests exist, batch requests share at most
        `batch_tokens_under_load` tokens per step (the rest keep their KV and wait), and at most
        `batch_tokens_beside_interactive_prompt` in a step that computes an interactive prompt.
        Held KV past its lease is freed first; with `check_kv_integrity`, requests holding a
        reassigned block are left out of the step (`stale_request_ids`) for the engine to end."""
        if self.held and self.kv_hold_ttl_s is not None:
            self.expire_held(self.kv_hold_ttl_s)
        step = StepInProgress(budget=self.max_num_batched_tokens)
        interactive_active = any(r.priority is Priority.INTERACTIVE for r in self.running) or bool(
            self.waiting and self.waiting[0].priority is Priority.INTERACTIVE
        )
        batch_cap = self.batch.step_cap(interactive_active)  # None: the budget
        self._planned_drafts = self.speculation.plan(self.running, batch_cap)
        for priority in Priority:
            if priority is Priority.BATCH and self._computes_interactive_prompt(step):
                batch_cap = self.batch.cap_beside_prompt(batch_cap)
            throttled = priority is Priority.BATCH and batch_cap is not None
            cap = min(step.budget, batch_cap or 0) if throttled else step.budget
            self._schedule_class(priority, step, cap, prompts_wait=throttled)
        finished_ids, self._finished_ids = self._finished_ids, []
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
        request_ids = [s.request_id for s in scheduled]
        stale = self.shared.stale_requests(request_ids)
        if self.head_layout is not None:  # compressed requests' head blocks carry the same tags
            stale += self.head_layout.stale_requests([r for r in request_ids if r not in stale])
        return stale

    def _computes_interactive_prompt(self, step: StepInProgress) -> bool:
        """Whether the step so far holds a chunk of an interactive request's prompt (not only
        decodes: a decoding request has computed all its tokens but the last)."""
        for item in step.scheduled:
            request = self.requests[item.request_id]
            if request.priority is Priority.INTERACTIVE and item.start_position < request.num_tokens - 1:
                return True
        return False

    def _chunk(self, request: Request, cap: int) -> int:
        num_new = min(request.num_tokens - request.num_computed_tokens, cap)
        if request.priority is Priority.BATCH:
            num_new = min(num_new, self.batch.prefill_cap(self.max_num_batched_tokens))
        return num_new

    def _schedule_class(
        self, priority: Priority, step: StepInProgress, cap: int, prompts_wait: bool = False
    ) -> None:
        """One priority class within `cap` tokens: first its decoding requests (one token each,
        plus drafts), then its running prompts' chunks and its waiting requests' admissions in
        one fair order (`FairShare.order`), so a tenant's long prompt shares the budget with
        another tenant's newly arrived one instead of going first. With `prompts_wait` (throttled
        batch tokens) running prompts' chunks come before admissions (the few tokens go to work
        already started: decodes first, so a step of decodes only stays small and fast)."""
        running = [r for r in self.running if r.priority is priority]
        decoding = [r for r in running if r.num_computed_tokens >= r.num_tokens - 1]
        prompting = [r for r in running if r.num_computed_tokens < r.num_tokens - 1]
        waiting = [r for r in self.waiting if r.priority is priority and admission.may_start(self, r)]
        if prompts_wait:
            cap = self._schedule_running(self.fair.order(decoding, self._num_uncomputed), step, cap)
            cap = self._schedule_running(self.fair.order(prompting, self._num_uncomputed), step, cap)
            admission.admit_waiting(self, self.fair.order(waiting, self._num_uncomputed), step, cap)
            return
        queue = self.fair.order(sorted(prompting + waiting, key=Request.sort_key), self._num_uncomputed)
        if priority is Priority.INTERACTIVE and admission.prompt_first(self, decoding, queue, step, cap):
            return
        cap = self._schedule_running(self.fair.order(decoding, self._num_uncomputed), step, cap)
        admission.admit_waiting(self, queue, step, cap)

    def _schedule_running(self, candidates: list[Request], step: StepInProgress, cap: int) -> int:
        """Schedule these running requests, in this order, within `cap` tokens; when blocks run
        out, preempt (`_victim_in_pool`: lowest priority, tenant most over its share, latest
        arrival). Returns what is left of `cap`."""
        for request in candidates:
            if cap <= 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted for an earlier one
                continue
            num_new = self._chunk(request, cap)
            drafts = self._planned_drafts.get(request.request_id, Proposal())
            if drafts and request.num_computed_tokens + num_new == request.num_tokens:
                drafts = drafts.truncated(max(0, cap - num_new))
            else:
                drafts = Proposal()
            while not self._allocate(request, request.num_computed_tokens + num_new + len(drafts)):
                victim = self._victim_in_pool(request)
                # The victim may already hold a share of this step: it gives it back (to the cap
                # too, when it is of this class).
                returned = self._preempt_in_step(victim, step)
                if victim.priority is request.priority:
                    cap += returned
                if victim is request:
                    break
            else:
                self._schedule_one(request, num_new, step.scheduled, drafts)
                step.scheduled_ids.add(request.request_id)
                step.budget -= num_new + len(drafts)
                cap -= num_new + len(drafts)
        return cap

    @staticmethod
    def _num_uncomputed(request: Request) -> int:
        return max(1, request.num_tokens - request.num_computed_tokens)

    def _preempt_in_step(self, request: Request, step: StepInProgress) -> int:
        """Preempt a running request, giving back its share of this step if it had one (its
        tokens and draft slots, returned)."""
        returned = 0
        if request.request_id in step.scheduled_ids:
            index = next(i for i, s in enumerate(step.scheduled) if s.request_id == request.request_id)
            item = step.scheduled.pop(index)
            returned = len(item.token_ids) + item.num_draft_slots  # explicit drafts are in token_ids
            step.budget += returned
            step.scheduled_ids.discard(request.request_id)
        self._preempt(request)
        step.preempted.append(request.request_id)
        return returned

    def cache_salt(self, request: Request) -> tuple[str | None, str | None]:
        """What besides the tokens keys a cached block: the adapter, and the tenant unless
        tenants are configured to share cached prefixes."""
        tenant = None if self.share_prefix_cache_across_tenants else request.tenant_id
        return (request.lora_name, tenant)

    # -- applying the runner's result (step_updates.py) ------------------------------------------
    def update_from_output(self, output: SchedulerOutput, result: RunnerResult) -> list[RequestUpdate]:
        """Apply a step's results (`step_updates.update_from_output`)."""
        return step_updates.update_from_output(self, output, result)

    def add_handed_over(self, request: Request, first_token_id: int) -> RequestUpdate:
        """Admit a request whose prompt KV another engine computed, with its first token
        (`step_updates.add_handed_over`)."""
        return step_updates.add_handed_over(self, request, first_token_id)

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
            self._layout(request).check_request(request)
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            if request.num_computed_tokens == 0:
                assert request.request_id not in self.kv.tables, "waiting request holds blocks"
                assert head_kv is None or request.request_id not in head_kv.tables
