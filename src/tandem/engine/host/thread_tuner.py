"""`ThreadTuner`: how many intra-op threads a step runs with, chosen by measured step times.

On a CPU that other processes share, a step split over every core waits at each parallel
region's barrier for the thread the kernel descheduled: a batch-1 decode step of the default
model (about a hundred parallel regions) then runs many times slower on every core than on one
(figures: docs/performance.md, "a shared CPU"). On a quiet CPU all threads win. No flag tells the
two apart in advance, so the tuner measures. Per class of step size (tokens in the step besides
speculative drafts, in powers of two) it keeps the wall time per computed token under each
candidate count (one thread, and the most it may use) and runs the cheaper one. It times the
other count again when the chosen one's cost moved by a third since the two were compared, the
way that favours the other (all threads slower: neighbours came; one thread faster: they left),
and otherwise every `explore_every` blocks' worth of steps of the class, times how much worse the
other measured (up to 16 times). A class's first estimate of the other count is one step (a rare
class, such as a batch-1 prompt, would otherwise spend several requests on one thread); every
later check times a block of `explore_steps` steps and averages all but the first, which wakes
parked threads: on a shared CPU single steps are noisy (one unlucky step had kept a host on the
wrong count for hundreds of steps), and a median would hide the slow tail that is all-thread
steps' cost there. No torch here: the engine applies the count.
"""

from __future__ import annotations

import math


class ThreadTuner:
    def __init__(
        self, max_threads: int, *, explore_every: int = 48, smoothing: float = 0.25, explore_steps: int = 3
    ) -> None:
        self.max_threads = max_threads
        self.explore_steps = explore_steps
        self.candidates = (max_threads, 1) if max_threads > 1 else (max_threads,)
        self.explore_every = explore_every
        self.smoothing = smoothing
        self.cost: dict[tuple[int, int], float] = {}  # (size class, threads) -> seconds per token
        self.num_steps: dict[int, int] = {}  # size class -> steps seen
        self.cost_when_compared: dict[int, float] = {}  # size class -> the chosen count's cost then
        # size class -> (the count its steps try, their costs so far, the block's length)
        self.exploring: dict[int, tuple[int, list[float], int]] = {}
        self.num_switches = 0

    @staticmethod
    def size_class(num_tokens: int) -> int:
        return max(0, math.ceil(math.log2(max(1, num_tokens))))

    def choose(self, num_tokens: int) -> int:
        """The thread count for a step of `num_tokens` tokens."""
        if len(self.candidates) == 1:
            return self.max_threads
        size = self.size_class(num_tokens)
        seen = self.num_steps.get(size, 0)
        self.num_steps[size] = seen + 1
        block = self.exploring.get(size)
        if block is not None:
            return block[0]
        unmeasured = [t for t in self.candidates if (size, t) not in self.cost]
        if unmeasured and seen >= 1:  # the first step warms up on every core, then each count is timed
            self.exploring[size] = (unmeasured[0], [], 1)  # a first estimate: one step
            return unmeasured[0]
        best = min(
            self.candidates,
            key=lambda t: self.cost.get((size, t), math.inf if t != self.max_threads else 0.0),
        )
        other = next(t for t in self.candidates if t != best)
        # Follow a host that changed: try the other count when the chosen one's cost moved by a
        # third since the two were last compared the way that favours the other (all threads
        # slower: neighbours came, try one; one thread faster: they left, try all; one thread
        # beside two spinning neighbours runs about 1.5x slower than alone), else now and then,
        # the rarer the worse it measured (a step on the wrong count costs that ratio).
        best_cost = self.cost.get((size, best), 0.0)
        then = self.cost_when_compared.get(size)
        change = best_cost / then if then is not None and best_cost > 0 else 1.0
        moved = change > 4 / 3 if best == self.max_threads else change < 3 / 4
        ratio = self.cost.get((size, other), math.inf) / max(best_cost, 1e-12)
        interval = self.explore_every * self.explore_steps * (16 if not ratio < 16 else max(1, round(ratio)))
        if moved or (seen and seen % interval == 0):
            self.exploring[size] = (other, [], self.explore_steps)
            return other
        return best

    def observe(self, num_tokens: int, threads: int, wall_s: float, num_computed: int | None = None) -> None:
        """A step of `num_tokens` (its size, as given to `choose`) ran with `threads` threads in
        `wall_s` seconds, computing `num_computed` tokens (default `num_tokens`; more with
        speculative drafts, which the cost is divided by so that steps with and without drafts
        compare within one size)."""
        if num_tokens <= 0 or wall_s <= 0 or len(self.candidates) == 1:
            return
        size = self.size_class(num_tokens)
        key = (size, threads)
        per_token = wall_s / max(num_tokens, num_computed or 0)
        block = self.exploring.get(size)
        if block is not None and block[0] == threads:
            block[1].append(per_token)
            if len(block[1]) >= block[2]:
                # The block replaces what the count measured before (the host may have changed
                # since); its first step, which woke parked threads, is left out, the rest averaged.
                samples = block[1][1:] or block[1]
                self.cost[key] = sum(samples) / len(samples)
                del self.exploring[size]
                # what "moved" is measured against: the cheaper count's cost at this comparison
                self.cost_when_compared[size] = min(
                    self.cost.get((size, t), math.inf) for t in self.candidates
                )
            return
        previous = self.cost.get(key)
        self.cost[key] = per_token if previous is None else previous + self.smoothing * (per_token - previous)
