"""`SpeculationGuard`: speculation stays on only where it measured faster than off (no torch).

The planner drafts where its step-cost model predicts drafts pay, but a prediction can be wrong
on a CPU it was not fitted on, and it leaves out what proposing costs (the n-gram lookups, the
draft head's passes, the planning itself). So the outcome is measured. Per class of decode-only
step (the decoding requests in it, in powers of two) the guard keeps, for each arm (speculation
allowed, where the planner decides the drafts, and not allowed), the wall seconds per generated
token of that arm's recent steps, and runs the cheaper arm. The other arm runs a block of steps
now and then, to follow a workload whose acceptance changed: at once when the chosen arm's cost
moved by half since the two were compared, else after `explore_every` steps of the class, or
more where the other arm measured much worse, so that re-measuring it costs at most
`max_explore_loss` of the class's throughput (block * (ratio - 1) / interval), and at most
`max_interval` steps; the first verdict of a class is re-checked after `explore_every` steps
whatever its ratio (its blocks ran first: a draft head's first few hundred steps run slower). A
new class runs a block of each arm first, speculation allowed first.

Steps that also compute a prompt chunk are not measured (a chunk's cost would drown the drafts'),
but follow their class's choice. A step's wall time runs from planning to the end of its update
(`begin_step` to `end_step`), so everything speculation adds is in it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

ON, OFF = True, False


@dataclass
class _ClassState:
    samples: dict[bool, deque[tuple[float, int]]] = field(default_factory=dict)  # arm -> (wall_s, tokens)
    arm: bool = ON  # the arm its steps run now
    chosen: bool = ON  # the arm the last comparison chose
    num_comparisons: int = 0
    block_left: int = 0  # steps left of an exploring block (0: running the chosen arm)
    steps_since_explored: int = 0
    cost_when_compared: float = math.inf  # the chosen arm's cost at the last comparison

    def cost(self, arm: bool) -> float:
        """Seconds per generated token of the arm's recent steps (inf: not measured)."""
        samples = self.samples.get(arm)
        if not samples:
            return math.inf
        return sum(w for w, _ in samples) / max(1, sum(n for _, n in samples))


class SpeculationGuard:
    def __init__(
        self,
        *,
        enabled: bool = True,
        block_steps: int = 6,
        explore_every: int = 96,
        max_explore_loss: float = 0.005,
        max_interval: int = 2000,
        window: int = 24,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.enabled = enabled  # False: speculation always allowed, nothing measured
        self.block_steps = block_steps
        self.explore_every = explore_every
        self.max_explore_loss = max_explore_loss
        self.max_interval = max_interval
        self.window = window
        self.clock = clock
        self.classes: dict[int, _ClassState] = {}
        self._step: tuple[int, bool, float] | None = None  # (class, arm, started) of a measured step
        self.num_switches = 0

    @staticmethod
    def size_class(num_decoding: int) -> int:
        return max(0, math.ceil(math.log2(max(1, num_decoding))))

    def begin_step(self, num_decoding: int, *, measured: bool) -> bool:
        """Whether speculation is allowed in a step with `num_decoding` decoding requests;
        `measured`: the step decodes only (its time then counts for its arm at `end_step`)."""
        if not self.enabled:
            return True
        size = self.size_class(num_decoding)
        state = self.classes.setdefault(size, _ClassState(block_left=self.block_steps))
        self._step = (size, state.arm, self.clock()) if measured else None
        return state.arm

    def end_step(self, num_generated: int) -> None:
        """The step `begin_step` opened generated `num_generated` tokens (accepted drafts included)."""
        if self._step is None:
            return
        size, arm, started = self._step
        self._step = None
        state = self.classes[size]
        samples = state.samples.setdefault(arm, deque(maxlen=self.window))
        if state.block_left == self.block_steps:  # an exploring block's first step: the old samples are stale
            samples.clear()
        samples.append((self.clock() - started, num_generated))
        if state.block_left > 0:
            state.block_left -= 1
            if state.block_left == 0:
                self._block_done(state)
        else:
            state.steps_since_explored += 1
            self._maybe_explore(state)

    def _block_done(self, state: _ClassState) -> None:
        first = state.num_comparisons == 0
        if first and OFF not in state.samples:
            state.arm, state.block_left = OFF, self.block_steps  # the first comparison's other arm
            return
        best = ON if state.cost(ON) <= state.cost(OFF) else OFF
        if best != state.chosen and not first:
            self.num_switches += 1
        state.arm, state.chosen, state.steps_since_explored = best, best, 0
        state.cost_when_compared = state.cost(best)
        state.num_comparisons += 1

    def _maybe_explore(self, state: _ClassState) -> None:
        chosen = state.cost(state.arm)
        moved = not 2 / 3 < chosen / state.cost_when_compared < 3 / 2
        ratio = min(state.cost(not state.arm) / max(chosen, 1e-12), 1e6)
        interval = min(
            self.max_interval, max(self.explore_every, self.block_steps * (ratio - 1) / self.max_explore_loss)
        )
        if state.num_comparisons == 1:  # the first verdict is checked once soon: its blocks ran cold
            interval = self.explore_every
        if moved or state.steps_since_explored >= interval:
            state.arm, state.block_left = not state.arm, self.block_steps

    def stats(self) -> dict[str, dict[str, float | bool]]:
        """Per class (its largest decode batch): the arm chosen and each arm's seconds per token."""
        out: dict[str, dict[str, float | bool]] = {}
        for size, state in sorted(self.classes.items()):
            out[str(2**size)] = {
                "speculate": state.chosen,
                "on_s_per_token": state.cost(ON), "off_s_per_token": state.cost(OFF),
            }  # fmt: skip
        return out
