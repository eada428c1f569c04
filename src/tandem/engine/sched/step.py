"""The step contract: what the scheduler hands the runner, and what comes back (no torch).

One step: `Scheduler.schedule()` -> `SchedulerOutput` -> `ModelRunner.execute()` ->
`RunnerResult` -> `Scheduler.update_from_output()` -> `RequestUpdate`s for the output processor.

A request may carry speculative (draft) tokens: its `token_ids` end with `draft_token_ids`,
which are not the request's tokens yet. The runner scores every position of such a request and
returns the tokens it accepts, which are the first drafts that the target model agrees with
(greedy) or that pass rejection sampling (random), then one token of its own. The scheduler then
advances `num_computed_tokens` past the accepted drafts only: the slots written for rejected ones
lie beyond it, are overwritten by the next step, and are never published to the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams

PLACEHOLDER_TOKEN = -1  # an output token whose value the device has not returned yet (`in_flight.py`)


def num_known(token_ids: list[int]) -> int:
    """How many of `token_ids` (a request's output) are known now: all but a trailing placeholder."""
    return len(token_ids) - 1 if token_ids and token_ids[-1] == PLACEHOLDER_TOKEN else len(token_ids)


@dataclass
class HeadStep:
    """A compressed request's share of a step in the per-head layout: its KV lives in head blocks,
    per (layer, KV head) `h = layer * num_kv_heads + kv_head`."""

    # slots[h]: the flat head slots this step's tokens are written to (in order);
    # block_ids[h] / num_tokens[h]: head h's table and token count once they are written.
    slots: list[list[int]]
    block_ids: list[list[int]]
    num_tokens: list[int]
    # observe: the runner scores this step's last rows' queries (the observation window) against
    # the tokens each head holds, adding to what it observed of the request since its last
    # eviction. evict: then it returns what each head keeps at `kv_compression_rate`
    # (`RunnerResult.kept_tokens`), from all of that. The chunk that completes the context is
    # observed and evicted at once; later decode rows are observed over the last `window` steps
    # of every `interval` (`EvictionPolicy`), the last of them evicting.
    observe: bool = False
    evict: bool = False
    kv_compression_rate: float | None = None
    # A prompt prefix found in the prefix cache: before its rows run, the runner copies the shared
    # cache's KV at flat slots `prefix_src_slots` (one per token, in order) into every head, head
    # h's copies at `prefix_dst_slots[h]` (same order). The copies are the request's own: eviction
    # never touches the shared blocks, which it holds only until this step ends.
    prefix_src_slots: list[int] = field(default_factory=list)
    prefix_dst_slots: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)  # one per request per step: slots make it cheaper to build
class ScheduledRequest:
    """One request's share of a step. Lists are the scheduler's own (read-only for the runner)."""

    request_id: str
    # The tokens whose KV this step writes, at positions start_position.. (the request's own
    # uncomputed tokens, then its draft tokens, if any).
    token_ids: list[int]
    start_position: int  # == the request's num_computed_tokens before the step
    block_ids: list[int]  # the request's whole block table (covers start_position + len(token_ids))
    sample: bool  # this chunk reaches the request's last token: sample what comes next
    sampling_params: SamplingParams
    output_token_ids: list[int]  # generated so far (penalties)
    is_new: bool  # first time the runner sees this request (or first time since preemption)
    lora_name: str | None = None  # LoRA adapter of this request, if any
    # Speculative tokens at the end of `token_ids` (only when `sample`); the runner verifies them.
    draft_token_ids: list[int] = field(default_factory=list)
    # With a draft model: how many drafts the runner's draft model proposes for this request (their
    # slots are allocated; the runner appends the drafts to `token_ids` itself).
    num_draft_slots: int = 0
    # the request's prompt, where the draft model catches up on it or the repetition penalty reads it
    prompt_token_ids: list[int] = field(default_factory=list)
    # A compressed request's step in the per-head layout (`kv_layout.HeadLayout`); None for the
    # shared layout. `block_ids` is then empty.
    head: HeadStep | None = None
    # An embedding request (`Request.embed`): its rows run in the runner's embedding forward and,
    # at the prompt's end (`sample`), the runner returns the pooled state instead of a token.
    embed: bool = False

    @property
    def is_compressed(self) -> bool:
        return self.head is not None

    @property
    def known_output_token_ids(self) -> list[int]:
        """`output_token_ids` as the serial engine would hand them over: without the trailing
        placeholder a step scheduled ahead leaves for this step's own token (a copy then)."""
        ids = self.output_token_ids
        num_tokens = num_known(ids)
        return ids if num_tokens == len(ids) else ids[:num_tokens]

    @property
    def num_draft_tokens(self) -> int:
        """Drafts verified for this request this step (given, or to be proposed by the runner)."""
        return len(self.draft_token_ids) or self.num_draft_slots


