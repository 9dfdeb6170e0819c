"""The result files of a gamma sweep (gamma_sweep.run_sweep): sweep.md, sweep.csv, sweep.json with the
environment header, and two plots. Every output says whether acceptance was simulated and weights were random.

The theory is spec_decoding/stats.py's (Leviathan et al. 2023, section 3): α is `SpecStats.alpha` of the cell's
runs pooled, E = `expected_tokens_per_step(α, γ)` (eq. 1), and `predicted_speedup` = E t_t / (γ t_d + t_v(γ+1))
is Theorem 3.8's improvement factor with the verification pass at its measured cost. efficiency = measured /
predicted is what the loop loses to what the formula leaves out; `predicted_with_start` adds each run's start-up
(new KV caches, prompt prefill, paid by both sides), so that `efficiency_with_start` isolates the loop.
"""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING

from benchmarks.common import environment_lines, markdown_table, write_csv, write_json
from spec_decoding import SpecStats, expected_tokens_per_step, predicted_speedup

if TYPE_CHECKING:
    from benchmarks.gamma_sweep import Cell, SweepResult


def predicted_speedup_with_start(E: float, gamma: int, n: int, t_draft: float, t_target: float,
                                 t_verify: float, t_start_target: float, t_start_draft: float) -> float:
    """(S_t + n t_t) / (S_t + S_d + (n / E)(γ t_d + t_v(γ+1))): the prediction for whole runs of n tokens at E
    tokens per target call, with S_t, S_d the target's and draft's start-up (new KV cache + prompt prefill), paid
    once a run by both sides."""
    return (t_start_target + n * t_target) / (t_start_target + t_start_draft + (n / E) * (gamma * t_draft + t_verify))


def pooled(stats: list[SpecStats]) -> SpecStats:
    """Runs as one SpecStats, every counter summed (per-position ones by position): its α,
    accepted_per_drafted and position rates are the pooled ones."""
    total = SpecStats(max((s.gamma for s in stats), default=1))
    for s in stats:
        for f in fields(SpecStats):
            mine, theirs = getattr(total, f.name), getattr(s, f.name)
            if f.name == "accepted_rank":  # trees: per depth, per sibling rank
                for depth, ranks in enumerate(theirs):
                    mine.extend([] for _ in range(depth + 1 - len(mine)))
                    mine[depth].extend(0 for _ in range(len(ranks) - len(mine[depth])))
                    for rank, value in enumerate(ranks):
                        mine[depth][rank] += value
            elif isinstance(mine, list):
                for i, value in enumerate(theirs):
                    mine[i] += value
            elif f.name not in ("gamma", "stopped_at_eos", "tree"):
                setattr(total, f.name, mine + theirs)
    return total


