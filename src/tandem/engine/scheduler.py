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
from dataclasses import dataclass, field

from tandem.engine.fair_share import FairShare
from tandem.engine.head_kv_cache import HeadKVCacheManager
from tandem.engine.kv_cache import KVCacheManager
from tandem.engine.request import Priority, Request, RequestStatus
from tandem.engine.speculative import (
    AcceptanceTracker,
    DraftCandidate,
    NgramIndex,
    SpeculationSettings,
    StepCostModel,
    plan_drafts,
)
from tandem.engine.step import RequestUpdate, RunnerResult, ScheduledRequest, SchedulerOutput

__all__ = ["RequestUpdate", "RunnerResult", "ScheduledRequest", "Scheduler", "SchedulerOutput"]


@dataclass
class _Step:
    """What one `schedule()` call has handed out so far."""

    budget: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    scheduled_ids: set[str] = field(default_factory=set)
    preempted: list[str] = field(default_factory=list)


DRAFT_SLOT = -1  # a planned draft the runner's draft model fills in


def _expected_accepted(acceptance: float, num_drafts: int, step_cost_s: float, draft_cost_s: float) -> float:
    """Expected accepted drafts of a proposal of `num_drafts` when each is accepted with
    `acceptance` given the ones before it were, counting only the drafts `plan_drafts` would
    verify for this request alone at these costs (so a proposer whose drafts would not pay is
    worth nothing, and another one gets the chance)."""
    expected, cost, gain, total = 1.0, step_cost_s, acceptance, 0.0
    for _ in range(num_drafts):
        if gain * cost <= expected * draft_cost_s:
            break
        total += gain
        expected += gain
        cost += draft_cost_s
        gain *= acceptance
    return total


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        batch_kv_occupancy_limit: float = 0.8,
        batch_max_prefill_tokens: int | None = None,
        batch_tokens_under_load: int = 4,
        batch_tokens_after_interactive: int | None = None,
        interactive_quiet_s: float = 2.0,
        batch_tokens_beside_interactive_prompt: int | None = None,
        max_loras: int = 0,
        share_prefix_cache_across_tenants: bool = False,
        speculation: SpeculationSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        head_kv: HeadKVCacheManager | None = None,
        eviction_interval: int = 0,
        eviction_window: int = 16,
        fair_share: FairShare | None = None,
        kv_hold_ttl_s: float | None = None,
        check_kv_integrity: bool = False,
        on_finish: Callable[[Request], None] | None = None,
    ) -> None:
        """`kv_hold_ttl_s`: held KV (`Request.hold_kv`) not collected this long is freed at the
        next `schedule()`. `check_kv_integrity`: `schedule()` leaves out requests holding a block
        whose generation changed (`SchedulerOutput.stale_request_ids`). `on_finish` is called with
        every request that finishes, whatever ends it (`finish_request` is the one path)."""
        self.kv = kv_manager
        self.kv_hold_ttl_s = kv_hold_ttl_s
        self.check_kv_integrity = check_kv_integrity
        self.on_finish = on_finish
        # Tenants' shares inside a priority class: order of service, seats and preemption.
        self.fair = fair_share or FairShare()
        # Compressed requests (`Request.compressed`) keep their KV here, per (layer, KV head),
        # instead of in `kv`; None: the engine runs no compressed request.
        self.head_kv = head_kv
        self._head_slots: dict[str, list[list[int]]] = {}  # appended this step, not yet handed out
        self._pending_moves: dict[str, tuple[list[int], list[int]]] = {}  # evictions to copy
        # Compressed requests admitted with a prefix-cache hit: tokens to copy from the shared
        # blocks they hold (in `kv`) into their heads, in their first step.
        self._prefix_copies: dict[str, int] = {}
        # After its context's eviction, a compressed request is evicted again every
        # `eviction_interval` decode steps (0: never), observed over the last `eviction_window`.
        self.eviction_interval = eviction_interval
        self.eviction_window = eviction_window
        self.num_compressed_evictions = 0  # evictions applied (contexts computed, and later ones)
        self.num_vectors_evicted = 0  # (layer, head, token) K/V vectors dropped by them
        # Prompt-lookup speculation (None: off): per request an n-gram index and its running
        # acceptance; the step cost model decides how many drafts a step verifies.
        self.speculation = speculation
        self.step_cost = StepCostModel()
        self._ngrams: dict[str, NgramIndex] = {}
        self.acceptance = (
            AcceptanceTracker(speculation.prompt_lookup_max, speculation.initial_acceptance, speculation.acceptance_smoothing)
            if speculation is not None
            else None
        )
        self._planned_drafts: dict[str, list[int]] = {}
        self._draft_match_len: dict[str, int] = {}  # request -> n-gram length behind its drafts
        self.num_draft_tokens_total = 0
        self.num_accepted_tokens_total = 0
        # Batch-priority requests fill idle capacity only: one is admitted while the KV cache,
        # counting its whole prompt, stays under this occupancy, and each batch prefill chunk is
        # capped so that a step holding interactive decodes stays short.
        self.batch_kv_occupancy_limit = batch_kv_occupancy_limit
        self.batch_max_prefill_tokens = batch_max_prefill_tokens or max(1, max_num_batched_tokens // 4)
        # While interactive requests run or wait, batch requests share this many tokens per step.
        self.batch_tokens_under_load = batch_tokens_under_load
        # For `interactive_quiet_s` after the last of them left, batch steps stay short (at most
        # `batch_tokens_after_interactive` batch tokens): a step in flight is what a newly
        # arrived interactive request waits for, and a full batch step is many times a short one.
        self.batch_tokens_after_interactive = batch_tokens_after_interactive
        self.interactive_quiet_s = interactive_quiet_s
        # A step that computes an interactive prompt chunk gives batch requests at most this many
        # tokens (None: `batch_tokens_under_load`). Batch rows beside a prompt lengthen exactly
        # the steps that make up its time to first token.
        self.batch_tokens_beside_interactive_prompt = batch_tokens_beside_interactive_prompt
        self.clock = clock
        self._last_interactive_at = float("-inf")
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
        self._ngrams.pop(request_id, None)
        self._draft_match_len.pop(request_id, None)
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
            max(0, r.num_prompt_tokens - max(r.num_computed_tokens, self._num_forked_tokens(r) if r.fork_of else 0))
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

    def _free_kv(self, request_id: str) -> None:
        """Give back a request's blocks, whichever layout holds them."""
        self.kv.free(request_id)
        if self.head_kv is not None:
            self.head_kv.free(request_id)
            self._head_slots.pop(request_id, None)
            self._pending_moves.pop(request_id, None)  # its blocks are free: nothing to copy
            self._prefix_copies.pop(request_id, None)

    def _allocate(self, request: Request, num_total_tokens: int, admission: bool = False) -> bool:
        """Room for the request's first `num_total_tokens` tokens in its layout (all-or-nothing).
        A compressed request appends the new ones to every head now, and its slots wait in
        `_head_slots` for `_schedule_one`."""
        if not request.compressed:
            return self.kv.allocate_slots(request.request_id, num_total_tokens, admission=admission)
        assert self.head_kv is not None, "a compressed request on an engine without a head-block pool"
        num_new = num_total_tokens - self.head_kv.num_appended.get(request.request_id, 0)
        if num_new <= 0:
            return True
        slots = self.head_kv.append_slots(request.request_id, num_new)
        if slots is None:
            return False
        self._head_slots[request.request_id] = slots
        return True

    def _victim_in_pool(self, request: Request) -> Request:
        """Whom to preempt when `request` needs blocks: among running requests whose blocks come
        from the same pool (preempting another pool's request frees nothing it can use), the
        lowest priority class, the tenant most over its share, its latest arrival."""
        same_pool = [r for r in self.running if r.compressed == request.compressed]
        return self.fair.victim(same_pool or self.running)

    def _schedule_one(
        self, request: Request, num_new: int, scheduled: list[ScheduledRequest], drafts: list[int] | None = None
    ) -> None:
        """Schedule `num_new` of the request's own tokens, then `drafts` (only when they reach its
        end; with a draft model, as many slots for the runner's own drafts)."""
        num_draft_slots = 0
        if drafts and drafts[0] == DRAFT_SLOT:
            num_draft_slots, drafts = len(drafts), None
        start = request.num_computed_tokens
        end = start + num_new
        is_new = request.request_id not in self._seen_by_runner
        self._seen_by_runner.add(request.request_id)
        token_ids = request.token_ids_slice(start, end)
        if drafts:
            token_ids = token_ids + drafts
        scheduled.append(
            ScheduledRequest(
                request_id=request.request_id,
                token_ids=token_ids,
                start_position=start,
                block_ids=[] if request.compressed else self.kv.block_table(request.request_id).block_ids,
                sample=end == request.num_tokens,
                sampling_params=request.sampling_params,
                output_token_ids=request.output_token_ids,
                is_new=is_new,
                lora_name=request.lora_name,
                draft_token_ids=list(drafts or []),
                num_draft_slots=num_draft_slots,
                prompt_token_ids=request.prompt_token_ids if num_draft_slots else [],
            )
        )
        if request.compressed:
            assert self.head_kv is not None
            item = scheduled[-1]
            tables = self.head_kv.head_tables(request.request_id)
            item.head_slots = self._head_slots.pop(request.request_id, [[] for _ in tables])
            copied = self._prefix_copies.pop(request.request_id, 0)
            if copied:  # its first appended tokens are the cached prefix: copied, not computed
                bs = self.kv.block_size
                shared = self.kv.block_table(request.request_id).block_ids
                item.prefix_src_slots = [shared[i // bs] * bs + i % bs for i in range(copied)]
                item.prefix_dst_head_slots = [slots[:copied] for slots in item.head_slots]
                item.head_slots = [slots[copied:] for slots in item.head_slots]
            item.head_block_ids = [list(t.block_ids) for t in tables]
            item.head_num_tokens = [t.num_tokens for t in tables]
            if not request.kv_evicted:  # the chunk that completes the context
                item.observe = item.evict = item.sample
            elif self.eviction_interval and item.sample:
                since = end - request.num_tokens_at_eviction  # this step's tokens included
                item.observe = since > self.eviction_interval - self.eviction_window
                item.evict = since >= self.eviction_interval
            item.kv_compression_rate = request.kv_compression_rate

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
        step = _Step(budget=self.max_num_batched_tokens)
        interactive_active = any(r.priority is Priority.INTERACTIVE for r in self.running) or bool(
            self.waiting and self.waiting[0].priority is Priority.INTERACTIVE
        )
        now = self.clock()
        if interactive_active:
            self._last_interactive_at = now
        batch_cap: int | None = None  # tokens batch requests share this step (None: the budget)
        if interactive_active:
            batch_cap = self.batch_tokens_under_load
        elif (
            self.batch_tokens_after_interactive is not None
            and now - self._last_interactive_at < self.interactive_quiet_s
        ):
            batch_cap = self.batch_tokens_after_interactive
        self._planned_drafts = self._plan_speculation(batch_cap) if self.speculation else {}
        for priority in Priority:
            if (
                priority is Priority.BATCH
                and self.batch_tokens_beside_interactive_prompt is not None
                and self._computes_interactive_prompt(step)
            ):
                beside = self.batch_tokens_beside_interactive_prompt
                batch_cap = beside if batch_cap is None else min(batch_cap, beside)
            cap = step.budget
            throttled = priority is Priority.BATCH and batch_cap is not None
            if priority is Priority.BATCH and batch_cap is not None:
                cap = min(cap, batch_cap)
            self._schedule_class(priority, step, cap, prompts_wait=throttled)

        finished_ids, self._finished_ids = self._finished_ids, []
        move_src: list[int] = []
        move_dst: list[int] = []
        for src, dst in self._pending_moves.values():
            move_src += src
            move_dst += dst
        self._pending_moves.clear()
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
        stale = self.kv.stale_requests(request_ids)
        if self.head_kv is not None:  # compressed requests' head blocks carry the same tags
            stale += self.head_kv.stale_requests([r for r in request_ids if r not in stale])
        return stale

    def _computes_interactive_prompt(self, step: _Step) -> bool:
        """Whether the step so far holds a chunk of an interactive request's prompt (not only
        decodes: a decoding request has computed all its tokens but the last)."""
        for item in step.scheduled:
            request = self.requests[item.request_id]
            if request.priority is Priority.INTERACTIVE and item.start_position < request.num_tokens - 1:
                return True
        return False

    def _plan_speculation(self, batch_cap: int | None) -> dict[str, list[int]]:
        """Draft tokens to verify this step, per running request that is decoding (its next
        token is the only one not computed) and may speculate: not opted out, no penalties (they
        depend on every earlier token), not seeded sampling (how many drafts a step verifies
        depends on measured time, and a seed promises the same tokens on every run), not a batch
        request while batch tokens are capped (`batch_cap`: interactive traffic), and room left
        under max_tokens and the context. How many each gets is `plan_drafts` on the measured step
        cost, of a step as it will be: throttled batch requests count for what they get."""
        assert self.speculation is not None and self.acceptance is not None
        settings = self.speculation
        self.acceptance.drift()
        candidates: list[DraftCandidate] = []
        decoding = [r for r in self.running if r.num_computed_tokens == r.num_tokens - 1]
        # Tokens this step computes before drafts: one per decoding request plus prompt chunks;
        # batch requests' share at most `batch_cap`.
        tokens = {priority: 0 for priority in Priority}
        rows = {priority: 0 for priority in Priority}
        for r in self.running:
            tokens[r.priority] += max(1, r.num_tokens - r.num_computed_tokens)
            rows[r.priority] += r.num_computed_tokens == r.num_tokens - 1
        if batch_cap is not None:
            tokens[Priority.BATCH] = min(tokens[Priority.BATCH], batch_cap)
            rows[Priority.BATCH] = min(rows[Priority.BATCH], batch_cap)
        num_decoding = sum(rows.values())
        step_tokens = min(self.max_num_batched_tokens, sum(tokens.values()))
        step_cost_s, draft_cost_s = self._draft_costs(num_decoding, step_tokens)
        for request in decoding:
            params = request.sampling_params
            if (
                not params.speculative
                or params.has_penalties
                or (params.seed is not None and not params.greedy)
                or (request.priority is Priority.BATCH and batch_cap is not None)
            ):
                continue
            # Accepted drafts plus the target's own token must fit max_tokens and the context.
            room = self.max_model_len - request.num_tokens - 1
            if params.max_tokens is not None:
                room = min(room, params.max_tokens - request.num_output_tokens - 1)
            if room <= 0:
                continue
            proposal: list[int] = []
            match_len = 0
            if settings.method in ("ngram", "both"):
                index = self._ngrams.get(request.request_id)
                if index is None:
                    index = NgramIndex(settings.prompt_lookup_min, settings.prompt_lookup_max)
                    index.extend(request.token_ids_slice(0, request.num_tokens))
                    self._ngrams[request.request_id] = index
                proposal, match_len = index.propose(min(room, settings.num_speculative_tokens))
            if settings.method in ("draft", "both"):
                # The runner's draft model proposes (plan slots), unless prompt lookup is expected
                # to yield more here (a long match while the request copies its prompt).
                slots = [DRAFT_SLOT] * min(room, settings.num_speculative_tokens)
                head = _expected_accepted(self.acceptance.estimate(0), len(slots), step_cost_s, draft_cost_s)
                lookup = _expected_accepted(
                    self.acceptance.estimate(match_len), len(proposal), step_cost_s, draft_cost_s
                )
                if head > lookup or (head == lookup and not proposal):
                    proposal, match_len = slots, 0
            if proposal:
                self._draft_match_len[request.request_id] = match_len
                candidates.append(DraftCandidate(request.request_id, proposal, self.acceptance.estimate(match_len)))
        if not candidates:
            return {}
        planned = plan_drafts(
            candidates,
            step_cost_s=step_cost_s,
            step_yield=num_decoding,
            draft_cost_s=draft_cost_s,
            max_draft_tokens=self.max_num_batched_tokens - step_tokens,
        )
        return {c.request_id: c.proposal[: planned[c.request_id]] for c in candidates if c.request_id in planned}

    def _draft_costs(self, num_decoding: int, step_tokens: int) -> tuple[float, float]:
        """(the step's predicted wall time without drafts, what one more draft row adds) from the
        measured step costs; for a decode-only step, from decode-only steps where they have been
        seen at different sizes."""
        fixed_s, per_token_s, per_row_s = self.step_cost.coefficients()
        decode_fit = self.step_cost.decode_coefficients()
        if decode_fit is not None and step_tokens == num_decoding:
            return decode_fit[0] + decode_fit[1] * num_decoding, decode_fit[1]
        return fixed_s + per_token_s * step_tokens + per_row_s * num_decoding, per_token_s + per_row_s

    def _chunk(self, request: Request, cap: int) -> int:
        num_new = min(request.num_tokens - request.num_computed_tokens, cap)
        if request.priority is Priority.BATCH:
            num_new = min(num_new, self.batch_max_prefill_tokens)
        return num_new

    def _schedule_class(self, priority: Priority, step: _Step, cap: int, prompts_wait: bool = False) -> None:
        """One priority class within `cap` tokens: first its decoding requests (one token each,
        plus drafts), then its running prompts' chunks and its waiting requests' admissions in
        one fair order (`FairShare.order`), so a tenant's long prompt shares the budget with
        another tenant's newly arrived one instead of going first. With `prompts_wait` (throttled
        batch tokens) running prompts' chunks come before admissions (the few tokens go to work
        already started: decodes first, so a step of decodes only stays small and fast)."""
        running = [r for r in self.running if r.priority is priority]
        decoding = [r for r in running if r.num_computed_tokens >= r.num_tokens - 1]
        prompting = [r for r in running if r.num_computed_tokens < r.num_tokens - 1]
        waiting = [r for r in self.waiting if r.priority is priority and self._may_start(r)]
        if prompts_wait:
            cap = self._schedule_running(self.fair.order(decoding, self._num_uncomputed), step, cap)
            cap = self._schedule_running(self.fair.order(prompting, self._num_uncomputed), step, cap)
            self._admit_waiting(self.fair.order(waiting, self._num_uncomputed), step, cap)
            return
        queue = self.fair.order(sorted(prompting + waiting, key=Request.sort_key), self._num_uncomputed)
        if priority is Priority.INTERACTIVE and self._prompt_first(decoding, queue, step, cap):
            return
        cap = self._schedule_running(self.fair.order(decoding, self._num_uncomputed), step, cap)
        self._admit_waiting(queue, step, cap)

    def _may_start(self, request: Request) -> bool:
        """False for a parallel-sampling choice whose leader is still computing the prompt it will
        share (`Request.fork_of`); a choice whose leader is gone forgets it and starts alone."""
        if request.fork_of is None:
            return True
        leader = self.requests.get(request.fork_of)
        if leader is None or leader.status.is_finished:
            request.fork_of = None
            return True
        return leader.status is RequestStatus.RUNNING and leader.num_computed_tokens >= self._num_forked_tokens(
            request
        )

    def _num_forked_tokens(self, request: Request) -> int:
        """Tokens of the prompt a choice shares with its leader: its full blocks, leaving at least
        one token to compute (the choice samples its own first token from its logits)."""
        return (request.num_prompt_tokens - 1) // self.kv.block_size * self.kv.block_size

    def _prompt_first(self, decoding: list[Request], queue: list[Request], step: _Step, cap: int) -> bool:
        """A step of its own for a lighter tenant's short new prompt: when a waiting request's
        whole prompt fits this step and a seat is free, and other tenants hold more running
        requests per weight (`FairShare.heavier_tenants`), prompts and admissions go first (the
        decoders' tokens held in reserve); if such a request was admitted, the heavier tenants'
        decodes sit out this step. `queue`: the class's running prompts and waiting requests in
        fair order. Returns whether it scheduled the class (False: nothing to do)."""
        if len(self.running) >= self.max_num_seqs:
            return False
        reserve = len(decoding)
        newcomers = [
            r
            for r in queue
            if r.status is not RequestStatus.RUNNING and r.num_tokens - r.num_computed_tokens <= cap - reserve
        ]
        interactive = [r for r in self.running if r.priority is Priority.INTERACTIVE]
        heavier = self.fair.heavier_tenants(interactive, newcomers)  # batch work is no weight here
        if not heavier or all(r.tenant_id in heavier for r in newcomers):
            return False
        first = len(step.scheduled)
        cap = self._admit_waiting(queue, step, cap - reserve) + reserve
        started = any(
            item.is_new and item.sample and self.requests[item.request_id].tenant_id not in heavier
            for item in step.scheduled[first:]
        )
        if started:
            decoding = [r for r in decoding if r.tenant_id not in heavier]
        self._schedule_running(self.fair.order(decoding, self._num_uncomputed), step, cap)
        return True

    def _schedule_running(self, candidates: list[Request], step: _Step, cap: int) -> int:
        """Schedule these running requests, in this order, within `cap` tokens; when blocks run
        out, preempt (`_victim_in_pool`: lowest priority, tenant most over its share, latest
        arrival). Returns what is left of `cap`."""
        for request in candidates:
            if cap <= 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted for an earlier one
                continue
            num_new = self._chunk(request, cap)
            drafts = self._planned_drafts.get(request.request_id, [])
            if drafts and request.num_computed_tokens + num_new == request.num_tokens:
                drafts = drafts[: max(0, cap - num_new)]
            else:
                drafts = []
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

    def _admit_waiting(self, candidates: list[Request], step: _Step, cap: int) -> int:
        """Admit waiting requests of one class, in this order, within `cap` tokens,
        `max_num_seqs` and free blocks; running requests among `candidates` (prompts) get their
        next chunk at their place. A waiting request may preempt a running one of lower priority,
        or, for a seat or for room, one of its own class whose tenant is over its share while its
        own tenant is under. Admission stops for the step when memory is tight (a running request
        had to be preempted, or a request found no room). Returns what is left of `cap`."""
        active_loras = {r.lora_name for r in self.running if r.lora_name is not None}
        admitting = not step.preempted  # memory is tight when running requests had to be preempted
        position = 0  # requests before it wait for a LoRA slot or a seat; later ones may go ahead
        seatless: set[str | None] = set()  # tenants found at their seat share while full
        while position < len(candidates) and cap > 0:
            request = candidates[position]
            if request.status is RequestStatus.RUNNING:  # a prompt's next chunk
                num_preempted = len(step.preempted)
                cap = self._schedule_running([request], step, cap)
                admitting = admitting and len(step.preempted) == num_preempted
                position += 1
                continue
            if not admitting or request.request_id in step.preempted:
                position += 1
                continue
            if len(self.running) >= self.max_num_seqs:
                # Full: a request of higher priority than some running one takes its seat (an
                # interactive request never waits for batch requests, which are throttled while it
                # waits, to finish); so does one whose tenant is under its share of the seats.
                victim = None
                if request.tenant_id not in seatless:
                    victim = self._lower_priority_victim(request) or self.fair.seat_victim(
                        request, self.running, self.max_num_seqs
                    )
                if victim is None:
                    seatless.add(request.tenant_id)
                    position += 1  # another tenant's request may still be under its share
                    continue
                self._preempt_in_step(victim, step)
                active_loras = {r.lora_name for r in self.running if r.lora_name is not None}
                continue
            if request.priority is Priority.BATCH and not self._batch_has_room(request):
                admitting = False
                continue
            lora = request.lora_name
            if lora is not None and lora not in active_loras and len(active_loras) >= self.max_loras:
                position += 1  # every LoRA slot is taken by running requests' adapters
                continue
            if request.num_computed_tokens == 0 and request.request_id not in self.kv.tables:
                if not self._may_start(request):  # its leader was preempted in this step
                    position += 1
                    continue
                self._take_prefix(request)
            num_new = self._chunk(request, cap)
            total = request.num_computed_tokens + num_new
            if not self._allocate(request, total, admission=True):
                victim = self._lower_priority_victim(request, same_pool=True) or self.fair.seat_victim(
                    request, (r for r in self.running if r.compressed == request.compressed), self.max_num_seqs
                )
                if victim is None:
                    self._free_kv(request.request_id)  # give back any prefix-cache hits
                    request.num_computed_tokens = 0
                    admitting = False
                    continue
                self._preempt_in_step(victim, step)
                active_loras = {r.lora_name for r in self.running if r.lora_name is not None}
                continue
            self.waiting.remove(request)
            candidates.pop(position)
            request.fork_of = None  # it holds its blocks now; a preemption recomputes it alone
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=Request.sort_key)
            if lora is not None:
                active_loras.add(lora)
            self._schedule_one(request, num_new, step.scheduled)
            step.scheduled_ids.add(request.request_id)
            step.budget -= num_new
            cap -= num_new
        return cap

    def _take_prefix(self, request: Request) -> None:
        """Before admission: the computed tokens a request starts with, as blocks it shares. A
        parallel-sampling choice shares its leader's full prompt blocks; any other request takes
        what the prefix cache holds of its tokens (a compressed request copies the cached prefix
        into its own heads, and leaves at least the observation window to compute, whose queries
        score its tokens)."""
        if request.fork_of is not None:
            num_blocks = self._num_forked_tokens(request) // self.kv.block_size
            request.num_computed_tokens = self.kv.fork(request.request_id, request.fork_of, num_blocks)
            request.num_cached_tokens = request.num_computed_tokens
            return
        lookup_tokens = request.num_tokens
        if request.compressed:
            lookup_tokens = max(1, request.num_tokens - self.eviction_window + 1)
        cached = self.kv.allocate_cached_prefix(
            request.request_id, lookup_tokens, request.token_ids_slice, self.cache_salt(request)
        )
        request.num_computed_tokens = cached
        if request.num_preemptions == 0:
            request.num_cached_tokens = cached
        if request.compressed and cached:
            self._prefix_copies[request.request_id] = cached

    def _preempt_in_step(self, request: Request, step: _Step) -> int:
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

    def _batch_has_room(self, request: Request) -> bool:
        if request.compressed and self.head_kv is not None:
            pool = self.head_kv.pool
            done = self.head_kv.num_appended.get(request.request_id, 0)
            need = self.head_kv.num_new_blocks_needed(request.request_id, request.num_tokens - done)
        else:
            pool = self.kv.pool
            need = self.kv.num_new_blocks_needed(request.request_id, request.num_tokens)
        if pool.num_used_blocks == 0:
            return True  # alone it always runs, however long its prompt
        return pool.num_used_blocks + need <= self.batch_kv_occupancy_limit * pool.num_blocks

    def _lower_priority_victim(self, request: Request, same_pool: bool = False) -> Request | None:
        """A running request of strictly lower priority, if any: of the lowest class, the tenant
        most over its share, its latest arrival (with `same_pool`, only one whose blocks
        `request` could use: the same KV layout)."""
        lower = [
            r
            for r in self.running
            if r.priority > request.priority and (not same_pool or r.compressed == request.compressed)
        ]
        return self.fair.victim(lower) if lower else None

    # -- applying the runner's result ----------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, result: RunnerResult) -> list[RequestUpdate]:
        """Apply the runner's tokens: each request's computed count advances past its own tokens
        and its accepted drafts only (rejected drafts' slots are rewritten later and never cached),
        then its new tokens are appended one by one until one of them stops it. The step's cost
        (`result.wall_s`) feeds the speculation's step-cost model."""
        num_rows = sum(1 + s.num_draft_tokens for s in output.scheduled if s.sample)
        self.step_cost.observe(output.num_scheduled_tokens, num_rows, result.wall_s)
        updates: list[RequestUpdate] = []
        for item in output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None:  # finished while the step ran (abort)
                continue
            self.fair.charge(request, len(item.token_ids) + item.num_draft_slots)
            if item.prefix_src_slots:  # copied into its heads: the shared blocks go back
                self.kv.free(item.request_id)
            kept = result.kept_tokens.get(item.request_id)
            if kept is not None and self.head_kv is not None and request.compressed:
                self._apply_eviction(request, item, kept)
            token_ids = result.sampled_token_ids.get(item.request_id) or []
            num_drafts = item.num_draft_tokens
            num_accepted = min(max(0, len(token_ids) - 1), num_drafts)
            if num_drafts:
                self._record_acceptance(request.request_id, num_drafts, num_accepted)
            if not token_ids:  # a prefill chunk short of the prompt's end (never has drafts)
                before = request.num_computed_tokens
                request.num_computed_tokens += len(item.token_ids)
                self._maybe_cache(request, before)
                continue
            logprobs = result.logprobs.get(item.request_id)
            updates.append(self._append_tokens(request, token_ids[: num_accepted + 1], logprobs))
        return updates

    def add_handed_over(self, request: Request, first_token_id: int) -> RequestUpdate:
        """Admit a request whose prompt KV another engine computed, its blocks allocated and filled
        (`num_computed_tokens` = its prompt), with the first token that engine sampled: the token
        goes through the same stop checks and bookkeeping as a token sampled here."""
        self.add_running(request)
        return self._append_tokens(request, [first_token_id], None)

    def _append_tokens(
        self, request: Request, token_ids: list[int], logprobs: list[dict[int, float]] | None
    ) -> RequestUpdate:
        """Append a request's new tokens until one of them stops it; every token but the newest
        now has its KV written (this step's own tokens and accepted drafts; a stop inside the
        accepted drafts ends the request there)."""
        before = request.num_computed_tokens
        new_tokens: list[int] = []
        status: RequestStatus | None = None
        for token_id in token_ids:
            request.output_token_ids.append(token_id)
            new_tokens.append(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                break
        request.num_computed_tokens = request.num_tokens - 1
        self.num_output_tokens_total[request.priority] += len(new_tokens)
        self._maybe_cache(request, before)
        index = self._ngrams.get(request.request_id)
        if index is not None:
            index.extend(new_tokens)
        if status is not None:
            self.finish_request(request.request_id, status)
        return RequestUpdate(
            request=request,
            new_token_ids=new_tokens,
            new_logprobs=logprobs[: len(new_tokens)] if logprobs is not None else None,
            finished=status is not None,
        )

    def _apply_eviction(self, request: Request, item: ScheduledRequest, kept: list[list[int]]) -> None:
        """What each head of a compressed request keeps (the runner's plan): the moves are copied
        before the next step writes anything."""
        assert self.head_kv is not None
        held = sum(self.head_kv.num_tokens(request.request_id))
        moves = self.head_kv.evict(request.request_id, kept)
        self.num_compressed_evictions += 1
        self.num_vectors_evicted += held - sum(len(k) for k in kept)
        self._pending_moves[request.request_id] = (moves.src_slots, moves.dst_slots)
        request.kv_evicted = True
        request.num_tokens_at_eviction = item.start_position + len(item.token_ids)

    def _maybe_cache(self, request: Request, computed_before: int) -> None:
        """Publish blocks that this step filled with computed tokens to the prefix cache."""
        if computed_before // self.kv.block_size != request.num_computed_tokens // self.kv.block_size:
            self.kv.cache_full_blocks(
                request.request_id,
                request.token_ids_slice,
                request.num_computed_tokens,
                self.cache_salt(request),
            )

    def _record_acceptance(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        assert self.acceptance is not None
        self.acceptance.record(self._draft_match_len.get(request_id, 1), num_drafts, num_accepted)
        self.num_draft_tokens_total += num_drafts
        self.num_accepted_tokens_total += num_accepted

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if not params.ignore_eos and token_id in request.eos_token_ids:
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len  # None: the context
        if request.num_output_tokens >= max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        if self.head_kv is not None:
            self.head_kv.check_integrity()
            assert set(self.head_kv.tables) <= set(self.requests) | set(self.held), "orphan head tables"
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
            if request.compressed:
                assert self.head_kv is not None and request.request_id not in self.kv.tables
                assert self.head_kv.num_appended[request.request_id] >= request.num_computed_tokens
                continue
            table = self.kv.tables.get(request.request_id)
            need = self.kv.num_blocks_for(request.num_computed_tokens)
            assert table is not None and len(table.block_ids) >= need, request.request_id
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            if request.num_computed_tokens == 0:
                assert request.request_id not in self.kv.tables, "waiting request holds blocks"
                assert self.head_kv is None or request.request_id not in self.head_kv.tables
