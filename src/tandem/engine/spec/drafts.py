"""Speculative decoding's scheduling side (no torch): proposals and how many to verify.

- `NgramIndex` (prompt lookup): per request, the latest position after each n-gram of its tokens
  (prompt and output), updated as tokens arrive, so a proposal costs a few dict lookups: the tokens
  that followed the most recent earlier occurrence of the request's last n tokens (longest n first).
- `StepCostModel`: the measured wall time of a step against the tokens it computed and the logits
  rows it produced, fitted as `fixed + per_token * tokens + per_row * rows` over recent steps (a
  prior until steps of different shapes are seen).
- `plan_drafts`: how many of each request's proposed tokens to verify this step. A draft token
  is worth adding while the tokens it is expected to yield per second of step time beat the
  step's current rate: with acceptance rate `a` of a request, its j-th draft is accepted with
  probability `a^j`, and adding it costs `per_token + per_row`; so the greedy allocation adds the most
  likely drafts first and stops when `gain / draft_cost < expected_tokens / step_cost`. At batch 1
  on a CPU, where the fixed cost dominates, it verifies several drafts; as the batch grows the
  step's own rate rises and speculation turns itself off, so it never makes a step slower in
  expectation than no speculation.

Acceptance is estimated per n-gram match length across requests (`AcceptanceTracker`; length 0
stands for the draft model).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sized
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SpeculationSettings:
    """Engine-side settings (from `EngineConfig.speculative`)."""

    # "ngram": prompt lookup (proposed by the scheduler); "draft": a draft model (in the runner);
    # "both": per request and step, whichever is expected to yield more accepted tokens.
    method: str = "ngram"
    num_speculative_tokens: int = 5  # most drafts per request per step
    prompt_lookup_min: int = 1  # shortest n-gram matched
    prompt_lookup_max: int = 4  # longest n-gram matched (tried first)
    initial_acceptance: float = 0.6  # a match length's acceptance before it has any
    acceptance_smoothing: float = 0.1  # weight of the newest verification in the running acceptance

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft", "both"):
            raise ValueError("method must be 'ngram', 'draft' or 'both'")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if not 0.0 < self.initial_acceptance < 1.0 or not 0.0 < self.acceptance_smoothing <= 1.0:
            raise ValueError("initial_acceptance must be in (0, 1) and acceptance_smoothing in (0, 1]")


class NgramIndex:
    """Prompt lookup for one request. `extend` with every new token; `propose` the continuation.
    The n-grams are indexed when a proposal needs them (a step that drafts nothing costs an
    append per token; the index a proposal reads is the same)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # n-gram -> the position right after its latest occurrence that has a token after it,
        # for the n-grams followed by a token before position `_num_indexed`
        self._after: dict[tuple[int, ...], int] = {}
        self._num_indexed = 0

    def extend(self, token_ids: list[int]) -> None:
        self.tokens.extend(token_ids)

    def _catch_up(self) -> None:
        """Index the n-grams that ended at each token appended since the last proposal, each
        mapped to its end (a later occurrence replaces an earlier one). A few new tokens (a decode
        step's) are indexed one by one; many (a prompt at its first proposal: 4k tokens) per n, by
        zipping shifted slices, not a Python loop over positions."""
        tokens, after, num_tokens = self.tokens, self._after, len(self.tokens)
        if num_tokens - self._num_indexed < 16:
            for end in range(self._num_indexed, num_tokens):
                for n in range(self.min_n, min(self.max_n, end) + 1):
                    after[tuple(tokens[end - n : end])] = end
        else:
            for n in range(self.min_n, self.max_n + 1):
                first_end = max(n, self._num_indexed)  # positions before n end no n-gram
                shifted = [tokens[first_end - n + i : num_tokens - n + i] for i in range(n)]
                after.update(zip(zip(*shifted, strict=True), range(first_end, num_tokens), strict=True))
        self._num_indexed = num_tokens

    def propose(self, num_tokens: int) -> tuple[list[int], int]:
        """Up to `num_tokens` tokens that followed the latest earlier occurrence of the longest
        matching suffix, and that suffix's length ([], 0 when no suffix of at least `min_n`
        tokens occurred before)."""
        if self._num_indexed < len(self.tokens):
            self._catch_up()
        size = len(self.tokens)
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            start = self._after.get(tuple(self.tokens[size - n :]))
            if start is not None:
                return self.tokens[start : start + num_tokens], n
        return [], 0


