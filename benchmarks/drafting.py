"""Smarter and cheaper drafting, measured side by side: `gamma="auto"` against
fixed γ and Hugging Face's +2/-1 heuristic, a draft-only int8 draft, prompt
lookup (`NgramDrafter`) and llama.cpp's p_min early stop.

Three --parts: simulated acceptance on the gpt2 -> gpt2-large shapes
(`part_simulated`), prompt lookup on repetitive text (`part_ngram`), and a small pair
with a real acceptance process (`part_noisy`, which also counts sampled runs, untimed).
In each repeat plain decoding and every method run in lockstep (benchmarks/lockstep.py);
a speedup is the median over repeats of plain seconds over the method's. Every timed
run emits exactly --max-gen tokens and must reproduce plain greedy decoding. Writes
drafting.md (the tables) and drafting.json (every run) to --out.

    python -m benchmarks.drafting                              # everything, modest settings
    python -m benchmarks.drafting --parts simulated --alphas 0.8 --gammas 2 4 6 --repeats 1 --max-gen 32
    python -m benchmarks.drafting --tiny --repeats 1           # a smoke run in seconds
"""

from __future__ import annotations

import argparse
import copy
import itertools
import random
import shlex
import statistics
import sys
from collections.abc import Callable

import torch

from benchmarks.common import (
    ArgumentParser,
    MAX_SEED,
    check_caches_fit,
    check_range,
    environment,
    environment_lines,
    load_prompt_tokenizer,
    markdown_table,
    must,
    noisy_copy,
    pair_names,
    random_model,
    results_dir,
    run_cli,
    set_threads,
    shape,
    write_json,
)
from benchmarks.lockstep import lockstep, plain_decoding, rotated, stepwise
from benchmarks.prompts import PROMPTS
from benchmarks.sweep_report import pooled
from gpt2 import GPT2, GPT2Config, KVCache, fast, generate, init_random_weights
from spec_decoding import (
    AutoGamma,
    FixedGamma,
    HeuristicGamma,
    ModelDrafter,
    NgramDrafter,
    SimulatedDrafter,
    StepCosts,
    calibrate,
    speculative_generate,
)
from spec_decoding.stats import clock
from spec_decoding.schedule import DEFAULT_MAX_GAMMA

PARTS = ("simulated", "ngram", "noisy")

# The repetitive prompt: a paragraph, then a request to repeat it, then its first words.
PARAGRAPH = (
    "The old lighthouse keeper climbed the spiral stairs one last time. For forty years he had watched the "
    "ships pass in the night, and tonight, as the storm gathered over the bay, he lit the lamp again."
)
REPEAT_PROMPT = f"{PARAGRAPH}\n\nThe same paragraph again, word for word:\n\nThe old lighthouse keeper"

# The noisy pair: GPT-2's init for the blocks, a larger one for the token
# embedding (also the LM head) so that next-token distributions are peaked, and
# a draft that is the target plus noise (relative to each matrix's spread).
NOISY_CONFIG = GPT2Config(n_layer=4, n_head=4, n_embd=256)
NOISY_BLOCK_STD, NOISY_WTE_STD = 0.05, 0.2
MAX_NOISE = 10.0  # --noise: far past a useful draft, short of overflowing float32 weights
MAX_MODEL_SEEDS = 100_000  # --model-seeds: each string costs about a millisecond per α, after the timed runs


# ---------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------


def spec_run(target: GPT2, drafter_fn, ids: torch.Tensor, max_gen: int, schedule_fn, temperature=0.0, seed=0):
    """A lockstep method: speculative_generate with a fresh drafter and
    schedule, pausing after each step."""
    return stepwise(lambda on_step: speculative_generate(
        target, drafter_fn(), ids, gamma=schedule_fn(), max_new_tokens=max_gen, temperature=temperature,
        generator=torch.Generator().manual_seed(seed), on_step=on_step))


