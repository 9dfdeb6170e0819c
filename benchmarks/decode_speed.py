"""Decode speed of the hand-written GPT-2 beside transformers' GPT-2 (the same
weights) and the memory-bandwidth bound: prefill, one decode step (t_step)
and one pass over k new tokens (t_v(k)) on a KV cache of --prefix tokens,
random weights, fp32, batch 1. r_k = t_v(k) / t_step is the cost of verifying
gamma = k - 1 drafts: speculative decoding pays only while it stays near 1
(Leviathan et al. 2023). --busy N keeps N cores busy in every other phase,
for every figure and a simulated alpha 0.8, gamma 4 speedup.

    python -m benchmarks.decode_speed --models gpt2-large --tree-mask --readable --int8
    python -m benchmarks.decode_speed --models gpt2-large --busy 1 --fixed-threads --repeats 5

Writes decode_speed.md (the tables) and decode_speed.json (every sample) to --out.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import importlib.util
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from statistics import median

import torch

from benchmarks.common import ArgumentParser, must
from benchmarks.common import binary_tree_mask, check_range, environment, environment_lines, logical_cpus
from benchmarks.common import markdown_table, random_model, results_dir, run_cli, say, set_threads, shape, timed
from benchmarks.common import MAX_SEED, write_json
from benchmarks.lockstep import lockstep, plain_decoding, stepwise
from gpt2 import GPT2, fast, generate
from spec_decoding import SimulatedDrafter, speculative_generate
from spec_decoding.stats import clock

CPU = torch.device("cpu")
LONG_K = 5  # the verification length timed at the long context (gamma = 4)
MAX_K = 64  # the longest verification --ks may ask for
SIM_ALPHA, SIM_GAMMA, SIM_PROMPT = 0.8, 4, 32  # the simulated speculative runs of --busy (a 32-token prompt)
# A spinner: a tight Python loop that ends by itself once its parent is gone.
SPIN = "import os, sys\nwhile os.getppid() == int(sys.argv[1]):\n    for _ in range(10**6): pass\n"
SETTLE_S = 0.2  # after starting the spinners, before timing
SETTLE_STEPS = 6  # untimed decode steps per phase with --busy (see `one_turn`)


class BandwidthProbe:
    """Read bandwidth: the bytes/s of summing a `mib`-MiB float32 tensor."""

    MAX_MIB = 4096  # 4 GiB: far past any cache, and not all of a small machine's memory

    @classmethod
    def check(cls, mib: int) -> None:
        """Raises a ValueError unless `mib` (--bandwidth-mib) lies in 1..MAX_MIB."""
        check_range("--bandwidth-mib", mib, 1, cls.MAX_MIB, " (MiB of the probe's tensor)")

    def __init__(self, mib: int) -> None:
        self.x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)  # every page touched before timing

    def sample(self) -> float:
        return self.x.numel() * 4 / timed(self.x.sum)


class Spinners:
    """`n` processes that keep a core busy each inside `running(True)`, stopped
    at exit whatever happens; each also ends by itself if this process dies.
    `n` (--busy) is 0 to the machine's logical CPUs, or a ValueError."""

    def __init__(self, n: int) -> None:
        check_range("--busy", n, 0, logical_cpus(), " (this machine's logical CPUs)")
        self.n = n
        self.processes: list[subprocess.Popen] = []
        atexit.register(self.stop)

    @contextlib.contextmanager
    def running(self, busy: bool):
        if busy:
            self.processes = [subprocess.Popen([sys.executable, "-c", SPIN, str(os.getpid())])
                              for _ in range(self.n)]
            time.sleep(SETTLE_S)
        try:
            yield
        finally:
            self.stop()

    def stop(self) -> None:
        for p in self.processes:
            p.kill()
            p.wait()
        self.processes = []


