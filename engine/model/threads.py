"""CPU threads that follow the machine's load: every core while the engine has them to itself, fewer while other
processes want some.

torch's OpenMP threads wait for each other at the end of every parallel operation, spinning on their core. When
another process holds one of two cores, the thread that shares it is descheduled mid-operation and its partner
spins until it comes back: decoding with two threads then runs far slower than with one (docs/benchmarks.md,
"Busy machine"). Between two decoding steps the governor looks at how much CPU other processes used since its last look
(from /proc/stat and /proc/self/stat, Linux only) and sets the thread count to the cores they leave free.

Processes at a positive nice level (background jobs) are not counted: they yield to the engine anyway. Every
layer the engine runs gives the same bits whatever the thread count (tests/test_threads.py), so switching
threads between steps never changes the output.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_seconds() -> tuple[float, float] | None:
    """(CPU seconds of every process but niced ones, this process's CPU seconds), or None off Linux."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        mine = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    user, _nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + system + irq + softirq + steal) / _TICKS, (int(mine[11]) + int(mine[12])) / _TICKS


class ThreadGovernor:
    """Sets torch's thread count between steps: `cores` minus the cores other processes kept busy lately."""

    def __init__(self, cores: int | None = None, window_s: float = 0.3, spare: float = 0.4):
        """window_s: the shortest span a load reading covers; spare: how much of a core others may use before the
        engine gives that core up (a browser repainting now and then uses less)."""
        self.cores = cores or torch.get_num_threads()
        self.window_s, self.spare = window_s, spare
        self._since: tuple[float, float, float] | None = None
        self.others = 0.0  # cores other processes used over the last reading

    def start(self) -> None:
        """Begin a reading at the start of a generation (idle time before it says nothing about contention)."""
        times = _busy_seconds()
        self._since = None if times is None else (time.monotonic(), *times)

    def update(self) -> int:
        """Re-read the load if a window has passed and set the thread count; returns the count in effect."""
        if self._since is None or time.monotonic() - self._since[0] < self.window_s:  # reading /proc is not free
            return torch.get_num_threads()
        now, times = time.monotonic(), _busy_seconds()
        started, total_then, mine_then = self._since
        if times is not None:
            total, mine = times
            self.others = max(0.0, (total - total_then) - (mine - mine_then)) / (now - started)
            self._since = (now, total, mine)
            wanted = self.threads_for(self.others)
            if wanted != torch.get_num_threads():
                torch.set_num_threads(wanted)
        return torch.get_num_threads()

    def threads_for(self, others: float) -> int:
        """Threads to use when other processes keep `others` cores busy."""
        taken = int(others + 1 - self.spare)  # a core counts as taken once others use more than `spare` of it
        return max(1, self.cores - taken)
