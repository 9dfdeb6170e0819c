"""Throughput of batched decoding: tokens per second of plain batched decoding
(`gpt2.generate`) and of batched speculative decoding (spec_decoding/batch.py)
for B = 1, 2, 4, 8 rows, each against plain decoding at B = 1, and the step
costs that explain them.

On a CPU a decode step reads every weight once whatever B, so B rows cost
little more than one until the pass turns compute-bound. Verification feeds
B (gamma + 1) rows, so speculation reaches that turn gamma + 1 times sooner,
and stops paying where t_v(B (gamma + 1) rows) grows faster than the tokens a
step buys. Every B serves the same --prompts prompts, B at a time, with
simulated acceptance (`SimulatedBatchDrafter`); the protocol is `one_repeat`'s.
Writes batch_speed.md (the tables) and batch_speed.json to --out.

    python -m benchmarks.batch_speed                       # gpt2 -> gpt2-large shapes
    python -m benchmarks.batch_speed --repeats 5 --gammas 1 2 3 4 6 --step-batches 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import gc
import shlex
import sys
from statistics import median

import torch

from benchmarks.common import ArgumentParser, must, pair_names
from benchmarks.common import build_pair, check_range, environment, environment_lines, markdown_table, results_dir
from benchmarks.common import MAX_SEED, check_caches_fit, run_cli, say, set_threads, shape, timed, write_json
from benchmarks.decode_speed import BandwidthProbe, step_bytes, weight_bytes
from benchmarks.lockstep import Method, lockstep, paused_passes
from gpt2 import GPT2, KVCache, fast, generate
from gpt2.fast.quantize import matrix_weights
from spec_decoding import SimulatedBatchDrafter, predicted_speedup, speculative_generate
from spec_decoding.stats import clock

MAIN_GAMMA = 4  # the setting for the main table
GOAL_PLAIN_B8 = 5.0  # plain B = 8 against plain B = 1
GOAL_SPEC_B2 = 1.3  # speculative B = 2 (best gamma) against plain B = 2
MAX_PROMPTS = 4096  # --prompts at most
MAX_B = 256  # rows of a pass at most (--batch-sizes, --step-batches): gpt2-large caches 0.37 MB a row and position
SPREAD = 12  # prompt lengths differ from --prompt-len by up to this many tokens


def make_prompts(B: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """B prompts of random token ids, of different lengths around `length`."""
    g = torch.Generator().manual_seed(seed)
    lengths = [max(1, length + (8 * b) % (2 * SPREAD + 1) - SPREAD) for b in range(B)]  # e.g. 20 .. 44 for 32
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------------------
# What is timed
# ---------------------------------------------------------------------------


def batches(prompts: list[list[int]], B: int) -> list[tuple[int, list[list[int]]]]:
    """(index of the first prompt, the prompts) of each batch: every prompt, B at a time."""
    return [(i, prompts[i : i + B]) for i in range(0, len(prompts), B)]


def plain_run(target: GPT2, prompts: list[list[int]], B: int, n: int) -> Method:
    """`generate` over every prompt, B at a time, as a lockstep method that
    pauses before each of its target passes; returns the rows."""
    return paused_passes(target, lambda: [row for _, batch in batches(prompts, B)
                                          for row in generate(target, batch, n)])


def spec_run(target: GPT2, draft: GPT2, prompts: list[list[int]], references: list[list[int]], B: int, n: int,
             gamma: int, alpha: float, seed: int) -> Method:
    """Batched speculative decoding over every prompt, B at a time, with
    simulated acceptance (prompt i meets the coins of row i of `seed`,
    whatever B), as a lockstep method that pauses after each row's step;
    returns the batches' counters summed."""

    def run(pause):
        totals, tokens = {"new_tokens": 0, "accepted": 0, "judged": 0, "target_calls": 0}, 0

        def on_step(row: int, new: list[int], accepted: int) -> None:
            nonlocal tokens
            tokens += len(new)
            pause(tokens)

        for first, batch in batches(prompts, B):
            rows_of = references[first : first + len(batch)]
            drafter = SimulatedBatchDrafter(draft, rows_of, alpha, seed=seed, first_row=first)
            rows, stats = speculative_generate(target, drafter, batch, gamma=gamma, max_new_tokens=n, on_step=on_step)
            must(rows == rows_of, "greedy speculative decoding must reproduce plain decoding")
            for key in totals:
                totals[key] += getattr(stats, key)
        totals["alpha"] = totals["accepted"] / max(totals["judged"], 1)  # Leviathan's alpha over every row
        totals["tokens_per_target_call"] = totals["new_tokens"] / max(totals["target_calls"], 1)
        return totals

    return run