def time_methods(target, ids, max_gen, methods: dict[str, Callable], repeats: int, reference: list[int],
                 costs: StepCosts | None = None) -> dict:
    """Times every method against plain decoding: each repeat runs plain
    decoding and every method in lockstep (benchmarks/lockstep.py; who goes
    first rotates between repeats), and a method's ratio is plain decoding's
    seconds over its own in that repeat. With `costs`, each run's steps are
    also priced by the cost model (`modelled`: max_gen t_v(1) over the sum of
    its steps' K t_d + t_v(K + 1)), a speedup free of the machine's swings.

    Returns {method: {"speedup": median ratio, "ratios": [...], "seconds": [...],
    "modelled": [...], "stats": the last run's SpecStats dict, "alpha": α
    over every run, "gamma_hist": K asked, summed over the runs}}, and
    "plain": {"seconds": [...]}."""
    names = list(methods)
    results = {name: {"ratios": [], "seconds": [], "modelled": []} for name in names}
    runs = {name: [] for name in names}  # every run's SpecStats
    plain_seconds = []
    for r in range(repeats):
        timed = lockstep(rotated({"plain": plain_decoding(target, ids, max_gen)} | methods, r),
                         lambda: clock(target.device))
        plain, out = timed.pop("plain")
        must(out[0].tolist() == reference, "plain decoding changed between runs")
        plain_seconds.append(plain)
        for name, (seconds, (out, stats)) in timed.items():
            must(out[0].tolist() == reference, f"{name}: the output differs from plain greedy decoding")
            results[name]["seconds"].append(seconds)
            results[name]["ratios"].append(plain / seconds)
            results[name]["stats"] = stats.to_dict()
            runs[name].append(stats)
            if costs is not None:
                steps = sum(n * costs.step_seconds(K) for K, n in enumerate(stats.gamma_hist))
                results[name]["modelled"].append(max_gen * costs.t_verify[0] / steps)
    for name in names:
        total = pooled(runs[name])
        results[name].update(speedup=statistics.median(results[name]["ratios"]), accepted=total.accepted,
                             judged=total.judged, gamma_hist=total.gamma_hist, alpha=total.alpha)
    results["plain"] = {"seconds": plain_seconds}
    return results


# ---------------------------------------------------------------------------
# Part 1: auto against fixed γ and the heuristic, simulated α; the int8 draft
# ---------------------------------------------------------------------------


def part_simulated(args, target, drafts: dict[str, GPT2], costs: dict[str, StepCosts], ids) -> dict:
    """The target with a SimulatedDrafter on the draft model at each α of
    --alphas: the speedup over plain decoding of auto, of every fixed γ of
    --gammas (the best one found in the same run) and of the heuristic; auto
    learns α from its own steps, it is never told. Then at each α of
    --int8-alphas the same with the draft's weights in int8 (the target, and
    so the output, stays float32). Timed runs see few draws of the coins, so
    `expected_table` also compares the schedules in expectation."""
    reference = generate(target, ids, args.max_gen)  # (1, T + max_gen): what every run must reproduce
    ref_list = reference[0].tolist()
    cases = [("float32", a) for a in args.alphas] + [("int8", a) for a in args.int8_alphas]
    out = {}
    for draft_name, alpha in cases:
        draft = drafts[draft_name]

        def drafter(draft=draft, alpha=alpha):
            """A method's r-th run draws its simulated coins from seed --seed + r: every method sees the
            same seeds, so the best fixed γ is not simply the one whose single draw was luckiest."""
            seeds = itertools.count(args.seed)
            return lambda: SimulatedDrafter(draft, reference, alpha, seed=next(seeds))

        methods = {f"fixed {g}": spec_run(target, drafter(), ids, args.max_gen, lambda g=g: FixedGamma(g))
                   for g in args.gammas}
        methods["auto"] = spec_run(target, drafter(), ids, args.max_gen, lambda c=costs[draft_name]: AutoGamma(c))
        methods["heuristic"] = spec_run(target, drafter(), ids, args.max_gen, HeuristicGamma)
        print(f"simulated: draft {draft_name}, alpha {alpha}", file=sys.stderr, flush=True)
        out[f"{draft_name} alpha {alpha}"] = {
            "draft": draft_name, "alpha": alpha,
            "runs": time_methods(target, ids, args.max_gen, methods, args.repeats, ref_list, costs[draft_name]),
        }
    return out


