"""Applying a step's results to the scheduler's requests (no torch).

The part of scheduling that takes the runner's tokens: computed counts advance past each
request's own tokens and its accepted drafts only, full blocks are published to the prefix cache,
tokens are appended until one stops the request (`finish_request`, the one path every finish takes),
evictions of compressed requests are recorded, and the step's cost feeds the speculation planner.
Functions over the `Scheduler`'s state (`Scheduler.update_from_output` and `add_handed_over`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.engine.request import Request, RequestStatus
from tandem.engine.step import RequestUpdate, RunnerResult, SchedulerOutput

if TYPE_CHECKING:
    from tandem.engine.scheduler import Scheduler


def update_from_output(
    sched: Scheduler, output: SchedulerOutput, result: RunnerResult
) -> list[RequestUpdate]:
    """Apply the runner's tokens: each request's computed count advances past its own tokens
    and its accepted drafts only (rejected drafts' slots are rewritten later and never cached),
    then its new tokens are appended one by one until one of them stops it. The step's cost
    (`result.wall_s`) feeds the speculation's step-cost model, its generated tokens the
    speculation guard."""
    num_rows = sum(1 + s.num_draft_tokens for s in output.scheduled if s.sample)
    sched.speculation.step_cost.observe(output.num_scheduled_tokens, num_rows, result.wall_s)
    updates: list[RequestUpdate] = []
    num_generated = 0
    for item in output.scheduled:
        request = sched.requests.get(item.request_id)
        if request is None:  # finished while the step ran (abort)
            continue
        sched.fair.charge(request, len(item.token_ids) + item.num_draft_slots)
        if item.head is not None and item.head.prefix_src_slots:  # copied into its heads
            sched.kv.free(item.request_id)  # the shared blocks go back
        kept = result.kept_tokens.get(item.request_id)
        if kept is not None and sched.head_layout is not None and request.compressed:
            sched.head_layout.apply_eviction(request, item, kept)
        token_ids = result.sampled_token_ids.get(item.request_id) or []
        num_drafts = item.num_draft_tokens
        num_accepted = min(max(0, len(token_ids) - 1), num_drafts)
        if num_drafts:
            sched.speculation.record(request.request_id, num_drafts, num_accepted)
            request.num_accepted_draft_tokens += num_accepted
        if not token_ids:  # a prefill chunk short of the prompt's end (never has drafts)
            before = request.num_computed_tokens
            request.num_computed_tokens += len(item.token_ids)
            maybe_cache(sched, request, before)
            release_outside_window(sched, request)
            continue
        logprobs = result.logprobs.get(item.request_id)
        num_generated += num_accepted + 1
        update = append_tokens(sched, request, token_ids[: num_accepted + 1], logprobs)
        if not update.finished:
            release_outside_window(sched, request)
        updates.append(update)
    sched.speculation.end_step(num_generated)
    return updates


def add_handed_over(sched: Scheduler, request: Request, first_token_id: int) -> RequestUpdate:
    """Admit a request whose prompt KV another engine computed, its blocks allocated and filled
    (`num_computed_tokens` = its prompt), with the first token that engine sampled: the token
    goes through the same stop checks and bookkeeping as a token sampled here."""
    sched.add_running(request)
    return append_tokens(sched, request, [first_token_id], None)


def append_tokens(
    sched: Scheduler, request: Request, token_ids: list[int], logprobs: list[dict[int, float]] | None
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
        status = check_stop(sched, request, token_id)
        if status is not None:
            break
    request.num_computed_tokens = request.num_tokens - 1
    sched.num_output_tokens_total[request.priority] += len(new_tokens)
    maybe_cache(sched, request, before)
    sched.speculation.extend(request.request_id, new_tokens)
    if status is not None:
        sched.finish_request(request.request_id, status)
    return RequestUpdate(
        request=request,
        new_token_ids=new_tokens,
        new_logprobs=logprobs[: len(new_tokens)] if logprobs is not None else None,
        finished=status is not None,
    )


def release_outside_window(sched: Scheduler, request: Request) -> None:
    """Give back the blocks no query of the request can read again (a sliding-window model's;
    `KVCacheManager.release_outside_window`), except for a prefill whose KV waits to be exported
    whole (`hold_kv`)."""
    if not request.hold_kv:
        sched.kv.release_outside_window(request.request_id, request.num_computed_tokens)


def maybe_cache(sched: Scheduler, request: Request, computed_before: int) -> None:
    """Publish blocks that this step filled with computed tokens to the prefix cache."""
    if computed_before // sched.kv.block_size != request.num_computed_tokens // sched.kv.block_size:
        sched.kv.cache_full_blocks(
            request.request_id,
            request.token_ids_slice,
            request.num_computed_tokens,
            sched.cache_salt(request),
        )


def check_stop(sched: Scheduler, request: Request, token_id: int) -> RequestStatus | None:
    params = request.sampling_params
    if not params.ignore_eos and token_id in request.eos_token_ids:
        request.stop_reason = None
        return RequestStatus.FINISHED_STOPPED
    if token_id in params.stop_token_ids:
        request.stop_reason = token_id
        return RequestStatus.FINISHED_STOPPED
    max_tokens = (
        params.max_tokens if params.max_tokens is not None else sched.max_model_len
    )  # None: the context
    if request.num_output_tokens >= max_tokens or request.num_tokens >= sched.max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
