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
  r_k = t_v(k) / t_step, the median over the repeats of the ratio of the two
  calls of one repeat (seconds apart): this machine's speed drifts between
  repeats, and the ratio of two medians can then pair a fast-phase step
  with a slow-phase verification (once 1.46 where every phase gave ~1.2);
- t_step and t_v(5) again with a long context (prefix + --long positions,
  its own cache, timed in the same repeats), so that attention over the
  cache and the cache writes show if they cost much;
- the bandwidth bound: the bytes one step must read (every weight matrix,
  the tied LM head included, once; plus the cached keys and values) / the
  machine's read bandwidth, measured by summing a --bandwidth-mib tensor
  right before and right after every timed decode step. Each step is set
  against the bandwidth sampled around it: the bandwidth of a shared
  machine drifts within seconds (30 to 56 GB/s here), and a probe taken
  apart from the calls it bounds once gave "122% of the bound".

How: every repeat runs each implementation in turn (in reversed order on odd
repeats), after --warmup uncounted repeats; the tables show medians. After each
timed call the cache goes back to the prefix (ours: `KVCache.rewind`;
transformers: `DynamicCache.crop(-k)`), so every call sees the same context.
The two models are checked to give the same logits before anything is timed.

Usage:
    python -m benchmarks.decode_speed                        # gpt2 and gpt2-large shapes
    python benchmarks/decode_speed.py --models gpt2 --repeats 5 --no-transformers
    python -m benchmarks.decode_speed --module-blocks --plain-attention --plain-linear   # and without each speed trick
    python -m benchmarks.decode_speed --int8 --no-transformers   # and with int8 weights (gpt2/quantize.py)

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
from gpt2.attention import plain_attention
from gpt2.block_loop import module_blocks

CPU = torch.device("cpu")
INT8_LABEL = "ours, int8 weights"
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
    head is the tied wte), except the position table wpe, of which it reads
    one row; a weight matrix the kernel reads as int8 (gpt2/quantize.py)
    counts its int8 levels and its rows' float32 scales."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # tied wte counted once
    for w in model.matrix_weights():
        packed = gpt2_linear.packed_weight(w) if gpt2_linear.kernel_takes(w) else None
        if packed is not None and packed.scale is not None:  # read as int8: 1 byte a weight, plus the scales
            total -= w.numel() * w.element_size() - (w.numel() + packed.scale.numel() * packed.scale.element_size())
    wpe = model.wpe.weight
    return total - wpe.numel() * wpe.element_size() + wpe.size(1) * wpe.element_size()


def step_bytes(model: GPT2, context: int) -> int:
    """Bytes one decode step must read with `context` positions already cached:
    the weights, plus the keys and values of every layer at the context
    positions and the new one (B = 1)."""
    c = model.config
    kv = 2 * c.n_layer * (context + 1) * c.n_embd * model.dtype.itemsize  # (k, v) x layers x positions x C
    return step_weight_bytes(model) + kv


class OursRunner:
    """Our GPT-2 with its preallocated KV caches, one per context length.

    Args:
        model: the model.
        plain: "linear": every matrix product through F.linear and attention
            through SDPA (`gpt2.linear.plain_linear`: the readable path);
            "attention": attention through SDPA (`plain_attention`), the
            linear kernel kept, so through the Block modules;
            "blocks": the kernels, called from the Block modules one by one
            instead of the one-call block loop (`module_blocks`);
            None: the fast paths. To show what each speed trick buys.
        label: the report's name for it (default: from `plain`).
    """

    LABELS = {
        None: "ours",
        "blocks": "ours, Block modules",
        "attention": "ours, SDPA attention",
        "linear": "ours, F.linear + SDPA",
    }

    def __init__(self, model: GPT2, *, plain: str | None = None, label: str | None = None) -> None:
        self.model = model
        self.plain = plain
        self.label = label or self.LABELS[plain]
        self.caches: dict[str, KVCache] = {}

    def context(self):
        if self.plain == "linear":
            return gpt2_linear.plain_linear()
        if self.plain == "attention":
            return plain_attention()
        if self.plain == "blocks":
            return module_blocks()
        return contextlib.nullcontext()

    def prefill(self, prompt: torch.Tensor, slot: str) -> None:
        """Empties cache `slot` and fills it with `prompt` (1, P)."""
        if slot not in self.caches:
            self.caches[slot] = self.model.new_cache(1)
        cache = self.caches[slot]
        cache.rewind(0)
        with self.context():
            self.model(prompt, cache, last_logits_only=True)

    def verify(self, tokens: torch.Tensor, slot: str) -> torch.Tensor:
        """Logits (1, k, V) of `tokens` (1, k) on top of cache `slot`; the cache is then rewound."""
        cache = self.caches[slot]
        P = cache.length
        with self.context():
            logits = self.model(tokens, cache)
        cache.rewind(P)
        return logits