def modelled_seconds(schedule, alpha: float, max_gen: int, costs: StepCosts, rng: random.Random) -> float:
    """The seconds of one run of `max_gen` tokens under the cost model: the
    loop's step arithmetic (K = min(choice, tokens left - 1); the drafts are
    accepted up to the first failed coin; a step emits its accepted drafts and
    one target token) on a string of coins, one per position, heads with
    probability alpha, each step priced K t_d + t_v(K + 1)."""
    coins = [rng.random() < alpha for _ in range(max_gen)]
    seconds, emitted = 0.0, 0
    while emitted < max_gen:
        K = min(schedule.choose(), max_gen - emitted - 1)
        accepted = 0
        while accepted < K and coins[emitted + accepted]:
            accepted += 1
        seconds += costs.step_seconds(K)
        schedule.update(K, accepted)
        emitted += accepted + 1
    return seconds


def modelled_runs(costs: StepCosts, alpha: float, max_gen: int, gammas: list[int],
                  seeds: int) -> dict[str, list[float]]:
    """Each method's `modelled_seconds` on coin strings 0 .. seeds - 1 (the
    same strings for every method)."""
    makers = {f"fixed {g}": (lambda g=g: FixedGamma(g)) for g in gammas}
    makers["auto"] = lambda: AutoGamma(costs)
    makers["heuristic"] = HeuristicGamma
    return {name: [modelled_seconds(make(), alpha, max_gen, costs, random.Random(seed)) for seed in range(seeds)]
            for name, make in makers.items()}


def mean_speedups(runs: dict[str, list[float]], costs: StepCosts, max_gen: int) -> dict[str, float]:
    """Speedup over plain decoding in expectation under the cost model:
    max_gen t_v(1) over each method's mean seconds in `runs` (`modelled_runs`)."""
    return {name: max_gen * costs.t_verify[0] / statistics.mean(seconds) for name, seconds in runs.items()}


def expected_speedups(costs: StepCosts, alpha: float, max_gen: int, gammas: list[int], seeds: int) -> dict[str, float]:
    """`mean_speedups` over `seeds` coin strings."""
    return mean_speedups(modelled_runs(costs, alpha, max_gen, gammas, seeds), costs, max_gen)


def same_run_ratios(runs: dict[str, list[float]], repeats: int) -> list[float]:
    """auto / best fixed γ as a timed run of `repeats` repeats finds it, had
    it a perfect clock: `runs` (`modelled_runs`) cut into groups of `repeats`
    coin strings; in each, auto's median speedup over the largest of the
    fixed γ's medians. Sorted. It shows how far the coins alone move the
    timed comparison, and how much picking the best of several near-equal
    medians flatters the best fixed γ."""
    ratios = []
    for start in range(0, len(runs["auto"]) - repeats + 1, repeats):
        median_seconds = {name: statistics.median(s[start : start + repeats]) for name, s in runs.items()}
        best = min(seconds for name, seconds in median_seconds.items() if name.startswith("fixed"))
        ratios.append(best / median_seconds["auto"])  # speedups are max_gen t_v(1) / seconds
    return sorted(ratios)


