"""`SpeculationGuard`: per decode batch size, speculation runs only while it measures fewer
seconds per generated token than no speculation, and the other arm is re-measured now and then
(a workload whose acceptance changed). A fake clock stands in for the step times."""

from __future__ import annotations

import math
from pathlib import Path

from tandem import LLM, SamplingParams
from tandem.engine.spec.guard import SpeculationGuard


class Steps:
    """Drives a guard through decode steps whose wall time and tokens depend on the arm."""

    def __init__(self, guard: SpeculationGuard, clock: list[float]) -> None:
        self.guard, self.clock = guard, clock
        self.num_on = 0

    def run(self, num_steps: int, num_decoding: int, on: tuple[float, int], off: tuple[float, int]) -> float:
        """Steps of `num_decoding` requests; (seconds, tokens) of a step with speculation allowed
        or not. Returns the fraction of them that speculated."""
        speculated = 0
        for _ in range(num_steps):
            allowed = self.guard.begin_step(num_decoding, measured=True)
            wall, tokens = on if allowed else off
            self.clock[0] += wall
            self.guard.end_step(tokens)
            speculated += allowed
        return speculated / num_steps


def make_guard() -> tuple[SpeculationGuard, Steps]:
    clock = [0.0]
    guard = SpeculationGuard(clock=lambda: clock[0])
    return guard, Steps(guard, clock)


def test_speculation_that_measures_slower_is_turned_off_but_for_rare_checks() -> None:
    guard, steps = make_guard()
    # drafts rejected: a speculating step costs 30% more and yields the same one token
    share = steps.run(2000, 1, on=(0.013, 1), off=(0.010, 1))
    assert guard.stats()["1"]["speculate"] is False
    assert share < 0.03, share  # the first block, then a block every few hundred steps
    # the throughput lost against never speculating: under 1%
    assert (share * 0.013 + (1 - share) * 0.010) / 0.010 < 1.01


def test_speculation_that_measures_faster_stays_on() -> None:
    guard, steps = make_guard()
    share = steps.run(2000, 1, on=(0.013, 2), off=(0.010, 1))  # 1.54x the tokens per second
    assert guard.stats()["1"]["speculate"] is True
    assert share > 0.96, share


def test_each_batch_size_class_decides_alone_and_follows_a_changing_workload() -> None:
    guard, steps = make_guard()
    steps.run(500, 1, on=(0.013, 2), off=(0.010, 1))  # batch 1: drafts pay
    steps.run(500, 32, on=(0.060, 33), off=(0.040, 32))  # batch 32: they do not
    stats = guard.stats()
    assert stats["1"]["speculate"] is True and stats["32"]["speculate"] is False
    # batch 1's requests stop quoting their prompts: the drafts are rejected from now on
    steps.run(1000, 1, on=(0.013, 1), off=(0.010, 1))
    assert guard.stats()["1"]["speculate"] is False
    assert steps.run(200, 1, on=(0.013, 1), off=(0.010, 1)) < 0.1
    assert guard.num_switches == 1  # batch 1 changed its verdict once; first verdicts are not switches


def test_unmeasured_steps_follow_the_choice_without_counting() -> None:
    guard, steps = make_guard()
    steps.run(300, 1, on=(0.013, 1), off=(0.010, 1))
    before = dict(guard.stats()["1"])
    for _ in range(50):  # steps that also compute a prompt chunk
        assert guard.begin_step(1, measured=False) is False
        steps.clock[0] += 1.0  # slow, and not charged to either arm
        guard.end_step(1)
    assert guard.stats()["1"] == before


def test_a_disabled_guard_always_allows() -> None:
    guard = SpeculationGuard(enabled=False)
    assert all(guard.begin_step(1, measured=True) for _ in range(100))


def test_the_engine_measures_both_arms_and_keeps_greedy_tokens(tiny_model_dir: Path) -> None:
    """Through a real engine: decode steps of one request are measured under both arms (the
    first comparison), and whichever the guard runs, greedy tokens equal no speculation's."""
    prompt = "one two three four one two three four one two three four one two"
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    options = {"kv_cache_memory": 8 << 20, "dtype": "float32"}
    plain = LLM(str(tiny_model_dir), speculative=None, **options).generate([prompt], params)[0]
    llm = LLM(str(tiny_model_dir), speculative={"method": "ngram"}, **options)
    out = llm.generate([prompt], params)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    by_batch = llm.stats()["speculation_by_batch"]
    costs = (by_batch["1"]["on_s_per_token"], by_batch["1"]["off_s_per_token"])
    assert all(0 < cost < math.inf for cost in costs), by_batch