@dataclass
class SchedulerOutput:
    """One step's work."""

    scheduled: list[ScheduledRequest]  # batch order; token rows are concatenated in this order
    num_scheduled_tokens: int  # of the step's token budget, drafts included
    preempted_request_ids: list[str] = field(default_factory=list)  # lost their KV this step
    finished_request_ids: list[str] = field(default_factory=list)  # freed since the last step
    # Copies the runner makes in the head-block pool before anything else this step (evictions
    # decided after the last step; `head_kv_cache.EvictionMoves`): all sources are read first.
    head_move_src_slots: list[int] = field(default_factory=list)
    head_move_dst_slots: list[int] = field(default_factory=list)
    # Scheduled requests left out of the step: a block of theirs was reassigned (KV integrity);
    # the engine ends them with an error before anything is computed from that KV.
    stale_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def with_items(self, items: list[ScheduledRequest]) -> SchedulerOutput:
        """This step with only `items` (some of its own, in its order), its token count recounted
        (draft slots included); itself where nothing was left out."""
        if len(items) == len(self.scheduled):
            return self
        num_tokens = sum(len(item.token_ids) + item.num_draft_slots for item in items)
        return replace(self, scheduled=items, num_scheduled_tokens=num_tokens)


@dataclass
class RunnerResult:
    """The runner's answer for one step.

    For each request that sampled: its new tokens in order (the accepted drafts, then one token of
    the target's own; a request without drafts has exactly one), and, when it asked for logprobs,
    one {token_id: logprob} per new token. `failed` holds the requests the runner could not compute
    (the engine ends those with an error; the others go on)."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # request_id -> why it failed (client-safe)
    forward_failed: bool = False  # the model pass raised for every request of the step, each alone
    # Per observed compressed request: per head (layer * num_kv_heads + kv_head), the indices of
    # the head's tokens it keeps, increasing (`HeadKVCacheManager.evict`).
    kept_tokens: dict[str, list[list[int]]] = field(default_factory=dict)
    wall_s: float = 0.0  # the step's wall seconds in the runner (the scheduler's step-cost model)
    # Per embedding request whose prompt ended this step: its pooled hidden state [hidden] float32
    embeddings: dict[str, list[float]] = field(default_factory=dict)

    def merge(self, other: RunnerResult) -> None:
        """Add `other`'s requests (a part of the same step, computed separately)."""
        self.sampled_token_ids.update(other.sampled_token_ids)
        self.embeddings.update(other.embeddings)
        self.logprobs.update(other.logprobs)
        self.failed.update(other.failed)
        self.kept_tokens.update(other.kept_tokens)


@dataclass(slots=True)  # one per request per step: slots make it cheaper to build
class RequestUpdate:
    """What one step did to one request, for the output processor."""

    request: Request
    new_token_ids: list[int]  # appended to the request's output this step (after stop checks)
    new_logprobs: list[dict[int, float]] | None  # one per new token, when logprobs were asked
    finished: bool  # the scheduler finished it this step (stop token, length)


@dataclass
class RunnerStats:
    """What a runner reports for `LLMEngine.stats()`."""

    native_decoder: bool = False  # the native CPU decoder stack is built
    num_native_decoder_steps: int = 0
    num_graph_steps: int = 0  # decode steps replayed from CUDA graphs
    draft_wall_s: float = 0.0  # wall seconds spent proposing with a draft model
    grammar_mask_s: float = 0.0  # wall seconds computing and applying grammar masks
    expert_tokens: list[int] = field(default_factory=list)  # MoE: tokens routed to each expert (all layers)


class Runner(Protocol):
    """All the engine uses of a runner (`runner.ModelRunner`; tests inject their own)."""

    @property
    def has_draft(self) -> bool:
        """A draft model or head proposes speculative tokens (`ScheduledRequest.num_draft_slots`)."""
        ...

    def execute(self, sched: SchedulerOutput) -> RunnerResult:
        """Compute one step; failure per request (`RunnerResult.failed`)."""
        ...

    def stats(self) -> RunnerStats: ...

    def export_pages(self, block_ids: list[int], num_tokens: int, dtype_name: str) -> list[bytes]:
        """The KV of the first `num_tokens` tokens in `block_ids`, one page per block, in the
        cache dtype `dtype_name` (`kv_transfer.KVPage`)."""
        ...

    def import_pages(self, block_ids: list[int], pages: list[tuple[int, bytes]]) -> None:
        """Write (token count, page bytes) into `block_ids`, in order."""
        ...

    def imported_prompt(self, request_id: str, first_position: int, num_tokens: int) -> None:
        """Positions first_position..num_tokens-1 of the request's prompt were imported."""
        ...