def weight_bytes(model: GPT2, int8: bool) -> int:
    """Bytes of weights one decode step reads: every parameter once (the LM
    head is the tied wte) but one row of the position table wpe; with `int8`
    (the fast path of a quantised model) a packed matrix as 1 byte a weight
    plus its rows' float32 scales."""
    params = dict(model.named_parameters())  # the tied wte once
    total = sum(p.numel() * p.element_size() for p in params.values())
    for name, packed in model.accelerator.packed.items() if int8 else ():
        if packed.scale is not None:
            w = params[name]
            total -= w.numel() * w.element_size() - (w.numel() + packed.scale.numel() * packed.scale.element_size())
    wpe = model.wpe.weight
    return total - (wpe.size(0) - 1) * wpe.size(1) * wpe.element_size()


def step_bytes(model: GPT2, context: int, int8: bool, rows: int = 1) -> int:
    """Bytes one decode step of `rows` rows reads after `context` cached positions a row: every weight once, and
    each row's L layers' keys and values."""
    c = model.config
    return weight_bytes(model, int8) + rows * 2 * c.n_layer * (context + 1) * c.n_embd * model.dtype.itemsize


@dataclass
class OursRunner:
    """Our GPT-2 with a KV cache per context slot: the fast path it was given,
    or (`readable`) the same model with `model.accelerator = None`, or
    (`fixed_threads`) the fast path without its thread chooser; `tree`:
    verification passes take `binary_tree_mask(k)`."""

    model: GPT2
    name: str = "ours"
    readable: bool = False
    tree: bool = False
    fixed_threads: bool = False

    def __post_init__(self) -> None:
        flags = {"readable": self.readable, "fixed threads": self.fixed_threads, "tree mask": self.tree}
        self.label = ", ".join([self.name, *(flag for flag, on in flags.items() if on)])
        self.int8 = not self.readable and getattr(self.model.accelerator, "int8", False)  # kernels read int8
        self.caches = {}

    def forward(self, tokens: torch.Tensor, cache, *, mask: torch.Tensor | None = None,
                last_logits_only: bool = False) -> torch.Tensor:
        accelerator = self.model.accelerator
        chooser = getattr(accelerator, "threads", None)
        if self.readable:
            self.model.accelerator = None
        elif self.fixed_threads and accelerator is not None:
            accelerator.threads = None  # every pass on torch.get_num_threads() threads
        try:
            return self.model(tokens, cache, mask=mask, last_logits_only=last_logits_only)
        finally:
            self.model.accelerator = accelerator
            if accelerator is not None:
                accelerator.threads = chooser

    def prefill(self, prompt: torch.Tensor, slot: str) -> None:
        """Empties cache `slot` and fills it with `prompt` (1, P)."""
        if slot not in self.caches:  # room for the prompt and the longest verification, not n_ctx
            self.caches[slot] = self.model.new_cache(1, capacity=min(prompt.size(1) + MAX_K, self.model.config.n_ctx))
        self.caches[slot].rewind(0)
        self.forward(prompt, self.caches[slot], last_logits_only=True)

    def verify(self, tokens: torch.Tensor, slot: str) -> torch.Tensor:
        """Logits (1, k, V) of `tokens` (1, k) on top of cache `slot`, which is then rewound."""
        cache = self.caches[slot]
        P, k = cache.length, tokens.size(1)
        logits = self.forward(tokens, cache, mask=binary_tree_mask(k) if self.tree and k > 1 else None)
        cache.rewind(P)
        return logits


class TransformersRunner:
    """transformers' GPT2LMHeadModel with a DynamicCache (its default) per context slot."""

    label, int8, tree = "transformers", False, False

    def __init__(self, model: GPT2) -> None:
        from transformers import DynamicCache  # a benchmark-only dependency

        from benchmarks.hf_peer import to_transformers

        self.model = model  # whose weights it holds a copy of
        self.hf_model, self.new_cache, self.caches = to_transformers(model), DynamicCache, {}

    def prefill(self, prompt: torch.Tensor, slot: str) -> None:
        self.caches[slot] = self.new_cache()
        # The cache goes second, by position: `past_key_values` before transformers 5.x renamed it `cache`.
        self.hf_model(prompt, self.caches[slot], use_cache=True, logits_to_keep=1)

    def verify(self, tokens: torch.Tensor, slot: str) -> torch.Tensor:
        cache = self.caches[slot]
        logits = self.hf_model(tokens, cache, use_cache=True).logits  # (1, k, V)
        cache.crop(-tokens.size(1))  # a negative count drops that many positions
        return logits