def expected_table(args, costs: dict[str, StepCosts]) -> tuple[str, dict]:
    """The simulated part's comparison in expectation: each schedule's steps on
    --model-seeds coin strings, priced at the calibrated costs
    (`expected_speedups`), so that the best fixed γ is the one best on average,
    not the luckiest draw; and how far the coins alone move a timed run of
    --repeats repeats (`same_run_ratios`)."""
    cases = [("float32", a) for a in args.alphas] + [("int8", a) for a in args.int8_alphas]
    rows, report = [], {}
    for draft_name, alpha in cases:
        runs = modelled_runs(costs[draft_name], alpha, args.max_gen, args.gammas, args.model_seeds)
        speedups = mean_speedups(runs, costs[draft_name], args.max_gen)
        fixed = {name: v for name, v in speedups.items() if name.startswith("fixed")}
        best = max(fixed, key=fixed.get)
        same_run = same_run_ratios(runs, args.repeats)
        report[f"{draft_name} alpha {alpha}"] = {**speedups, "same run: auto / best": same_run}
        spread = (f"{statistics.median(same_run):.3f} [{same_run[len(same_run) // 10]:.3f}]; "
                  f"{sum(r < 0.95 for r in same_run) / len(same_run):.0%}" if same_run else "n/a")
        rows.append([draft_name, f"{alpha:g}", best.removeprefix("fixed "), f"{fixed[best]:.2f}x",
                     f"{speedups['auto']:.2f}x", f"{speedups['auto'] / fixed[best]:.3f}",
                     f"{speedups['heuristic']:.2f}x", f"{speedups['heuristic'] / fixed[best]:.3f}", spread])
    table = markdown_table(["draft", "sim. α", "best fixed γ", "its speedup", "auto", "auto / best", "+2/-1",
                            "+2/-1 / best", "a run like this one: auto / best, median [10th pct.]; below 0.95"],
                           rows)
    return table, report


def held_out_best(runs: dict) -> float | None:
    """The best fixed γ's speedup without the winner's luck: in each repeat r,
    the γ with the best median ratio over the *other* repeats, at its ratio
    in repeat r; the median over r. (The largest of the fixed γ's medians is
    biased upward: it picks whichever γ's noise came out high.) None with
    one repeat."""
    fixed = {name: r["ratios"] for name, r in runs.items() if name.startswith("fixed")}
    repeats = len(next(iter(fixed.values())))
    if repeats < 2:
        return None
    values = []
    for r in range(repeats):
        others = {name: statistics.median(ratios[:r] + ratios[r + 1 :]) for name, ratios in fixed.items()}
        values.append(fixed[max(others, key=others.get)][r])
    return statistics.median(values)


def simulated_table(results: dict) -> str:
    rows = []
    for case in results.values():
        runs = case["runs"]
        fixed = {name: r["speedup"] for name, r in runs.items() if name.startswith("fixed")}
        best = max(fixed, key=fixed.get)
        auto, heuristic = runs["auto"], runs["heuristic"]
        held_out = held_out_best(runs)
        modelled = {name: statistics.median(r["modelled"]) for name, r in runs.items() if name != "plain"}
        best_modelled = max((name for name in modelled if name.startswith("fixed")), key=modelled.get)
        rows.append([
            case["draft"], f"{case['alpha']:g}", f"{statistics.median(runs['plain']['seconds']):.2f}",
            f"{auto['speedup']:.2f}x", gamma_summary(auto), alpha_cell(auto["alpha"], auto["judged"]),
            f"{best.removeprefix('fixed ')}", f"{fixed[best]:.2f}x", f"{auto['speedup'] / fixed[best]:.3f}",
            "n/a" if held_out is None else f"{auto['speedup'] / held_out:.3f}", f"{heuristic['speedup']:.2f}x",
            f"{modelled['auto'] / modelled[best_modelled]:.3f} (best {best_modelled.removeprefix('fixed ')})",
            f"{modelled['heuristic'] / modelled[best_modelled]:.3f}",
        ])
    return markdown_table(
        ["draft", "sim. α", "plain s", "auto", "auto: K asked (K:steps)", "measured α", "best fixed γ",
         "its speedup", "auto / best", "auto / best held out", "+2/-1", "cost model: auto / best",
         "cost model: +2/-1 / best"], rows)


def gamma_summary(counts: dict) -> str:
    """The K a method asked for (counts["gamma_hist"]), as 'K:steps' pairs, e.g. '0:2 4:10 5:3'."""
    return " ".join(f"{K}:{n}" for K, n in enumerate(counts["gamma_hist"]) if n)


# ---------------------------------------------------------------------------
# Part 2: prompt lookup on repetitive text
# ---------------------------------------------------------------------------