def warm_up(pair, args: argparse.Namespace, prompts: list[list[int]], references: list[list[int]]) -> None:
    """Short uncounted runs at the largest batch (first-touch page faults,
    the kernels' first calls), before any repeat."""
    B, alone, n = max(args.batch_sizes), lambda tokens: None, min(2, args.new_tokens)  # the references hold n
    plain_run(pair.target, prompts[:B], B, n)(alone)
    spec_run(pair.target, pair.draft, prompts[:B], [r[: len(p) + n] for p, r in zip(prompts, references)], B, n,
             max(args.gammas), args.alpha, args.seed)(alone)
    pass_seconds(pair.target, max(args.step_batches), max(args.gammas) + 1, args.context, args.seed)
    pass_seconds(pair.draft, max(args.step_batches), 1, args.context, args.seed)


def pass_seconds(model: GPT2, B: int, T: int, context: int, seed: int) -> float:
    """One forward pass of B rows x T new tokens on a cache holding `context` positions per row."""
    g = torch.Generator().manual_seed(seed)
    cache = model.new_cache(B, capacity=context + T)
    with torch.inference_mode():
        model(torch.randint(0, model.config.vocab_size, (B, context), generator=g), cache, last_logits_only=True)
        tokens = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
        return timed(model, tokens, cache)


def arithmetic_rate() -> float:
    """Multiply-adds x 2 per second of a float32 matrix product on all
    threads (torch.mm, the best of 5): near what the cores can do."""
    a, b = torch.ones(256, 1280), torch.ones(1280, 1280)
    return 2 * 256 * 1280 * 1280 / min(timed(torch.mm, a, b) for _ in range(5))


def pass_flops(model: GPT2, rows: int) -> int:
    """Floating-point operations of a pass over `rows` tokens: 2 per weight of
    every matrix (the blocks' and the LM head, the tied wte) per row;
    attention and the rest are small beside them."""
    return 2 * rows * sum(w.numel() for w in matrix_weights(model).values())


def one_repeat(pair, args: argparse.Namespace, prompts: list[list[int]], references: list[list[int]],
               reverse: bool, probe: BandwidthProbe, seed: int) -> dict:
    """Every measurement once: "plain B=<B>" (seconds) and "spec B=<B>
    gamma=<g>" (seconds and stats), whole generation runs all in lockstep
    (benchmarks/lockstep.py: a swing of the machine's speed lands on all of
    them alike). Acceptance per row: the target's own greedy token with
    probability --alpha, prompt i meeting the same coins (from `seed`) at
    every B; the draft model's passes are paid. Then, each in turn (reversed
    if `reverse`), on a cache of --context positions per row: one pass of B
    rows "t_step B=<B>", of B (gamma + 1) rows "t_v B=<B>", of the draft
    "t_d B=<B>", and the machine's read bandwidth "bandwidth B=<B>" and
    arithmetic rate "flops B=<B>" sampled around the step. Ratios are taken
    within a repeat, then the median over repeats (`summarise`)."""
    got: dict = {}
    methods = {f"plain B={B}": plain_run(pair.target, prompts, B, args.new_tokens) for B in args.batch_sizes}
    methods |= {f"spec B={B} gamma={gamma}": spec_run(pair.target, pair.draft, prompts, references, B,
                                                      args.new_tokens, gamma, args.alpha, seed)
                for B in args.batch_sizes for gamma in args.gammas}
    for name, (seconds, result) in lockstep(dict(reversed(methods.items())) if reverse else methods,
                                            lambda: clock(pair.device)).items():
        must(not name.startswith("plain") or result == references, "plain decoding must not depend on B")
        got[name] = seconds if name.startswith("plain") else (seconds, result)
    gc.collect()
    for B in (list(reversed(args.step_batches)) if reverse else args.step_batches):
        before, flops_before = probe.sample(), arithmetic_rate()
        got[f"t_step B={B}"] = pass_seconds(pair.target, B, 1, args.context, args.seed)
        got[f"bandwidth B={B}"] = (before + probe.sample()) / 2
        got[f"flops B={B}"] = (flops_before + arithmetic_rate()) / 2
        for gamma in args.gammas:
            got[f"t_v B={B} gamma={gamma}"] = pass_seconds(pair.target, B, gamma + 1, args.context, args.seed)
        got[f"t_d B={B}"] = pass_seconds(pair.draft, B, 1, args.context, args.seed)
        gc.collect()
    return got