class TransformersRunner:
    """transformers' GPT2LMHeadModel with a DynamicCache (its default cache) per context length."""

    label = "transformers"

    def __init__(self, hf_model) -> None:
        from transformers import DynamicCache  # a benchmark-only dependency

        self.hf_model = hf_model
        self.new_cache = DynamicCache
        self.caches: dict = {}

    def prefill(self, prompt: torch.Tensor, slot: str) -> None:
        self.caches[slot] = self.new_cache()
        self.hf_model(prompt, past_key_values=self.caches[slot], use_cache=True, logits_to_keep=1)

    def verify(self, tokens: torch.Tensor, slot: str) -> torch.Tensor:
        cache = self.caches[slot]
        logits = self.hf_model(tokens, past_key_values=cache, use_cache=True).logits  # (1, k, V)
        cache.crop(-tokens.size(1))  # a negative count drops that many positions (transformers 4.x and 5.x)
        return logits


def timed(fn: Callable[..., object], *args) -> float:
    """Seconds that `fn(*args)` takes."""
    t0 = clock(CPU)
    fn(*args)
    return clock(CPU) - t0


def time_interleaved(
    runners: list, prompts: dict[str, torch.Tensor], drafts: torch.Tensor, ks: dict[str, list[int]], *,
    warmup: int, repeats: int, probe: BandwidthProbe,
) -> dict[str, dict[str, list[float]]]:
    """Samples per runner label: "prefill" (of prompts["short"]), "<slot> k=<k>"
    for every slot (context) and k in ks[slot] (s), and "<slot> bandwidth"
    (bytes/s) for every slot.

    Each repeat runs every runner in turn, reversed on odd repeats; the first
    `warmup` repeats are not kept. A runner's turn starts with its decode
    steps, one per slot, each between two bandwidth samples (the probe right
    before and right after it: a shared machine's bandwidth drifts within
    seconds); "<slot> bandwidth" is their mean. Then the prefill and the
    verifications. Every slot's cache holds its prompt between calls."""
    samples = {r.label: {} for r in runners}
    slots = list(prompts)
    for r in runners:
        for slot in slots:
            r.prefill(prompts[slot], slot)
    for rep in range(warmup + repeats):
        order = runners if rep % 2 == 0 else runners[::-1]
        for r in order:
            got = {}
            before = probe.sample()
            for slot in slots:
                got[f"{slot} k=1"] = timed(r.verify, drafts[:, :1], slot)
                after = probe.sample()
                got[f"{slot} bandwidth"] = (before + after) / 2
                before = after
            got["prefill"] = timed(r.prefill, prompts["short"], "short")  # leaves the prompt in the cache
            for slot in slots:
                for k in ks[slot]:
                    if k > 1:
                        got[f"{slot} k={k}"] = timed(r.verify, drafts[:, :k], slot)
            if rep >= warmup:
                for key, value in got.items():
                    samples[r.label].setdefault(key, []).append(value)
    return samples