def part_ngram(args, target, ids, costs: StepCosts, label: str) -> dict:
    """Prompt lookup with fixed γ and auto on a repetitive prompt (a paragraph
    quoted, then asked for again). The weights are random, so the target does
    not copy the paragraph, but its greedy output soon falls into loops, which
    prompt lookup copies: this measures that mechanism, not real text."""
    ref_list = generate(target, ids, args.max_gen)[0].tolist()
    methods = {f"ngram, fixed {g}": spec_run(target, lambda: NgramDrafter(args.ngram), ids, args.max_gen,
                                             lambda g=g: FixedGamma(g)) for g in (2, 4, 8)}
    methods["ngram, auto"] = spec_run(target, lambda: NgramDrafter(args.ngram), ids, args.max_gen,
                                      lambda: AutoGamma(costs))
    print(f"ngram: {label}", file=sys.stderr, flush=True)
    return {"label": label, "runs": time_methods(target, ids, args.max_gen, methods, args.repeats, ref_list)}


def ngram_table(results: list[dict]) -> str:
    rows = []
    for case in results:
        for name, r in case["runs"].items():
            if name == "plain":
                continue
            s = r["stats"]
            no_match = s["plain_steps"] - s["gamma_hist"][0]
            rows.append([case["label"], name, f"{s['tokens_per_target_call']:.2f}",
                         alpha_cell(s["alpha"], s["drafted"]),  # a step that drafts judges its first draft
                         f"{no_match}/{s['target_calls']}", f"{r['speedup']:.2f}x"])
    return markdown_table(["target", "drafter", "tokens / target call", "α", "steps with no match", "speedup"],
                          rows)


# ---------------------------------------------------------------------------
# Part 3: the noisy pair (real acceptance)
# ---------------------------------------------------------------------------