# ---------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------


def summarise(repeats: list[dict], args: argparse.Namespace, pair) -> dict:
    """Medians over repeats; every ratio taken within a repeat first."""
    n = args.new_tokens

    def med(fn) -> float:
        return median(fn(r) for r in repeats)

    def plain_tps(r, B):
        return args.prompts * n / r[f"plain B={B}"]

    def spec_tps(r, B, g):
        seconds, stats = r[f"spec B={B} gamma={g}"]
        return stats["new_tokens"] / seconds

    throughput = {}
    for B in args.batch_sizes:
        entry = {"plain_tokens_per_s": med(lambda r: plain_tps(r, B)),
                 "plain_vs_plain_B1": med(lambda r: plain_tps(r, B) / plain_tps(r, 1)), "spec": {}}
        for g in args.gammas:
            entry["spec"][g] = {
                "tokens_per_s": med(lambda r: spec_tps(r, B, g)),
                "vs_plain_B1": med(lambda r: spec_tps(r, B, g) / plain_tps(r, 1)),
                "vs_plain_same_B": med(lambda r: spec_tps(r, B, g) / plain_tps(r, B)),
                "alpha": med(lambda r: r[f"spec B={B} gamma={g}"][1]["alpha"]),
                "tokens_per_target_call": med(lambda r: r[f"spec B={B} gamma={g}"][1]["tokens_per_target_call"]),
            }
        entry["best_gamma"] = max(args.gammas, key=lambda g: entry["spec"][g]["vs_plain_same_B"])  # as shown
        throughput[B] = entry

    steps = {}
    weights = weight_bytes(pair.target, False)
    for B in args.step_batches:
        nbytes = step_bytes(pair.target, args.context, False, rows=B)
        entry = {
            "t_step_s": med(lambda r: r[f"t_step B={B}"]),
            "step_vs_B1": med(lambda r: r[f"t_step B={B}"] / r["t_step B=1"]),
            "t_d_s": med(lambda r: r[f"t_d B={B}"]),
            "bytes": nbytes,
            "bound_s": med(lambda r: nbytes / r[f"bandwidth B={B}"]),
            "fraction_of_bound": med(lambda r: nbytes / r[f"bandwidth B={B}"] / r[f"t_step B={B}"]),
            "arithmetic_bound_s": med(lambda r: pass_flops(pair.target, B) / r[f"flops B={B}"]),
            "verify": {},
        }
        for g in args.gammas:
            alpha = args.alpha
            entry["verify"][g] = {
                "rows": B * (g + 1),
                "t_v_s": med(lambda r: r[f"t_v B={B} gamma={g}"]),
                "r": med(lambda r: r[f"t_v B={B} gamma={g}"] / r[f"t_step B={B}"]),  # against a plain step of B rows
                "fraction_of_bound": med(lambda r: nbytes / r[f"bandwidth B={B}"] / r[f"t_v B={B} gamma={g}"]),
                "arithmetic_bound_s": med(lambda r: pass_flops(pair.target, B * (g + 1)) / r[f"flops B={B}"]),
                # Leviathan et al.'s speedup over plain decoding at the same B, from these step costs.
                "predicted_speedup": med(lambda r: predicted_speedup(
                    alpha, g, r[f"t_d B={B}"], r[f"t_step B={B}"], r[f"t_v B={B} gamma={g}"])),
            }
        entry["best_predicted_gamma"] = max(args.gammas, key=lambda g: entry["verify"][g]["predicted_speedup"])
        steps[B] = entry
    stops = [B for B in args.step_batches
             if steps[B]["verify"][steps[B]["best_predicted_gamma"]]["predicted_speedup"] <= 1.0]
    measured_stops = [B for B in args.batch_sizes
                      if throughput[B]["spec"][throughput[B]["best_gamma"]]["vs_plain_same_B"] <= 1.0]
    return {"throughput": throughput, "steps": steps, "weight_bytes": weights,
            "speculation_stops_paying_at_B": {"measured": measured_stops[0] if measured_stops else None,
                                              "predicted": stops[0] if stops else None}}


