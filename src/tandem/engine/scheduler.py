"""Token-budget scheduler (no torch).

One scheduling model, as in vLLM v1: each request has `num_computed_tokens`; each step hands out
`num_scheduled_tokens` per request against `max_num_batched_tokens`. A prompt is computed in
chunks when the budget is short, decodes (one token) and prefill chunks share a batch, and a
preempted request simply restarts from `num_computed_tokens = 0` (recompute).

Order of service, per priority class (`interactive`, then `batch`): the class's running
requests (by arrival), then its waiting ones; so a waiting interactive request gets tokens before
any batch request does. When a running request needs a block and none is free, the
lowest-priority, latest-arriving running request is preempted. Batch requests fill idle capacity
only: one is admitted while the KV cache stays under `batch_kv_occupancy_limit` with its whole
prompt counted, its prefill chunks are capped at `batch_max_prefill_tokens`, and while any
interactive request runs or waits all batch requests together get at most
`batch_tokens_under_load` tokens per step (the others keep their KV and wait a step).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from tandem.engine.kv_cache import KVCacheManager
from tandem.engine.request import Priority, Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of a step. Lists are the scheduler's own (read-only for the runner)."""

    request_id: str
    token_ids: list[int]  # the tokens whose KV this step computes, positions start..start+len
    start_position: int  # == num_computed_tokens before the step
    block_ids: list[int]  # the request's whole block table (covers start_position + len tokens)
    sample: bool  # True when this chunk reaches the sequence end: sample the next token
    sampling_params: SamplingParams
    output_token_ids: list[int]  # generated so far (penalties)
    is_new: bool  # first time the runner sees this request (or first time since preemption)
    lora_name: str | None = None  # LoRA adapter of this request, if any


