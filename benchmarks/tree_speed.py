"""Token trees against chains, side by side in one run, on the gpt2 ->
gpt2-large shapes (random weights, fp32, batch 1).

First the costs relative to one target step t_t: r_k = t_v(k) / t_t with and
without a tree mask, and the draft's pass over a level of n nodes. Then, for
acceptance profiles a = (a_1, a_2, ...) (`SimulatedTreeDrafter`: the target's
greedy token is the draft's rank-r candidate with probability a_r; chains:
`SimulatedDrafter` at alpha = a_1), every chain and tree gets a predicted
speedup, and the best --measure of each run against plain decoding in
lockstep (benchmarks/lockstep.py). Last, a real acceptance process: a small
target and a noisy copy as the draft (`noisy_pair`). Writes tree_speed.md
and tree_speed.json to --out.

    python -m benchmarks.tree_speed
    python -m benchmarks.tree_speed --draft-quantize int8    # the draft reads a quarter of the bytes
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from statistics import median

import torch

from benchmarks.common import ArgumentParser, must, pair_names
from benchmarks.common import environment, environment_lines, markdown_table, random_model, results_dir, run_cli
from benchmarks.common import check_caches_fit, check_passes_fit, noisy_copy, say, shape, timed
from benchmarks.common import binary_tree_mask, check_range, write_json
from benchmarks.lockstep import Method, lockstep, plain_decoding, rotated, stepwise
from gpt2 import GPT2, GPT2Config, KVCache, fast, generate, init_random_weights
from spec_decoding.stats import clock
from spec_decoding import (
    SimulatedDrafter,
    SimulatedTreeDrafter,
    TreeShape,
    expected_tokens_per_step,
    speculative_generate,
)

CPU = torch.device("cpu")
PROFILES = {"strong": (0.8, 0.1, 0.04), "weak": (0.5, 0.15, 0.07)}
CHAINS = tuple(range(1, 9))
TREES = ("2", "3", "4", "2,1", "3,1", "4,1", "2,2", "3,2", "2,1,1", "3,1,1", "2,2,1", "3,2,1", "2,2,2",
         "3,2,1,1", "4,2,1", "nodes 4 depth 2", "nodes 6 depth 3", "nodes 8 depth 4", "nodes 12 depth 4",
         "nodes 16 depth 5")  # fmt: skip
R_K_REPORTED = (2, 4, 8, 16, 32)
COST_KS = sorted({*range(1, 11), 12, 16, 20, 24, 32} | set(R_K_REPORTED))  # the passes whose r_k is measured
# The noisy pair: a small GPT-2 with peaked random weights, and its copy plus weight noise.
NOISY_TARGET = GPT2Config(n_layer=4, n_head=4, n_embd=128, n_ctx=1024, vocab_size=4096)
NOISY_STD, NOISY_SCALE = 0.2, 0.01
NOISY_PROMPT = 16  # tokens of each of its random prompts
MAX_NOISY_PROMPTS = 1000  # --noisy-prompts: each config decodes each of them twice


def parse_shape(text: str) -> TreeShape:
    """"3,2,1" or "nodes 16 depth 5"."""
    words = text.split()
    if len(words) == 4 and words[0] == "nodes" and words[2] == "depth" and all(
            w.isascii() and w.isdigit() for w in (words[1], words[3])):  # not '²', a digit to isdigit alone
        return TreeShape(nodes=int(words[1]), depth=int(words[3]))
    return TreeShape.parse(text)


# ---------------------------------------------------------------------------
# Costs
# ---------------------------------------------------------------------------


def measure_costs(target: GPT2, draft: GPT2, prompt: torch.Tensor, ks: list[int], widths: list[int],
                  repeats: int) -> dict:
    """r[k], r_tree[k] = t_v(k) / t_t (causal; a binary tree's mask) and
    c[n] = (the draft's pass over a level of n nodes) / t_t: medians over
    repeats of ratios to a target step timed right before; t_t in seconds."""
    caches = {}
    for name, model in (("target", target), ("draft", draft)):
        caches[name] = model.new_cache(1)
        model(prompt, caches[name], last_logits_only=True)
    P = prompt.size(1)
    ids = torch.randint(0, target.config.vocab_size, (1, max(ks + widths)), generator=torch.Generator().manual_seed(1))

    def pass_of(name: str, k: int, mask: torch.Tensor | None):
        model, cache = (target if name == "target" else draft), caches[name]

        def run():
            model(ids[:, :k], cache, mask=mask)
            cache.rewind(P)
        return run

    step = pass_of("target", 1, None)
    items = {("r", k): pass_of("target", k, None) for k in ks if k > 1}
    items |= {("r_tree", k): pass_of("target", k, binary_tree_mask(k)) for k in ks if k > 1}
    items |= {("c", n): pass_of("draft", n, torch.eye(n, dtype=torch.bool)) for n in widths}
    steps, ratios = [], {key: [] for key in items}
    for rep in range(repeats + 1):  # the first is a warm-up
        for key in list(items) if rep % 2 else list(items)[::-1]:
            # Each pass is paired with a target step timed right before it: the
            # machine's speed drifts within seconds, the ratio much less.
            t_step = timed(step)
            t = timed(items[key])
            if rep:
                steps.append(t_step)
                ratios[key].append(t / t_step)
        say(f"  costs: repeat {rep}/{repeats}, t_t {t_step * 1e3:.0f} ms")
    out = {"t_t_s": median(steps), "r": {1: 1.0}, "r_tree": {1: 1.0}, "c": {},
           "samples": {"t_t": steps, **{f"{kind} {k}": s for (kind, k), s in ratios.items()}}}
    for (kind, k), s in ratios.items():
        out[kind][k] = median(s)
    return out


def interpolate(table: dict[int, float], k: int) -> float:
    """table[k], or linear between the nearest measured neighbours (or beyond the last two)."""
    if k in table:
        return table[k]
    keys = sorted(table)
    below = [x for x in keys if x < k][-1:] or keys[:1]
    above = [x for x in keys if x > k][:1] or keys[-1:]
    if below == above:
        below, above = keys[-2:-1], keys[-1:]
    (a,), (b,) = below, above
    return table[a] + (table[b] - table[a]) * (k - a) / (b - a)


# ---------------------------------------------------------------------------
# Predictions from a profile
# ---------------------------------------------------------------------------


def profile_tree(drafter: SimulatedTreeDrafter, tree: TreeShape) -> list[list[tuple[int, int]]]:
    """The tree `drafter` grows for `tree` (its calibrated profile decides a
    dynamic shape), level by level: levels[d] lists the nodes at depth d + 1
    as (index of the parent in the level above, sibling rank)."""
    levels, values = [], [1.0]
    dummy = torch.zeros(1, 1)
    for depth in range(1, tree.max_depth + 1):
        budget = tree.max_nodes - sum(len(level) for level in levels)
        counts = drafter.level_counts(tree, depth, values, dummy.expand(len(values), drafter.vocab_size), budget)
        level = [(v, rank) for v, count in enumerate(counts) for rank in range(count)]
        if not level:
            break
        ranked = drafter.ranked(dummy[0], max(rank for _, rank in level) + 1)
        values = [values[v] * ranked[rank] for v, rank in level]
        levels.append(level)
    return levels


def predict_tree(levels: list, profile: tuple[float, ...], costs: dict) -> dict:
    """E = 1 + sum over nodes of the probability that the target accepts it
    (the product of a_rank along its path); cost = the draft's first pass and
    one pass per level but the last, plus a tree verification of N + 1 tokens."""
    accept, E = [1.0], 1.0
    for level in levels:
        accept = [accept[v] * (profile[rank] if rank < len(profile) else 0.0) for v, rank in level]
        E += sum(accept)
    N = sum(len(level) for level in levels)
    cost = costs["c"][1] + sum(interpolate(costs["c"], len(level)) for level in levels[:-1])
    cost += interpolate(costs["r_tree"], N + 1)
    return {"nodes": N, "levels": [len(level) for level in levels], "E": E, "cost": cost, "predicted": E / cost}


def predict_chain(gamma: int, alpha: float, costs: dict) -> dict:
    E = expected_tokens_per_step(alpha, gamma)
    cost = gamma * costs["c"][1] + interpolate(costs["r"], gamma + 1)
    return {"nodes": gamma, "levels": [1] * gamma, "E": E, "cost": cost, "predicted": E / cost}


# What the costs of width allow: the best predicted tree against the best predicted chain, at the measured costs
# and with the costs a tree pays for its width removed or lowered.
def free_verification(costs: dict) -> dict:
    return {**costs, "r": {k: 1.0 for k in costs["r"]}, "r_tree": {k: 1.0 for k in costs["r_tree"]}}


def cheaper_draft(costs: dict) -> dict:
    return {**costs, "c": {n: c / 2.5 for n, c in costs["c"].items()}}


CEILING_COSTS = {
    "measured costs": lambda costs: costs,
    "verification free (r_k = 1)": free_verification,
    "draft passes 2.5x cheaper": cheaper_draft,
    "both": lambda costs: cheaper_draft(free_verification(costs)),
}


def ceiling(levels: dict, profile: str, chains: range, costs: dict) -> dict:
    """Per CEILING_COSTS variant: the best chain and tree of `profile` by
    predicted speedup, and the tree / chain ratio. It says how far the goal
    is from what this machine's r_k and draft passes permit."""
    a, out = PROFILES[profile], {}
    for variant, cost_of in CEILING_COSTS.items():
        c = cost_of(costs)
        chain = {f"chain gamma {g}": predict_chain(g, a[0], c)["predicted"] for g in chains}
        tree = {name: predict_tree(lv, a, c)["predicted"] for (p, name), lv in levels.items() if p == profile}
        best_chain, best_tree = max(chain, key=chain.get), max(tree, key=tree.get)
        out[variant] = {"chain": best_chain, "chain_predicted": chain[best_chain], "tree": best_tree,
                        "tree_predicted": tree[best_tree], "tree_vs_chain": tree[best_tree] / chain[best_chain]}
    return out


# ---------------------------------------------------------------------------
# Measured runs
# ---------------------------------------------------------------------------


def measure_profiles(target: GPT2, draft: GPT2, prompt: torch.Tensor, plans: dict[str, list[tuple[str, dict]]],
                     args: argparse.Namespace) -> dict:
    """Runs plain greedy decoding and every planned config of every profile
    in lockstep (benchmarks/lockstep.py; who moves first rotates between
    repeats), after a short warm-up of each config. A config's speedup in a
    repeat is plain decoding's seconds over its own. Returns, per (profile,
    config): seconds, speedups, their median and the pooled tokens per
    target call; and plain decoding's seconds ("baseline_s")."""
    runs = [(profile, name, config) for profile, configs in plans.items() for name, config in configs]
    reference = generate(target, prompt, args.new_tokens)  # the target's greedy continuation

    def method(profile: str, config: dict, new_tokens: int, seed: int) -> Method:
        def call(on_step):
            a = PROFILES[profile]
            if config["kind"] == "chain":
                drafter, how = SimulatedDrafter(draft, reference, a[0], seed=seed), {"gamma": config["gamma"]}
            else:
                drafter, how = SimulatedTreeDrafter(draft, reference, a, seed=seed), {"tree": config["shape"]}
            return speculative_generate(target, drafter, prompt, max_new_tokens=new_tokens, on_step=on_step, **how)
        return stepwise(call)

    for profile, _, config in runs:  # warm-up: first calls allocate and touch everything
        method(profile, config, 4, seed=0)(lambda _: None)
    baselines, seconds, stats = [], {(p, n): [] for p, n, _ in runs}, {(p, n): [] for p, n, _ in runs}
    for rep in range(args.repeats):
        methods = {"plain": plain_decoding(target, prompt, args.new_tokens)}
        methods |= {(profile, name): method(profile, config, args.new_tokens, seed=rep)
                    for profile, name, config in runs}
        got = lockstep(rotated(methods, rep), lambda: clock(CPU))
        plain, _ = got.pop("plain")
        baselines.append(plain)
        for (profile, name), (t, (out, run_stats)) in got.items():
            must(out.tolist() == reference.tolist(), f"{profile} {name}: not the target's greedy output")
            seconds[(profile, name)].append((plain, t))
            stats[(profile, name)].append(run_stats)
        say(f"  runs: repeat {rep + 1}/{args.repeats}, plain decoding {plain:.1f} s ...")
    result = {"baseline_s": baselines}
    for key, pairs in seconds.items():
        pooled = stats[key]
        result[key] = {
            "seconds": [t for _, t in pairs],
            "speedups": [b / t for b, t in pairs],
            "speedup": median(b / t for b, t in pairs),
            "tokens_per_call": sum(x.new_tokens for x in pooled) / sum(x.target_calls for x in pooled),
        }
    return result


def compare_best(configs: dict[str, dict]) -> dict:
    """The best measured chain and tree (by median speedup), and every
    measured config against that chain: the median of per-repeat ratios."""
    def best_of(kind: str) -> str:
        measured = [n for n, c in configs.items() if c["kind"] == kind and "(the chain)" not in n]
        return max(measured, key=lambda n: configs[n]["speedup"])

    chain, tree = best_of("chain"), best_of("tree")
    for c in configs.values():
        c["vs_best_chain"] = median(x / y for x, y in zip(c["speedups"], configs[chain]["speedups"]))
    return {"chain": chain, "tree": tree, "chain_speedup": configs[chain]["speedup"],
            "tree_speedup": configs[tree]["speedup"], "tree_vs_chain": configs[tree]["vs_best_chain"]}


def noisy_pair(configs: dict[str, dict], costs: dict, args: argparse.Namespace) -> dict:
    """Tokens per target call of every config on the noisy pair (greedy, and
    sampling at temperature 1), over --noisy-prompts random prompts, with the
    speedup they predict at the large pair's costs."""
    target = GPT2(NOISY_TARGET)
    init_random_weights(target, std=NOISY_STD, generator=torch.Generator().manual_seed(0))
    target = fast.accelerate(target.eval())
    draft = fast.accelerate(noisy_copy(target, scale=NOISY_SCALE, seed=1))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, NOISY_TARGET.vocab_size, (1, NOISY_PROMPT), generator=g)
               for _ in range(args.noisy_prompts)]
    result = {}
    for temperature in (0.0, 1.0):
        for name, config in configs.items():
            how = {"gamma": config["gamma"]} if config["kind"] == "chain" else {"tree": config["shape"]}
            new, calls, accepted, judged = 0, 0, 0, 0
            for i, prompt in enumerate(prompts):
                _, stats = speculative_generate(
                    target, draft, prompt, max_new_tokens=args.new_tokens, temperature=temperature,
                    generator=torch.Generator().manual_seed(i), **how,
                )
                new, calls = new + stats.new_tokens, calls + stats.target_calls
                accepted, judged = accepted + stats.accepted, judged + stats.judged
            tokens_per_call = new / calls
            result[(temperature, name)] = {
                "tokens_per_call": tokens_per_call, "alpha": accepted / judged if judged else None,  # undefined
                "predicted_at_large_costs": tokens_per_call / config["cost"],
            }
        say(f"  noisy pair: temperature {temperature} done")
    return result


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def fmt(x: float | None, digits: int = 2) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def report(payload: dict, env: dict, args: argparse.Namespace) -> str:
    costs, lines = payload["costs"], ["# Token trees against chains", "", *environment_lines(env),
                                      f"- command: `{env['command']}`", ""]
    draft = args.draft + (" (int8 weights)" if args.draft_quantize == "int8" else "")
    lines += [f"- target {args.target}, draft {draft}, random weights; prompt {args.prefix} tokens, "
              f"{args.new_tokens} new tokens; medians of {args.repeats} repeats, each running plain decoding and "
              f"every measured config in lockstep; t_t = one target step ({costs['t_t_s'] * 1e3:.1f} ms)", "",
              "## Costs relative to one target step", ""]
    rows = [[str(k), fmt(costs["r"].get(k)), fmt(costs["r_tree"].get(k))] for k in sorted(costs["r"])]
    lines += [markdown_table(["k", "r_k = t_v(k) / t_t", "r_k, tree mask"], rows), ""]
    rows = [[str(n), fmt(c, 3)] for n, c in sorted(costs["c"].items())]
    lines += [markdown_table(["level of n nodes", "draft pass / t_t"], rows), ""]
    for profile, configs in payload["profiles"].items():
        lines += [f"## Profile {profile}: a = {PROFILES[profile]} (chains: alpha = {PROFILES[profile][0]})", ""]
        rows = []
        for name, c in sorted(configs.items(), key=lambda item: -item[1]["predicted"]):
            rows.append([name, str(c["nodes"]), fmt(c["E"]), fmt(c.get("tokens_per_call")), fmt(c["predicted"]),
                         fmt(c.get("speedup")), fmt(c.get("vs_best_chain"))])
        lines += [markdown_table(["config", "nodes", "E (theory)", "tokens / call", "predicted", "measured",
                                  "vs best chain"], rows), ""]
        best = payload["best"][profile]
        lines += [f"Best measured: {best['tree']} at {fmt(best['tree_speedup'])}x, {best['chain']} at "
                  f"{fmt(best['chain_speedup'])}x: the tree is {fmt(best['tree_vs_chain'])}x the chain (median of "
                  "per-repeat ratios).", "", "What the costs of width allow (predicted):", ""]
        rows = [[variant, f"{c['chain']}: {fmt(c['chain_predicted'])}x", f"{c['tree']}: {fmt(c['tree_predicted'])}x",
                 fmt(c["tree_vs_chain"])] for variant, c in payload["ceilings"][profile].items()]
        lines += [markdown_table(["costs", "best chain", "best tree", "tree / chain"], rows), ""]
    lines += ["## A real acceptance process: the noisy pair", "",
              f"- target: {NOISY_TARGET.n_layer} layers, C = {NOISY_TARGET.n_embd}, V = {NOISY_TARGET.vocab_size}, "
              f"N(0, {NOISY_STD}) weights; draft: the target + N(0, {NOISY_SCALE}) on every matrix; "
              f"{args.noisy_prompts} random prompts; speedup predicted at the costs above", ""]
    rows = []
    for name in payload["noisy"]["greedy"]:
        g, s = payload["noisy"]["greedy"][name], payload["noisy"]["sampled"][name]
        rows.append([name, fmt(g["alpha"]), fmt(g["tokens_per_call"]), fmt(g["predicted_at_large_costs"]),
                     fmt(s["tokens_per_call"]), fmt(s["predicted_at_large_costs"])])
    lines += [markdown_table(["config", "alpha (greedy)", "tokens / call", "predicted", "tokens / call (T = 1)",
                              "predicted (T = 1)"], rows), ""]
    for label in ("greedy", "sampled"):
        results = payload["noisy"][label]
        best = {kind: max((n for n in results if n.startswith(kind)),
                          key=lambda n: results[n]["predicted_at_large_costs"]) for kind in ("chain", "tree")}
        chain, tree = (results[best[kind]]["predicted_at_large_costs"] for kind in ("chain", "tree"))
        lines += [f"Noisy pair, {label}: best chain {best['chain']} ({fmt(chain)}x), best tree {best['tree']} "
                  f"({fmt(tree)}x): the tree is {fmt(tree / chain)}x the chain (predicted at the costs above).", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m benchmarks.tree_speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="target shape, random weights (default gpt2-large)")
    parser.add_argument("--draft", help="draft shape, random weights (default gpt2)")
    parser.add_argument("--draft-quantize", choices=("none", "int8"), default="none",
                        help="int8: the draft's weights in int8 (the float32 target decides the output)")
    parser.add_argument("--tiny", action="store_true", help="tiny random models (a smoke run)")
    parser.add_argument("--prefix", type=int, default=64, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3, help="repeats of the decoding runs")
    parser.add_argument("--cost-repeats", type=int, default=5, help="repeats of the cost measurements")
    parser.add_argument("--measure", type=int, default=2, help="best predicted chains and trees run per profile")
    parser.add_argument("--profiles", default="strong,weak", help=f"of {', '.join(PROFILES)}")
    parser.add_argument("--noisy-prompts", type=int, default=8)
    parser.add_argument("--max-gamma", type=int, default=max(CHAINS), help="chains gamma = 1..this")
    parser.add_argument("--trees", nargs="+", default=list(TREES),
                        help='tree shapes: "3,2,1" or "nodes 16 depth 5" (default: a set of 20)')
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    for name in args.profiles.split(","):
        if name not in PROFILES:
            raise ValueError(f"unknown profile {name!r}: pick from {', '.join(PROFILES)}")
    if min(args.prefix, args.new_tokens, args.repeats, args.cost_repeats, args.measure, args.noisy_prompts,
           args.max_gamma) < 1:
        raise ValueError("--prefix, --new-tokens, --repeats, --cost-repeats, --measure, --noisy-prompts and "
                         "--max-gamma must be >= 1")
    check_range("--noisy-prompts", args.noisy_prompts, 1, MAX_NOISY_PROMPTS, " (random prompts, made up front)")
    shapes = {name: parse_shape(name) for name in args.trees}
    chains = range(1, args.max_gamma + 1)
    pair_names(args, presets=True)
    n_ctx = min(shape(args.target).n_ctx, shape(args.draft).n_ctx, NOISY_TARGET.n_ctx)
    if args.prefix + max(COST_KS) > n_ctx:
        raise ValueError(f"--prefix {args.prefix} and the cost passes of up to {max(COST_KS)} tokens exceed the "
                         f"context window of {n_ctx}: give --prefix at most {n_ctx - max(COST_KS)}")
    prompt_len = max(args.prefix, NOISY_PROMPT)  # the noisy pair's prompts are NOISY_PROMPT tokens
    passes = {f"--max-gamma {args.max_gamma}": args.max_gamma + 1}
    passes |= {f"--trees {name!r}": tree.max_nodes + 1 for name, tree in shapes.items()}
    check_passes_fit(n_ctx, prompt_len + args.new_tokens,
                     f"a prompt of {prompt_len} tokens and --new-tokens {args.new_tokens}", passes)
    runs = 2 + 2 * args.measure * len(args.profiles.split(","))  # plain, chains and trees, the chain as a tree
    check_caches_fit(runs * sum(KVCache.nbytes(shape(n)) for n in (args.target, args.draft)),
                     "give a smaller --measure or fewer --profiles")
    folder = results_dir(args.out, "tree_speed")
    target = random_model(shape(args.target), device=CPU, dtype=torch.float32, seed=0)
    draft = random_model(shape(args.draft), device=CPU, dtype=torch.float32, seed=1, quantize=args.draft_quantize)
    prompt = torch.randint(0, target.config.vocab_size, (1, args.prefix), generator=torch.Generator().manual_seed(0))
    env = environment(CPU, torch.float32, {"target": args.target, "draft": args.draft}, fast.status(target),
                      "draft int8" if args.draft_quantize == "int8" else None)
    env["command"] = "python -m benchmarks.tree_speed " + shlex.join(sys.argv[1:] if argv is None else argv)

    with torch.inference_mode():
        say("costs ...")
        widest = max(max(len(level) for level in profile_tree(SimulatedTreeDrafter(draft, prompt, (1.0,)), s))
                     for s in shapes.values())
        costs = measure_costs(target, draft, prompt, COST_KS, sorted({*range(1, 9), widest}), args.cost_repeats)

        profiles, plans, levels, ceilings = {}, {}, {}, {}
        for profile in args.profiles.split(","):
            a = PROFILES[profile]
            configs = {f"chain gamma {g}": {"kind": "chain", "gamma": g, **predict_chain(g, a[0], costs)}
                       for g in chains}
            for name, tree in shapes.items():
                levels[(profile, f"tree {name}")] = profile_tree(SimulatedTreeDrafter(draft, prompt, a), tree)
                configs[f"tree {name}"] = {"kind": "tree", "shape": tree,
                                           **predict_tree(levels[(profile, f"tree {name}")], a, costs)}
            profiles[profile] = configs
            ceilings[profile] = ceiling(levels, profile, chains, costs)
            chosen = []
            for kind in ("chain", "tree"):
                ranked = sorted((c["predicted"], name) for name, c in configs.items() if c["kind"] == kind)
                chosen += [name for _, name in ranked[::-1][: args.measure]]
            plans[profile] = [(name, configs[name]) for name in chosen]
        # The best predicted chain of the first profile again, run by the tree loop: is it slower?
        first = args.profiles.split(",")[0]
        best_gamma = max(chains, key=lambda g: profiles[first][f"chain gamma {g}"]["predicted"])
        as_tree = f"tree {','.join(['1'] * best_gamma)} (the chain)"
        profiles[first][as_tree] = {"kind": "tree", "shape": TreeShape(branching=(1,) * best_gamma),
                                    **predict_chain(best_gamma, PROFILES[first][0], costs)}
        plans[first].append((as_tree, profiles[first][as_tree]))
        say(f"runs: {sum(len(p) for p in plans.values())} configs and the baseline ...")
        measured = measure_profiles(target, draft, prompt, plans, args)
        best = {}
        for profile, configs in plans.items():
            for name, config in configs:
                config.update(measured[(profile, name)])
            best[profile] = compare_best(dict(configs))

        say("noisy pair ...")
        candidates = {name: c for name, c in profiles["weak" if "weak" in profiles else args.profiles.split(",")[0]]
                      .items() if "(the chain)" not in name}
        noisy = noisy_pair(candidates, costs, args)

    payload = {
        "costs": {k: v for k, v in costs.items() if k != "samples"},
        "cost_samples": costs["samples"],
        "baseline_s": measured["baseline_s"],
        "profiles": {p: {n: {k: v for k, v in c.items() if k != "shape"} for n, c in configs.items()}
                     for p, configs in profiles.items()},
        "best": best,
        "ceilings": ceilings,
        "noisy": {label: {name: noisy[(t, name)] for name in candidates}
                  for t, label in ((0.0, "greedy"), (1.0, "sampled"))},
    }
    text = report(payload, env, args)
    (folder / "tree_speed.md").write_text(text + "\n", encoding="utf-8")
    write_json(folder / "tree_speed.json", {"environment": env, "args": vars(args), **payload})
    print(text)
    print(f"\nwritten to {folder}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