# The columns of sweep.csv and of each row in sweep.json, in order, with their meaning.
COLUMNS: dict[str, str] = {
    "max_gen": "new tokens per run (end-of-text ignored)",
    "gamma": "tokens drafted per step (a tree: its depth)",
    "tree": "the token tree's shape (tree_loop.py); empty: a chain of gamma tokens",
    "alpha_sim": "simulated acceptance rate; empty: the real draft model proposed",
    "drafter": "'simulated' (SimulatedDrafter, acceptance set to alpha_sim) or 'model' (the draft's own tokens)",
    "speedup": "median over repeats of baseline seconds / speculative seconds in the same repeat",
    "speedup_min": "smallest per-repeat speedup",
    "speedup_max": "largest per-repeat speedup",
    "spec_tok_s": "speculative decoding, new tokens per second (median time)",
    "base_tok_s": "plain decoding of the target (gpt2.generate), new tokens per second (median time)",
    "alpha": "α = accepted / judged drafted tokens (SpecStats.alpha, the cell's runs pooled)",
    "accepted_per_drafted": "accepted / all drafted tokens (SpecStats.accepted_per_drafted)",
    "tokens_per_call": "new tokens per target forward pass",
    "t_draft_ms": "t_d: one draft step with the KV cache (median ms)",
    "t_target_ms": "t_t: one target step with the KV cache (median ms)",
    "t_verify_ms": "t_v(gamma+1): one target pass over gamma + 1 tokens with the KV cache (a tree: over its N + 1 "
                   "nodes, with its mask) (median ms)",
    "c": "Leviathan's cost ratio t_d / t_t",
    "verify_ratio": "t_v(gamma+1) / t_t",
    "expected_tokens": "E = (1 - α^(gamma+1)) / (1 - α) at the measured α (expected_tokens_per_step); a tree: "
                       "its measured tokens per call",
    "predicted_speedup": "E * t_t / (gamma * t_d + t_v(gamma+1)) (spec_decoding.predicted_speedup)",
    "efficiency": "speedup / predicted_speedup: what the loop loses to everything the formula leaves out",
    "start_target_ms": "S_t: the target's start-up, a new KV cache + prefill of the median prompt (median ms)",
    "start_draft_ms": "S_d: the draft's start-up, likewise (median ms)",
    "predicted_with_start": "(S_t + n t_t) / (S_t + S_d + (n / E)(gamma t_d + t_v(gamma+1))), n = max_gen",
    "efficiency_with_start": "speedup / predicted_with_start: what the loop loses, start-up aside",
    "draft_share": "share of speculative time spent drafting (SpecStats.draft_seconds)",
    "verify_share": "share spent verifying: target pass + acceptance rule (SpecStats.verify_seconds)",
    "tokens": "new tokens of one repeat, summed over prompts",
    "spec_seconds": "speculative seconds of one repeat, summed over prompts (median)",
    "base_seconds": "baseline seconds of one repeat, summed over prompts (median)",
    "context_len": "context length at which t_d, t_t, t_v were measured (median prompt + max_gen / 2)",
    "identical_runs": "greedy speculative runs whose output equals the baseline's, token for token",
    "compared_runs": "greedy speculative runs compared with the baseline (0 when sampling)",
}
PEER_COLUMNS: dict[str, str] = {
    "hf_speedup": "transformers: plain generate seconds / assisted generation seconds (median over repeats)",
    "hf_speedup_min": "smallest per-repeat transformers speedup",
    "hf_speedup_max": "largest per-repeat transformers speedup",
    "hf_spec_tok_s": "transformers' assisted generation, new tokens per second",
    "hf_base_tok_s": "transformers' plain generate, new tokens per second",
    "ours_over_hf": "our speculative tokens/s / transformers' assisted tokens/s (> 1: ours faster)",
    "hf_identical_runs": "greedy assisted runs whose output equals our baseline's",
}