def one_turn(r, prompts: dict[str, torch.Tensor], drafts: torch.Tensor, ks: dict[str, list[int]],
             probe: BandwidthProbe, settle: bool) -> dict[str, float]:
    """One repeat of runner `r`: "<slot> k=1", each decode step between two
    bandwidth samples ("<slot> bandwidth", their mean, bytes/s: a shared
    machine's bandwidth drifts within seconds), then "prefill" and every
    "<slot> k=<k>" (seconds); each call leaves the cache at its context.
    `settle` (--busy) first makes SETTLE_STEPS untimed steps and one pass of
    each k, so that the thread chooser (gpt2/fast/threads.py) meets the load."""
    for slot in prompts if settle else ():
        for k in [1] * SETTLE_STEPS + ks[slot]:
            r.verify(drafts[:, :k], slot)
    got, before = {}, probe.sample()
    for slot in prompts:
        got[f"{slot} k=1"] = timed(r.verify, drafts[:, :1], slot)
        after = probe.sample()
        got[f"{slot} bandwidth"], before = (before + after) / 2, after
    got["prefill"] = timed(r.prefill, prompts["short"], "short")  # leaves the prompt in the cache
    for slot in prompts:
        for k in ks[slot]:
            got[f"{slot} k={k}"] = timed(r.verify, drafts[:, :k], slot)
    return got


def interleaved(items: list, args: argparse.Namespace, spinners: Spinners):
    """Yields (repeat, phase, item) over --warmup + --repeats repeats: each has
    a quiet phase and, with spinners, a loaded one, and every item takes its
    turn in each. Both orders are reversed on odd repeats, so slow drift cancels."""
    phases = ["quiet", "loaded"][: 1 + bool(spinners.n)]
    for rep in range(args.warmup + args.repeats):
        say(f"  repeat {rep + 1} of {args.warmup + args.repeats}" + (" (warm-up)" if rep < args.warmup else ""))
        for phase in phases if rep % 2 == 0 else phases[::-1]:
            with spinners.running(phase == "loaded"):
                for item in items if rep % 2 == 0 else items[::-1]:
                    yield rep, phase, item


def figures(s: dict[str, list[float]], ks: dict[str, list[int]], nbytes: dict[str, int]) -> dict:
    """One runner's samples `s` and its figures at each context slot, where a
    step reads `nbytes[slot]`. r_k pairs t_v(k) and t_step of each repeat: a
    ratio of two medians can pair calls from a fast and a slow phase."""
    result = {"samples": s, "prefill_s": median(s["prefill"])}
    for slot, n in nbytes.items():
        steps, bandwidth = s[f"{slot} k=1"], s[f"{slot} bandwidth"]
        verify = {k: median(s[f"{slot} k={k}"]) for k in ks[slot]}
        fractions = [n / bw / t for bw, t in zip(bandwidth, steps)]  # each step against its own bound
        result[slot] = {
            "step_bytes": n, "step_s": median(steps), "verify_s": verify,
            "read_bandwidth_bytes_per_s": median(bandwidth), "bound_s": n / median(bandwidth),
            "fraction_of_bound": median(fractions), "fraction_of_bound_samples": fractions,
            "r": {k: median([t / t1 for t, t1 in zip(s[f"{slot} k={k}"], steps)]) for k in ks[slot]},
            "r_of_medians": {k: t / median(steps) for k, t in verify.items()},
        }
    return result


