"""How many threads a pass of the kernels gets: chosen at run time, by timing.

On a quiet machine every core helps. When another process keeps a core
busy, the thread that shares that core runs only part of the time, and each
of the tens to hundreds of parallel loops of a pass waits at its end for it: the
whole pass slows to the pace of the shared core. One thread fewer then wins.
So every pass is timed, and now and then run with one thread fewer or more;
the count moves where passes of the same size ran faster. Probes grow rare
while they lose (one in up to 256 passes; below all threads, one in up to
32, since a pass with fewer threads cannot see the other cores free up),
and one comes at once when the pass time jumps either way and stays there:
the load changed.

The count never exceeds `torch.get_num_threads()`, and it does not change a
result: every output of a kernel is summed by one thread, whatever the count.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

Result = TypeVar("Result")

FIRST_PROBE = 8  # passes before the first probe, and again once a probe has moved the count
LAST_PROBE = 256  # the longest interval between two probes
LAST_PROBE_BELOW = 32  # the same while running with fewer than all threads
WIN = 0.9  # a probe must be this much faster (time ratio) to move the count
JUMP = 1.5  # JUMPS passes in a row this much slower or faster than usual: the load changed
JUMPS = 3
NEW_WEIGHT = 0.3  # of a new time in the running mean of its (size, count)


class ThreadChooser:
    """Times the passes of one model and picks their thread count."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock  # seconds; the tests give a fake one
        self.most = 1  # torch.get_num_threads() at the latest pass
        self.count: int | None = None  # threads of an ordinary pass; None: all there are
        self.mean: dict[tuple[int, int], float] = {}  # (pass size, threads) -> running mean seconds
        self.interval = FIRST_PROBE
        self.countdown = FIRST_PROBE
        self.probe_fewer = True  # the next probe tries count - 1 (else count + 1)
        self.jumps = 0  # passes in a row far from their usual time

    def run(self, size: int, work: Callable[[], Result]) -> Result:
        """work() with the chosen number of threads; `size` (the tokens of the
        pass, B x T) keys the times, so only passes of one size are compared."""
        most = self.most = torch.get_num_threads()
        if most == 1:
            return work()
        self.count = min(self.count or most, most)
        threads = self.next_threads()
        torch.set_num_threads(threads)
        try:
            start = self.clock()
            result = work()
            self.record(size, threads, self.clock() - start)
        finally:
            torch.set_num_threads(most)
        return result

    def next_threads(self) -> int:
        self.countdown -= 1
        if self.countdown > 0:
            return self.count
        self.countdown = self.interval
        fewer = (self.probe_fewer and self.count > 1) or self.count == self.most
        self.probe_fewer = not self.probe_fewer
        return self.count - 1 if fewer else self.count + 1

    def record(self, size: int, threads: int, seconds: float) -> None:
        usual = self.mean.get((size, threads))
        if threads != self.count:  # a probe: move if it won, else probe less often
            ordinary = self.mean.get((size, self.count))
            self.mean[size, threads] = seconds  # what this count costs now, not in an older load
            if ordinary is not None and seconds < WIN * ordinary:
                self.count, self.interval = threads, FIRST_PROBE
            else:
                self.interval = min(2 * self.interval, LAST_PROBE if self.count == self.most else LAST_PROBE_BELOW)
            self.countdown = self.interval
        elif usual is not None and not usual / JUMP < seconds < usual * JUMP:
            self.jumps += 1
            if self.jumps == JUMPS:  # the load changed (not just one slow pass): probe now
                self.mean[size, threads] = seconds
                self.countdown, self.jumps = 1, 0
        else:
            self.mean[size, threads] = seconds if usual is None else usual + NEW_WEIGHT * (seconds - usual)
            self.jumps = 0
