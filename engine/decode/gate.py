"""Whether the draft head drafts this round: decided by measuring, in the answers themselves, what it buys.

A head pays only where the drafts it gets accepted save more base-model time than drafting and verifying them
cost, and that depends on the machine, its load, the head and the text: on two CPU cores the shipped head makes
MT-bench answers slower than drafting from the context alone (docs/benchmarks.md). So the gate runs windows of
rounds with the head drafting and without it (the context's chains alone, or a plain step where there are none),
and gives most windows to the arm that decodes more tokens a second. A text's own speed swings by half from one
passage to the next (a list the context drafts well, then prose), far more than the arms differ, so arms are only
compared where they are adjacent: each switch gives one sample, the ratio of the head's window to the other arm's
next to it, and the median of the recent samples decides. The slower arm still gets a window now and then, so a
change of text or load is noticed: as often as keeps what exploring costs near EXPLORING_COST of the speed.

Which tokens are drafted never changes the output's law (verification decides), so the gate is as lossless as
EAGLE; greedy answers keep their tokens, and a seeded sampler keeps the gate off (DecodeParams.gated).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import median

WINDOW = 16  # rounds an arm runs before the gate decides again
RECENT = 9  # samples the median takes: two held-up windows (up to four samples) do not turn the gate
EXPLORING_COST = 0.01  # the share of the speed that windows on the slower arm may cost
MAX_PERIOD = 32  # explore at least once every MAX_PERIOD windows, however far behind the other arm is


@dataclass
class HeadGate:
    """The head's arm (`head` True) against drafting without it, over windows of `window` rounds: the first window
    drafts with the head, the second without, then the ratio of their speeds decides (ties go to the head)."""

    window: int = WINDOW
    head: bool = True  # the arm of the current window
    ratios: list[float] = field(default_factory=list)  # the head's speed over the other arm's, adjacent windows
    _last: tuple[bool, float] | None = None  # the arm and speed of the window before
    _tokens: int = 0
    _seconds: float = 0.0
    _rounds: int = 0
    _since_explored: int = 0  # windows on the faster arm since the slower one last had one

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"the gate's window must be at least 1 round, got {self.window}")

    def observe(self, tokens: int, seconds: float) -> None:
        """Count one round of the current arm (its wall time, drafting and the head's catch-up included)."""
        self._tokens, self._seconds, self._rounds = self._tokens + tokens, self._seconds + seconds, self._rounds + 1
        if self._rounds < self.window:
            return
        if self._seconds > 0:
            speed = self._tokens / self._seconds
            if self._last is not None and self._last[0] != self.head:
                head, other = (speed, self._last[1]) if self.head else (self._last[1], speed)
                self.ratios = (self.ratios + [head / other])[-RECENT:]
            self._last = (self.head, speed)
        self._tokens, self._seconds, self._rounds = 0, 0.0, 0
        self.head = self._next_arm()

    @property
    def head_ratio(self) -> float | None:
        """The head's arm's speed over the other's (median of the recent samples); None before the first."""
        return median(self.ratios) if self.ratios else None

    def _next_arm(self) -> bool:
        ratio = self.head_ratio
        if ratio is None:
            return not self.head  # the second window runs the other arm
        faster = ratio >= 1
        gap = max(ratio, 1 / ratio) - 1
        period = min(MAX_PERIOD, max(2, math.ceil(gap / EXPLORING_COST)))  # one window in `period` on the slower arm
        self._since_explored += 1
        if self._since_explored >= period:
            self._since_explored = 0
            return not faster
        return faster
