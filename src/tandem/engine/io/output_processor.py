"""Turns per-step token updates into `RequestOutput`s: detokenisation, stop strings, deltas.

While a request streams text, it is decoded incrementally (`TextStream`: each new token decodes a
window from the last settled token, as vLLM does, in the tokenizer library), so tokenizers that
drop a leading space or merge across tokens give the same text as decoding the whole output, and
each step costs what is new, not the output so far. Text waits while it ends in an incomplete
UTF-8 sequence. The final text is one decode of the whole output.
While a request runs, anything that could still become a stop string is held back. A request
added `final_only` gets two outputs: its first token and its end; one added not `cumulative` gets
running outputs with deltas only (no copy of the output so far).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tandem.engine.io.text_stream import TextStream
from tandem.engine.io.tokenizer import Tokenizer
from tandem.engine.protocol import CompletionOutput, RequestMetrics, RequestOutput
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sched.step import PLACEHOLDER_TOKEN, RequestUpdate, num_known


@dataclass(slots=True)
class _RequestState:
    request: Request
    prompt: str | None
    stream_text: bool
    final_only: bool  # outputs only for the first token and the end (`GenerationRequest.stream=False`)
    cumulative: bool  # running outputs carry the output so far too (`GenerationRequest.cumulative`)
    metrics: RequestMetrics
    logprobs: list[dict[int, float]] | None
    text: TextStream
    # Running outputs are deltas of streamed text, without stop strings or logprobs: each step's
    # output after the first takes `_plain_delta` (the serving routes' requests)
    plain_deltas: bool = False
    num_emitted_tokens: int = 0
    unsent_text: str = ""  # emitted while a `final_only` request's outputs were skipped


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        tokenizer.prepare_streaming()
        self.states: dict[str, _RequestState] = {}

    def add(
        self,
        request: Request,
        prompt: str | None,
        stream_text: bool,
        final_only: bool = False,
        cumulative: bool = True,
    ) -> None:
        params = request.sampling_params
        self.states[request.request_id] = _RequestState(
            request=request,
            prompt=prompt,
            stream_text=stream_text or bool(params.stop),
            final_only=final_only,
            cumulative=cumulative,
            metrics=RequestMetrics(arrival_time=request.arrival_time),
            logprobs=[] if params.logprobs is not None else None,
            text=TextStream(self.tokenizer, list(params.stop or []), params.include_stop_str_in_output),
            plain_deltas=stream_text
            and not params.stop
            and not final_only
            and not cumulative
            and params.logprobs is None,
        )

    def process(self, updates: list[RequestUpdate]) -> tuple[list[RequestOutput], list[str]]:
        """Outputs for this step and the ids of requests that a stop string finished."""
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        stopped: list[str] = []
        states = self.states
        for update in updates:
            request = update.request
            state = states.get(request.request_id)
            if state is None:
                continue
            if state.plain_deltas and state.num_emitted_tokens and not update.finished:
                outputs.append(self._plain_delta(state, request))
                continue
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            if state.logprobs is not None and update.new_logprobs:
                state.logprobs.extend(update.new_logprobs)
            finished = update.finished
            text = state.text
            delta_text = ""
            if finished:
                output_ids = request.output_token_ids
                delta_text = text.finish(output_ids[: num_known(output_ids)])
            elif state.stream_text:
                output_ids = request.output_token_ids
                num_tokens, num_decoded = num_known(output_ids), text.num_decoded_tokens
                if num_decoded < num_tokens:
                    delta_text = text.step(output_ids[num_decoded:num_tokens])
            if text.stop is not None:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = text.stop
                finished = True
                stopped.append(request.request_id)
            if state.final_only and not finished and state.num_emitted_tokens:
                state.unsent_text += delta_text  # the final output's delta carries it
                continue
            outputs.append(self._make_output(state, finished, now, delta_text))
        return outputs, stopped

    def mark_scheduled(self, request_ids: list[str], now: float) -> None:
        for request_id in request_ids:
            state = self.states.get(request_id)
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now

    def finish(self, request: Request) -> RequestOutput | None:
        """Final output of a request ended from outside (abort, error): its text so far, with
        what was held back."""
        state = self.states.get(request.request_id)
        if state is None:
            return None
        return self._make_output(state, True, time.monotonic(), state.text.flush())

    @staticmethod
    def _plain_delta(state: _RequestState, request: Request) -> RequestOutput:
        """A running output of a request that streams plain deltas (`_RequestState.plain_deltas`)
        after its first: the step's tokens and their text, nothing copied."""
        output_ids = request.output_token_ids
        num_emitted, num_tokens = state.num_emitted_tokens, len(output_ids)
        if output_ids[-1] == PLACEHOLDER_TOKEN:  # a step in flight: not a token yet
            num_tokens -= 1
        delta_ids = output_ids[num_emitted:num_tokens]
        delta_text = state.text.step(delta_ids) if delta_ids else ""
        state.num_emitted_tokens = num_tokens
        metrics = state.metrics
        metrics.num_accepted_draft_tokens = request.num_accepted_draft_tokens
        completion = CompletionOutput(0, "", [], None, None, None, delta_text, delta_ids, None)
        return RequestOutput(
            request.request_id, state.prompt, request.prompt_token_ids, [completion], False, metrics
        )

    def _make_output(
        self, state: _RequestState, finished: bool, now: float, delta_text: str
    ) -> RequestOutput:
        """The output of a step: `delta_text` is the text emitted since the last output."""
        request = state.request
        output_ids = request.output_token_ids
        num_emitted, num_tokens = state.num_emitted_tokens, num_known(output_ids)
        delta_ids = output_ids[num_emitted:num_tokens]
        logprobs = state.logprobs
        delta_logprobs = logprobs[num_emitted:] if logprobs is not None else None
        state.num_emitted_tokens = num_tokens
        if state.unsent_text:
            delta_text, state.unsent_text = state.unsent_text + delta_text, ""
        metrics = state.metrics
        metrics.num_cached_tokens = request.num_cached_tokens
        metrics.num_accepted_draft_tokens = request.num_accepted_draft_tokens
        if not finished and not state.cumulative:  # a running output of deltas only: no copies
            completion = CompletionOutput(0, "", [], None, None, None, delta_text, delta_ids, delta_logprobs)
            return RequestOutput(
                request.request_id, state.prompt, request.prompt_token_ids, [completion], False, metrics
            )
        error = error_code = None
        if finished:
            metrics.finished_time = now
            metrics.num_preemptions = request.num_preemptions
            self.states.pop(request.request_id, None)
            if request.status is RequestStatus.FINISHED_ERROR:
                error = request.error or "request failed"
                error_code = request.error_code or "request_failed"
        completion = CompletionOutput(
            index=0,
            text=state.text.text,
            token_ids=output_ids[:num_tokens],
            finish_reason=request.status.finish_reason if finished else None,
            stop_reason=request.stop_reason if finished else None,
            logprobs=list(logprobs) if logprobs is not None else None,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            delta_logprobs=delta_logprobs,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=state.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=metrics,
            error=error,
            error_code=error_code,
            embedding=request.embedding if finished else None,
        )
