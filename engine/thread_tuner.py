"""``ThreadTuner``: picks torch's thread count for one-token CPU steps by timing them while
serving (torch-free).

Why measured, not fixed: on 2 vCPUs a lone stream runs much faster on one torch thread on some
machines and on two on others (docs/benchmarks.md): whether two OpenMP workers beat one
depends on how the vCPUs share cores with the event loop, which only the served process can
see. So while serving, the engine alternates the candidate counts in short blocks, keeps the
one whose steps took the least (median), and measures again after ``every`` one-token steps or
``every_s`` seconds, whichever comes first. The tokens do not depend on the count (each output
of our CPU kernels is summed by one thread).

Why seconds too: a trial taken while another process holds a core can choose the slower
count, and a server that mostly batches may not run ``every`` one-token steps for many minutes;
all that time its lone streams would run at about half speed.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class ThreadTuner:
    """Chooses among ``candidates`` (torch thread counts) for one-token steps.

    Per trial the candidates run in turn, ``block`` steps each, for ``rounds`` rounds; the
    first step of each block is not counted (the OpenMP pool resizes on it). The candidate
    with the lowest median step time wins and runs until ``every`` one-token steps have run or
    ``every_s`` seconds have passed since the trial ended, then a new trial starts (load on the
    machine changes).

    Args:
        candidates: distinct thread counts >= 1, e.g. ``(1, 2)``.
        block: steps per candidate per round (>= 2).
        rounds: rounds per trial (>= 1).
        every: one-token steps between trials (>= 0; 0 = never by count).
        every_s: seconds between trials (>= 0; 0 = never by time). A trial costs
            ``trial_steps`` steps, half of them on the slower count: at 60 s, about 1% of an
            fp32 stream on 2 vCPUs.
        clock: seconds, monotonic (``time.monotonic``; tests pass their own).

    Raises:
        ValueError: fewer than 2 candidates, a count below 1, or a bad block, rounds, every
            or every_s.
    """

    candidates: tuple[int, ...]
    block: int = 8
    rounds: int = 3
    every: int = 4096
    every_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    chosen: int | None = None  # the winner of the last trial; None before the first ends
    trials: int = 0  # trials finished
    _times: dict[int, list[float]] = field(default_factory=dict, init=False)
    _step: int = field(default=0, init=False)  # one-token steps into the current phase
    _trying: bool = field(default=True, init=False)
    _chosen_at: float = field(default=0.0, init=False)  # clock() when the last trial ended

    def __post_init__(self) -> None:
        if len(set(self.candidates)) < 2 or min(self.candidates) < 1:
            raise ValueError(f"thread candidates must be 2+ distinct counts >= 1, "
                             f"got {self.candidates}")
        if self.block < 2 or self.rounds < 1 or self.every < 0 or not self.every_s >= 0:
            raise ValueError("block must be >= 2, rounds >= 1, every >= 0 and every_s >= 0")
        self._times = {c: [] for c in self.candidates}

    @property
    def trial_steps(self) -> int:
        return self.block * self.rounds * len(self.candidates)

    def threads(self) -> int:
        """The thread count for the next one-token step."""
        if self._trying:
            return self.candidates[(self._step // self.block) % len(self.candidates)]
        assert self.chosen is not None
        return self.chosen

    def record(self, threads: int, seconds: float) -> None:
        """Reports the step just run on ``threads`` (what ``threads()`` returned) and its wall
        time in seconds; advances the schedule."""
        if not self._trying:
            self._step += 1
            if (self.every and self._step >= self.every) or \
                    (self.every_s and self.clock() - self._chosen_at >= self.every_s):
                self._trying, self._step = True, 0
            return
        if self._step % self.block:  # not the first step of its block
            self._times[threads].append(seconds)
        self._step += 1
        if self._step < self.trial_steps:
            return
        medians = {c: statistics.median(t) for c, t in self._times.items()}
        self.chosen = min(self.candidates, key=lambda c: (medians[c], c))
        self.trials += 1
        logger.info("one-token steps: %s; running them on %d torch threads",
                    ", ".join(f"{c} threads {1000 * m:.2f} ms" for c, m in medians.items()),
                    self.chosen)
        self._times = {c: [] for c in self.candidates}
        self._trying, self._step = False, 0
        self._chosen_at = self.clock()
