"""Decode speed of the hand-written GPT-2: one decode step, the verification of
k tokens in one forward pass, and prefill, beside `transformers`' GPT-2 with
the same weights and beside the memory-bandwidth bound.

What is timed, for each model shape (random weights, fp32, batch 1), on top of
a KV cache holding a --prefix-token prompt:
- prefill: the prompt in one forward pass, logits of the last position only
  (as `gpt2.generate` does it);
- t_step: one new token, the cost of one step of plain decoding;
- t_v(k), k = 2..9: k new tokens in one forward pass with logits for all k,
  the cost of verifying gamma = k - 1 drafted tokens (Leviathan et al. 2023:
  speculative decoding pays off only if t_v(gamma + 1) is close to t_step);
  r_k = t_v(k) / t_step;
- t_step and t_v(5) again with a long context (prefix + --long positions), so
  that attention over the cache and the cache writes show if they cost much;
- the bandwidth bound: the bytes of weights one step must read (every matrix,
  the tied LM head included, once) / the machine's read bandwidth, measured
  here by summing a --bandwidth-mib tensor, sampled between the timed calls
  of that model (the bandwidth of a shared machine drifts: a probe taken
  apart from the calls it bounds gave "122% of the bound").

How: every repeat runs each implementation in turn (in reversed order on odd
repeats), after --warmup uncounted repeats; the tables show medians. After each
timed call the cache goes back to the prefix (ours: `KVCache.rewind`;
transformers: `DynamicCache.crop(-k)`), so every call sees the same context.
The two models are checked to give the same logits before anything is timed.

Usage:
    python -m benchmarks.decode_speed                        # gpt2 and gpt2-large shapes
    python benchmarks/decode_speed.py --models gpt2 --repeats 5 --no-transformers
    python -m benchmarks.decode_speed --plain-linear         # also time F.linear everywhere

Outputs (in --out, default benchmarks/results/decode_speed-<UTC time>/):
decode_speed.md (the tables, with the environment header) and
decode_speed.json (the same with every sample).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/decode_speed.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import contextlib
import gc
import shlex
from collections.abc import Callable

import torch

from benchmarks.common import (
    clock,
    environment,
    environment_lines,
    markdown_table,
    median,
    random_model,
    results_dir,
    run_cli,
    write_json,
)
from gpt2 import GPT2, KVCache, preset
from gpt2 import linear as gpt2_linear

CPU = torch.device("cpu")
DTYPE = torch.float32
LONG_K = 5  # the verification length timed at the long context (gamma = 4)


# ---------------------------------------------------------------------------
# What is measured
# ---------------------------------------------------------------------------


class BandwidthProbe:
    """Read bandwidth: the bytes/s of summing a `mib`-MiB float32 tensor."""

    def __init__(self, mib: int) -> None:
        self.x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)  # every page touched before timing
        self.x.sum()

    def sample(self) -> float:
        t0 = clock(CPU)
        self.x.sum()
        return self.x.numel() * 4 / (clock(CPU) - t0)


def step_weight_bytes(model: GPT2) -> int:
    """Bytes of weights one decode step reads: every parameter once (the LM
    head is the tied wte), except the position table wpe, of which it reads one row."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # tied wte counted once
    wpe = model.wpe.weight
    return total - wpe.numel() * wpe.element_size() + wpe.size(1) * wpe.element_size()


