"""Step and t_v(5) on a busy machine once the thread chooser has settled.

decode_speed's --busy table times single passes in alternating quiet and
loaded phases, the hard case for gpt2/fast/threads.py (it moves only after
a few slow passes). Here one process keeps --busy cores spinning for the whole
run, and the target (gpt2-large shape, random weights, a 100-token cache)
runs --passes decode steps, then --passes five-token verifications, then the
two alternating, after a warm-up; medians of each. Once with the chooser, once
on fixed threads (all torch threads every pass), in the order given by
--repeats rounds, reversed every other round.

    python -m benchmarks.busy_settled
    python -m benchmarks.busy_settled --tiny --passes 4 --repeats 1    # a smoke run
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from benchmarks.common import ArgumentParser, random_model, run_cli, shape
from benchmarks.decode_speed import Spinners
from gpt2 import fast


def measure(model, passes: int) -> dict[str, float]:
    """Medians in seconds: steps alone, five-token passes alone, and both alternating."""
    g = torch.Generator().manual_seed(1)
    V = model.config.vocab_size
    prefix, drafts = torch.randint(V, (1, 100), generator=g), torch.randint(V, (1, 5), generator=g)
    cache = model.new_cache(1)
    model(prefix, cache)

    def once(k: int) -> float:
        t0 = time.perf_counter()
        model(drafts[:, :k], cache)
        seconds = time.perf_counter() - t0
        cache.rewind(100)
        return seconds

    for _ in range(max(2, passes // 3)):  # warm-up: the chooser probes and settles
        once(1), once(5)
    steps = [once(1) for _ in range(passes)]
    verifies = [once(5) for _ in range(passes)]
    mixed = [(once(1), once(5)) for _ in range(passes)]
    return {"step": statistics.median(steps), "verify5": statistics.median(verifies),
            "mixed_step": statistics.median(a for a, _ in mixed),
            "mixed_verify5": statistics.median(b for _, b in mixed)}


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m benchmarks.busy_settled", description=__doc__.split("\n\n")[0])
    p.add_argument("--busy", type=int, default=1, help="cores kept busy (default 1; at most the logical CPUs)")
    p.add_argument("--passes", type=int, default=30, help="timed passes of each kind (default 30)")
    p.add_argument("--repeats", type=int, default=2, help="rounds of both settings (default 2)")
    p.add_argument("--tiny", action="store_true", help="a tiny model (a smoke run)")
    args = p.parse_args(argv)
    if args.passes < 1 or args.repeats < 1:
        raise ValueError("--passes and --repeats must be >= 1")
    spinners = Spinners(args.busy)  # checks --busy
    model = random_model(shape("tiny" if args.tiny else "gpt2-large"), seed=0)
    path = fast.status(model)
    if not path.startswith("fast path:"):  # both settings would time the same readable path
        raise ValueError(f"busy_settled times the fast path's thread chooser, and the fast path does not run here: "
                         f"{path}")
    names = ("chooser", "fixed")
    results = {name: [] for name in names}
    with torch.inference_mode(), spinners.running(args.busy > 0):
        for r in range(args.repeats):
            for name in names if r % 2 == 0 else names[::-1]:
                fast.accelerate(model, adapt_threads=name == "chooser")  # a fresh chooser each round
                results[name].append(measure(model, args.passes))
                print(f"round {r + 1}/{args.repeats}: {name}", file=sys.stderr, flush=True)
    print(f"{'tiny' if args.tiny else 'gpt2-large'}, {args.busy} busy core(s) of {torch.get_num_threads()} threads, "
          f"{args.passes} passes of each kind, medians over {args.repeats} round(s), on the fast path "
          "(gpt2/fast):")
    for name, rounds in results.items():
        m = {key: statistics.median(x[key] for x in rounds) for key in rounds[0]}
        print(f"{name:>7}: step {1e3 * m['step']:.1f} ms, t_v(5) {1e3 * m['verify5']:.1f} ms, "
              f"r_5 {m['verify5'] / m['step']:.2f}; alternating: step {1e3 * m['mixed_step']:.1f} ms, "
              f"t_v(5) {1e3 * m['mixed_verify5']:.1f} ms, r_5 {m['mixed_verify5'] / m['mixed_step']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
