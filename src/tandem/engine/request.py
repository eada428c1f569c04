"""Request state inside the engine (no torch).

A request is a prompt plus the tokens generated so far. The scheduler only looks at
`num_computed_tokens` (tokens whose KV is in the cache) against `num_tokens`; there is no
separate prefill or decode phase.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tandem.engine.sampling_params import SamplingParams


class Priority(enum.IntEnum):
    """Lower value is served first and preempted last."""

    INTERACTIVE = 0
    BATCH = 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self in FINISHED_STATUSES

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


FINISHED_STATUSES = frozenset(s for s in RequestStatus if s.name.startswith("FINISHED"))


@dataclass(eq=False)  # an entity: equal only to itself (queues find and remove it by identity)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: Priority = Priority.INTERACTIVE
    tenant_id: str | None = None
    tenant_weight: float | None = None  # its tenant's weight when it arrived (None: the configured one)
    lora_name: str | None = None  # the LoRA adapter this request runs with, if any
    hold_kv: bool = False  # keep its blocks when it finishes (prefill for a hand-over)
    embed: bool = False  # pool the prompt's hidden states instead of generating (`GenerationRequest.embed`)
    # An encoder's request attends bidirectionally over its whole prompt: it runs in one step, unchunked
    whole_prompt: bool = False
    embedding: list[float] | None = None  # the pooled state, once computed
    # Parallel sampling (parallel_sampling.py): the sibling whose full prompt blocks this request
    # shares once they are computed; it waits until then (None: it computes its own prompt).
    fork_of: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is written; invariant: <= num_tokens
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_accepted_draft_tokens: int = 0  # speculative draft tokens accepted so far
    error: str | None = None  # why it finished with FINISHED_ERROR (safe to show the client)
    error_code: str | None = None  # machine-readable kind of that error ("kv_integrity", ...)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # KV compression (per-head eviction) rate, resolved by the engine; None or 1: the shared
    # block layout. A compressed request's KV lives in per-(layer, head) blocks and is evicted
    # once its prompt is computed (`kv_evicted`; again after a preemption recomputes it), then
    # every `EvictionPolicy.interval` decode steps; `num_tokens_at_eviction`: tokens computed
    # when it was last evicted.
    kv_compression_rate: float | None = None
    kv_evicted: bool = False
    num_tokens_at_eviction: int = 0

    @property
    def compressed(self) -> bool:
        return self.kv_compression_rate is not None and self.kv_compression_rate > 1.0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def sort_key(self) -> tuple[int, float]:
        return (int(self.priority), self.arrival_time)