def bench_model(name: str, args: argparse.Namespace, probe: BandwidthProbe, spinners: Spinners) -> dict:
    """Every implementation asked for on shape `name`, checked against the readable path, then timed."""
    config = shape(name)
    say(f"[{name}] building the model with random weights ...")
    model = random_model(config, seed=args.seed)
    runners: list = [OursRunner(model)]
    if args.int8:
        say(f"[{name}] the same weights quantised to int8 ...")
        runners.append(OursRunner(random_model(config, seed=args.seed, quantize="int8"), "ours, int8 weights"))
    if args.fixed_threads:
        runners.append(OursRunner(model, fixed_threads=True))
    if args.readable:
        runners.append(OursRunner(model, readable=True))
    if args.tree_mask:
        runners += [replace(r, tree=True) for r in runners]
    if not args.no_transformers:
        say(f"[{name}] copying the weights into transformers' GPT2LMHeadModel ...")
        runners.append(TransformersRunner(model))

    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(config.vocab_size, (1, args.prefix), generator=g)  # (1, P)
    drafts = torch.randint(config.vocab_size, (1, max(*args.ks, LONG_K)), generator=g)  # (1, max k)
    prompts, ks = {"short": prompt}, {"short": args.ks}  # the verification lengths timed at each context
    if args.long > 0:
        prompts["long"] = torch.cat([prompt, torch.randint(config.vocab_size, (1, args.long), generator=g)], 1)
        ks["long"] = [LONG_K]
    contexts = {slot: p.size(1) for slot, p in prompts.items()}

    with torch.inference_mode():
        # Each implementation against the readable path of the same model and mask: timing wrong logits means nothing.
        diffs = {}
        for r in runners:
            ref = OursRunner(r.model, readable=True, tree=r.tree)
            for runner in (r, ref):
                runner.prefill(prompt, "check")
            diffs[r.label] = (r.verify(drafts, "check") - ref.verify(drafts, "check")).abs().max().item()
            r.caches.pop("check")
        say(f"[{name}] max |logits - readable path|: {diffs}")
        if max(diffs.values()) > 1e-3:
            raise AssertionError(f"the implementations disagree on {name}: {diffs}")
        say(f"[{name}] timing prefill {args.prefix}, step and k = {args.ks} at {args.prefix}"
            + (f", step and k = {LONG_K} at {contexts['long']}" if args.long else "")
            + (f", quiet and with {spinners.n} busy core(s)" if spinners.n else "")
            + f" ({args.warmup} warm-up + {args.repeats} repeats) ...")
        # samples[phase][label][key] (keys: see `one_turn`), the warm-up repeats dropped
        samples = {phase: {r.label: {} for r in runners} for phase in ["quiet", "loaded"][: 1 + bool(spinners.n)]}
        for r in runners:
            for slot, p in prompts.items():
                r.prefill(p, slot)
        for rep, phase, r in interleaved(runners, args, spinners):
            got = one_turn(r, prompts, drafts, ks, probe, settle=spinners.n > 0)
            for key, value in got.items() if rep >= args.warmup else ():
                samples[phase][r.label].setdefault(key, []).append(value)

    result = {"model": name, "weight_bytes": weight_bytes(model, False), "path": fast.status(model),
              "max_abs_logit_diff": diffs, "contexts": contexts,
              "step_bytes": {slot: step_bytes(model, P, False) for slot, P in contexts.items()}}
    for phase, by_label in samples.items():
        result["implementations" if phase == "quiet" else "loaded"] = {r.label: figures(
            by_label[r.label], ks, {slot: step_bytes(r.model, P, r.int8) for slot, P in contexts.items()})
            for r in runners}
    del runners, model
    gc.collect()
    return result


