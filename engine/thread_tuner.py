"""``ThreadTuner``: picks torch's thread count for one-token CPU steps by timing them while
serving (torch-free).

Why measured, not fixed: through the server on 2 vCPUs a lone gguf stream ran 103.9 tok/s on
one torch thread against 59.3 on two on one machine (an AMD EPYC, 2026-12-02, session 12), and
47.7 against 70.3 on another (an Intel Xeon, session 13): whether two OpenMP workers beat one
depends on how the vCPUs share cores with the event loop, which only the served process can
see. So while serving, the engine alternates the candidate counts in short blocks, keeps the
one whose steps took the least (median), and measures again every ``every`` one-token steps.
The tokens do not depend on the count (each output of our CPU kernels is summed by one thread).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class ThreadTuner:
    """Chooses among ``candidates`` (torch thread counts) for one-token steps.

    Per trial the candidates run in turn, ``block`` steps each, for ``rounds`` rounds; the
    first step of each block is not counted (the OpenMP pool resizes on it). The candidate
    with the lowest median step time wins and runs for the next ``every`` one-token steps,
    then a new trial starts (load on the machine changes).

    Args:
        candidates: distinct thread counts >= 1, e.g. ``(1, 2)``.
        block: steps per candidate per round (>= 2).
        rounds: rounds per trial (>= 1).
        every: one-token steps between trials (>= 0; 0 = never measure again).

    Raises:
        ValueError: fewer than 2 candidates, a count below 1, or a bad block/rounds/every.
    """

    candidates: tuple[int, ...]
    block: int = 8
    rounds: int = 3
    every: int = 4096
    chosen: int | None = None  # the winner of the last trial; None before the first ends
    trials: int = 0  # trials finished
    _times: dict[int, list[float]] = field(default_factory=dict, init=False)
    _step: int = field(default=0, init=False)  # one-token steps into the current phase
    _trying: bool = field(default=True, init=False)

    def __post_init__(self) -> None:
        if len(set(self.candidates)) < 2 or min(self.candidates) < 1:
            raise ValueError(f"thread candidates must be 2+ distinct counts >= 1, "
                             f"got {self.candidates}")
        if self.block < 2 or self.rounds < 1 or self.every < 0:
            raise ValueError("block must be >= 2, rounds >= 1 and every >= 0")
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
            if self.every and self._step >= self.every:
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