@dataclass
class _Step:
    """What one `schedule()` call has handed out so far."""

    budget: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    scheduled_ids: set[str] = field(default_factory=set)
    preempted: list[str] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # batch order; token rows are concatenated in this order
    num_scheduled_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # freed since the last step

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RequestUpdate:
    """What one step did to one request, for the output processor."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finished: bool


@dataclass
class RunnerResult:
    """The runner's answer for one step: request_id -> sampled token (and its logprobs), and the
    requests it could not compute (the engine ends those with an error; the others go on)."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # request_id -> why it failed (client-safe)
    forward_failed: bool = False  # the model pass raised for every request of the step, each alone

    def merge(self, other: RunnerResult) -> None:
        """Add `other`'s requests (a part of the same step, computed separately)."""
        self.sampled_token_ids.update(other.sampled_token_ids)
        self.logprobs.update(other.logprobs)
        self.failed.update(other.failed)


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
        max_loras: int = 0,
        share_prefix_cache_across_tenants: bool = False,
    ) -> None:
        self.kv = kv_manager
        # Batch-priority requests fill idle capacity only: one is admitted while the KV cache,
        # counting its whole prompt, stays under this occupancy, and each batch prefill chunk is
        # capped so that a step holding interactive decodes stays short.
        self.batch_kv_occupancy_limit = batch_kv_occupancy_limit
        self.batch_max_prefill_tokens = batch_max_prefill_tokens or max(1, max_num_batched_tokens // 4)
        # While interactive requests run or wait, batch requests share this many tokens per step.
        self.batch_tokens_under_load = batch_tokens_under_load
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
        self._seen_by_runner: set[str] = set()
        self.num_preemptions_total = 0

    # -- queue management ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=Request.sort_key)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Stop a request (abort, stop string, error); its blocks are free when this returns."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request_id)
        self._forget(request_id)
        return request

    def _forget(self, request_id: str) -> None:
        if request_id in self._seen_by_runner:
            self._seen_by_runner.discard(request_id)
            self._finished_ids.append(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- scheduling ---------------------------------------------------------------------
    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        if victim.request_id in self._seen_by_runner:
            self._seen_by_runner.discard(victim.request_id)
        bisect.insort(self.waiting, victim, key=Request.sort_key)

    def _schedule_one(self, request: Request, num_new: int, scheduled: list[ScheduledRequest]) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        is_new = request.request_id not in self._seen_by_runner
        self._seen_by_runner.add(request.request_id)
        scheduled.append(
            ScheduledRequest(
                request_id=request.request_id,
                token_ids=request.token_ids_slice(start, end),
                start_position=start,
                block_ids=self.kv.block_table(request.request_id).block_ids,
                sample=end == request.num_tokens,
                sampling_params=request.sampling_params,
                output_token_ids=request.output_token_ids,
                is_new=is_new,
                lora_name=request.lora_name,
            )
        )

    def schedule(self) -> SchedulerOutput:
        """One step: per priority class (interactive, then batch), first its running requests,
        then its waiting ones; so a waiting interactive request is admitted before any batch
        request gets tokens. While interactive requests exist, batch requests share at most
        `batch_tokens_under_load` tokens per step (the rest keep their KV and wait)."""
        step = _Step(budget=self.max_num_batched_tokens)
        interactive_active = any(r.priority is Priority.INTERACTIVE for r in self.running) or bool(
            self.waiting and self.waiting[0].priority is Priority.INTERACTIVE
        )
        for priority in Priority:
            cap = step.budget
            if priority is Priority.BATCH and interactive_active:
                cap = min(cap, self.batch_tokens_under_load)
            cap = self._schedule_running(priority, step, cap)
            if not step.preempted:  # memory is tight when running requests had to be preempted
                self._admit_waiting(priority, step, cap)

        finished_ids, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            scheduled=step.scheduled,
            num_scheduled_tokens=self.max_num_batched_tokens - step.budget,
            preempted_request_ids=step.preempted,
            finished_request_ids=finished_ids,
        )

    def _chunk(self, request: Request, cap: int) -> int:
        num_new = min(request.num_tokens - request.num_computed_tokens, cap)
        if request.priority is Priority.BATCH:
            num_new = min(num_new, self.batch_max_prefill_tokens)
        return num_new

    def _schedule_running(self, priority: Priority, step: _Step, cap: int) -> int:
        """Schedule running requests of `priority` (arrival order) within `cap` tokens; preempt
        from the back of `running` (lowest priority, latest arrival) when blocks run out.
        Returns what is left of `cap`."""
        index = next((i for i, r in enumerate(self.running) if r.priority is priority), len(self.running))
        while index < len(self.running) and self.running[index].priority is priority and cap > 0:
            request = self.running[index]
            num_new = self._chunk(request, cap)
            while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim)
                step.preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                self._schedule_one(request, num_new, step.scheduled)
                step.scheduled_ids.add(request.request_id)
                step.budget -= num_new
                cap -= num_new
                index += 1
                continue
            # `request` itself was preempted; the list shifted, `index` already points past it.
        return cap

    def _admit_waiting(self, priority: Priority, step: _Step, cap: int) -> None:
        """Admit waiting requests of `priority` (arrival order) within `cap` tokens, `max_num_seqs`
        and free blocks; a waiting request may preempt a running one of lower priority."""
        active_loras = {r.lora_name for r in self.running if r.lora_name is not None}
        position = 0  # requests before it wait for a LoRA slot; later ones may still go ahead
        while (
            position < len(self.waiting)
            and self.waiting[position].priority is priority
            and cap > 0
            and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting[position]
            if priority is Priority.BATCH and not self._batch_has_room(request):
                break
            lora = request.lora_name
            if lora is not None and lora not in active_loras and len(active_loras) >= self.max_loras:
                position += 1  # every LoRA slot is taken by running requests' adapters
                continue
            if request.num_computed_tokens == 0 and request.request_id not in self.kv.tables:
                cached = self.kv.allocate_cached_prefix(
                    request.request_id, request.num_tokens, request.token_ids_slice, self._cache_salt(request)
                )
                request.num_computed_tokens = cached
                if request.num_preemptions == 0:
                    request.num_cached_tokens = cached
            num_new = self._chunk(request, cap)
            total = request.num_computed_tokens + num_new
            if not self.kv.allocate_slots(request.request_id, total, admission=True):
                lower = self._lower_priority_victim(request)
                if lower is None:
                    self.kv.free(request.request_id)  # give back any prefix-cache hits
                    request.num_computed_tokens = 0
                    break
                if lower.request_id in step.scheduled_ids:  # give back its share of this step
                    index = next(i for i, s in enumerate(step.scheduled) if s.request_id == lower.request_id)
                    returned = len(step.scheduled.pop(index).token_ids)
                    step.budget += returned
                    step.scheduled_ids.discard(lower.request_id)
                self._preempt(lower)
                step.preempted.append(lower.request_id)
                active_loras = {r.lora_name for r in self.running if r.lora_name is not None}
                continue
            self.waiting.pop(position)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=Request.sort_key)
            if lora is not None:
                active_loras.add(lora)
            self._schedule_one(request, num_new, step.scheduled)
            step.scheduled_ids.add(request.request_id)
            step.budget -= num_new
            cap -= num_new

    def _cache_salt(self, request: Request) -> tuple[str | None, str | None]:
        """What besides the tokens keys a cached block: the adapter, and the tenant unless
        tenants are configured to share cached prefixes."""
        tenant = None if self.share_prefix_cache_across_tenants else request.tenant_id
        return (request.lora_name, tenant)

    def _batch_has_room(self, request: Request) -> bool:
        pool = self.kv.pool
        need = self.kv.num_new_blocks_needed(request.request_id, request.num_tokens)
        if pool.num_used_blocks == 0:
            return True  # alone it always runs, however long its prompt
        return pool.num_used_blocks + need <= self.batch_kv_occupancy_limit * pool.num_blocks

    def _lower_priority_victim(self, request: Request) -> Request | None:
        """The running request of strictly lower priority that arrived last, if any."""
        for candidate in reversed(self.running):
            if candidate.priority > request.priority:
                return candidate
        return None

    # -- applying the runner's result ----------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, result: RunnerResult) -> list[RequestUpdate]:
        updates: list[RequestUpdate] = []
        for item in output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None:  # finished while the step ran (abort)
                continue
            before = request.num_computed_tokens
            request.num_computed_tokens += len(item.token_ids)
            if before // self.kv.block_size != request.num_computed_tokens // self.kv.block_size:
                self.kv.cache_full_blocks(
                    request.request_id,
                    request.token_ids_slice,
                    request.num_computed_tokens,
                    self._cache_salt(request),
                )
            token_id = result.sampled_token_ids.get(item.request_id)
            if token_id is None:
                continue
            request.output_token_ids.append(token_id)
            status = self._check_stop(request, token_id)
            logprobs = result.logprobs.get(item.request_id)
            if status is not None:
                self.finish_request(request.request_id, status)
            updates.append(
                RequestUpdate(
                    request=request,
                    new_token_ids=[token_id],
                    new_logprobs=[logprobs] if logprobs is not None else None,
                    finished=status is not None,
                )
            )
        return updates

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
        live = {r.request_id for r in self.running} | {r.request_id for r in self.waiting}
        assert live == set(self.requests), "queues disagree with the request map"
        assert len(self.running) + len(self.waiting) == len(self.requests), "request in two queues"
        assert len(self.running) <= self.max_num_seqs
        num_loras = len({r.lora_name for r in self.running if r.lora_name is not None})
        assert num_loras <= self.max_loras, "more running adapters than LoRA slots"
        for request in self.running:
            assert request.status is RequestStatus.RUNNING
            assert request.num_computed_tokens <= request.num_tokens
            table = self.kv.tables.get(request.request_id)
            need = self.kv.num_blocks_for(request.num_computed_tokens)
            assert table is not None and len(table.block_ids) >= need, request.request_id
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            if request.num_computed_tokens == 0:
                assert request.request_id not in self.kv.tables, "waiting request holds blocks"
