"""Timing decoding methods in lockstep, so that a machine whose speed swings
moves them all alike.

On a shared machine the memory bandwidth can change severalfold within
seconds, so runs timed one after the other see different machines. Here the
methods take turns: the one with the fewest tokens so far runs until its next
step boundary, where it pauses, so every method reaches its k-th token at
about the same moment. A method's seconds are the sum of its own turns, and
its result is what its call returned: lockstep changes when the work is done,
not what is computed. (Every method's KV caches are alive at once.) A method
pauses where its call lets it: `paused_passes` before each target pass,
`stepwise` after each speculative step, transformers' generate as its
streamer receives tokens (`hf_peer.PausingStreamer`).

    python -m benchmarks.lockstep     # checks this machine: lockstep, a thread and the plain call compared
"""

from __future__ import annotations

import shlex
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from greenlet import greenlet

from benchmarks.common import ArgumentParser, markdown_table, random_model, run_cli, set_threads, shape
from gpt2 import GPT2, SamplingConfig, generate

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
    method is raised here.

    The methods are greenlets (coroutines with their own stacks) on the
    calling thread, not threads: each OS thread that runs PyTorch or the C
    kernels gets an OpenMP pool of its own, and with more pooled threads than
    cores OpenMP puts idle workers to sleep after a few spins, which makes
    every parallel loop wait for a wake-up (measured in docs/performance.md).
    One thread keeps one pool."""
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
    # Inference mode is a thread-wide state that a method sets on entry and
    # restores on exit: on from here, it stays on whichever method ends first.
    with torch.inference_mode():
        try:
            while active := [r for r in runners.values() if not r.done]:
                min(active, key=lambda r: r.tokens).coroutine.switch()  # min keeps the first of equals
        finally:  # after an exception, end the paused methods (hooks off, caches freed) before the mode is restored
            for r in runners.values():
                if not r.coroutine.dead:
                    r.coroutine.throw()
    return {name: (r.seconds, r.result) for name, r in runners.items()}


def rotated(methods: dict[Any, Method], shift: int) -> dict[Any, Method]:
    """`methods` in their order rotated left by `shift`: the one that moves first (and wins ties) changes."""
    keys = list(methods)
    return {key: methods[key] for key in keys[shift % len(keys) :] + keys[: shift % len(keys)]}


def paused_passes(model: GPT2, call: Callable[[], Any]) -> Method:
    """`call()`, a decoding with `model`, as a lockstep method: it pauses
    before each of its own passes of `model`, counting as tokens so far the
    rows of its passes over one new position each (a prefill makes none)."""

    def run(pause):
        me, tokens = current(), 0

        def before_pass(module, args):  # the model may be shared: pause before this method's passes only
            nonlocal tokens
            if current() is me:
                pause(tokens)
                ids = args[0]  # (rows, T) new token ids
                tokens += ids.size(0) if ids.size(1) == 1 else 0

        hook = model.register_forward_pre_hook(before_pass)
        try:
            return call()
        finally:
            hook.remove()

    return run


def plain_decoding(target: GPT2, ids: torch.Tensor, max_gen: int, sampling: SamplingConfig = SamplingConfig(),
                   seed: int = 0) -> Method:
    """Plain decoding (`gpt2.generate`, greedy unless `sampling` says otherwise,
    from a generator seeded with `seed`) as a lockstep method that pauses
    before each of its target passes."""
    return paused_passes(target, lambda: generate(
        target, ids, max_gen, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
        generator=torch.Generator(target.device).manual_seed(seed)))


def stepwise(call: Callable[[Callable[..., None]], Any]) -> Method:
    """`call(on_step)`, a decoding that calls `on_step(new_tokens, ...)` after
    each of its steps (`speculative_generate`'s `on_step`), as a lockstep
    method: it pauses there."""

    def run(pause):
        tokens = 0

        def on_step(new: list[int], *_) -> None:
            nonlocal tokens
            tokens += len(new)
            pause(tokens)

        return call(on_step)

    return run


def check(shape_name: str, tokens: int, repeats: int) -> list[str]:
    """One row: plain decoding of `tokens` tokens alone in lockstep and in an
    OS thread, each over the mean of plain calls just before and after it
    (medians over repeats), and two plain decodings in lockstep: their
    largest time ratio."""
    model = random_model(shape(shape_name), seed=0)
    ids = torch.tensor([[464, 1893, 286, 4881]])  # "The president of France"
    generate(model, ids, 4)  # warm-up

    def called() -> float:
        start = time.perf_counter()
        generate(model, ids, tokens)
        return time.perf_counter() - start

    def in_thread() -> float:
        box = []
        thread = threading.Thread(target=lambda: box.append(called()))
        thread.start()
        thread.join()
        return box[0]

    alone, thread, pair = [], [], []
    for _ in range(repeats):
        before = called()
        alone.append(lockstep({"plain": plain_decoding(model, ids, tokens)}, time.perf_counter)["plain"][0])
        thread.append(in_thread())
        two = lockstep({"a": plain_decoding(model, ids, tokens), "b": plain_decoding(model, ids, tokens)},
                       time.perf_counter)
        after = called()
        alone[-1] /= (before + after) / 2
        thread[-1] /= (before + after) / 2
        pair.append(max(two["a"][0], two["b"][0]) / min(two["a"][0], two["b"][0]))
    return [shape_name, str(tokens), f"{statistics.median(alone):.3f}", f"{statistics.median(thread):.3f}",
            f"{max(pair):.3f}"]


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m benchmarks.lockstep",
                        description="Checks that lockstep timing leaves a pass's speed alone.")
    ap.add_argument("--repeats", type=int, default=6, help="repeats (default 6)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model instead (a smoke run)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    set_threads(args.threads)
    cases = [("tiny", 8)] if args.tiny else [("gpt2", 120), ("gpt2-large", 30)]
    rows = [check(name, tokens, args.repeats) for name, tokens in cases]
    print(f"`{shlex.join(['python', '-m', 'benchmarks.lockstep', *(argv if argv is not None else sys.argv[1:])])}`\n")
    print(markdown_table(["shape (random weights)", "tokens", "in lockstep / called", "in a thread / called",
                          "two in lockstep: slower / faster, the largest"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