def cell_row(result: SweepResult, cell: Cell) -> dict:
    """One cell's row: every column of COLUMNS (and of PEER_COLUMNS with a peer)."""
    group, n, gamma = result.groups[cell.max_gen], cell.max_gen, cell.gamma
    speedups = [b / s for b, s in zip(group.base_seconds, cell.spec_seconds)]
    speedup, spec_s, base_s = median(speedups), median(cell.spec_seconds), median(group.base_seconds)
    t_d, t_t, s_t, s_d = map(median, (group.t_draft, group.t_target, group.t_start_target, group.t_start_draft))
    t_v = median(group.t_verify[gamma if cell.tree is None else cell.tree])
    stats = pooled(cell.stats)
    alpha = stats.alpha if stats.judged else None  # runs too short to draft judge nothing: no α to predict from
    if cell.tree is None:
        E = None if alpha is None else expected_tokens_per_step(alpha, gamma)
        predicted = None if alpha is None else predicted_speedup(alpha, gamma, t_d, t_t, t_v)
    else:  # a tree has no closed form in α: its measured tokens per call stand in for E; one draft pass per depth
        E = stats.tokens_per_target_call
        predicted = E * t_t / (gamma * t_d + t_v)
    with_start = None if E is None else predicted_speedup_with_start(E, gamma, n, t_d, t_t, t_v, s_t, s_d)
    row = {
        "max_gen": n, "gamma": gamma, "tree": cell.tree, "alpha_sim": cell.alpha_sim,
        "drafter": "model" if cell.alpha_sim is None else "simulated",
        "speedup": speedup, "speedup_min": min(speedups), "speedup_max": max(speedups),
        "spec_tok_s": cell.tokens / spec_s, "base_tok_s": group.base_tokens / base_s, "alpha": alpha,
        "accepted_per_drafted": stats.accepted_per_drafted, "tokens_per_call": stats.tokens_per_target_call,
        "t_draft_ms": 1e3 * t_d, "t_target_ms": 1e3 * t_t, "t_verify_ms": 1e3 * t_v, "c": t_d / t_t,
        "verify_ratio": t_v / t_t, "expected_tokens": E, "predicted_speedup": predicted,
        "efficiency": None if predicted is None else speedup / predicted,
        "start_target_ms": 1e3 * s_t, "start_draft_ms": 1e3 * s_d, "predicted_with_start": with_start,
        "efficiency_with_start": None if with_start is None else speedup / with_start,
        "draft_share": cell.draft_seconds / sum(cell.spec_seconds),
        "verify_share": cell.verify_seconds / sum(cell.spec_seconds),
        "tokens": cell.tokens, "spec_seconds": spec_s, "base_seconds": base_s, "context_len": group.context_len,
        "identical_runs": cell.identical,
        "compared_runs": len(result.prompts) * result.settings.repeats if result.settings.sampling.greedy else 0,
    }
    if result.settings.peer:
        hf_speedups = [b / s for b, s in zip(group.hf_base_seconds, cell.hf_spec_seconds)]
        hf_spec_tok_s = cell.tokens / median(cell.hf_spec_seconds)
        row.update(hf_speedup=median(hf_speedups), hf_speedup_min=min(hf_speedups), hf_speedup_max=max(hf_speedups),
                   hf_spec_tok_s=hf_spec_tok_s, hf_base_tok_s=group.base_tokens / median(group.hf_base_seconds),
                   ours_over_hf=row["spec_tok_s"] / hf_spec_tok_s, hf_identical_runs=cell.hf_identical)
    return row


