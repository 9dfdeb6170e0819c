"""Two checkouts of this project, timed side by side: did a change make
decoding slower? Each checkout runs in its own worker process (its own
`gpt2` and `spec_decoding`, the same random weights); the driver asks them in
turn, the order reversed every other repeat, so that the machine's swings in
speed fall on both alike. Reported: the decode step and t_v(k) (k in --ks,
default 5) on a 100-token cache, r_k, a step of B rows (--rows), the draft's
decode step t_d (--draft-int8: the draft quantised), plain greedy decoding,
and speculative decoding with a simulated draft (alpha 0.8, --gamma, default
4), each as after / before ratios paired within a repeat.

    git worktree add /tmp/before cd36fce
    python -m benchmarks.compare_commits /tmp/before .
    python -m benchmarks.compare_commits /tmp/before . --ks 5 8 16 32 --rows 8
    python -m benchmarks.compare_commits /tmp/before . --draft-int8 --gamma 7
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

from benchmarks.common import ArgumentParser, check_caches_fit, check_range, run_cli
from gpt2 import KVCache, preset

CACHED, PROMPT = 100, 20  # the worker's cache before each timed pass, and its decoding prompt, in tokens
MAX_ROWS = 32  # --rows at most: each row's cache holds the whole window (gpt2-large: 0.38 GB a row)

# A worker imports only names both sides have (a checkout from before gpt2/fast/
# is accelerated by `prepare_linear_layers`, as it was then), and draws the
# simulated drafter's coins itself, one per position, so that both sides'
# speculative runs accept the same drafts.
WORKER = r"""
import json, sys, time
import torch
from gpt2 import GPT2, generate, init_random_weights, preset
from spec_decoding import speculative_generate
from spec_decoding.drafters import SimulatedDrafter

target_name, draft_name, new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
ks, rows = [int(k) for k in sys.argv[4].split(",")], int(sys.argv[5])
cached, prompt_len = int(sys.argv[6]), int(sys.argv[7])
gamma, draft_int8 = int(sys.argv[8]), sys.argv[9] == "int8"

def build(name, seed, int8=False):
    config = preset(name)
    with torch.device("meta"):
        model = GPT2(config)
    model = model.to_empty(device="cpu")
    init_random_weights(model, generator=torch.Generator().manual_seed(seed))
    model.eval()
    try:
        from gpt2 import fast
        fast.accelerate(model, int8=int8)
    except ImportError:
        model.prepare_linear_layers()
        if int8:  # as that checkout quantised: in place, the kernels given the int8 copies
            from gpt2.quantize import quantize_model_int8
            quantize_model_int8(model)
    return model

class SameLuck(SimulatedDrafter):
    # Either checkout's simulated drafter, with one coin per position drawn
    # here: both sides meet the same accepted positions.

    def __init__(self, model, reference, alpha, seed):
        super().__init__(model, reference, alpha, seed=seed)
        self.luck = torch.rand(len(self.reference) + 1, generator=torch.Generator().manual_seed(seed))

    def pick(self, position, logits, sampling, generator):
        right = self.reference[position] if position < len(self.reference) else 0
        lucky = position < len(self.luck) and self.luck[position] < self.alpha
        token = right if lucky else (right + 1) % self.vocab_size
        return torch.tensor(token), None

target, draft = build(target_name, 0), build(draft_name, 1, draft_int8)
V = target.config.vocab_size
g = torch.Generator().manual_seed(1)
prefix, drafts, prompt = (torch.randint(V, (1, n), generator=g) for n in (cached, max(ks), prompt_len))
cache, batch, draft_cache = target.new_cache(1), target.new_cache(rows), draft.new_cache(1)

def timed_pass(k, cache=cache, tokens=drafts, model=target):
    t0 = time.perf_counter()
    model(tokens[:, :k], cache)
    seconds = time.perf_counter() - t0
    cache.rewind(cached)
    return seconds

with torch.inference_mode():
    target(prefix, cache)
    target(prefix.expand(rows, -1), batch)  # (rows, cached): the same prefix in every row
    draft(prefix, draft_cache)

    def batch_step():
        return timed_pass(1, batch, drafts[:, :1].expand(rows, -1))  # (rows, 1): one new token per row

    def draft_step():
        return timed_pass(1, draft_cache, model=draft)

    timed_pass(1), batch_step(), draft_step(), [timed_pass(k) for k in ks]
    reference = generate(target, prompt, new_tokens)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "costs":
            print(json.dumps({"step": timed_pass(1), "rows": batch_step(), "draft": draft_step(),
                              **{f"k={k}": timed_pass(k) for k in ks}}), flush=True)
            continue
        t0 = time.perf_counter()
        plain = generate(target, prompt, new_tokens)
        t1 = time.perf_counter()
        out, _ = speculative_generate(target, SameLuck(draft, reference, 0.8, seed=3), prompt,
                                      gamma=gamma, max_new_tokens=new_tokens)
        t2 = time.perf_counter()
        if not (torch.equal(plain, reference) and torch.equal(out, reference)):
            raise AssertionError("greedy decoding changed between runs, or speculative decoding differs from it")
        print(json.dumps({"plain": t1 - t0, "speculative": t2 - t1}), flush=True)
