"""`ThreadTuner`: the thread count a step size runs with follows measured step times, on a quiet
host (all threads) and a shared one (one thread), and back."""

from __future__ import annotations

from tandem.engine.thread_tuner import ThreadTuner


def run(tuner: ThreadTuner, steps: int, cost_per_token: dict[int, float], num_tokens: int = 1) -> list[int]:
    """Feed `steps` steps whose wall time per token is `cost_per_token[threads]`; the counts chosen."""
    chosen = []
    for _ in range(steps):
        threads = tuner.choose(num_tokens)
        tuner.observe(num_tokens, threads, cost_per_token[threads] * num_tokens)
        chosen.append(threads)
    return chosen


def test_the_faster_count_wins_and_a_changed_host_is_followed() -> None:
    tuner = ThreadTuner(4, explore_every=10)
    quiet = {4: 0.007, 1: 0.011}  # every core helps
    busy = {4: 0.120, 1: 0.015}  # neighbours: a step on every core waits at each barrier
    chosen = run(tuner, 200, quiet)
    assert chosen[:5] == [4, 1, 1, 1, 4]  # warm up, then time the other count over a block of 3 steps
    assert chosen[50:].count(4) >= 0.9 * len(chosen[50:])
    chosen = run(tuner, 200, busy)
    assert chosen[5:].count(1) >= 0.95 * len(chosen[5:])  # switched within a few steps
    chosen = run(tuner, 200, quiet)
    assert chosen[10:].count(4) >= 0.85 * len(chosen[10:])  # and back when the host quietens
    # size classes are tuned apart: a prefill of 512 tokens has its own measurements
    assert tuner.size_class(512) != tuner.size_class(1)
    assert run(tuner, 5, {4: 0.001, 1: 0.004}, num_tokens=512) == [4, 1, 1, 1, 4]


def test_one_thread_is_never_tuned() -> None:
    tuner = ThreadTuner(1)
    assert run(tuner, 20, {1: 0.01}) == [1] * 20


def test_one_slow_step_of_a_block_does_not_decide() -> None:
    """The first step after a change of count pays for waking threads: the block's median counts,
    so one slow step does not decide the count for the hundreds of steps until the next check."""
    tuner = ThreadTuner(2, explore_every=10)
    one_thread = iter([0.030, 0.011, 0.011])  # the block: a slow first step, then the count's own cost
    chosen = []
    for _ in range(6):
        threads = tuner.choose(1)
        chosen.append(threads)
        tuner.observe(1, threads, 0.007 if threads == 2 else next(one_thread))
    assert chosen == [2, 1, 1, 1, 2, 2]
    assert tuner.cost[(0, 1)] == 0.011
