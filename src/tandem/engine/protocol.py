"""Public input and output dataclasses of the engine (what `LLM` and `AsyncEngine` speak)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.engine.request import Priority
from tandem.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for offline generation: a name, and the PEFT folder to load it from once."""

    name: str
    path: str


@dataclass
class GenerationRequest:
    """One generation. Exactly one of `prompt`, `prompt_token_ids` or `messages` is set."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # rendered with the model's chat template
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    priority: Priority = Priority.INTERACTIVE
    tenant_id: str | None = None
    # The tenant's fair-share weight as its operator set it now (the tenant directory, changed
    # live); None: the engine's configured weight (`tenant_weights`, else 1).
    tenant_weight: float | None = None
    lora_name: str | None = None  # a LoRA adapter registered with the engine (`EngineAdapters.add`)
    # With `sampling_params.max_tokens=None`: at most this many new tokens (None: what the context leaves)
    default_max_tokens: int | None = None
    # False (a consumer that wants only the answer, e.g. a non-streaming API call or a batch line):
    # the engine sends the first output (its first token, or an error) and the final one, nothing
    # in between, and decodes the text once at the end. The final output's cumulative fields are
    # whole; its deltas cover only what the skipped outputs did not.
    stream: bool = True
    # False (a consumer that forwards deltas: the serving path): a running output carries only what
    # is new (`delta_*`; `text`, `token_ids` and `logprobs` empty), the final one all of it; no
    # step copies the output so far. True: each output also carries it all, as vLLM's default.
    cumulative: bool = True
    # An embedding request: the prompt runs through the model once (prefill only; nothing is
    # generated and its blocks are not published to the prefix cache) and the final output carries
    # its pooled hidden state (`RequestOutput.embedding`) instead of tokens.
    embed: bool = False


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic()
    first_scheduled_time: float | None = None  # when the engine first computed any of its tokens
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_accepted_draft_tokens: int = 0  # speculative draft tokens the model accepted (every choice's)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def phase_durations(self) -> dict[str, float]:
        """Seconds spent queued, in prefill (to the first token) and decoding, as far as known."""
        out: dict[str, float] = {}
        if self.first_scheduled_time is not None:
            out["queue"] = self.first_scheduled_time - self.arrival_time
            if self.first_token_time is not None:
                out["prefill"] = self.first_token_time - self.first_scheduled_time
                if self.finished_time is not None:
                    out["decode"] = self.finished_time - self.first_token_time
        return out


@dataclass(slots=True)  # one per request per step
class CompletionOutput:
    index: int
    text: str  # cumulative (empty until the end when the request does not stream text)
    token_ids: list[int]  # cumulative
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob}
    delta_text: str = ""  # new since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def carries_cumulative(self) -> bool:
        """Whether it holds the output so far (`text`, `token_ids`, `logprobs`), not only deltas."""
        return bool(self.token_ids or self.text) or self.logprobs is not None


def merge_deltas(earlier: CompletionOutput, later: CompletionOutput) -> CompletionOutput:
    """`later` with `earlier`'s deltas prepended: one update carrying both steps' new tokens."""
    later.delta_text = earlier.delta_text + later.delta_text
    later.delta_token_ids = earlier.delta_token_ids + later.delta_token_ids
    if earlier.delta_logprobs is not None and later.delta_logprobs is not None:
        later.delta_logprobs = earlier.delta_logprobs + later.delta_logprobs
    return later


@dataclass(slots=True)  # one per request per step
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set when finish_reason is "error": why, safe to show the client
    error_code: str | None = None  # "kv_integrity", "request_failed", "engine_failed"
    # An embedding request's pooled hidden state (the model's pooling: `LLMEngine.pooling`),
    # not normalised, [hidden_size] float32 values; set on its final output
    embedding: list[float] | None = None

    def for_the_wire(self, *, first: bool) -> RequestOutput:
        """What crosses to another process of a streamed request: a running output's deltas only
        (cumulative fields cross once, with the final output), and its prompt (`prompt`,
        `prompt_token_ids`) only with the `first` output and the final one: a running output
        after the first carries none (the receiver puts the first's back: `with_prompt_of`), so
        a message costs what is new, not the prompt's length. Itself when there is nothing to
        drop."""
        if self.finished:
            return self
        if first and not any(c.carries_cumulative for c in self.outputs if c.finish_reason is None):
            return self
        slim = [
            CompletionOutput(
                index=c.index,
                text="",
                token_ids=[],
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                logprobs=None,
                delta_text=c.delta_text,
                delta_token_ids=c.delta_token_ids,
                delta_logprobs=c.delta_logprobs,
            )
            if c.finish_reason is None and c.carries_cumulative
            else c  # deltas only already, or a choice that ended before the others: whole
            for c in self.outputs
        ]
        if first:
            return RequestOutput(
                self.request_id, self.prompt, self.prompt_token_ids, slim, False, self.metrics
            )
        return RequestOutput(self.request_id, None, [], slim, False, self.metrics)

    def with_prompt_of(self, first: RequestOutput) -> RequestOutput:
        """A running output received from `for_the_wire(first=False)`, its prompt put back from
        the request's `first` output (the same objects: nothing copied); a final output is
        whole already."""
        if not self.finished:
            self.prompt, self.prompt_token_ids = first.prompt, first.prompt_token_ids
        return self

    def num_new_tokens(self) -> int:
        """Tokens this output adds, over all its choices."""
        return sum(len(c.delta_token_ids) for c in self.outputs)


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """`later` with `earlier`'s new tokens folded in, choice by choice (`index`): one update
    carrying both. A choice only `earlier` updated is carried over as it is."""
    later_indexes = {c.index for c in later.outputs}
    carried = [c for c in earlier.outputs if c.index not in later_indexes]
    by_index = {c.index: c for c in earlier.outputs}
    for completion in later.outputs:
        if completion.index in by_index:
            merge_deltas(by_index[completion.index], completion)
    if carried:
        later.outputs = sorted([*carried, *later.outputs], key=lambda c: c.index)
    return later
