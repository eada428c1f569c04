"""Turns per-step token updates into `RequestOutput`s: detokenisation, stop strings, deltas.

While a request streams text, it is decoded incrementally (`Tokenizer.incremental_decoder`: each
new token decodes a window from the last settled token, as vLLM does, in the tokenizer library),
so tokenizers that drop a leading space or merge across tokens give the same text as decoding the
whole output, and a long answer costs linear, not quadratic, time. Text waits while it ends in an
incomplete UTF-8 sequence. The final text is one decode of the whole output.
While a request runs, anything that could still become a stop string is held back. A request
added `final_only` gets two outputs: its first token and its end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tandem.engine.io.tokenizer import IncrementalDecoder, Tokenizer
from tandem.engine.protocol import CompletionOutput, RequestMetrics, RequestOutput
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sched.step import RequestUpdate, num_known


@dataclass
class _RequestState:
    request: Request
    prompt: str | None
    stream_text: bool
    final_only: bool  # outputs only for the first token and the end (`GenerationRequest.stream=False`)
    cumulative: bool  # running outputs carry the output so far too (`GenerationRequest.cumulative`)
    metrics: RequestMetrics
    logprobs: list[dict[int, float]] | None
    text: str = ""  # text emitted so far
    num_emitted_tokens: int = 0
    decoded_text: str | None = None  # latest decode of the output, cut at a stop string
    settled_text: str = ""  # text the incremental decoder settled so far
    decoder: IncrementalDecoder | None = None  # made when the output's text is first decoded


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
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
        )

    def process(self, updates: list[RequestUpdate]) -> tuple[list[RequestOutput], list[str]]:
        """Outputs for this step and the ids of requests that a stop string finished."""
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        stopped: list[str] = []
        for update in updates:
            state = self.states.get(update.request.request_id)
            if state is None:
                continue
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            if state.logprobs is not None and update.new_logprobs:
                state.logprobs.extend(update.new_logprobs)
            finished = update.finished
            if (state.stream_text or finished) and self._apply_stop_strings(state, finished):
                finished = True
                stopped.append(update.request.request_id)
            if state.final_only and not finished and state.num_emitted_tokens:
                continue
            outputs.append(self._make_output(state, finished, now))
        return outputs, stopped

    def mark_scheduled(self, request_ids: list[str], now: float) -> None:
        for request_id in request_ids:
            state = self.states.get(request_id)
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now

    def finish(self, request: Request) -> RequestOutput | None:
        """Final output of a request ended from outside (abort, error)."""
        state = self.states.get(request.request_id)
        if state is None:
            return None
        return self._make_output(state, True, time.monotonic())

    def _decode(self, state: _RequestState, finished: bool) -> str:
        """The output's text: one full decode when finished, else the incremental one."""
        token_ids = state.request.output_token_ids
        num_tokens = num_known(token_ids)  # a step in flight: its placeholder is not a token yet
        if finished:
            return self.tokenizer.decode(token_ids[:num_tokens])
        if state.decoder is None:
            state.decoder = self.tokenizer.incremental_decoder()
        if state.decoder.num_tokens < num_tokens:
            state.settled_text += state.decoder.extend(token_ids[state.decoder.num_tokens : num_tokens])
        return state.settled_text

    def _apply_stop_strings(self, state: _RequestState, finished: bool) -> bool:
        request = state.request
        params = request.sampling_params
        full = self._decode(state, finished)
        if params.stop:
            search_from = max(0, len(state.text) - max(len(s) for s in params.stop))
            hits = [(full.find(s, search_from), s) for s in params.stop]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                pos, stop = min(hits)
                end = pos + len(stop) if params.include_stop_str_in_output else pos
                state.decoded_text = full[:end]
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = stop
                return True
        state.decoded_text = full
        return False

    def _make_output(self, state: _RequestState, finished: bool, now: float) -> RequestOutput:
        request = state.request
        full = state.decoded_text if state.decoded_text is not None else state.text
        if not finished:
            full = self._hold_back(full, request)
        emitted = state.text
        if not full.startswith(emitted):  # a stop string cut into already-emitted text (cannot
            full = emitted  # happen with hold-back; kept as a guard)
        output_ids = request.output_token_ids
        num_emitted, num_tokens = state.num_emitted_tokens, num_known(output_ids)
        delta_ids = output_ids[num_emitted:num_tokens]
        logprobs = state.logprobs
        delta_logprobs = logprobs[num_emitted:] if logprobs is not None else None
        whole = finished or state.cumulative  # else no copy of the output so far
        state.text, state.num_emitted_tokens = full, num_tokens
        metrics = state.metrics
        metrics.num_cached_tokens = request.num_cached_tokens
        metrics.num_accepted_draft_tokens = request.num_accepted_draft_tokens
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
            text=full if whole else "",
            token_ids=output_ids[:num_tokens] if whole else [],
            finish_reason=request.status.finish_reason if finished else None,
            stop_reason=request.stop_reason if finished else None,
            logprobs=list(logprobs) if logprobs is not None and whole else None,
            delta_text=full[len(emitted) :],
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

    def _hold_back(self, text: str, request: Request) -> str:
        text = text.rstrip("\ufffd")
        stops = request.sampling_params.stop
        if stops:
            # Hold back the longest suffix that is a proper prefix of some stop string.
            keep = len(text)
            for stop in stops:
                for n in range(min(len(stop) - 1, len(text)), 0, -1):
                    if text.endswith(stop[:n]):
                        keep = min(keep, len(text) - n)
                        break
            text = text[:keep]
        return text
