"""Parallel sampling (`SamplingParams.n` > 1): one request, n choices (no torch).

A request asking for n choices runs as n child requests of the scheduler, `<id>#<index>`:
- each samples with its own generator: with a seed, choice i is seeded `seed + i` (wrapped into
  the seed range), so it equals a request of its own with that seed; without one they draw from
  the engine's generator in turn;
- the prompt is computed once: choice 0 leads, the others wait until its prompt is computed and
  then share its full prompt blocks (`Request.fork_of`; `KVCacheManager.fork`), recomputing only
  the tokens of the last, partly filled prompt block (fewer than `block_size`), which each writes
  into a block of its own. Shared blocks are full and never written again, so nothing is copied.

`ChoiceFamilies` turns the children's outputs back into the parent's: one `RequestOutput` per
step under the parent's id, whose `outputs` hold the choices that changed (each with its
`index`). The parent's last output (`finished=True`) holds every choice's final output, sorted by
index, cumulative fields whole; a choice that finished earlier appears again with empty deltas.
A choice that fails ends the others (the parent fails with its error).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from tandem.engine.protocol import CompletionOutput, RequestMetrics, RequestOutput, merge_deltas
from tandem.engine.request import Request
from tandem.engine.sampling_params import MAX_SEED, MIN_SEED

_SEED_RANGE = MAX_SEED - MIN_SEED + 1


def choice_id(parent_id: str, index: int) -> str:
    return f"{parent_id}#{index}"


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: `seed + index`, wrapped into [MIN_SEED, MAX_SEED]."""
    if seed is None:
        return None
    return (seed + index - MIN_SEED) % _SEED_RANGE + MIN_SEED


def choice_requests(request: Request) -> list[Request]:
    """The n child requests of `request` (n = its `sampling_params.n` > 1): same prompt, tenant,
    priority and adapter, n=1 each, their own seeds; all but the first share the first's prompt
    blocks (a compressed request's heads evict differently: each computes its own)."""
    params = request.sampling_params
    leader = choice_id(request.request_id, 0)
    children = []
    for index in range(params.n):
        children.append(
            dataclasses.replace(
                request,
                request_id=choice_id(request.request_id, index),
                sampling_params=dataclasses.replace(params, n=1, seed=choice_seed(params.seed, index)),
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=[],
                fork_of=None if index == 0 or request.compressed else leader,
            )
        )
    return children


@dataclass
class _Family:
    parent_id: str
    child_ids: list[str]
    finals: dict[int, CompletionOutput] = field(default_factory=dict)  # index -> final output
    metrics: RequestMetrics | None = None  # the leader's (its arrival, first token, cached tokens)
    num_accepted_draft_tokens: dict[int, int] = field(default_factory=dict)  # index -> that choice's
    error: str | None = None
    error_code: str | None = None

    @property
    def finished(self) -> bool:
        return len(self.finals) == len(self.child_ids)


class ChoiceFamilies:
    """The parents of running child requests, and the mapping of outputs to them."""

    def __init__(self) -> None:
        self.families: dict[str, _Family] = {}
        self.parent_of: dict[str, tuple[str, int]] = {}  # child id -> (parent id, index)

    def add(self, parent_id: str, child_ids: list[str]) -> None:
        self.families[parent_id] = _Family(parent_id, list(child_ids))
        for index, child in enumerate(child_ids):
            self.parent_of[child] = (parent_id, index)

    def __contains__(self, parent_id: str) -> bool:
        return parent_id in self.families

    def unfinished_children(self, parent_id: str) -> list[str]:
        family = self.families.get(parent_id)
        if family is None:
            return []
        return [c for i, c in enumerate(family.child_ids) if i not in family.finals]

    def to_parents(self, outputs: list[RequestOutput]) -> tuple[list[RequestOutput], list[str]]:
        """`outputs` with the children's merged into their parents' (one per parent, in the order
        the parents first appear), and the ids of children to end because a sibling failed."""
        result: list[RequestOutput] = []
        merged: dict[str, RequestOutput] = {}
        to_end: list[str] = []
        for output in outputs:
            link = self.parent_of.get(output.request_id)
            if link is None:
                result.append(output)
                continue
            parent_id, index = link
            family = self.families[parent_id]
            completion = dataclasses.replace(output.outputs[0], index=index)
            if index == 0 or family.metrics is None:
                family.metrics = output.metrics
            family.num_accepted_draft_tokens[index] = output.metrics.num_accepted_draft_tokens
            if completion.finished:
                family.finals[index] = completion
                del self.parent_of[output.request_id]
                if completion.finish_reason == "error" and family.error is None:
                    family.error, family.error_code = output.error, output.error_code
                    to_end += [c for c in family.child_ids if c in self.parent_of]
            parent = merged.get(parent_id)
            if parent is None:
                parent = merged[parent_id] = RequestOutput(
                    request_id=parent_id,
                    prompt=output.prompt,
                    prompt_token_ids=output.prompt_token_ids,
                    outputs=[],
                    finished=False,
                    metrics=family.metrics,
                )
                result.append(parent)
            parent.outputs = [c for c in parent.outputs if c.index != index] + [completion]
        for parent_id, parent in merged.items():
            family = self.families[parent_id]
            parent.metrics = family.metrics or parent.metrics
            if family.finished:
                self._finish(family, parent)
            else:
                parent.outputs.sort(key=lambda c: c.index)
        return result, to_end

    def _finish(self, family: _Family, parent: RequestOutput) -> None:
        """`parent` as the family's last output: every choice's final output, by index."""
        del self.families[family.parent_id]
        updated = {c.index for c in parent.outputs}
        outputs = []
        for index in sorted(family.finals):
            final = family.finals[index]
            if index not in updated:  # reported in an earlier output: no new deltas
                final = dataclasses.replace(
                    final,
                    delta_text="",
                    delta_token_ids=[],
                    delta_logprobs=[] if final.delta_logprobs is not None else None,
                )
            outputs.append(final)
        parent.outputs = outputs
        parent.finished = True
        if family.metrics is not None:  # the leader's, ended when the last choice ended
            parent.metrics = dataclasses.replace(
                family.metrics,
                finished_time=time.monotonic(),
                num_accepted_draft_tokens=sum(family.num_accepted_draft_tokens.values()),
            )
        if family.error is not None:
            parent.error, parent.error_code = family.error, family.error_code


def merge_by_id(first: list[RequestOutput], then: list[RequestOutput]) -> list[RequestOutput]:
    """`first` with the outputs of `then` of the same request folded in (their completions
    replace those of the same index; a finished one carries every choice)."""
    by_id = {o.request_id: o for o in first}
    merged = list(first)
    for output in then:
        earlier = by_id.get(output.request_id)
        if earlier is None:
            merged.append(output)
            continue
        earlier_by_index = {c.index: c for c in earlier.outputs}
        completions = [
            merge_deltas(earlier_by_index.pop(c.index), c) if c.index in earlier_by_index else c
            for c in output.outputs
        ]
        earlier.outputs = sorted([*earlier_by_index.values(), *completions], key=lambda c: c.index)
        earlier.finished = output.finished
        earlier.metrics = output.metrics
        earlier.error, earlier.error_code = (
            output.error or earlier.error,
            output.error_code or earlier.error_code,
        )
    return merged