class AcceptanceTracker:
    """How often drafts are accepted, by the length of the n-gram match that proposed them
    (length 0: the draft model), shared by all requests (a 4-token match while a request copies
    its prompt is right far more often than a 1-token match in free text).

    The estimate is the conditional acceptance `a` that `plan_drafts` models (draft j is accepted
    with probability a^j): of the drafts that were reached (every draft up to and including the
    first rejected one), the share accepted. Chain-level ratios (accepted / verified) would read
    low: five drafts of which the first two are accepted mean a = 2/3, not 2/5. Successes and
    trials are exponentially weighted sums, and drift back toward `initial` a little every step,
    so a length that stopped being tried is tried again later instead of being ruled out forever."""

    def __init__(self, max_n: int, initial: float, smoothing: float, recovery: float = 0.01) -> None:
        self.initial, self.smoothing, self.recovery = initial, smoothing, recovery
        # Per match length: (weighted accepted drafts, weighted reached drafts); a prior of one trial.
        self.accepted = [initial] * (max_n + 1)
        self.reached = [1.0] * (max_n + 1)

    def estimate(self, match_len: int) -> float:
        return min(0.95, max(0.02, self.accepted[match_len] / self.reached[match_len]))  # never certain

    def record(self, match_len: int, num_drafts: int, num_accepted: int) -> None:
        reached = num_accepted + (1 if num_accepted < num_drafts else 0)
        keep = 1 - self.smoothing
        self.accepted[match_len] = keep * self.accepted[match_len] + self.smoothing * num_accepted
        self.reached[match_len] = keep * self.reached[match_len] + self.smoothing * reached

    def drift(self) -> None:
        for n, (accepted, reached) in enumerate(zip(self.accepted, self.reached, strict=True)):
            rate = accepted / reached
            self.accepted[n] = reached * (rate + self.recovery * (self.initial - rate))