def labels(result: SweepResult, env: dict) -> list[str]:
    """The warnings every output carries: simulated acceptance, random weights, int8."""
    out, s = [], result.settings
    if s.simulate:
        out.append(f"SIMULATED ACCEPTANCE (alpha_sim = {', '.join(f'{a:g}' for a in s.simulate)}): the draft model "
                   "runs every forward pass (its real cost), but each proposed token is replaced by the target's "
                   "own greedy token with probability alpha_sim and by a wrong token otherwise; the target "
                   "verifies for real.")
    if env.get("weights") in ("random", "tiny"):
        shapes = " and ".join(dict.fromkeys(env["models"].values()))  # --random-weights takes the tiny names too
        what = f"the shapes of {shapes}" if env["weights"] == "random" else "tiny test models"
        acceptance = ("the real draft's acceptance would be meaningless; here it is simulated." if s.simulate else
                      "the target drafts for itself, so greedy acceptance is 1 by construction."
                      if env.get("draft_is_target") else "acceptance is meaningless (two unrelated random networks).")
        out.append(f"RANDOM WEIGHTS ({what}): costs and speedups are real for these shapes; {acceptance}")
    if env.get("quantize"):
        q = env["quantize"]
        out.append(f"{q.upper()} WEIGHTS: both models' weight matrices are quantised (gpt2/fast/quantize.py); the "
                   f"baseline is the {q} target alone, and the speculative output is lossless with respect to "
                   "it, not to the float32 target."
                   + (" The peer's transformers models compute in float32 from the same rounded weights."
                      if s.peer else ""))
    return out


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def markdown(result: SweepResult, rows: list[dict], env: dict, command: str) -> str:
    s, q = result.settings, result.settings.sampling
    decoding = "greedy" if q.greedy else (
        f"sampling, temperature {q.temperature:g}, top-k {q.top_k}, top-p {q.top_p}, seed {s.seed}")
    weights = {"checkpoint": "checkpoint weights", "random": "random weights (the presets' shapes)",
               "tiny": "random weights (tiny test shapes)"}.get(env.get("weights"), env.get("weights"))
    lines = ["# Speculative decoding: gamma x max_gen sweep", ""]
    lines += [line for label in labels(result, env) for line in (f"**{label}**", "")]
    lines += [
        f"Command: `{command}`", "",
        f"- target {env['models']['target']}, draft {env['models']['draft']}, {weights}; {decoding}",
        f"- prompts: {', '.join(f'{name} ({n} tokens)' for name, n in result.prompts)}; end-of-text ignored, "
        "every run emits max_gen tokens",
        f"- baseline: gpt2.generate of the target (KV cache), in lockstep with the speculative runs (they take turns "
        f"step by step); {s.repeats} repeat(s) after {s.warmup} warm-up round(s); speedup = median [min-max] over "
        "repeats",
        f"- t_d, t_t, t_v: {s.component_calls} calls per repeat each, taking turns with the runs, KV cache at "
        "context_len = " + ", ".join(f"{g.context_len} (max_gen {n})" for n, g in result.groups.items()),
    ]
    if s.peer:
        lines.append(f"- peer: transformers {env.get('transformers')} assisted generation (constant "
                     "num_assistant_tokens = gamma, confidence stop off) and its plain generate")
    lines += [*environment_lines(env), ""]

    headers = ["max_gen", "γ", *(["α_sim"] if s.simulate else []), "speedup [min-max]", "tok/s spec",
               "tok/s base", "α", "tok/call", "t_d ms", "t_t ms", "t_v(γ+1) ms", "c", "t_v/t_t", "predicted",
               "efficiency", "eff. w/ start-up", *(["HF speedup", "HF tok/s", "ours/HF"] if s.peer else [])]
    table = [[str(r["max_gen"]), str(r["gamma"]) if r["tree"] is None else f"tree {r['tree']}",
              *([fmt(r["alpha_sim"], "g")] if s.simulate else []),
              f"{fmt(r['speedup'])} [{fmt(r['speedup_min'])}-{fmt(r['speedup_max'])}]", fmt(r["spec_tok_s"], ".1f"),
              fmt(r["base_tok_s"], ".1f"), fmt(r["alpha"], ".3f"), fmt(r["tokens_per_call"]),
              fmt(r["t_draft_ms"], ".1f"), fmt(r["t_target_ms"], ".1f"), fmt(r["t_verify_ms"], ".1f"),
              fmt(r["c"], ".3f"), fmt(r["verify_ratio"]), fmt(r["predicted_speedup"]), fmt(r["efficiency"]),
              fmt(r["efficiency_with_start"]),
              *([fmt(r["hf_speedup"]), fmt(r["hf_spec_tok_s"], ".1f"), fmt(r["ours_over_hf"])] if s.peer else [])]
             for r in rows]
    lines += [markdown_table(headers, table), "",
              "speedup: baseline time / speculative time; α: accepted / judged drafted tokens (SpecStats.alpha); "
              "tok/call: new tokens per target pass; t_d, t_t: one draft / target step, t_v(γ+1): one target pass "
              "over γ+1 tokens; c = t_d / t_t; predicted = E·t_t / (γ·t_d + t_v(γ+1)) with E = (1 − α^(γ+1)) "
              "/ (1 − α); efficiency = speedup / predicted. The formula leaves out each run's start-up S (new KV "
              "caches, prompt prefill), paid once by both sides; eff. w/ start-up = speedup / ((S_t + n·t_t) / "
              "(S_t + S_d + (n/E)(γ·t_d + t_v(γ+1)))), n = max_gen, isolates the loop (`efficiency_with_start` in "
              "sweep.csv, with S_t, S_d). Every column is defined in sweep.json."]
    if s.trees:
        lines += ["", "Tree rows (spec_decoding/tree_loop.py): γ is the tree's depth, t_v the target's pass over its "
                  "N + 1 nodes with the tree mask, and predicted = tok/call·t_t / (depth·t_d + t_v): a tree's E has "
                  "no closed form in α, so its measured tokens per call stand in. Simulated trees: the target's token "
                  "is the draft's 1st candidate with probability α_sim, its 2nd, 3rd, ... with "
                  f"{', '.join(f'{p:g}' for p in s.tree_profile)} (SimulatedTreeDrafter)."]
    compared = sum(r["compared_runs"] for r in rows)
    if compared:
        identical = sum(r["identical_runs"] for r in rows)
        lines += ["", f"Greedy check: {identical} of {compared} speculative runs produced exactly the baseline's "
                  "tokens."]
        if identical < compared:  # where they part: docs/parity.md; a simulated drafter then leaves the path
            lines.append("Runs part from the baseline where its top two logits nearly tie and a one-row step and a "
                         "multi-row pass round them apart (rare in float32, common in half precision with random "
                         "weights; `python -m benchmarks.parity_check` says which)"
                         + (": a simulated drafter copies the baseline, so after such a point its proposals leave "
                            "the path and α falls below α_sim." if s.simulate else "."))
    if s.peer and q.greedy:
        lines.append(f"transformers' assisted runs identical to our baseline: "
                     f"{sum(r['hf_identical_runs'] for r in rows)} of {compared}.")
    return "\n".join(lines) + "\n"