def bench_speedup(args: argparse.Namespace, spinners: Spinners) -> dict:
    """Greedy speculative decoding of --gen tokens after a SIM_PROMPT-token
    prompt with a `SimulatedDrafter` (alpha SIM_ALPHA, gamma SIM_GAMMA; repeat
    r draws its coins from seed --seed + r in both phases) against `generate`,
    the two in lockstep (benchmarks/lockstep.py), quiet and loaded: speedup =
    the median over repeats of baseline / speculative seconds in the same
    phase of the same repeat."""
    say(f"[speedup] {args.draft} -> {args.models[-1]}, simulated alpha {SIM_ALPHA}, gamma {SIM_GAMMA}, "
        f"{args.gen} tokens, quiet and with {spinners.n} busy core(s) ...")
    target = random_model(shape(args.models[-1]), seed=args.seed)
    draft = random_model(shape(args.draft), seed=args.seed + 1)
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(target.config.vocab_size, (1, SIM_PROMPT), generator=g)  # (1, P)
    reference = generate(target, prompt, args.gen)  # (1, P + gen): what the simulated drafter copies
    seconds = {phase: {"baseline": [], "speculative": []} for phase in ("quiet", "loaded")}
    runs = []  # the SpecStats of every counted speculative run
    for rep, phase, _ in interleaved(["the pair"], args, spinners):  # one item: the two run together
        def speculative(on_step):  # coins from seed --seed + repeat: both phases of a repeat get the same luck
            drafter = SimulatedDrafter(draft, reference, SIM_ALPHA, seed=args.seed + rep)
            return speculative_generate(target, drafter, prompt, gamma=SIM_GAMMA, max_new_tokens=args.gen,
                                        on_step=on_step)

        methods = {"baseline": plain_decoding(target, prompt, args.gen), "speculative": stepwise(speculative)}
        got = lockstep(dict(reversed(methods.items())) if rep % 2 else methods, lambda: clock(CPU))
        (base_s, _), (spec_s, (out, stats)) = got["baseline"], got["speculative"]
        must(torch.equal(out, reference), "greedy speculative output must equal greedy decoding")
        if rep >= args.warmup:
            seconds[phase]["baseline"].append(base_s)
            seconds[phase]["speculative"].append(spec_s)
            runs.append(stats)
    result = {"target": args.models[-1], "draft": args.draft, "alpha_sim": SIM_ALPHA, "gamma": SIM_GAMMA,
              "new_tokens": args.gen, "alpha": sum(r.alpha for r in runs) / len(runs),
              "tokens_per_target_call": sum(r.tokens_per_target_call for r in runs) / len(runs)}
    for phase, s in seconds.items():
        speedups = [b / t for b, t in zip(s["baseline"], s["speculative"])]
        result[phase] = {"speedup": median(speedups), "speedup_min": min(speedups), "speedup_max": max(speedups),
                         "baseline_s": median(s["baseline"]), "speculative_s": median(s["speculative"]),
                         "samples": s}
    return result


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def report(results: list[dict], speedup: dict | None, args: argparse.Namespace, env: dict) -> str:
    """decode_speed.md: the environment, the step and k tables, the others against ours, the --busy speedup."""
    k5, P = 5 if 5 in args.ks else args.ks[0], args.prefix + args.long
    loads = {"quiet": "quiet", "loaded": f"{args.busy} busy"}  # the "load" column of each phase
    phases = [(res, phase, res["implementations" if phase == "quiet" else "loaded"])
              for res in results for phase in loads if phase == "quiet" or "loaded" in res]
    gbps = [bw / 1e9 for res, _, impl in phases for e in impl.values()
            for slot in res["contexts"] for bw in e["samples"][f"{slot} bandwidth"]]
    load = f"; with --busy {args.busy}, every repeat also has a phase with {args.busy} core(s) kept busy by a " \
        "spinning process (\"loaded\")" if args.busy else ""
    lines = ["# Decode speed", "", *environment_lines(env),
             f"- read bandwidth (summing a {args.bandwidth_mib} MiB tensor right before and after each timed decode "
             f"step): median {median(gbps):.1f} GB/s, {min(gbps):.1f} to {max(gbps):.1f} over the run",
             f"- batch 1, random weights, prefix {args.prefix} tokens; medians of {args.repeats} interleaved repeats "
             f"after {args.warmup} warm-up{load}", f"- command: `{args.command}`", ""]

    # Each context timed: (slot, its columns' suffix, the k shown, what precedes it in a comparison).
    slots = [("short", "", k5, ", "), ("long", f" @{P}", LONG_K, f"; at {P}: ")][: 1 + bool(args.long)]
    headers = ["model", *(["load"] if args.busy else []), "implementation", f"prefill {args.prefix} (ms)"]
    for _, at, k, _ in slots:
        headers += [f"step{at} (ms)", f"bound{at} (ms)", f"% of bound{at}", f"t_v({k}){at} (ms)", f"r_{k}{at}"]
    rows, k_rows, comparisons = [], [], []  # comparisons: every other implementation against "ours"
    for res, phase, impl in phases:
        o = impl["ours"]
        for label, e in impl.items():
            key = [res["model"], *([loads[phase]] if args.busy else []), label]
            row = key + [ms(e["prefill_s"])]
            line = (f"- {res['model']}{', ' + phase if args.busy else ''}: {label} / ours: prefill "
                    f"{e['prefill_s'] / o['prefill_s']:.2f}x")
            for slot, _, k, before in slots:
                s, so = e[slot], o[slot]
                row += [ms(s["step_s"]), ms(s["bound_s"]), f"{100 * s['fraction_of_bound']:.0f}%",
                        ms(s["verify_s"][k]), f"{s['r'][k]:.2f}"]
                line += (f"{before}step {s['step_s'] / so['step_s']:.2f}x, "
                         f"t_v({k}) {s['verify_s'][k] / so['verify_s'][k]:.2f}x")
            rows.append(row)
            k_rows.append(key + [f"{ms(e['short']['verify_s'][k])} ({e['short']['r'][k]:.2f})" for k in args.ks])
            comparisons += [line] if label != "ours" else []
    lines += ["## Step, verification and the bandwidth bound", "",
              "bound = bytes one step must read (every weight once, plus the cached keys and values; int8 weights: "
              "1 byte each plus their rows' scales) / read bandwidth. % of bound: each step against the bound of the "
              "bandwidth sampled around it, median over the repeats; the bound column uses the median bandwidth. "
              "r_k: the median over the repeats of t_v(k) / t_step within each repeat. \"readable\": the same model "
              "with `model.accelerator = None`; \"fixed threads\": the fast path on every thread, without the thread "
              "chooser of gpt2/fast/threads.py; \"tree mask\": verification passes take a binary tree's ancestor "
              "mask.", "", markdown_table(headers, rows), "",
              f"## Verification of k tokens in one forward pass at context {args.prefix}: t_v(k) in ms (r_k = "
              "t_v(k) / t_step: the median over the repeats of each repeat's ratio)", "",
              markdown_table(headers[: 3 if args.busy else 2] + [f"k={k}" for k in args.ks], k_rows), ""]
    if comparisons:
        lines += ["## The others against ours (time ratios; higher: ours faster)", "", *comparisons, ""]
    if speedup:
        lines += [f"## Speculative decoding under load: {speedup['draft']} -> {speedup['target']}, simulated "
                  f"α = {speedup['alpha_sim']:g}, γ = {speedup['gamma']}, {speedup['new_tokens']} new tokens after a "
                  f"{SIM_PROMPT}-token prompt", "",
                  f"Greedy, random weights; `SimulatedDrafter` proposes the target's token with probability "
                  f"{speedup['alpha_sim']:g}, coins from seed --seed + repeat (measured α {speedup['alpha']:.3f}, "
                  f"{speedup['tokens_per_target_call']:.2f} tokens per target call, means over the runs). speedup: "
                  "the median over repeats of `generate` seconds / speculative seconds, the two run in lockstep in the "
                  "same phase.", "",
                  markdown_table(["load", "speedup [min-max]", "baseline (s)", "speculative (s)"], [
                      [loads[p], f"{speedup[p]['speedup']:.2f} [{speedup[p]['speedup_min']:.2f}-"
                       f"{speedup[p]['speedup_max']:.2f}]", f"{speedup[p]['baseline_s']:.2f}",
                       f"{speedup[p]['speculative_s']:.2f}"] for p in loads]), ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m benchmarks.decode_speed", description=(
        "Decode step, verification of k tokens and prefill: ours vs transformers vs the bandwidth bound."))
    p.add_argument("--models", nargs="+", default=["gpt2", "gpt2-large"],
                   help="preset shapes, or tiny (default: gpt2 gpt2-large)")
    p.add_argument("--repeats", type=int, default=10, help="timed repeats per measurement (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="uncounted repeats first (default 2)")
    p.add_argument("--prefix", type=int, default=100, help="prompt tokens in the cache (default 100)")
    p.add_argument("--ks", type=int, nargs="+", default=[*range(2, 10), 16, 32],
                   help="verification lengths, 2 to 64 (default 2..9 16 32)")
    p.add_argument("--long", type=int, default=500,
                   help="also time step and k=5 with the cache at prefix + LONG positions (default 500; 0: skip)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own choice)")
    p.add_argument("--bandwidth-mib", type=int, default=1024,
                   help=f"MiB summed to measure the read bandwidth (default 1024, at most {BandwidthProbe.MAX_MIB})")
    p.add_argument("--readable", action="store_true", help="also time the readable path (model.accelerator = None)")
    p.add_argument("--tree-mask", action="store_true", help="also time every verification with a tree's mask")
    p.add_argument("--fixed-threads", action="store_true", help="also time the fast path without its thread chooser")
    p.add_argument("--int8", action="store_true", help="also time the model with int8 weight matrices")
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="also time everything, and a simulated alpha 0.8, gamma 4 speedup, with N cores kept busy "
                   "(default 0)")
    p.add_argument("--draft", default="gpt2", help="--busy: the speedup's draft shape, default gpt2 "
                   "(its target: the last --models)")
    p.add_argument("--gen", type=int, default=100, help="--busy: new tokens of the speedup runs (default 100)")
    p.add_argument("--no-transformers", action="store_true", help="skip transformers (it need not be installed)")
    p.add_argument("--seed", type=int, default=0, help="seeds the random weights and tokens")
    p.add_argument("--out", help="results folder (default: benchmarks/results/decode_speed-<UTC time>/)")
    args = p.parse_args(argv)
    for name in ("repeats", "prefix", "gen"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1")
    if args.warmup < 0 or args.long < 0:
        raise ValueError("--warmup and --long must be >= 0")
    check_range("--seed", args.seed, -MAX_SEED, MAX_SEED)
    BandwidthProbe.check(args.bandwidth_mib)
    if any(not 2 <= k <= MAX_K for k in args.ks):
        raise ValueError(f"--ks are verification lengths: each must lie in 2..{MAX_K} (k = 1 is the decode step)")
    for name in args.models:
        n_ctx = shape(name).n_ctx  # raises a ValueError naming the presets
        if args.prefix + args.long + max(*args.ks, LONG_K) > n_ctx:
            raise ValueError(f"--prefix {args.prefix} + --long {args.long} + the longest verification pass "
                             f"({max(*args.ks, LONG_K)} tokens) exceed {name}'s context window of {n_ctx}: give a "
                             "shorter --prefix or --long")
    n_ctx = min(shape(args.draft).n_ctx, shape(args.models[-1]).n_ctx)
    if args.busy and SIM_PROMPT + args.gen > n_ctx:
        raise ValueError(f"--gen {args.gen} new tokens after the {SIM_PROMPT}-token prompt exceed the context "
                         f"window of {n_ctx}: give --gen at most {n_ctx - SIM_PROMPT}")
    args.ks = sorted(set(args.ks))
    args.command = "python -m benchmarks.decode_speed " + shlex.join(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    spinners = Spinners(args.busy)  # checks --busy
    if not args.no_transformers and importlib.util.find_spec("transformers") is None:
        raise ValueError("transformers is not installed: pip install -r requirements-dev.txt, "
                         "or pass --no-transformers")
    out = results_dir(args.out, "decode_speed")
    probe = BandwidthProbe(args.bandwidth_mib)
    try:
        results = [bench_model(name, args, probe, spinners) for name in args.models]
        speedup = bench_speedup(args, spinners) if args.busy else None
    finally:
        spinners.stop()
    models = {f"shape {i + 1}": name for i, name in enumerate(args.models)}
    env = environment(CPU, torch.float32, models, results[0]["path"])
    text = report(results, speedup, args, env)
    (out / "decode_speed.md").write_text(text + "\n", encoding="utf-8")  # first: a reader that left loses nothing
    write_json(out / "decode_speed.json", {"environment": env, "settings": vars(args), "results": results,
                                           "speedup": speedup})
    print(text)
    say(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