def noisy_target(seed: int) -> GPT2:
    model = GPT2(NOISY_CONFIG)
    init_random_weights(model, std=NOISY_BLOCK_STD, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model.wte.weight.normal_(0.0, NOISY_WTE_STD, generator=torch.Generator().manual_seed(seed + 1))
    return model.eval()


def count_runs(target, make_drafter, prompts, max_gen, gamma_fn, temperature, seeds) -> dict:
    """Summed counters of speculative runs over prompts and seeds (no timing)."""
    total = {"drafted": 0, "accepted": 0, "target_calls": 0, "new_tokens": 0, "draft_calls": 0, "judged": 0}
    for ids in prompts:
        for seed in seeds:
            _, s = spec_run(target, make_drafter, ids, max_gen, gamma_fn, temperature, seed)(lambda _: None)
            total["drafted"] += s.drafted
            total["accepted"] += s.accepted
            total["target_calls"] += s.target_calls
            total["new_tokens"] += s.new_tokens
            total["draft_calls"] += s.draft_calls
            total["judged"] += s.judged
    total["wasted"] = total["drafted"] - total["accepted"]
    total["tokens_per_target_call"] = total["new_tokens"] / total["target_calls"]
    total["alpha"] = total["accepted"] / total["judged"] if total["judged"] else 0.0
    return total


def part_noisy(args, tokenizer) -> dict:
    """A real acceptance process without downloads: a small target and a draft
    that is a copy of it with noise added. p_min against wasted drafts
    (drafted - accepted) and tokens per target call, the acceptance an int8
    draft keeps (counted, not timed), and prompt lookup on the small target
    (timed as in `part_ngram`)."""
    target = noisy_target(args.seed)
    draft = noisy_copy(target, scale=args.noise, seed=args.seed + 2, relative=True)
    draft8 = copy.deepcopy(draft)  # the same draft, to be quantised
    for model in (target, draft):
        fast.accelerate(model)
    fast.accelerate(draft8, int8=True)
    prompts = [torch.tensor([tokenizer.encode(text)]) for _, text in PROMPTS[: args.noisy_prompts]]
    seeds = range(args.noisy_seeds)
    out = {"config": str(NOISY_CONFIG), "noise": args.noise, "p_min": {}, "int8": {}}
    settings = {"greedy": (0.0, [0]), "sampling T=1": (1.0, seeds)}
    print("noisy: p_min", file=sys.stderr, flush=True)
    for setting, (temperature, setting_seeds) in settings.items():
        for schedule_name, schedule_fn in (("fixed 3", lambda: FixedGamma(3)), ("fixed 6", lambda: FixedGamma(6)),
                                           ("heuristic", HeuristicGamma)):
            for p_min in args.p_mins:
                key = f"{setting}, {schedule_name}, p_min {p_min}"
                out["p_min"][key] = count_runs(
                    target, lambda p=p_min: ModelDrafter(draft, p_min=None if p == 0 else p), prompts,
                    args.max_gen, schedule_fn, temperature, setting_seeds)
    print("noisy: int8 draft", file=sys.stderr, flush=True)
    for setting, (temperature, setting_seeds) in settings.items():
        for name, model in (("float32", draft), ("int8", draft8)):
            out["int8"][f"{setting}, {name}"] = count_runs(
                target, lambda m=model: ModelDrafter(m), prompts, args.max_gen, lambda: FixedGamma(4), temperature,
                setting_seeds)
    costs32 = calibrate(target, draft, 5, refresh=True)
    costs8 = calibrate(target, draft8, 5, refresh=True)
    out["t_draft"] = {"float32": costs32.t_draft, "int8": costs8.t_draft, "t_target": costs32.t_verify[0]}
    ids = torch.tensor([tokenizer.encode(REPEAT_PROMPT)])
    out["ngram"] = part_ngram(args, target, ids, calibrate(target, None, DEFAULT_MAX_GAMMA + 1, refresh=True),
                              "noisy small target, repetitive prompt")
    return out


def alpha_cell(alpha: float, judged: int) -> str:
    """α to two digits, or "-" where no draft was judged: α is undefined there, not 0."""
    return f"{alpha:.2f}" if judged else "-"


def p_min_table(results: dict, heading: str) -> str:
    rows = [[key, str(r["drafted"]), str(r["accepted"]), str(r["wasted"]), str(r["draft_calls"]),
             alpha_cell(r["alpha"], r["judged"]), f"{r['tokens_per_target_call']:.3f}"] for key, r in results.items()]
    return markdown_table([heading, "drafted", "accepted", "wasted", "draft passes", "α", "tokens / target call"],
                          rows)


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m benchmarks.drafting", description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--target", help="target shape, random weights (default gpt2-large)")
    ap.add_argument("--draft", help="draft shape, random weights (default gpt2)")
    ap.add_argument("--tiny", action="store_true", help="tiny random models instead (a smoke run)")
    ap.add_argument("--alphas", type=float, nargs="*", default=[0.5, 0.6, 0.7, 0.8, 0.9],
                    help="simulated α of the float32 draft (none: skip it)")
    ap.add_argument("--int8-alphas", type=float, nargs="*", default=[0.8],
                    help="simulated α of the int8 draft (default 0.8; none: skip it)")
    ap.add_argument("--gammas", type=int, nargs="+", default=list(range(1, 9)),
                    help=f"fixed γ tried, 1 to {DEFAULT_MAX_GAMMA} (default 1 .. 8)")
    ap.add_argument("--ngram", type=int, default=3, help="the n-gram drafter's longest suffix (default 3)")
    ap.add_argument("--max-gen", type=int, default=64, help="tokens per run (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats (default 3)")
    ap.add_argument("--model-seeds", type=int, default=2000,
                    help=f"coin strings of the in-expectation comparison (default 2000, at most {MAX_MODEL_SEEDS})")
    ap.add_argument("--noise", type=float, default=0.1, help="the noisy draft's relative weight noise")
    ap.add_argument("--p-mins", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2, 0.3],
                    help="p_min values of the noisy pair (0 = off)")
    ap.add_argument("--noisy-prompts", type=int, default=4, help="prompts of the noisy pair's counts")
    ap.add_argument("--noisy-seeds", type=int, default=4, help="sampling seeds of the noisy pair's counts")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads, at most the logical CPUs (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results/drafting-<UTC time>)")
    args = ap.parse_args(argv)
    unused = [f"--{role}" for role, parts in (("target", {"simulated", "ngram"}), ("draft", {"simulated"}))
              if getattr(args, role) is not None and not parts & set(args.parts)]
    if unused:  # the noisy part has a pair of its own; prompt lookup drafts without a draft model
        raise ValueError(f"--parts {' '.join(args.parts)} uses no {' or '.join(unused)}: drop "
                         f"{' and '.join(unused)}, or add --parts simulated")
    pair_names(args, presets=True)
    for name in ("max_gen", "repeats", "model_seeds", "ngram", "noisy_prompts", "noisy_seeds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("gammas", "alphas", "int8_alphas", "p_mins"):  # a value given twice is run once
        setattr(args, name, list(dict.fromkeys(getattr(args, name))))
    for gamma in args.gammas:  # the step costs are calibrated up to auto's largest γ
        check_range("--gammas", gamma, 1, DEFAULT_MAX_GAMMA, " (the largest γ gamma='auto' drafts)")
    check_range("--noisy-prompts", args.noisy_prompts, 1, len(PROMPTS), " (the benchmark prompts)")
    check_range("--model-seeds", args.model_seeds, 1, MAX_MODEL_SEEDS, " (coin strings priced after the timed runs)")
    if not all(0.0 <= a <= 1.0 for a in [*args.alphas, *args.int8_alphas, *args.p_mins]):  # NaN too
        raise ValueError("--alphas, --int8-alphas and --p-mins must lie in [0, 1]")
    if "simulated" in args.parts and not args.alphas + args.int8_alphas:
        raise ValueError("the simulated part needs an α: give --alphas or --int8-alphas")
    check_range("--seed", args.seed, -MAX_SEED, MAX_SEED)
    check_range("--noise", args.noise, 0, MAX_NOISE, " (the noise's spread over each weight matrix's)")
    if {"simulated", "ngram"} & set(args.parts):  # their methods run in lockstep: plain, each fixed γ, auto, +2/-1
        check_caches_fit((len(set(args.gammas)) + 3) * sum(KVCache.nbytes(shape(n)) for n in (args.target, args.draft)),
                         "give fewer --gammas")
    return args


def check_max_gen(args: argparse.Namespace, tokenizer, target_name: str, draft_name: str) -> None:
    """Raises a ValueError unless --max-gen new tokens fit both models' context window after every prompt the
    --parts decode: each run must emit exactly --max-gen tokens, and the cost model prices that many."""
    texts = [REPEAT_PROMPT] if {"ngram", "noisy"} & set(args.parts) else []
    texts += [PROMPTS[0][1]] if "simulated" in args.parts else []
    texts += [text for _, text in PROMPTS[: args.noisy_prompts]] if "noisy" in args.parts else []
    configs = [shape(target_name), shape(draft_name)] if {"simulated", "ngram"} & set(args.parts) else []
    configs += [NOISY_CONFIG] if "noisy" in args.parts else []
    longest, n_ctx = max(len(tokenizer.encode(text)) for text in texts), min(c.n_ctx for c in configs)
    if longest + args.max_gen > n_ctx:
        raise ValueError(f"--max-gen {args.max_gen} new tokens after the longest prompt ({longest} tokens) exceed "
                         f"the context window of {n_ctx}: give --max-gen at most {n_ctx - longest}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    tokenizer = load_prompt_tokenizer()
    target_name, draft_name = args.target, args.draft
    check_max_gen(args, tokenizer, target_name, draft_name)
    out_dir = results_dir(args.out, "drafting")
    report = {"command": "python -m benchmarks.drafting " + shlex.join(argv if argv is not None else sys.argv[1:])}
    lines = ["# Drafting: auto γ, int8 draft, prompt lookup, p_min", "", f"`{report['command']}`", ""]
    needs_pair = {"simulated", "ngram"} & set(args.parts)
    if needs_pair:
        target = random_model(shape(target_name), seed=args.seed)
        drafts = {"float32": random_model(shape(draft_name), seed=args.seed + 1),
                  "int8": random_model(shape(draft_name), seed=args.seed + 1, quantize="int8")}
        ids = torch.tensor([tokenizer.encode(PROMPTS[0][1])])
    models = {"target": target_name, "draft": draft_name} if needs_pair else {"noisy pair": str(NOISY_CONFIG)}
    report["environment"] = environment(torch.device("cpu"), torch.float32, models,
                                        fast.status(target) if needs_pair else fast.status())
    lines += environment_lines(report["environment"]) + [""]
    if "simulated" in args.parts:
        costs = {name: calibrate(target, d, DEFAULT_MAX_GAMMA + 1, refresh=True) for name, d in drafts.items()}
        report["costs"] = {name: {"t_draft": c.t_draft, "t_verify": c.t_verify} for name, c in costs.items()}
        report["simulated"] = part_simulated(args, target, drafts, costs, ids)
        lines += ["## auto against fixed γ and +2/-1 (simulated α)", "", simulated_table(report["simulated"]), "",
                  "Speedups: timed, plain decoding's seconds over the method's, all run in lockstep (medians over "
                  "repeats). 'best held out': in each repeat, the fixed γ best over the other repeats, at its ratio "
                  "in that repeat (the best of several noisy medians is biased upward). Every "
                  "method's r-th run sees the same simulated coins (one per position, seed --seed + r); measured "
                  "α and the K auto asked: over every repeat. Cost model: each run's own steps priced at the "
                  "costs calibrated below, max_gen t_v(1) / sum of (K t_d + t_v(K + 1)), medians over repeats: "
                  "the schedules compared without the machine's swings.", ""]
        table, report["expected"] = expected_table(args, costs)
        lines += [f"### The same in expectation ({args.model_seeds} coin strings, cost model)", "", table, "",
                  f"Last column: the coin strings in groups of --repeats ({args.repeats}), each priced as a timed "
                  "run of this length would find auto / best fixed γ with a perfect clock: the median and 10th "
                  "percentile over the groups, and how often it falls below 0.95.", ""]
        c32, c8 = costs["float32"], costs["int8"]
        lines += [f"t_d float32 {c32.t_draft * 1e3:.2f} ms, int8 {c8.t_draft * 1e3:.2f} ms; t_v(1) "
                  f"{c32.t_verify[0] * 1e3:.1f} ms, t_v(5) {c32.t_verify[4] * 1e3:.1f} ms (calibrated at the start of "
                  "this run)", ""]
    if "ngram" in args.parts:
        repeat_ids = torch.tensor([tokenizer.encode(REPEAT_PROMPT)])
        costs0 = calibrate(target, None, DEFAULT_MAX_GAMMA + 1, refresh=True)
        report["ngram"] = part_ngram(args, target, repeat_ids, costs0, f"{target_name} (random weights)")
    if "noisy" in args.parts:
        report["noisy"] = noisy = part_noisy(args, tokenizer)
    if "ngram" in args.parts or "noisy" in args.parts:
        cases = [report[k] if k == "ngram" else report["noisy"]["ngram"] for k in ("ngram", "noisy") if k in report]
        lines += ["## Prompt lookup on a repetitive prompt", "", ngram_table(cases), ""]
    if "noisy" in args.parts:
        lines += [f"## The noisy pair ({NOISY_CONFIG}, draft noise {args.noise})", "", "### p_min", "",
                  p_min_table(noisy["p_min"], "setting, schedule, p_min"), "", "### int8 draft (fixed γ 4)", "",
                  p_min_table(noisy["int8"], "setting, draft"), "",
                  f"t_d float32 {noisy['t_draft']['float32'] * 1e3:.3f} ms, int8 {noisy['t_draft']['int8'] * 1e3:.3f} "
                  f"ms, target step {noisy['t_draft']['t_target'] * 1e3:.3f} ms", ""]
    write_json(out_dir / "drafting.json", report)
    (out_dir / "drafting.md").write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))
    print(f"results in {out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
