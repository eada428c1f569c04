"""Pure OpenAI mapping: request bodies -> `SamplingParams`, engine outputs -> OpenAI responses,
chunks, usage and logprobs, and the errors an engine output stands for. No server state, no I/O:
`OpenAIServer` (openai_server.py) calls these.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from tandem.deployments.openai.requests import ChatCompletionRequest, CompletionRequest
from tandem.deployments.openai.responses import PromptTokensDetails, Usage, chat_chunk, text_completion
from tandem.deployments.openai.structured_output import request_constraint, response_format_constraint
from tandem.engine.io.generation_defaults import DEFAULTABLE
from tandem.engine.protocol import CompletionOutput, RequestOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.platform.errors import InvalidRequestError, RequestFailedError, TandemError


@dataclass
class ResponseTiming:
    """Where a response's time to first token went, for its `Server-Timing` header (and the id of
    the engine request behind it).

    The route sets `started` when the request reaches it; `OpenAIServer._run` fills the rest once
    the engine's first output is in (before any byte of the response is sent). A client's TTFT
    minus `app` is what the path between client and route cost (HTTP, Serve's proxy and calls).
    """

    started: float  # time.monotonic() at the route
    first_output_at: float | None = None  # the first engine output reached the route
    engine_queue_s: float | None = None  # engine arrival -> first scheduled (same engine clock)
    engine_ttft_s: float | None = None  # engine arrival -> first token
    request_id: str | None = None  # the engine request's id (the completion's `id`), once it starts

    def header(self) -> str:
        """`app;dur=<ms>, engine-queue;dur=<ms>, engine-ttft;dur=<ms>` (W3C Server-Timing)."""
        app_s = None if self.first_output_at is None else self.first_output_at - self.started
        durations = {"app": app_s, "engine-queue": self.engine_queue_s, "engine-ttft": self.engine_ttft_s}
        return ", ".join(f"{name};dur={s * 1000:.1f}" for name, s in durations.items() if s is not None)


def sampling_params_from(req: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
    """The request's sampling fields; an unset `max_tokens` stays None (the engine then applies
    `GenerationRequest.default_max_tokens` and the checkpoint's within what the context leaves),
    and the other unset ones are named in `model_defaults` for the checkpoint's defaults."""
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    if isinstance(req, ChatCompletionRequest):
        structured = request_constraint(req)
    else:
        structured = response_format_constraint(req)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        # what the client left unset: the checkpoint's generation defaults fill it (in the engine)
        model_defaults=frozenset(name for name in DEFAULTABLE if getattr(req, name) is None),
        n=req.n,
        seed=req.seed,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        speculative=req.speculative,
        kv_compression_rate=req.kv_compression_rate,
        structured=structured,
    )


class TokenNames:
    """Token ids -> text and bytes for logprobs, from the engine's token bytes table."""

    def __init__(self, table: list[bytes]) -> None:
        self.table = table

    def token(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text (a partial UTF-8 character shows as U+FFFD) and its bytes."""
        raw = self.table[token_id] if 0 <= token_id < len(self.table) else b""
        return raw.decode("utf-8", errors="replace"), list(raw)

    def chat_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]] | None, num_top: int
    ) -> dict[str, object] | None:
        """OpenAI chat shape. Each engine entry holds the chosen token plus the top-n alternatives."""
        if logprobs is None:
            return None
        content = []
        for token_id, entry in zip(token_ids, logprobs, strict=False):
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:num_top]
            text, raw = self.token(token_id)
            top = []
            for top_id, value in ranked:
                top_text, top_raw = self.token(top_id)
                top.append({"token": top_text, "logprob": value, "bytes": top_raw})
            content.append(
                {"token": text, "logprob": entry.get(token_id, 0.0), "bytes": raw, "top_logprobs": top}
            )
        return {"content": content}

    def completion_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]] | None
    ) -> dict[str, object] | None:
        """OpenAI's legacy completions shape."""
        if logprobs is None:
            return None
        return {
            "tokens": [self.token(t)[0] for t in token_ids],
            "token_logprobs": [entry.get(t, 0.0) for t, entry in zip(token_ids, logprobs, strict=False)],
            "top_logprobs": [{self.token(t)[0]: v for t, v in entry.items()} for entry in logprobs],
            "text_offset": [],
        }


NO_TOKEN_NAMES = TokenNames([])  # for requests without logprobs


def stream_chunks(
    out: RequestOutput,
    *,
    model: str,
    created: int,
    chat: bool,
    num_top: int,
    names: TokenNames,
    ended: set[int],
) -> list[dict[str, object]]:
    """The streamed messages for `out`'s new tokens, one per choice it updates (each with its
    `index`): `chat.completion.chunk`s or `text_completion` chunks. `ended` holds the indexes of
    choices whose finish was sent (a choice reported again in the last output is skipped); this
    adds to it."""
    chunks = []
    for completion in unsent_choices(out, ended):
        finish = completion.finish_reason
        if chat:
            delta = {"content": completion.delta_text} if completion.delta_text or finish is None else {}
            chunks.append(
                chat_chunk(
                    request_id=out.request_id,
                    model=model,
                    created=created,
                    delta=delta,
                    finish_reason=finish,
                    logprobs=names.chat_logprobs(
                        completion.delta_token_ids, completion.delta_logprobs, num_top
                    ),
                    index=completion.index,
                    stop_reason=completion.stop_reason,
                )
            )
            continue
        chunks.append(
            text_completion(
                request_id=out.request_id,
                model=model,
                created=created,
                text=completion.delta_text,
                finish_reason=finish,
                usage=None,
                logprobs=names.completion_logprobs(completion.delta_token_ids, completion.delta_logprobs),
                index=completion.index,
            )
        )
    return chunks


def unsent_choices(out: RequestOutput, ended: set[int]) -> list[CompletionOutput]:
    """`out`'s choices whose finish was not sent yet (`ended` holds the indexes of those whose
    was; a choice the last output reports again is left out); the finished ones join `ended`."""
    unsent = [c for c in out.outputs if c.index not in ended]
    ended.update(c.index for c in unsent if c.finish_reason is not None)
    return unsent


def failed_choice(out: RequestOutput) -> bool:
    """Whether `out` reports an error: the request's, or one of its choices'."""
    return out.error is not None or any(c.finish_reason == "error" for c in out.outputs)


def engine_error(out: RequestOutput, param: str | None = None) -> TandemError:
    """The error a request that finished with `finish_reason: error` gets (names its id). An
    output constraint the model could not continue (`constraint_failed`) is a 400 naming
    `param`, the constraint's field: the schema or grammar needs changing, retrying will not help."""
    message = f"{out.error or 'the engine could not compute this request'} (request id {out.request_id})"
    if out.error_code == "constraint_failed":
        return InvalidRequestError(
            f"{message}; simplify the schema or grammar, or raise max_tokens",
            param=param,
            code="constraint_failed",
        )
    return RequestFailedError(message, code=out.error_code or "request_failed")


def usage(out: RequestOutput) -> Usage:
    """The prompt once, and the tokens of every choice (`out` is a final output: whole)."""
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=out.metrics.num_cached_tokens),
    )


def num_tokens(out: RequestOutput) -> int:
    return len(out.prompt_token_ids) + sum(len(c.token_ids) for c in out.outputs)


def sse_event(payload: Mapping[str, object]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