def check_same_logits(runners: list, prompt: torch.Tensor, drafts: torch.Tensor) -> dict[str, float]:
    """Max abs difference of each runner's logits to the first runner's, on
    `drafts` after `prompt`: timing two models that disagree would mean nothing."""
    ref = None
    diffs = {}
    for r in runners:
        r.prefill(prompt, "check")
        logits = r.verify(drafts, "check")
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
    int8_model = int8_runner = None
    if args.int8:
        print(f"[{name}] the same weights quantised to int8 ...", file=sys.stderr, flush=True)
        int8_model = random_model(config, device=CPU, dtype=DTYPE, seed=args.seed, quantize="int8")
        int8_runner = OursRunner(int8_model, label=INT8_LABEL)
        runners.append(int8_runner)
    if args.module_blocks:
        runners.append(OursRunner(model, plain="blocks"))
    if args.plain_attention:
        runners.append(OursRunner(model, plain="attention"))
    if args.plain_linear:
        runners.append(OursRunner(model, plain="linear"))
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
    prompts = {"short": prompt}
    ks = {"short": [1] + list(args.ks)}
    if args.long > 0:
        prompts["long"], ks["long"] = long_prompt, [1, LONG_K]
    contexts = {slot: p.size(1) for slot, p in prompts.items()}

    with torch.inference_mode():
        diffs = check_same_logits([r for r in runners if r is not int8_runner], prompt, drafts)
        if int8_runner is not None:  # another model: checked against itself on the readable path
            readable = OursRunner(int8_model, plain="linear")
            diffs[INT8_LABEL] = check_same_logits([readable, int8_runner], prompt, drafts)[INT8_LABEL]
        print(f"[{name}] max |logits - ours|: {diffs}", file=sys.stderr, flush=True)
        worst = max(diffs.values())
        if worst > 1e-3:
            raise AssertionError(f"the implementations disagree on {name} (max abs logit difference {worst:.3g})")
        for r in runners:
            r.caches.pop("check", None)

        long_part = f", step and k = {LONG_K} at {contexts['long']}" if "long" in contexts else ""
        print(f"[{name}] timing prefill {args.prefix}, step and verification k = {args.ks} at context "
              f"{args.prefix}{long_part} ({args.warmup} warm-up + {args.repeats} repeats) ...",
              file=sys.stderr, flush=True)
        samples = time_interleaved(runners, prompts, drafts, ks, warmup=args.warmup, repeats=args.repeats, probe=probe)

    weight_bytes = step_weight_bytes(model)
    result = {"model": name, "weight_bytes": weight_bytes, "max_abs_logit_diff": diffs, "contexts": contexts,
              "step_bytes": {slot: step_bytes(model, P) for slot, P in contexts.items()}, "implementations": {}}
    for r in runners:
        s = samples[r.label]
        entry = {"samples": s, "prefill_s": median(s["prefill"])}
        for slot in prompts:
            nbytes = step_bytes(int8_model, contexts[slot]) if r is int8_runner else result["step_bytes"][slot]
            steps, bandwidth = s[f"{slot} k=1"], s[f"{slot} bandwidth"]
            t_step = median(steps)
            # Each step against the bound of the bandwidth sampled around it, then the median.
            fractions = [nbytes / bw / t for bw, t in zip(bandwidth, steps)]
            entry[slot] = {
                "step_bytes": nbytes,
                "step_s": t_step,
                "verify_s": {k: median(s[f"{slot} k={k}"]) for k in ks[slot] if k > 1},
                "read_bandwidth_bytes_per_s": median(bandwidth),
                "bound_s": nbytes / median(bandwidth),
                "fraction_of_bound": median(fractions),
                "fraction_of_bound_samples": fractions,
            }
            # r_k paired within each repeat (see the module docstring); the ratio of the medians kept beside it
            entry[slot]["r"] = {k: median([t / t1 for t, t1 in zip(s[f"{slot} k={k}"], steps)]) for k in ks[slot] if k > 1}
            entry[slot]["r_of_medians"] = {k: t / t_step for k, t in entry[slot]["verify_s"].items()}
        result["implementations"][r.label] = entry

    del runners, model, int8_model, int8_runner
    gc.collect()
    return result


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def report(results: list[dict], args: argparse.Namespace, env: dict) -> str:
    k5 = 5 if 5 in args.ks else args.ks[0]
    bandwidths = [bw for res in results for e in res["implementations"].values()
                  for slot in res["contexts"] for bw in e["samples"][f"{slot} bandwidth"]]
    bandwidth_line = (
        f"- read bandwidth (summing a {args.bandwidth_mib} MiB tensor right before and after each timed "
        f"decode step): median {median(bandwidths) / 1e9:.1f} GB/s, "
        f"{min(bandwidths) / 1e9:.1f} to {max(bandwidths) / 1e9:.1f} over the run"
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
        headers += [f"step @{P} (ms)", f"bound @{P} (ms)", f"% of bound @{P}", f"t_v({LONG_K}) @{P} (ms)",
                    f"r_{LONG_K} @{P}"]
    rows = []
    for res in results:
        for label, e in res["implementations"].items():
            short = e["short"]
            row = [res["model"], label, ms(e["prefill_s"]), ms(short["step_s"]), ms(short["bound_s"]),
                   f"{100 * short['fraction_of_bound']:.0f}%", ms(short["verify_s"][k5]), f"{short['r'][k5]:.2f}"]
            if args.long > 0:
                long = e["long"]
                row += [ms(long["step_s"]), ms(long["bound_s"]), f"{100 * long['fraction_of_bound']:.0f}%",
                        ms(long["verify_s"][LONG_K]), f"{long['r'][LONG_K]:.2f}"]
            rows.append(row)
    lines += ["## Step, verification and the bandwidth bound", "",
              "bound = bytes one step must read (every weight once, plus the cached keys and values; int8 "
              "weights: 1 byte each plus their rows' scales) / read bandwidth. % of bound: each step against "
              "the bound of the bandwidth sampled around it (bound_i / step_i), median over the repeats; the "
              "bound column uses the median bandwidth. r_k: the median over the repeats of t_v(k) / t_step "
              "within each repeat.", "",
              markdown_table(headers, rows), ""]

    headers = ["model", "implementation"] + [f"k={k}" for k in args.ks]
    rows = []
    for res in results:
        for label, e in res["implementations"].items():
            short = e["short"]
            rows.append([res["model"], label] + [f"{ms(short['verify_s'][k])} ({short['r'][k]:.2f})" for k in args.ks])
    lines += [f"## Verification of k tokens in one forward pass at context {args.prefix}: "
              "t_v(k) in ms (r_k = t_v(k) / t_step: the median over the repeats of each repeat's ratio)", "",
              markdown_table(headers, rows), ""]

    comparisons = []
    for res in results:
        impl = res["implementations"]
        o = impl["ours"]
        for label, e in impl.items():
            if label == "ours":
                continue
            line = (f"- {res['model']}: {label} / ours: prefill {e['prefill_s'] / o['prefill_s']:.2f}x, "
                    f"step {e['short']['step_s'] / o['short']['step_s']:.2f}x, "
                    f"t_v({k5}) {e['short']['verify_s'][k5] / o['short']['verify_s'][k5]:.2f}x")
            if args.long > 0:
                line += (f"; at {args.prefix + args.long}: step {e['long']['step_s'] / o['long']['step_s']:.2f}x, "
                         f"t_v({LONG_K}) {e['long']['verify_s'][LONG_K] / o['long']['verify_s'][LONG_K]:.2f}x")
            comparisons.append(line)
    if comparisons:
        lines += ["## The others against ours (time ratios; higher: ours faster)", "", *comparisons, ""]
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
    p.add_argument("--plain-linear", action="store_true",
                   help="also time our model on the readable path: F.linear and SDPA everywhere")
    p.add_argument("--plain-attention", action="store_true",
                   help="also time our model with SDPA attention (the linear kernel kept, the Block modules called)")
    p.add_argument("--module-blocks", action="store_true",
                   help="also time our model calling its Block modules one by one (the kernels kept)")
    p.add_argument("--int8", action="store_true",
                   help="also time the model with its weight matrices quantised to int8 (gpt2/quantize.py), "
                   "against its own bound (a quarter of the weight bytes)")
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
