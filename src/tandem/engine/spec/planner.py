"""Speculation owned by one object (no torch): which requests speculate this step and with how
many drafts (`plan`), and what was learnt from the runner's verdicts (`record`).

It holds each request's n-gram index (prompt lookup), the acceptance tracker (acceptance by the
n-gram length behind a draft; length 0: the draft model) and the step-cost model fitted on measured
steps. A `Proposal` is either prompt-lookup tokens or a number of slots that the runner's draft
model fills; `speculative.plan_drafts` decides how many of each are verified, adding drafts while
the expected tokens per second rise. Over the predictions stands the `SpeculationGuard`: per decode
batch size, speculation runs only while its measured seconds per generated token beat no
speculation's (`begin_step` in `plan`, `end_step` when the step's tokens are applied).
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.request import Priority, Request
from tandem.engine.spec.drafts import (
    AcceptanceTracker,
    DraftCandidate,
    NgramIndex,
    SpeculationSettings,
    StepCostModel,
    plan_drafts,
)
from tandem.engine.spec.guard import SpeculationGuard


@dataclass(frozen=True)
class Proposal:
    """Drafts planned for one request this step: prompt-lookup `token_ids`, or `num_model_drafts`
    slots the runner's draft model fills (`ScheduledRequest.num_draft_slots`)."""

    token_ids: tuple[int, ...] = ()
    num_model_drafts: int = 0

    def __len__(self) -> int:
        return len(self.token_ids) or self.num_model_drafts

    def truncated(self, length: int) -> Proposal:
        return Proposal(self.token_ids[:length], min(self.num_model_drafts, length))


def expected_accepted(acceptance: float, num_drafts: int, step_cost_s: float, draft_cost_s: float) -> float:
    """Expected accepted drafts of a proposal of `num_drafts` when each is accepted with
    `acceptance` given the ones before it were, counting only the drafts `plan_drafts` would
    verify for this request alone at these costs (so a proposer whose drafts would not pay is
    worth nothing, and another one gets the chance)."""
    expected, cost, gain, total = 1.0, step_cost_s, acceptance, 0.0
    for _ in range(num_drafts):
        if gain * cost <= expected * draft_cost_s:
            break
        total += gain
        expected += gain
        cost += draft_cost_s
        gain *= acceptance
    return total