"""


class Worker:
    """One checkout's worker process: it answers each command with a line of
    JSON. If it fails, a ValueError carries its exception's last line (its
    error output goes to a file, not the terminal): one line, no traceback."""

    def __init__(self, folder: str, argv: list[str]) -> None:
        self.folder, self.log = folder, tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen([sys.executable, "-c", WORKER, *argv], cwd=folder, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True)
        if self.read().strip() != "ready":
            self.process.kill()
            raise ValueError(f"the worker in {folder} did not start: it printed something other than 'ready'")

    def read(self) -> str:
        line = self.process.stdout.readline()
        if not line:  # it exited
            self.process.wait()
            self.log.seek(0)
            errors = [e.strip() for e in self.log.read().splitlines() if e.strip()]
            raise ValueError(f"the worker in {self.folder} failed: {errors[-1] if errors else 'no error message'}")
        return line

    def ask(self, command: str) -> dict:
        with contextlib.suppress(BrokenPipeError):  # it has exited: read() says why
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        return json.loads(self.read())

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.close()  # its loop ends
        self.process.wait()
        self.log.close()


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m benchmarks.compare_commits", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", help="the checkout to compare against (a folder)")
    p.add_argument("after", help="the checkout with the change (a folder)")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per decoding run")
    p.add_argument("--ks", type=int, nargs="+", default=[5], help="verification passes timed, in tokens (default 5)")
    p.add_argument("--rows", type=int, default=8,
                   help=f"rows of the batched decode step timed (default 8, at most {MAX_ROWS})")
    p.add_argument("--gamma", type=int, default=4, help="draft length of the speculative runs (default 4)")
    p.add_argument("--draft-int8", action="store_true", help="the draft's weights in int8 (the target stays float32)")
    p.add_argument("--tiny", action="store_true", help="the distilgpt2 -> gpt2 shapes, for a smoke run")
    args = p.parse_args(argv)
    for folder in (args.before, args.after):
        try:
            checkout = bool(folder.strip()) and (Path(folder) / "gpt2" / "model.py").is_file()
        except OSError:  # a name too long, ...
            checkout = False
        if not checkout:
            raise ValueError(f"{folder!r} is not a checkout of this project (no gpt2/model.py): pass its folder")
    if min(args.repeats, args.new_tokens, args.rows, args.gamma, *args.ks) < 1:
        raise ValueError("--repeats, --new-tokens, --rows, --gamma and --ks must be >= 1")
    target, draft = ("gpt2", "distilgpt2") if args.tiny else ("gpt2-large", "gpt2")
    n_ctx = min(preset(target).n_ctx, preset(draft).n_ctx)
    check_range("--ks", max(args.ks), 1, n_ctx - CACHED,
                f" (the context window of {n_ctx} after {CACHED} cached tokens)")
    check_range("--rows", args.rows, 1, MAX_ROWS, " (each row caches the whole context window)")
    check_caches_fit(2 * KVCache.nbytes(preset(target), args.rows), "give fewer --rows",
                     "the two workers' batched steps")
    check_range("--gamma", args.gamma, 1, n_ctx - 1, f" (a context window of {n_ctx} verifies at most that many)")
    check_range("--new-tokens", args.new_tokens, 1, n_ctx - PROMPT,
                f" (the context window of {n_ctx} after a {PROMPT}-token prompt)")

    sides = {}
    worker_args = [target, draft, str(args.new_tokens), ",".join(map(str, args.ks)), str(args.rows), str(CACHED),
                   str(PROMPT), str(args.gamma), "int8" if args.draft_int8 else "float32"]
    samples = {name: [] for name in ("before", "after")}  # per repeat: {step, rows, k=..., plain, speculative}
    try:
        for name, folder in (("before", args.before), ("after", args.after)):
            sides[name] = Worker(folder, worker_args)
        for repeat in range(args.repeats):
            order = list(sides.items()) if repeat % 2 == 0 else list(sides.items())[::-1]
            costs = {name: [worker.ask("costs") for _ in range(3)] for name, worker in order}
            runs = {name: worker.ask("runs") for name, worker in order}
            for name in sides:
                samples[name].append({key: median(c[key] for c in costs[name]) for key in costs[name][0]}
                                     | runs[name])
            print(f"repeat {repeat + 1} of {args.repeats}", file=sys.stderr, flush=True)
    finally:
        for worker in sides.values():
            worker.close()

    print(f"{target} target, {draft} draft ({'int8' if args.draft_int8 else 'float32'}), "
          f"{args.repeats} interleaved repeats (medians)")
    for name, runs in samples.items():
        passes = "".join(f"t_v({k}) {1e3 * median(r[f'k={k}'] for r in runs):.1f} ms, "
                         f"r_{k} {median(r[f'k={k}'] / r['step'] for r in runs):.3f}, " for k in args.ks)
        print(f"{name:>6}: step {1e3 * median(r['step'] for r in runs):.1f} ms, {passes}"
              f"step of {args.rows} rows {median(r['rows'] / r['step'] for r in runs):.3f}x one row, "
              f"t_d {1e3 * median(r['draft'] for r in runs):.2f} ms, speedup at alpha 0.8, gamma {args.gamma}: "
              f"{median(r['plain'] / r['speculative'] for r in runs):.2f}x")
    labels = {"step": "step", **{f"k={k}": f"t_v({k})" for k in args.ks}, "rows": f"step of {args.rows} rows",
              "draft": "draft step t_d", "plain": "plain decoding", "speculative": "speculative decoding"}
    for key, label in labels.items():
        ratio = median(a[key] / b[key] for a, b in zip(samples["after"], samples["before"]))
        print(f"after / before, {label} time: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