@dataclass
class StepCostModel:
    """Step wall time ~ fixed_s + per_token_s * tokens + per_row_s * logits_rows, least squares
    over the last `window` steps.

    Tokens are the positions the step computes; logits rows the positions whose next-token
    distribution it computes (one per sampling request, plus its drafts). The two differ in cost:
    a logits row is a pass through the LM head (vocabulary x hidden), which a prefill token
    skips, and a draft token pays both. Until the steps seen separate the terms, the prior holds
    (a CPU step's fixed part dominates at small batch: many small ops)."""

    prior_fixed_s: float = 0.05
    prior_per_token_s: float = 0.002
    prior_per_row_s: float = 0.002
    window: int = 256
    samples: deque[tuple[int, int, float]] = field(default_factory=deque)
    # Decode-only steps (every token a logits row), kept apart: they may run on other weights and
    # kernels than prompt chunks do (a hybrid engine's INT4 native stack against its bfloat16
    # GEMMs), so a fit over both can misjudge what one more draft row costs a decode step. Kept as
    # a moving average of the wall time per step size (rows -> [seconds, steps seen]) that outlives
    # the window: sizes seen only while drafting are still known after drafting stops.
    decode_walls: dict[int, list[float]] = field(default_factory=dict)
    decode_smoothing: float = 0.2

    def observe(self, num_tokens: int, num_rows: int, wall_s: float) -> None:
        """Add a step's size and wall time (`window=0`: keep the prior, e.g. in tests)."""
        if num_tokens <= 0 or wall_s <= 0 or self.window == 0:
            return
        self.samples.append((num_tokens, num_rows, wall_s))
        if len(self.samples) > self.window:
            self.samples.popleft()
        if num_tokens == num_rows:
            entry = self.decode_walls.get(num_rows)
            if entry is None:
                self.decode_walls[num_rows] = [wall_s, 1]
            else:
                entry[0] += self.decode_smoothing * (wall_s - entry[0])
                entry[1] += 1

    def decode_coefficients(
        self, min_rows: int = 1, max_rows: int | None = None
    ) -> tuple[float, float] | None:
        """(fixed_s, per_row_s) of decode-only steps, fitted on those alone over the measured sizes
        in [min_rows, max_rows] (each weighted by its steps, up to 32); None until two sizes
        have been seen there (or when the fit is not positive)."""
        if self.window == 0:
            return None
        points = [
            (rows, wall, min(count, 32.0))
            for rows, (wall, count) in self.decode_walls.items()
            if rows >= min_rows and (max_rows is None or rows <= max_rows)
        ]
        if len(points) < 2:
            return None
        data = np.array(points, dtype=np.float64)  # [n, 3]: rows, wall, weight
        root = np.sqrt(data[:, 2])
        design = np.column_stack([np.ones(len(data)), data[:, 0]]) * root[:, None]
        fixed, per_row = (float(c) for c in np.linalg.lstsq(design, data[:, 1] * root, rcond=None)[0])
        if fixed <= 0 or per_row <= 0:
            return None
        return fixed, per_row

    def decode_step_costs(self, rows: int) -> tuple[float, float] | None:
        """(the wall time of a decode-only step of `rows` rows, what one more row adds), from the
        measured sizes. The step's own size gives its wall where measured (else the fit). A row
        adds the mean slope from that size to the larger sizes measured up to `2 * rows + 8` (the
        sizes its drafts make it; each weighted by its steps, up to 32): a secant from the step
        itself, so a step that changes kernels when it verifies drafts (a decode step of single
        rows against one with several rows per request) is charged the jump; else the slope of a
        fit over all sizes; with one size measured, a row is assumed to cost that step's wall over
        its rows plus one (a fixed part of one row's cost). None: no decode-only step measured."""
        if self.window == 0 or not self.decode_walls:
            return None
        fit: tuple[float, float] | None = None  # fitted only where needed: this runs every step
        measured = self.decode_walls.get(rows)
        if measured is not None:
            wall = measured[0]
        elif (fit := self.decode_coefficients()) is not None:
            wall = fit[0] + fit[1] * rows
        else:
            nearest = min(self.decode_walls, key=lambda r: abs(r - rows))
            wall = self.decode_walls[nearest][0] * (rows + 1) / (nearest + 1)
        slopes = [
            ((above - wall) / (size - rows), min(count, 32.0))
            for size, (above, count) in self.decode_walls.items()
            if rows < size <= 2 * rows + 8
        ]
        weight = sum(w for _, w in slopes)
        secant = sum(slope * w for slope, w in slopes) / weight if weight else 0.0
        if secant > 0:
            return wall, secant
        fit = fit or self.decode_coefficients()
        return wall, fit[1] if fit is not None else wall / (rows + 1)

    def coefficients(self) -> tuple[float, float, float]:
        """(fixed_s, per_token_s, per_row_s), each > 0."""
        prior = (self.prior_fixed_s, self.prior_per_token_s, self.prior_per_row_s)
        if len(self.samples) < 8:
            return prior
        data = np.array(self.samples, dtype=np.float64)  # [n, 3]: tokens, rows, wall
        design = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        if np.linalg.matrix_rank(design) < 3:  # sizes too alike to separate the terms
            return prior
        coefficients = np.linalg.lstsq(design, data[:, 2], rcond=None)[0]
        if not all(coefficients > 0):
            return prior
        fixed, per_token, per_row = (float(c) for c in coefficients)
        return fixed, per_token, per_row


@dataclass(frozen=True)
class DraftCandidate:
    """One request that may speculate this step."""

    request_id: str
    proposal: Sized  # proposed next tokens, or a `speculation_planner.Proposal` (only its length is read)
    acceptance: float  # its running acceptance rate, in (0, 1)


def plan_drafts(
    candidates: list[DraftCandidate],
    *,
    step_cost_s: float,
    step_yield: int,
    draft_cost_s: float,
    max_draft_tokens: int,
) -> dict[str, int]:
    """How many of its proposed tokens each candidate verifies this step (absent: none).

    `step_cost_s`: the step's predicted wall time without drafts; `step_yield`: the tokens it
    outputs without drafts (one per sampling request); `draft_cost_s`: what one more draft token
    adds to the step; `max_draft_tokens`: the token budget left for drafts."""
    expected = float(max(1, step_yield))
    cost = step_cost_s
    heap = [(-c.acceptance, c.request_id, 1, c.acceptance) for c in candidates if c.proposal]
    heapq.heapify(heap)
    lengths = {c.request_id: len(c.proposal) for c in candidates}
    planned: dict[str, int] = {}
    while heap and max_draft_tokens > 0:
        neg_gain, request_id, depth, acceptance = heap[0]
        gain = -neg_gain
        # Add while the expected tokens per second rise: (E + g) / (C + c) > E / C.
        if gain * cost <= expected * draft_cost_s:
            break
        heapq.heappop(heap)
        planned[request_id] = depth
        expected += gain
        cost += draft_cost_s
        max_draft_tokens -= 1
        if depth < lengths[request_id]:
            heapq.heappush(heap, (-(gain * acceptance), request_id, depth + 1, acceptance))
    return planned
