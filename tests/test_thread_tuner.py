"""`ThreadTuner`: the thread count a step size runs with follows measured step times, on a quiet
host (all threads) and a shared one (one thread), and back."""

from __future__ import annotations

from tandem.engine.host.thread_tuner import ThreadTuner


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
    assert chosen[:2] == [4, 1]  # warm up, then time the other count once
    assert chosen[50:].count(4) >= 0.9 * len(chosen[50:])
    chosen = run(tuner, 200, busy)
    assert chosen[5:].count(1) >= 0.95 * len(chosen[5:])  # switched within a few steps
    chosen = run(tuner, 200, quiet)
    assert chosen[10:].count(4) >= 0.85 * len(chosen[10:])  # and back when the host quietens
    # size classes are tuned apart: a prefill of 512 tokens has its own measurements
    assert tuner.size_class(512) != tuner.size_class(1)
    assert run(tuner, 3, {4: 0.001, 1: 0.004}, num_tokens=512) == [4, 1, 4]


def test_one_thread_is_never_tuned() -> None:
    tuner = ThreadTuner(1)
    assert run(tuner, 20, {1: 0.01}) == [1] * 20


def test_one_slow_wake_up_step_does_not_decide() -> None:
    """Trying more threads after running on one, the first step pays for waking them: that count
    is timed over a block of 3 steps, the first left out, so a host that quietened gets its
    threads back instead of staying on one thread for hundreds of steps."""
    tuner = ThreadTuner(2, explore_every=10)
    run(tuner, 100, {2: 0.120, 1: 0.015})  # busy: one thread wins
    assert tuner.choose(1) == 1
    tuner.observe(1, 1, 0.015)
    chosen, wakes = [], iter([0.050, 0.007, 0.007])  # quiet again: the first two-thread step wakes them up
    for _ in range(40):
        threads = tuner.choose(1)
        chosen.append(threads)
        tuner.observe(1, threads, next(wakes, 0.007) if threads == 2 else 0.009)
    assert chosen[:4] == [1, 1, 1, 1] and chosen[4:7] == [2, 2, 2], chosen  # moved: timed over a block
    assert chosen[7:].count(2) >= 0.85 * len(chosen[7:]), chosen  # back on its threads