def line_label(alpha_sim: float | None, env: dict) -> str:
    if alpha_sim is not None:
        return f"simulated α = {alpha_sim:g}"
    if env.get("draft_is_target"):
        return "target drafts for itself (α = 1)"
    return "real draft" + (" (random weights)" if env.get("weights") in ("random", "tiny") else "")


def plot(result: SweepResult, rows: list[dict], env: dict, speedup_path: Path, acceptance_path: Path) -> None:
    """The two plots, one colour per acceptance setting in each. speedup_path: one axis, ~1000 x 700 px, speedup
    against γ at the largest max_gen, measured solid (min-max bars), predicted dashed, transformers dotted.
    acceptance_path: one small axis, P(draft position i accepted | judged), pooled over γ, max_gen and prompts."""
    from matplotlib.figure import Figure  # matplotlib only when plotting; no pyplot state to close

    s, n = result.settings, max(result.settings.max_gens)
    speed_fig, accept_fig = Figure(figsize=(8, 5.6)), Figure(figsize=(6.4, 4))
    speed, accept = speed_fig.subplots(), accept_fig.subplots()
    for i, alpha_sim in enumerate(s.alpha_settings):
        color, name = f"C{i}", line_label(alpha_sim, env)
        sel = [r for r in rows if r["max_gen"] == n and r["alpha_sim"] == alpha_sim and r["tree"] is None]
        g, y = [r["gamma"] for r in sel], [r["speedup"] for r in sel]
        err = [[r["speedup"] - r["speedup_min"] for r in sel], [r["speedup_max"] - r["speedup"] for r in sel]]
        speed.errorbar(g, y, yerr=err, color=color, marker="o", capsize=3, label=f"{name}, measured")
        speed.plot(g, [r["predicted_speedup"] for r in sel], color=color, linestyle="--", label=f"{name}, predicted")
        if s.peer:
            speed.plot(g, [r["hf_speedup"] for r in sel], color=color, linestyle=":", marker="^",
                       label=f"{name}, transformers")
        stats = pooled([st for c in result.cells if c.alpha_sim == alpha_sim and c.tree is None for st in c.stats])
        accept.plot(range(1, stats.gamma + 1), stats.position_acceptance, color=color, marker="o", label=name)
        if alpha_sim is not None:
            accept.axhline(alpha_sim, color=color, linestyle="--", linewidth=0.8)
    speed.axhline(1.0, color="grey", linewidth=0.8)
    speed.set_xscale("log", base=2)
    speed.set_xticks(list(s.gammas), [str(g) for g in s.gammas])
    speed.set_xlabel("γ (tokens drafted per step)")
    speed.set_ylabel("speedup over plain decoding")
    speed.set_title(f"{env['models']['draft']} → {env['models']['target']}, max_gen {n}, {env['device_name']}, "
                    f"{env['dtype']}", fontsize=10)
    accept.set_ylim(-0.02, 1.02)
    accept.set_xticks(range(1, max(s.gammas) + 1))
    accept.set_xlabel("draft position i")
    accept.set_ylabel("P(accepted | judged)")
    for fig, ax, path in ((speed_fig, speed, speedup_path), (accept_fig, accept, acceptance_path)):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=125)


