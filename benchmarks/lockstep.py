"""Timing decoding methods in lockstep, so that a machine whose speed swings
moves them all alike.

On a shared machine the memory bandwidth can change severalfold within
seconds. Runs timed one after the other then see different machines, and a
ratio of their times measures the machine as much as the methods. Here the
methods take turns: the one with the fewest tokens so far runs until its next
step boundary, where it pauses. Every method thus reaches its k-th token at
about the same moment, and a slow phase lands on all of them at the same
point of their runs. A method's seconds are the sum of its own turns, and its
result is what its call returned: lockstep changes when the work is done,
not what is computed.

The methods are greenlets (coroutines with their own stacks) on the calling
thread, not threads: each OS thread that runs PyTorch or the C kernels gets
an OpenMP pool of its own, and with more pooled threads than cores OpenMP
puts idle workers to sleep after a few spins, which makes every parallel
loop wait for a wake-up. A pass of the gpt2 shape then takes 1.3x as long
(docs/performance.md). One thread keeps one pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from greenlet import greenlet

# A method: called with `pause`, which it calls at each step boundary with its
# token count so far; returns its result.
Method = Callable[[Callable[[int], None]], Any]


@dataclass
class Runner:
    call: Method
    tokens: int = 0
    seconds: float = 0.0
    started: float = 0.0
    done: bool = False
    result: Any = None
    coroutine: Any = None


def current() -> Any:
    """The coroutine running now: a method can tell its own work from the others'."""
    return greenlet.getcurrent()


def lockstep(methods: dict[str, Method], clock: Callable[[], float]) -> dict[str, tuple[float, Any]]:
    """Runs `methods` in lockstep (see the module docstring); ties go to the
    earlier name. Returns {name: (seconds, result)}. An exception in a
    method is raised here."""
    runners = {name: Runner(call) for name, call in methods.items()}
    by_coroutine = {}

    def pause(tokens: int) -> None:  # inside a method: hand the turn back to the loop below
        me = by_coroutine[greenlet.getcurrent()]
        me.seconds += clock() - me.started
        me.tokens = tokens
        me.coroutine.parent.switch()
        me.started = clock()

    def body(me: Runner) -> None:
        me.started = clock()
        me.result = me.call(pause)
        me.seconds += clock() - me.started
        me.done = True

    for r in runners.values():
        r.coroutine = greenlet(lambda r=r: body(r))
        by_coroutine[r.coroutine] = r
    # Every method enters and leaves inference mode (a thread-wide state) from
    # inside it, so whichever finishes first leaves it on for the others.
    with torch.inference_mode():
        while active := [r for r in runners.values() if not r.done]:
            min(active, key=lambda r: r.tokens).coroutine.switch()  # min keeps the first of equals
    return {name: (r.seconds, r.result) for name, r in runners.items()}
