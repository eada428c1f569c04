"""Applying a step's results to the scheduler's requests (no torch): `StepUpdates`.

It takes the runner's tokens: computed counts advance past each request's own tokens and its
accepted drafts only, full blocks are published to the prefix cache, tokens are appended until
one stops the request (the scheduler's `finish_request`, the one path every finish takes),
evictions of compressed requests are recorded, and the step's cost feeds the speculation planner.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.engine.request import Priority, Request, RequestStatus
from tandem.engine.sched.queues import RequestQueues
from tandem.engine.sched.step import RequestUpdate, RunnerResult, ScheduledRequest, SchedulerOutput
from tandem.engine.spec.planner import SpeculationPlanner


class StepUpdates:
    def __init__(
        self,
        queues: RequestQueues,
        speculation: SpeculationPlanner,
        *,
        max_model_len: int,
        finish: Callable[[str, RequestStatus], Request | None],
    ) -> None:
        """`finish`: the scheduler's `finish_request` (a token that stops a request ends it there)."""
        self.queues = queues
        self.speculation = speculation
        self.max_model_len = max_model_len
        self.finish = finish
        self.block_size = queues.shared.block_size  # a cached block's tokens (`maybe_cache`)
        # Tokens appended to requests' outputs, per priority class (batch progress is visible
        # while real-time traffic runs).
        self.num_output_tokens_total = {priority: 0 for priority in Priority}

    def update_from_output(self, output: SchedulerOutput, result: RunnerResult) -> list[RequestUpdate]:
        """Apply the runner's tokens: each request's computed count advances past its own tokens
        and its accepted drafts only (rejected drafts' slots are rewritten later and never cached),
        then its new tokens are appended one by one until one of them stops it. The step's cost
        (`result.wall_s`) feeds the speculation's step-cost model, its generated tokens the
        speculation guard."""
        num_rows = sum(1 + s.num_draft_tokens for s in output.scheduled if s.sample)
        self.speculation.step_cost.observe(output.num_scheduled_tokens, num_rows, result.wall_s)
        updates: list[RequestUpdate] = []
        charged: list[tuple[Request, int]] = []
        num_generated = 0
        requests, sampled, windowed = (
            self.queues.requests,
            result.sampled_token_ids,
            self.queues.shared.windowed,
        )
        for item in output.scheduled:
            request = requests.get(item.request_id)
            if request is None:  # finished while the step ran (abort)
                continue
            charged.append((request, len(item.token_ids) + item.num_draft_slots))
            if item.head is not None and item.head.prefix_src_slots:  # copied into its heads
                self.queues.shared.free(item.request_id)  # the shared blocks go back
            if item.embed:
                embedded = self.pooled(request, item, result)
                if embedded is not None:
                    updates.append(embedded)
                continue
            if result.kept_tokens and request.compressed:
                self._evict(request, item, result)
            token_ids = sampled.get(item.request_id) or []
            num_drafts = item.num_draft_tokens
            num_accepted = min(max(0, len(token_ids) - 1), num_drafts)
            if num_drafts:
                self.speculation.record(request.request_id, num_drafts, num_accepted)
                request.num_accepted_draft_tokens += num_accepted
            if not token_ids:  # a prefill chunk short of the prompt's end (never has drafts)
                before = request.num_computed_tokens
                request.num_computed_tokens += len(item.token_ids)
                self.maybe_cache(request, before)
                self.release_outside_window(request)
                continue
            logprobs = result.logprobs.get(item.request_id) if result.logprobs else None
            num_generated += num_accepted + 1
            update = self.append_tokens(request, token_ids[: num_accepted + 1], logprobs)
            if windowed and not update.finished:
                self.release_outside_window(request)
            updates.append(update)
        self.queues.fair.charge_step(charged)
        self.speculation.end_step(num_generated)
        return updates

    def _evict(self, request: Request, item: ScheduledRequest, result: RunnerResult) -> None:
        """A compressed request's eviction, when the runner returned what its heads keep."""
        kept = result.kept_tokens.get(item.request_id)
        if kept is not None and self.queues.head_layout is not None:
            self.queues.head_layout.apply_eviction(request, item, kept)

    def apply_filled(
        self,
        output: SchedulerOutput,
        result: RunnerResult,
        ending: dict[str, RequestStatus | None],
    ) -> list[RequestUpdate]:
        """The rest of `update_from_output` for a step whose tokens are in place already and whose
        requests' computed counts have moved on (`in_flight.InFlightStep.fill`; no drafts, no
        compressed or embedding requests): fair shares, the prefix cache, the window, and the
        requests whose token stopped them (`ending`) finish. Returns the same updates."""
        updates: list[RequestUpdate] = []
        charged: list[tuple[Request, int]] = []
        requests, sampled, all_logprobs = self.queues.requests, result.sampled_token_ids, result.logprobs
        windowed = self.queues.shared.windowed  # else releasing outside the window is a no-op
        num_rows = 0
        num_output_tokens = dict.fromkeys(Priority, 0)
        for item in output.scheduled:
            num_rows += item.sample
            request = requests.get(item.request_id)
            if request is None:  # finished meanwhile (abort, a stop string, a failure)
                continue
            charged.append((request, len(item.token_ids)))
            self.maybe_cache(request, item.start_position)  # the step's items start where their requests were
            token_ids = sampled.get(item.request_id) if item.sample else None
            if not token_ids:
                if windowed:
                    self.release_outside_window(request)
                continue
            status = ending.get(item.request_id) if ending else None
            num_output_tokens[request.priority] += 1
            if status is not None:
                self.finish(request.request_id, status)
            elif windowed:
                self.release_outside_window(request)
            logprobs = all_logprobs.get(item.request_id) if all_logprobs else None
            new_logprobs = logprobs[:1] if logprobs is not None else None
            updates.append(RequestUpdate(request, token_ids[:1], new_logprobs, status is not None))
        self.queues.fair.charge_step(charged)
        for priority, num_tokens in num_output_tokens.items():
            self.num_output_tokens_total[priority] += num_tokens
        self.speculation.step_cost.observe(output.num_scheduled_tokens, num_rows, result.wall_s)
        return updates

    def pooled(self, request: Request, item: ScheduledRequest, result: RunnerResult) -> RequestUpdate | None:
        """An embedding request's step: its prompt chunk is computed (never published to the prefix
        cache: nothing of it is kept); at the prompt's end it finishes with the pooled state."""
        request.num_computed_tokens += len(item.token_ids)
        embedding = result.embeddings.get(item.request_id)
        if embedding is None:
            return None
        request.embedding = embedding
        self.finish(request.request_id, RequestStatus.FINISHED_STOPPED)
        return RequestUpdate(request=request, new_token_ids=[], new_logprobs=None, finished=True)

    def add_handed_over(self, request: Request, first_token_id: int) -> RequestUpdate:
        """Admit a request whose prompt KV another engine computed, its blocks allocated and filled
        (`num_computed_tokens` = its prompt), with the first token that engine sampled: the token
        goes through the same stop checks and bookkeeping as a token sampled here."""
        self.queues.add(request, RequestStatus.RUNNING)
        return self.append_tokens(request, [first_token_id], None)

    def append_tokens(
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
            status = self.check_stop(request, token_id)
            if status is not None:
                break
        request.num_computed_tokens = request.num_tokens - 1
        self.num_output_tokens_total[request.priority] += len(new_tokens)
        self.maybe_cache(request, before)
        self.speculation.extend(request.request_id, new_tokens)
        if status is not None:
            self.finish(request.request_id, status)
        return RequestUpdate(
            request=request,
            new_token_ids=new_tokens,
            new_logprobs=logprobs[: len(new_tokens)] if logprobs is not None else None,
            finished=status is not None,
        )

    def release_outside_window(self, request: Request) -> None:
        """Give back the blocks no query of the request can read again (a sliding-window model's;
        `KVCacheManager.release_outside_window`), except for a prefill whose KV waits to be exported
        whole (`hold_kv`)."""
        if not request.hold_kv:
            self.queues.shared.release_outside_window(request)

    def maybe_cache(self, request: Request, computed_before: int) -> None:
        """Publish blocks that this step filled with computed tokens to the prefix cache."""
        block_size = self.block_size
        if computed_before // block_size != request.num_computed_tokens // block_size:
            self.queues.shared.publish_full_blocks(request, self.queues.cache_salt(request))

    def check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if not params.ignore_eos and token_id in request.eos_token_ids:
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        return RequestStatus.FINISHED_LENGTH if self.at_length_limit(request) else None

    def at_length_limit(self, request: Request) -> bool:
        """Whether the request's output (its newest token included, known or a placeholder) is as
        long as it may be: its `max_tokens` (None: the context) or the context itself."""
        num_output_tokens = len(request.output_token_ids)
        max_tokens = request.sampling_params.max_tokens
        return (
            max_tokens is not None and num_output_tokens >= max_tokens
        ) or request.num_prompt_tokens + num_output_tokens >= self.max_model_len
