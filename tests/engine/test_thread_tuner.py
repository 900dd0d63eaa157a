"""``ThreadTuner``: the thread count for one-token steps is the one measured fastest, and it is
measured again later."""

from __future__ import annotations

import logging

import pytest

from engine.thread_tuner import ThreadTuner


def drive(tuner: ThreadTuner, cost: dict[int, float], steps: int) -> list[int]:
    """Runs ``steps`` one-token steps, each taking ``cost[threads]`` seconds; the counts used."""
    used = []
    for _ in range(steps):
        n = tuner.threads()
        used.append(n)
        tuner.record(n, cost[n])
    return used


@pytest.mark.parametrize(("cost", "winner"), [({1: 0.020, 2: 0.013}, 2),
                                              ({1: 0.009, 2: 0.017}, 1),
                                              ({1: 0.010, 2: 0.010}, 1)])  # a tie: fewer
def test_the_faster_count_wins_the_trial(cost, winner):
    tuner = ThreadTuner((1, 2), block=4, rounds=2, every=100)
    assert tuner.trial_steps == 16
    used = drive(tuner, cost, 16)
    # Blocks of 4 in turn, two rounds.
    assert used == [1] * 4 + [2] * 4 + [1] * 4 + [2] * 4
    assert tuner.chosen == winner and tuner.trials == 1
    assert drive(tuner, cost, 50) == [winner] * 50


def test_the_first_step_of_each_block_is_not_counted():
    """The step after a switch pays for resizing the OpenMP pool; it must not decide."""
    tuner = ThreadTuner((1, 2), block=4, rounds=1, every=0)
    times = {1: [0.5, 0.010, 0.010, 0.010], 2: [0.001, 0.012, 0.012, 0.012]}
    for n in (1, 2):
        for t in times[n]:
            assert tuner.threads() == n
            tuner.record(n, t)
    assert tuner.chosen == 1  # 10 ms beats 12 ms; the outliers (500 ms, 1 ms) were skipped


def test_it_measures_again_after_every_steps_and_follows_a_change():
    tuner = ThreadTuner((1, 2), block=2, rounds=1, every=10)
    drive(tuner, {1: 0.02, 2: 0.01}, 4)
    assert tuner.chosen == 2
    assert drive(tuner, {1: 0.02, 2: 0.01}, 10) == [2] * 10
    # The machine got busier: two threads now lose. The next trial sees it.
    used = drive(tuner, {1: 0.01, 2: 0.03}, 4)
    assert used == [1, 1, 2, 2] and tuner.chosen == 1 and tuner.trials == 2


def test_it_measures_again_after_every_s_seconds_even_between_few_steps():
    """A server that mostly batches runs few one-token steps: the count must not stay on a
    choice made under a passing load until thousands of them have run (many minutes)."""
    now = [100.0]
    tuner = ThreadTuner((1, 2), block=2, rounds=1, every=4096, every_s=60, clock=lambda: now[0])
    drive(tuner, {1: 0.05, 2: 0.12}, 4)  # another process held a core: one thread won
    assert tuner.chosen == 1
    now[0] += 59
    assert drive(tuner, {1: 0.05, 2: 0.025}, 20) == [1] * 20  # not yet a minute
    now[0] += 1
    drive(tuner, {1: 0.05, 2: 0.025}, 1)  # the step that sees the minute is up
    used = drive(tuner, {1: 0.05, 2: 0.025}, 4)
    assert used == [1, 1, 2, 2] and tuner.chosen == 2 and tuner.trials == 2
    assert drive(tuner, {1: 0.05, 2: 0.025}, 30) == [2] * 30


def test_every_zero_keeps_the_first_choice():
    tuner = ThreadTuner((3, 4), block=2, rounds=1, every=0, every_s=0)
    drive(tuner, {3: 0.01, 4: 0.02}, 4)
    assert drive(tuner, {3: 0.05, 4: 0.01}, 1000) == [3] * 1000 and tuner.trials == 1


def test_the_choice_is_logged_without_request_data(caplog):
    tuner = ThreadTuner((1, 2), block=2, rounds=1)
    with caplog.at_level(logging.INFO, logger="engine.thread_tuner"):
        drive(tuner, {1: 0.02, 2: 0.01}, 4)
    assert caplog.messages == [("one-token steps: 1 threads 20.00 ms, 2 threads 10.00 ms; "
                                "running them on 2 torch threads")]


@pytest.mark.parametrize("kwargs", [{"candidates": (2,)}, {"candidates": (2, 2)},
                                    {"candidates": (0, 1)},
                                    {"candidates": (1, 2), "block": 1},
                                    {"candidates": (1, 2), "rounds": 0},
                                    {"candidates": (1, 2), "every": -1},
                                    {"candidates": (1, 2), "every_s": -1.0},
                                    {"candidates": (1, 2), "every_s": float("nan")}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        ThreadTuner(**kwargs)