def report_lines(summary: dict, args: argparse.Namespace) -> list[str]:
    g_main = MAIN_GAMMA if MAIN_GAMMA in args.gammas else args.gammas[-1]
    tp, steps = summary["throughput"], summary["steps"]
    lines = ["## Tokens per second", "",
             f"The same {args.prompts} prompts ({args.prompt_len} +- {SPREAD} tokens) at every B, served B at a time, "
             f"{args.new_tokens} new tokens each; speculative: gamma = {g_main}, simulated alpha = {args.alpha}. "
             "Plain and speculative runs at every B in lockstep (they take turns step by step). "
             "Each ratio is the median of the per-repeat ratios.",
             ""]
    rows = []
    for B, e in tp.items():
        s = e["spec"][g_main]
        rows.append([str(B), f"{e['plain_tokens_per_s']:.2f}", f"{e['plain_vs_plain_B1']:.2f}x",
                     f"{s['tokens_per_s']:.2f}", f"{s['vs_plain_B1']:.2f}x", f"{s['vs_plain_same_B']:.2f}x",
                     f"{s['alpha']:.2f}", f"{s['tokens_per_target_call']:.2f}"])
    headers = ["B", "plain tok/s", "plain / plain B=1", f"spec tok/s (gamma {g_main})", "spec / plain B=1",
               "spec / plain same B", "alpha", "batch tokens / target call"]
    lines += [markdown_table(headers, rows), ""]

    lines += ["## Which gamma for which B", "",
              "Speculative tokens per second over plain decoding at the same B (measured runs).", ""]
    rows = [[str(B)] + [f"{e['spec'][g]['vs_plain_same_B']:.2f}x" for g in args.gammas] + [str(e["best_gamma"])]
            for B, e in tp.items()]
    lines += [markdown_table(["B"] + [f"gamma {g}" for g in args.gammas] + ["best gamma"], rows), ""]

    lines += ["## Step cost against B", "",
              f"One pass on a cache of {args.context} positions per row. t_step: B rows x 1 token; bound: the "
              "bytes it must read (weights once, each row's keys and values) over the read bandwidth sampled "
              "around it; arith.: its multiply-adds (2 per weight per row) over the rate of a float32 matrix "
              "product sampled around it (torch.mm): a pass takes at least the larger of the two; r = "
              "t_v(B (gamma + 1) rows) / t_step(B rows); predicted: E(alpha, gamma) t_step / (gamma t_d + t_v), "
              "Leviathan et al. 2023 Thm 3.8 with these costs.", ""]
    rows = []
    for B, e in steps.items():
        v = e["verify"][g_main]
        rows.append([str(B), f"{1e3 * e['t_step_s']:.1f}", f"{e['step_vs_B1']:.2f}x", f"{1e3 * e['bound_s']:.1f}",
                     f"{1e3 * e['arithmetic_bound_s']:.1f}", f"{100 * e['fraction_of_bound']:.0f}%",
                     f"{1e3 * e['t_d_s']:.1f}", str(v["rows"]), f"{1e3 * v['t_v_s']:.1f}",
                     f"{1e3 * v['arithmetic_bound_s']:.1f}", f"{v['r']:.2f}", f"{100 * v['fraction_of_bound']:.0f}%",
                     f"{v['predicted_speedup']:.2f}x", str(e["best_predicted_gamma"])])
    lines += [markdown_table(["B", "t_step ms", "t_step / t_step(1)", "bound ms", "arith. ms", "% of bound",
                              "t_d ms", f"rows (gamma {g_main})", "t_v ms", "t_v arith. ms", "r", "t_v % of bound",
                              f"predicted (gamma {g_main})", "best predicted gamma"], rows), ""]

    goal_plain = tp[8]["plain_vs_plain_B1"] if 8 in tp else None
    goal_spec = tp[2]["spec"][tp[2]["best_gamma"]]["vs_plain_same_B"] if 2 in tp else None
    stop = summary["speculation_stops_paying_at_B"]
    lines += ["## Goals", ""]
    if goal_plain is not None:
        lines.append(f"- plain B = 8 / plain B = 1: {goal_plain:.2f}x (goal >= {GOAL_PLAIN_B8}x): "
                     + ("met" if goal_plain >= GOAL_PLAIN_B8 else "NOT met"))
    if goal_spec is not None:
        lines.append(f"- speculative B = 2 (gamma {tp[2]['best_gamma']}) / plain B = 2: {goal_spec:.2f}x "
                     f"(goal >= {GOAL_SPEC_B2}x): " + ("met" if goal_spec >= GOAL_SPEC_B2 else "NOT met"))
    if 8 in steps and 1 in steps:
        floor = max(steps[8]["bound_s"], steps[8]["arithmetic_bound_s"])
        lines.append(f"- a step of 8 rows takes at least {1e3 * floor:.1f} ms on this machine (the larger of its "
                     f"bounds) against {1e3 * steps[1]['t_step_s']:.1f} ms measured for one row: decoding alone, "
                     f"B = 8 could give at most {8 * steps[1]['t_step_s'] / floor:.2f}x the tokens per second of "
                     f"B = 1 (measured steps: {8 / steps[8]['step_vs_B1']:.2f}x), before prefill")
    lines.append(f"- speculation stops paying (best gamma <= 1x plain at the same B): measured at B = "
                 f"{stop['measured'] or 'none of ' + str(args.batch_sizes)}; predicted from the step costs at B = "
                 f"{stop['predicted'] or 'none of ' + str(args.step_batches)}")
    return lines


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m benchmarks.batch_speed", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", help="target shape, random weights (default gpt2-large)")
    p.add_argument("--draft", help="draft shape, random weights (default gpt2)")
    p.add_argument("--tiny", action="store_true", help="tiny random models, for tests and smoke runs")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8],
                   help=f"B of the generation runs, at most {MAX_B}")
    p.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3, 4], help="draft lengths to time")
    p.add_argument("--step-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                   help=f"B of the step costs, at most {MAX_B}")
    p.add_argument("--alpha", type=float, default=0.8, help="simulated acceptance rate")
    p.add_argument("--new-tokens", type=int, default=24, help="new tokens per row")
    p.add_argument("--prompt-len", type=int, default=32, help=f"prompt length (rows differ by up to +-{SPREAD})")
    p.add_argument("--prompts", type=int, default=None,
                   help="prompts every B serves, B at a time (default: the largest --batch-sizes)")
    p.add_argument("--context", type=int, default=64, help="cached positions per row for the step costs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=0, help="uncounted full repeats first (after a short warm-up)")
    p.add_argument("--bandwidth-mib", type=int, default=256,
                   help=f"size of the read-bandwidth probe, at most {BandwidthProbe.MAX_MIB}")
    p.add_argument("--threads", type=int, default=None,
                   help="torch (and kernel) threads, at most the logical CPUs; default: torch's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results folder")
    args = p.parse_args(argv)
    pair_names(args, presets=True)
    for name in ("batch_sizes", "gammas", "step_batches"):
        if min(getattr(args, name)) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must all be >= 1")
    for name in ("batch_sizes", "step_batches"):
        check_range(f"--{name.replace('_', '-')}", max(getattr(args, name)), 1, MAX_B, " (rows of a pass)")
    if 1 not in args.batch_sizes or 1 not in args.step_batches:
        raise ValueError("--batch-sizes and --step-batches must include 1: every ratio is against B = 1")
    if not 0.0 <= args.alpha <= 1.0:
        raise ValueError(f"--alpha must lie in [0, 1], got {args.alpha}")
    BandwidthProbe.check(args.bandwidth_mib)
    args.prompts = max(args.batch_sizes) if args.prompts is None else args.prompts
    check_range("--prompts", args.prompts, max(args.batch_sizes), MAX_PROMPTS,
                " (enough for the largest of --batch-sizes, and held in memory)")
    check_range("--seed", args.seed, -MAX_SEED, MAX_SEED)
    if min(args.new_tokens, args.prompt_len, args.context, args.repeats, args.prompts) < 1 or args.warmup < 0:
        raise ValueError("--new-tokens, --prompt-len, --context, --repeats and --prompts must be >= 1, "
                         "--warmup >= 0")
    n_ctx = min(shape(name).n_ctx for name in (args.target, args.draft))
    if args.prompt_len + SPREAD + args.new_tokens > n_ctx:
        raise ValueError(f"the longest prompt (--prompt-len {args.prompt_len} + {SPREAD}) and --new-tokens "
                         f"{args.new_tokens} exceed the context window of {n_ctx}: " + which_to_shrink(
                             n_ctx - SPREAD, ("--prompt-len", args.prompt_len), ("--new-tokens", args.new_tokens)))
    if args.context + max(args.gammas) + 1 > n_ctx:
        raise ValueError(f"--context {args.context} and a verification pass of max(--gammas) + 1 = "
                         f"{max(args.gammas) + 1} tokens exceed the context window of {n_ctx}: " + which_to_shrink(
                             n_ctx - 1, ("--context", args.context), ("--gammas", max(args.gammas))))
    args.batch_sizes, args.gammas, args.step_batches = (sorted(set(v)) for v in
                                                         (args.batch_sizes, args.gammas, args.step_batches))
    check_cache_memory(args)
    return args


def which_to_shrink(room: int, first: tuple[str, int], second: tuple[str, int]) -> str:
    """How to make two options' values, (option, value) each, sum to at most `room`: lower the first to fit
    beside the second, else the second beside the first, else both."""
    (a, x), (b, y) = first, second
    if room - y >= 1:
        return f"give {a} at most {room - y}"
    return f"give {b} at most {room - x}" if room - x >= 1 else f"give a smaller {a} and {b}"


def check_cache_memory(args: argparse.Namespace) -> None:
    """Raises a ValueError if the runs of a repeat, all alive at once in lockstep, would hold KV caches (each
    method one batch at a time, target and draft, float32) of more than half the machine's memory, or one step
    cost's cache would."""
    rows = sum(args.batch_sizes) * (1 + len(args.gammas))  # plain + each gamma
    positions = args.prompt_len + SPREAD + args.new_tokens + max(args.gammas) + 1
    names = (args.target, args.draft)
    check_caches_fit(sum(KVCache.nbytes(shape(name), rows, positions) for name in names),
                     "give fewer or smaller --batch-sizes, fewer --gammas or fewer --new-tokens")
    # The step costs: a cache of the largest step batch at --context, one model at a time.
    step = max(KVCache.nbytes(shape(name), max(args.step_batches), args.context + max(args.gammas) + 1)
               for name in names)
    check_caches_fit(step, "give a smaller largest --step-batches or a shorter --context", "a step cost's pass")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)  # the kernels share torch's OpenMP pool (gpt2/fast/build.py)
    folder = results_dir(args.out, "batch_speed")  # before the work: a bad --out fails now
    say(f"building {'tiny models' if args.tiny else f'{args.target} and {args.draft} (random weights)'} ...")
    pair = build_pair(args.target, args.draft, weights="tiny" if args.tiny else "random", seed=args.seed)
    prompts = make_prompts(args.prompts, args.prompt_len, pair.target.config.vocab_size, args.seed)
    probe = BandwidthProbe(args.bandwidth_mib)
    references = [row for _, batch in batches(prompts, max(args.batch_sizes))
                  for row in generate(pair.target, batch, args.new_tokens)]  # what the simulated drafters copy
    warm_up(pair, args, prompts, references)
    repeats = []
    for i in range(args.warmup + args.repeats):
        say(f"repeat {i + 1 - args.warmup} of {args.repeats}" if i >= args.warmup else "warm-up")
        got = one_repeat(pair, args, prompts, references, reverse=bool(i % 2), probe=probe, seed=args.seed + i)
        if i >= args.warmup:
            repeats.append(got)
    summary = summarise(repeats, args, pair)

    env = environment(pair.device, pair.dtype, {"target": pair.target_name, "draft": pair.draft_name},
                      fast.status(pair.target))
    command = "python -m benchmarks.batch_speed " + shlex.join(argv if argv is not None else sys.argv[1:])
    lines = ["# Batched decoding: tokens per second against B", "", *environment_lines(env),
             f"- command: `{command}`", "", *report_lines(summary, args)]
    (folder / "batch_speed.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    write_json(folder / "batch_speed.json", {"environment": env, "command": command, "settings": vars(args),
                                             "summary": summary, "samples": repeats})
    print("\n".join(lines))
    say(f"written to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