class SpeculationPlanner:
    def __init__(
        self, settings: SpeculationSettings | None, *, max_num_batched_tokens: int, max_model_len: int
    ) -> None:
        """`settings` None: speculation is off (`plan` proposes nothing)."""
        self.settings = settings
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.step_cost = StepCostModel()
        self.guard = SpeculationGuard()
        tracking = settings or SpeculationSettings()
        self.acceptance = AcceptanceTracker(
            tracking.prompt_lookup_max, tracking.initial_acceptance, tracking.acceptance_smoothing
        )
        self._ngrams: dict[str, NgramIndex] = {}
        self._match_len: dict[str, int] = {}  # request -> n-gram length behind its drafts
        self.num_draft_tokens_total = 0
        self.num_accepted_tokens_total = 0

    def always_draft(self) -> None:
        """Test hook: verify the proposals whatever they cost (a step-cost prior under which every
        draft pays, never refitted; no guard)."""
        self.step_cost = StepCostModel(
            prior_fixed_s=1.0, prior_per_token_s=1e-4, prior_per_row_s=1e-4, window=0
        )
        self.guard = SpeculationGuard(enabled=False)

    def forget(self, request_id: str) -> None:
        self._ngrams.pop(request_id, None)
        self._match_len.pop(request_id, None)

    def extend(self, request_id: str, token_ids: list[int]) -> None:
        """The request's new tokens, for its n-gram index."""
        index = self._ngrams.get(request_id)
        if index is not None:
            index.extend(token_ids)

    def end_step(self, num_generated: int) -> None:
        """The step planned last generated `num_generated` tokens (the guard's measure)."""
        if self.settings is not None:
            self.guard.end_step(num_generated)

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """The runner's verdict on a request's drafts this step."""
        self.acceptance.record(self._match_len.get(request_id, 1), num_drafts, num_accepted)
        self.num_draft_tokens_total += num_drafts
        self.num_accepted_tokens_total += num_accepted

    def plan(self, running: list[Request], batch_cap: int | None) -> dict[str, Proposal]:
        """Drafts to verify this step, per running request that is decoding (its next token is
        the only one not computed) and may speculate: not opted out, no penalties (they depend on
        every earlier token), not seeded sampling (how many drafts a step verifies depends on
        measured time, and a seed promises the same tokens on every run), not a batch request
        while batch tokens are capped (`batch_cap`: interactive traffic), and room left under
        max_tokens and the context. How many each gets is `plan_drafts` on the measured step cost,
        of a step as it will be: throttled batch requests count for what they get."""
        if self.settings is None:
            return {}
        self.acceptance.drift()
        tokens = {priority: 0 for priority in Priority}  # this step's tokens before drafts
        rows = {priority: 0 for priority in Priority}  # its decoding requests
        for r in running:
            tokens[r.priority] += max(1, r.num_tokens - r.num_computed_tokens)
            rows[r.priority] += r.num_computed_tokens == r.num_tokens - 1
        if batch_cap is not None:
            tokens[Priority.BATCH] = min(tokens[Priority.BATCH], batch_cap)
            rows[Priority.BATCH] = min(rows[Priority.BATCH], batch_cap)
        num_decoding = sum(rows.values())
        step_tokens = min(self.max_num_batched_tokens, sum(tokens.values()))
        eligible = [
            r
            for r in running
            if r.num_computed_tokens == r.num_tokens - 1 and self._may_speculate(r, batch_cap)
        ]
        # The guard measures decode-only steps where speculation could happen (else both arms are alike).
        if not self.guard.begin_step(num_decoding, measured=bool(eligible) and num_decoding == step_tokens):
            return {}  # measured slower than no speculation at this batch size
        step_cost_s, draft_cost_s = self._draft_costs(num_decoding, step_tokens)
        candidates: list[DraftCandidate] = []
        proposals: dict[str, Proposal] = {}
        for request in eligible:
            proposal, match_len = self._propose(request, step_cost_s, draft_cost_s)
            if proposal:
                self._match_len[request.request_id] = match_len
                proposals[request.request_id] = proposal
                candidates.append(
                    DraftCandidate(request.request_id, proposal, self.acceptance.estimate(match_len))
                )
        if not candidates:
            return {}
        planned = plan_drafts(
            candidates,
            step_cost_s=step_cost_s,
            step_yield=num_decoding,
            draft_cost_s=draft_cost_s,
            max_draft_tokens=self.max_num_batched_tokens - step_tokens,
        )
        return {request_id: proposals[request_id].truncated(num) for request_id, num in planned.items()}

    @staticmethod
    def _may_speculate(request: Request, batch_cap: int | None) -> bool:
        params = request.sampling_params
        return not (
            not params.speculative
            or params.has_penalties
            or (params.seed is not None and not params.greedy)
            or (request.priority is Priority.BATCH and batch_cap is not None)
        )

    def _room(self, request: Request) -> int:
        """Drafts that fit: accepted drafts plus the target's own token within max_tokens and the context."""
        params = request.sampling_params
        room = self.max_model_len - request.num_tokens - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - request.num_output_tokens - 1)
        return room

    def _propose(self, request: Request, step_cost_s: float, draft_cost_s: float) -> tuple[Proposal, int]:
        """The request's proposal and the n-gram length behind it (0 for the draft model): prompt
        lookup's, or the draft model's slots where they are expected to yield more."""
        settings = self.settings
        assert settings is not None
        room = self._room(request)
        if room <= 0:
            return Proposal(), 0
        proposal, match_len = Proposal(), 0
        if settings.method in ("ngram", "both"):
            index = self._ngrams.get(request.request_id)
            if index is None:
                index = NgramIndex(settings.prompt_lookup_min, settings.prompt_lookup_max)
                index.extend(request.token_ids_slice(0, request.num_tokens))
                self._ngrams[request.request_id] = index
            token_ids, match_len = index.propose(min(room, settings.num_speculative_tokens))
            proposal = Proposal(tuple(token_ids))
        if settings.method in ("draft", "both"):
            # Unless prompt lookup is expected to yield more here (a long match while the request
            # copies its prompt), the runner's draft model proposes.
            slots = Proposal(num_model_drafts=min(room, settings.num_speculative_tokens))
            head = expected_accepted(self.acceptance.estimate(0), len(slots), step_cost_s, draft_cost_s)
            lookup = expected_accepted(
                self.acceptance.estimate(match_len), len(proposal), step_cost_s, draft_cost_s
            )
            if head > lookup or (head == lookup and not proposal):
                return slots, 0
        return proposal, match_len

    def _draft_costs(self, num_decoding: int, step_tokens: int) -> tuple[float, float]:
        """(the step's predicted wall time without drafts, what one more draft row adds) from the
        measured step costs; for a decode-only step, from the decode-only steps measured
        (`StepCostModel.decode_step_costs`), once there are any."""
        if step_tokens == num_decoding:
            measured = self.step_cost.decode_step_costs(num_decoding)
            if measured is not None:
                return measured
        fixed_s, per_token_s, per_row_s = self.step_cost.coefficients()
        return fixed_s + per_token_s * step_tokens + per_row_s * num_decoding, per_token_s + per_row_s