def write_all(result: SweepResult, folder: Path, env: dict, command: str) -> list[Path]:
    """Writes sweep.md, sweep.csv, sweep.json and the two PNGs into `folder`; returns their paths."""
    rows = [cell_row(result, c) for c in result.cells]
    s = result.settings
    cols = {**COLUMNS, **(PEER_COLUMNS if s.peer else {})}
    paths = [folder / name for name in
             ("sweep.md", "sweep.csv", "sweep.json", "speedup_vs_gamma.png", "acceptance_per_position.png")]
    paths[0].write_text(markdown(result, rows, env, command), encoding="utf-8")
    write_csv(paths[1], list(cols), rows)
    write_json(paths[2], {
        "benchmark": "gamma_sweep", "labels": labels(result, env), "simulated_acceptance": list(s.simulate),
        "command": command, "environment": env,
        "settings": {"gammas": list(s.gammas), "max_gens": list(s.max_gens), "temperature": s.sampling.temperature,
                     "top_k": s.sampling.top_k, "top_p": s.sampling.top_p, "seed": s.seed, "repeats": s.repeats,
                     "warmup": s.warmup, "component_calls": s.component_calls, "peer": s.peer, "trees": list(s.trees),
                     "tree_profile": list(s.tree_profile), "eos": "ignored: every run emits max_gen tokens"},
        "prompts": [{"name": name, "tokens": n} for name, n in result.prompts],
        "columns": cols,
        "rows": rows,
        "cells": [{"max_gen": c.max_gen, "gamma": c.gamma, "tree": c.tree, "alpha_sim": c.alpha_sim,
                   "position_acceptance": pooled(c.stats).position_acceptance,
                   "accepted_hist": pooled(c.stats).accepted_hist, "spec_seconds": c.spec_seconds,
                   "base_seconds": result.groups[c.max_gen].base_seconds,
                   "stats_per_prompt": [st.to_dict() for st in c.stats],
                   **({"hf_spec_seconds": c.hf_spec_seconds,
                       "hf_base_seconds": result.groups[c.max_gen].hf_base_seconds} if s.peer else {})}
                  for c in result.cells],
        "components_seconds": {str(n): {"context_len": g.context_len, "t_draft": g.t_draft, "t_target": g.t_target,
                                        "t_verify": {f"tree {k}" if isinstance(k, str) else str(k): v
                                                     for k, v in g.t_verify.items()},
                                        "prompt_len": g.prompt_len, "t_start_target": g.t_start_target,
                                        "t_start_draft": g.t_start_draft}
                               for n, g in result.groups.items()},
    })
    plot(result, rows, env, paths[3], paths[4])
    return paths