class OursRunner:
    """Our GPT-2 with its preallocated KV cache.

    Args:
        model: the model.
        plain: run every matrix product through plain F.linear
            (`gpt2.linear.plain_linear`), to show what the fast path buys.
    """

    def __init__(self, model: GPT2, *, plain: bool = False) -> None:
        self.model = model
        self.plain = plain
        self.label = "ours, F.linear" if plain else "ours"
        self.cache: KVCache = model.new_cache(1)

    def context(self):
        return gpt2_linear.plain_linear() if self.plain else contextlib.nullcontext()

    def prefill(self, prompt: torch.Tensor) -> None:
        """Empties the cache and fills it with `prompt` (1, P)."""
        self.cache.rewind(0)
        with self.context():
            self.model(prompt, self.cache, last_logits_only=True)

    def verify(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (1, k, V) of `tokens` (1, k) on top of the cache; the cache is then rewound."""
        P = self.cache.length
        with self.context():
            logits = self.model(tokens, self.cache)
        self.cache.rewind(P)
        return logits


class TransformersRunner:
    """transformers' GPT2LMHeadModel with a DynamicCache (its default cache)."""

    label = "transformers"

    def __init__(self, hf_model) -> None:
        from transformers import DynamicCache  # a benchmark-only dependency

        self.hf_model = hf_model
        self.new_cache = DynamicCache
        self.cache = None

    def prefill(self, prompt: torch.Tensor) -> None:
        self.cache = self.new_cache()
        self.hf_model(prompt, past_key_values=self.cache, use_cache=True, logits_to_keep=1)

    def verify(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.hf_model(tokens, past_key_values=self.cache, use_cache=True).logits  # (1, k, V)
        self.cache.crop(-tokens.size(1))  # a negative count drops that many positions (transformers 4.x and 5.x)
        return logits


def timed(fn: Callable[..., object], *args: torch.Tensor) -> float:
    """Seconds that `fn(*args)` takes."""
    t0 = clock(CPU)
    fn(*args)
    return clock(CPU) - t0


def time_interleaved(
    runners: list, prompt: torch.Tensor, drafts: torch.Tensor, ks: list[int], *, warmup: int, repeats: int,
    time_prefill: bool, probe: BandwidthProbe, bandwidth: list[float],
) -> dict[str, dict[str, list[float]]]:
    """Samples (s) per runner label: "prefill" (if asked) and "k=1", "k=2", ...

    Each repeat runs every runner in turn, reversed on odd repeats; the first
    `warmup` repeats are not kept. Before each runner's turn the read
    bandwidth is sampled into `bandwidth`, so that the bound describes the
    machine the calls ran on. Every runner holds `prompt` in its cache
    between calls."""
    samples = {r.label: {} for r in runners}
    for r in runners:
        r.prefill(prompt)
    for rep in range(warmup + repeats):
        order = runners if rep % 2 == 0 else runners[::-1]
        for r in order:
            if rep >= warmup:
                bandwidth.append(probe.sample())
            got = {}
            if time_prefill:
                got["prefill"] = timed(r.prefill, prompt)  # leaves the prompt in the cache
            for k in ks:
                got[f"k={k}"] = timed(r.verify, drafts[:, :k])
            if rep >= warmup:
                for key, t in got.items():
                    samples[r.label].setdefault(key, []).append(t)
    return samples


def check_same_logits(runners: list, prompt: torch.Tensor, drafts: torch.Tensor) -> dict[str, float]:
    """Max abs difference of each runner's logits to the first runner's, on
    `drafts` after `prompt`: timing two models that disagree would mean nothing."""
    ref = None
    diffs = {}
    for r in runners:
        r.prefill(prompt)
        logits = r.verify(drafts)
        if ref is None:
            ref = logits
        diffs[r.label] = (logits - ref).abs().max().item()
    return diffs


# ---------------------------------------------------------------------------
# One model shape
# ---------------------------------------------------------------------------


def bench_model(name: str, args: argparse.Namespace, probe: BandwidthProbe) -> dict:
    config = preset(name)
    print(f"[{name}] building the model with random weights ...", file=sys.stderr, flush=True)
    model = random_model(config, device=CPU, dtype=DTYPE, seed=args.seed)
    runners: list = [OursRunner(model)]
    if args.plain_linear:
        runners.append(OursRunner(model, plain=True))
    if not args.no_transformers:
        from benchmarks.hf_peer import to_transformers

        print(f"[{name}] copying the weights into transformers' GPT2LMHeadModel ...", file=sys.stderr, flush=True)
        runners.append(TransformersRunner(to_transformers(model)))

    g = torch.Generator().manual_seed(args.seed)
    V = config.vocab_size
    prompt = torch.randint(V, (1, args.prefix), generator=g)  # (1, P)
    drafts = torch.randint(V, (1, max(*args.ks, LONG_K)), generator=g)  # (1, max k)
    long_prompt = torch.cat([prompt, torch.randint(V, (1, args.long), generator=g)], dim=1)  # (1, P + L)
    if long_prompt.size(1) + drafts.size(1) > config.n_ctx:
        raise ValueError(f"--prefix + --long + max(--ks) must fit the context window {config.n_ctx}")

    with torch.inference_mode():
        diffs = check_same_logits(runners, prompt, drafts)
        print(f"[{name}] max |logits - ours|: {diffs}", file=sys.stderr, flush=True)
        worst = max(diffs.values())
        if worst > 1e-3:
            raise AssertionError(f"the implementations disagree on {name} (max abs logit difference {worst:.3g})")

        print(f"[{name}] timing prefill {args.prefix}, step and verification k = {args.ks} "
              f"({args.warmup} warm-up + {args.repeats} repeats) ...", file=sys.stderr, flush=True)
        bandwidth: list[float] = []
        short = time_interleaved(
            runners, prompt, drafts, [1] + list(args.ks), warmup=args.warmup, repeats=args.repeats, time_prefill=True,
            probe=probe, bandwidth=bandwidth,
        )
        long = {}
        if args.long > 0:
            print(f"[{name}] timing step and k = {LONG_K} at context {long_prompt.size(1)} ...", file=sys.stderr, flush=True)
            long = time_interleaved(
                runners, long_prompt, drafts, [1, LONG_K], warmup=args.warmup, repeats=args.repeats, time_prefill=False,
                probe=probe, bandwidth=bandwidth,
            )

    weight_bytes, read_bandwidth = step_weight_bytes(model), median(bandwidth)
    result = {"model": name, "weight_bytes": weight_bytes, "max_abs_logit_diff": diffs,
              "read_bandwidth_bytes_per_s": read_bandwidth, "read_bandwidth_samples_bytes_per_s": bandwidth,
              "bound_s": weight_bytes / read_bandwidth, "implementations": {}}
    for r in runners:
        s = short[r.label]
        med = {key: median(v) for key, v in s.items()}
        t_step = med["k=1"]
        entry = {
            "prefill_s": med["prefill"],
            "step_s": t_step,
            "verify_s": {k: med[f"k={k}"] for k in args.ks},
            "r": {k: med[f"k={k}"] / t_step for k in args.ks},
            "samples": s,
            "fraction_of_bound": result["bound_s"] / t_step,
        }
        if long:
            ls = long[r.label]
            entry["long_context"] = long_prompt.size(1)
            entry["long_step_s"] = median(ls["k=1"])
            entry[f"long_verify{LONG_K}_s"] = median(ls[f"k={LONG_K}"])
            entry[f"long_r{LONG_K}"] = entry[f"long_verify{LONG_K}_s"] / entry["long_step_s"]
            entry["long_samples"] = ls
        result["implementations"][r.label] = entry

    del runners, model
    gc.collect()
    return result


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def report(results: list[dict], args: argparse.Namespace, env: dict) -> str:
    k5 = 5 if 5 in args.ks else args.ks[0]
    bandwidth_line = (
        "- read bandwidth: "
        + ", ".join(f"{res['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s ({res['model']})" for res in results)
        + f" (median of summing a {args.bandwidth_mib} MiB tensor, sampled between that model's timed calls)"
    )
    settings_line = (
        f"- batch 1, random weights, prefix {args.prefix} tokens; medians of {args.repeats} interleaved "
        f"repeats after {args.warmup} warm-up"
    )
    lines = ["# Decode speed", "", *environment_lines(env), bandwidth_line, settings_line,
             f"- command: `{args.command}`", ""]

    headers = ["model", "implementation", f"prefill {args.prefix} (ms)", "step (ms)", "bound (ms)",
               "% of bound", f"t_v({k5}) (ms)", f"r_{k5}"]
    if args.long > 0:
        P = args.prefix + args.long
        headers += [f"step @{P} (ms)", f"r_{LONG_K} @{P}"]
    rows = []
    for res in results:
        for label, e in res["implementations"].items():
            row = [res["model"], label, ms(e["prefill_s"]), ms(e["step_s"]), ms(res["bound_s"]),
                   f"{100 * e['fraction_of_bound']:.0f}%", ms(e["verify_s"][k5]), f"{e['r'][k5]:.2f}"]
            if args.long > 0:
                row += [ms(e["long_step_s"]), f"{e[f'long_r{LONG_K}']:.2f}"]
            rows.append(row)
    lines += ["## Step, verification and the bandwidth bound", "",
              "bound = bytes of weights one step reads / read bandwidth; % of bound = bound / step.", "",
              markdown_table(headers, rows), ""]

    headers = ["model", "implementation"] + [f"k={k}" for k in args.ks]
    rows = []
    for res in results:
        for label, e in res["implementations"].items():
            rows.append([res["model"], label] + [f"{ms(e['verify_s'][k])} ({e['r'][k]:.2f})" for k in args.ks])
    lines += ["## Verification of k tokens in one forward pass: t_v(k) in ms (r_k = t_v(k) / t_step)", "",
              markdown_table(headers, rows), ""]

    speedups = []
    for res in results:
        impl = res["implementations"]
        if "transformers" in impl:
            o, t = impl["ours"], impl["transformers"]
            speedups.append(
                f"- {res['model']}: transformers / ours: prefill {t['prefill_s'] / o['prefill_s']:.2f}x, "
                f"step {t['step_s'] / o['step_s']:.2f}x, t_v({k5}) {t['verify_s'][k5] / o['verify_s'][k5]:.2f}x"
            )
    if speedups:
        lines += ["## Ours against transformers (higher: ours faster)", "", *speedups, ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.decode_speed",
        description="Decode step, verification of k tokens and prefill: ours vs transformers vs the bandwidth bound.",
    )
    p.add_argument("--models", nargs="+", default=["gpt2", "gpt2-large"], help="preset shapes (default: gpt2 gpt2-large)")
    p.add_argument("--repeats", type=int, default=10, help="timed repeats per measurement (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="uncounted repeats first (default 2)")
    p.add_argument("--prefix", type=int, default=100, help="prompt tokens in the cache (default 100)")
    p.add_argument("--ks", type=int, nargs="+", default=list(range(2, 10)), help="verification lengths (default 2..9)")
    p.add_argument("--long", type=int, default=500,
                   help="also time step and k=5 with the cache at prefix + LONG positions (default 500; 0: skip)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice)")
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="size of the tensor summed to measure read bandwidth")
    p.add_argument("--plain-linear", action="store_true", help="also time our model with plain F.linear everywhere")
    p.add_argument("--no-transformers", action="store_true", help="skip transformers (it need not be installed)")
    p.add_argument("--seed", type=int, default=0, help="seeds the random weights and tokens")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/decode_speed-<UTC time>/)")
    args = p.parse_args(argv)
    for name in ("repeats", "prefix", "bandwidth_mib"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.long < 0:
        raise ValueError("--warmup and --long must be >= 0")
    if any(k < 2 for k in args.ks):
        raise ValueError("--ks are verification lengths: each must be >= 2 (k = 1 is the decode step)")
    if args.threads is not None and args.threads < 1:
        raise ValueError("--threads must be >= 1")
    for name in args.models:
        preset(name)  # raises ValueError naming the presets
    args.command = "python -m benchmarks.decode_speed " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not args.no_transformers:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise ValueError("transformers is not installed: pip install -r requirements-dev.txt, or pass --no-transformers") from None
    out = results_dir(args.out, "decode_speed")

    probe = BandwidthProbe(args.bandwidth_mib)
    results = [bench_model(name, args, probe) for name in args.models]

    env = environment(CPU, DTYPE, {f"shape {i + 1}": name for i, name in enumerate(args.models)})
    text = report(results, args, env)
    print(text)
    (out / "decode_speed.md").write_text(text + "\n", encoding="utf-8")
    write_json(out / "decode_speed.json", {
        "environment": env,
        "settings": {k: v for k, v in vars(args).items()},
        "results": results,
    })
    print(f"results in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
