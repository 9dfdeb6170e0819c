"""Turns a gamma sweep (gamma_sweep.run_sweep) into its result files: the
Markdown table the README quotes, CSV, JSON with the environment header, and
two plots, computing the theory columns on the way. Every output says whether
acceptance was simulated and whether the weights were random.

Theory (Leviathan et al. 2023, sections 3.3-3.4, notation as there): if each
drafted token is accepted with probability alpha, independently, one step
(gamma draft forward passes, one target pass over gamma + 1 tokens) emits on
average

    E = (1 - alpha^(gamma+1)) / (1 - alpha)        tokens  (eq. 1),

so that, against plain decoding at t_t per token,

    predicted speedup = E * t_t / (gamma * t_d + t_v(gamma+1)),

with t_d one draft step, t_t one target step and t_v(gamma+1) one target pass
over gamma + 1 tokens. The paper writes c = t_d / t_t and assumes
t_v(gamma+1) = t_t; both c and t_v(gamma+1) / t_t are reported, and
efficiency = measured / predicted says how much the decoding loop loses to
what the formula leaves out (Python, sampling, cache bookkeeping, and each
run's start-up: new KV caches and the prompt's prefill, paid by both sides).
`predicted_with_start` adds the measured start-up to the prediction, so that
`efficiency_with_start` isolates the loop.

alpha is estimated as Leviathan's alpha: accepted drafted tokens / drafted
tokens that verification reached (a token after the first rejection of a
step is never judged). SpecStats.acceptance_rate = accepted / all drafted is
reported too, as `accepted_over_drafted`; it is smaller whenever gamma > 1.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.common import environment_lines, markdown_table, median, write_csv, write_json
from spec_decoding import SpecStats, expected_tokens_per_step

if TYPE_CHECKING:
    from benchmarks.gamma_sweep import Cell, SweepResult


# ---------------------------------------------------------------------------
# Theory
# ---------------------------------------------------------------------------


def predicted_speedup(alpha: float, gamma: int, t_draft: float, t_target: float, t_verify: float) -> float:
    """E * t_t / (gamma * t_d + t_v(gamma+1)): tokens per step over the time of a
    step, against one token per t_t for plain decoding.

    With t_verify = t_target this is Leviathan et al. 2023's improvement factor
    (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)), c = t_draft / t_target.

    Args:
        alpha: acceptance rate in [0, 1].
        gamma: tokens drafted per step, >= 1.
        t_draft, t_target, t_verify: seconds of one draft step, one target step
            and one target pass over gamma + 1 tokens.
    """
    E = expected_tokens_per_step(alpha, gamma)
    return E * t_target / (gamma * t_draft + t_verify)


def predicted_speedup_with_start(
    alpha: float, gamma: int, n: int, t_draft: float, t_target: float, t_verify: float,
    t_start_target: float, t_start_draft: float,
) -> float:
    """The prediction for whole runs of n tokens, start-up included:
    (S_t + n t_t) / (S_t + S_d + (n / E)(gamma t_d + t_v(gamma+1))), with S_t,
    S_d the target's and draft's start-up (new KV cache + prompt prefill).
    Start-up is paid once per run by both sides, so it pulls the speedup of
    short runs towards 1; this is the part of the gap to `predicted_speedup`
    that is not the loop's doing."""
    E = expected_tokens_per_step(alpha, gamma)
    baseline = t_start_target + n * t_target
    speculative = t_start_target + t_start_draft + (n / E) * (gamma * t_draft + t_verify)
    return baseline / speculative


def leviathan_alpha(stats: list[SpecStats]) -> float:
    """alpha estimated from runs: accepted drafted tokens / drafted tokens that
    verification reached, pooled over `stats` (NaN if none was reached).

    Under the i.i.d. model each reached token is one Bernoulli(alpha) trial,
    so this is the maximum-likelihood estimate of alpha."""
    accepted = sum(sum(s.accepted_at) for s in stats)
    reached = sum(sum(s.reached_at) for s in stats)
    return accepted / reached if reached else float("nan")


def position_acceptance(stats: list[SpecStats], gamma: int) -> list[float]:
    """P(draft position i accepted | reached), i = 1..gamma, pooled over `stats`."""
    out = []
    for i in range(gamma):
        reached = sum(s.reached_at[i] for s in stats)
        out.append(sum(s.accepted_at[i] for s in stats) / reached if reached else float("nan"))
    return out


# ---------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------

# The columns of sweep.csv and of each row in sweep.json, in order, with their meaning.
COLUMNS: dict[str, str] = {
    "max_gen": "new tokens per run (end-of-text ignored)",
    "gamma": "tokens drafted per step",
    "alpha_sim": "simulated acceptance rate; empty: the real draft model proposed",
    "drafter": "'simulated' (SimulatedDrafter, acceptance set to alpha_sim) or 'model' (the draft's own tokens)",
    "speedup": "median over repeats of baseline seconds / speculative seconds in the same repeat",
    "speedup_min": "smallest per-repeat speedup",
    "speedup_max": "largest per-repeat speedup",
    "spec_tok_s": "speculative decoding, new tokens per second (median time)",
    "base_tok_s": "plain decoding of the target (gpt2.generate), new tokens per second (median time)",
    "alpha": "measured acceptance, Leviathan's alpha: accepted / drafted tokens that verification reached",
    "accepted_over_drafted": "accepted / all drafted tokens (SpecStats.acceptance_rate)",
    "tokens_per_call": "new tokens per target forward pass",
    "t_draft_ms": "t_d: one draft step with the KV cache (median ms)",
    "t_target_ms": "t_t: one target step with the KV cache (median ms)",
    "t_verify_ms": "t_v(gamma+1): one target pass over gamma + 1 tokens with the KV cache (median ms)",
    "c": "Leviathan's cost ratio t_d / t_t",
    "verify_ratio": "t_v(gamma+1) / t_t",
    "expected_tokens": "E = (1 - alpha^(gamma+1)) / (1 - alpha) at the measured alpha",
    "predicted_speedup": "E * t_t / (gamma * t_d + t_v(gamma+1))",
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
    """One cell's row: every column of COLUMNS (and PEER_COLUMNS with a peer)."""
    base = result.baselines[cell.max_gen]
    comp = result.components[cell.max_gen]
    speedups = [b / s for b, s in zip(base.seconds, cell.spec_seconds)]
    spec_s, base_s = median(cell.spec_seconds), median(base.seconds)
    t_d, t_t, t_v = median(comp.t_draft), median(comp.t_target), median(comp.t_verify[cell.gamma])
    s_t, s_d = median(comp.t_start_target), median(comp.t_start_draft)
    alpha = leviathan_alpha(cell.stats)
    drafted = sum(s.drafted for s in cell.stats)
    calls = sum(s.target_calls for s in cell.stats)
    nan = float("nan")  # alpha is NaN when nothing was drafted; the predictions then are NaN too
    predicted = predicted_speedup(alpha, cell.gamma, t_d, t_t, t_v)
    predicted_start = predicted_speedup_with_start(alpha, cell.gamma, cell.max_gen, t_d, t_t, t_v, s_t, s_d)
    all_spec_seconds = sum(cell.spec_seconds)
    row = {
        "max_gen": cell.max_gen,
        "gamma": cell.gamma,
        "alpha_sim": cell.alpha_sim,
        "drafter": "model" if cell.alpha_sim is None else "simulated",
        "speedup": median(speedups),
        "speedup_min": min(speedups),
        "speedup_max": max(speedups),
        "spec_tok_s": cell.tokens / spec_s,
        "base_tok_s": base.tokens / base_s,
        "alpha": alpha,
        "accepted_over_drafted": sum(s.accepted for s in cell.stats) / drafted if drafted else nan,
        "tokens_per_call": sum(s.new_tokens for s in cell.stats) / calls if calls else nan,
        "t_draft_ms": 1e3 * t_d,
        "t_target_ms": 1e3 * t_t,
        "t_verify_ms": 1e3 * t_v,
        "c": t_d / t_t,
        "verify_ratio": t_v / t_t,
        "expected_tokens": expected_tokens_per_step(alpha, cell.gamma),
        "predicted_speedup": predicted,
        "efficiency": median(speedups) / predicted,
        "start_target_ms": 1e3 * s_t,
        "start_draft_ms": 1e3 * s_d,
        "predicted_with_start": predicted_start,
        "efficiency_with_start": median(speedups) / predicted_start,
        "draft_share": cell.draft_seconds / all_spec_seconds,
        "verify_share": cell.verify_seconds / all_spec_seconds,
        "tokens": cell.tokens,
        "spec_seconds": spec_s,
        "base_seconds": base_s,
        "context_len": comp.context_len,
        "identical_runs": cell.identical,
        "compared_runs": cell.compared,
    }
    if result.settings.peer:
        hf_speedups = [b / s for b, s in zip(base.hf_seconds, cell.hf_spec_seconds)]
        hf_spec_tok_s = cell.tokens / median(cell.hf_spec_seconds)
        row.update(
            hf_speedup=median(hf_speedups),
            hf_speedup_min=min(hf_speedups),
            hf_speedup_max=max(hf_speedups),
            hf_spec_tok_s=hf_spec_tok_s,
            hf_base_tok_s=base.tokens / median(base.hf_seconds),
            ours_over_hf=row["spec_tok_s"] / hf_spec_tok_s,
            hf_identical_runs=cell.hf_identical,
        )
    return row


def columns(result: SweepResult) -> list[str]:
    return list(COLUMNS) + (list(PEER_COLUMNS) if result.settings.peer else [])


# ---------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------


def labels(result: SweepResult, env: dict) -> list[str]:
    """The warnings every output carries: simulated acceptance, random weights."""
    out = []
    s = result.settings
    if s.simulate:
        rates = ", ".join(f"{a:g}" for a in s.simulate)
        out.append(
            f"SIMULATED ACCEPTANCE (alpha_sim = {rates}): the draft model runs every forward pass (its real "
            "cost), but each proposed token is replaced by the target's own greedy token with probability "
            "alpha_sim and by a wrong token otherwise; the target verifies for real."
        )
    if env.get("weights") in ("random", "tiny"):
        what = "the presets' real GPT-2 shapes" if env["weights"] == "random" else "tiny test models"
        if s.simulate:
            acceptance = "the real draft's acceptance would be meaningless; here it is simulated."
        elif env.get("draft_is_target"):
            acceptance = "the target drafts for itself, so greedy acceptance is 1 by construction."
        else:
            acceptance = "acceptance is meaningless (two unrelated random networks)."
        out.append(f"RANDOM WEIGHTS ({what}): costs and speedups are real for these shapes; {acceptance}")
    if env.get("quantize"):
        out.append(
            f"{env['quantize'].upper()} WEIGHTS: both models' weight matrices are quantised (gpt2/quantize.py); "
            f"the baseline is the {env['quantize']} target alone, and the speculative output is lossless with "
            "respect to it, not to the float32 target."
        )
    return out


WEIGHTS_LABELS = {
    "checkpoint": "checkpoint weights",
    "random": "random weights (real GPT-2 shapes)",
    "tiny": "random weights (tiny test shapes)",
}


def fmt(value, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def markdown(result: SweepResult, rows: list[dict], env: dict, command: str) -> str:
    s = result.settings
    decoding = "greedy" if s.sampling.greedy else (
        f"sampling, temperature {s.sampling.temperature:g}, top-k {s.sampling.top_k}, top-p {s.sampling.top_p}, "
        f"seed {s.seed}"
    )
    prompt_names = ", ".join(f"{name} ({n} tokens)" for name, n in result.prompts)
    lines = ["# Speculative decoding: gamma x max_gen sweep", ""]
    for label in labels(result, env):
        lines += [f"**{label}**", ""]
    lines += [
        f"Command: `{command}`",
        "",
        f"- target {env['models']['target']}, draft {env['models']['draft']}, "
        f"{WEIGHTS_LABELS.get(env.get('weights'), env.get('weights'))}; {decoding}",
        f"- prompts: {prompt_names}; end-of-text ignored, every run emits max_gen tokens",
        f"- baseline: gpt2.generate of the target (KV cache), interleaved with the speculative runs; "
        f"{s.repeats} repeats after {s.warmup} warm-up round(s); speedup = median [min-max] over repeats",
        f"- t_d, t_t, t_v: {s.component_calls} calls per repeat each, spread between the runs, KV cache at "
        "context_len = "
        + ", ".join(f"{c.context_len} (max_gen {n})" for n, c in result.components.items()),
    ]
    if s.peer:
        lines.append(f"- peer: transformers {env.get('transformers')} assisted generation (constant "
                     "num_assistant_tokens = gamma, confidence stop off) and its plain generate")
    lines += environment_lines(env)
    lines.append("")

    simulate = bool(s.simulate)
    headers = ["max_gen", "γ"] + (["α_sim"] if simulate else []) + [
        "speedup [min-max]", "tok/s spec", "tok/s base", "α", "tok/call",
        "t_d ms", "t_t ms", "t_v(γ+1) ms", "c", "t_v/t_t", "predicted", "efficiency", "eff. w/ start-up",
    ]
    if s.peer:
        headers += ["HF speedup", "HF tok/s", "ours/HF"]
    table = []
    for row in rows:
        cells = [str(row["max_gen"]), str(row["gamma"])] + ([fmt(row["alpha_sim"], "g")] if simulate else []) + [
            f"{fmt(row['speedup'])} [{fmt(row['speedup_min'])}-{fmt(row['speedup_max'])}]",
            fmt(row["spec_tok_s"], ".1f"), fmt(row["base_tok_s"], ".1f"), fmt(row["alpha"], ".3f"),
            fmt(row["tokens_per_call"]), fmt(row["t_draft_ms"], ".1f"), fmt(row["t_target_ms"], ".1f"),
            fmt(row["t_verify_ms"], ".1f"), fmt(row["c"], ".3f"), fmt(row["verify_ratio"]),
            fmt(row["predicted_speedup"]), fmt(row["efficiency"]), fmt(row["efficiency_with_start"]),
        ]
        if s.peer:
            cells += [fmt(row["hf_speedup"]), fmt(row["hf_spec_tok_s"], ".1f"), fmt(row["ours_over_hf"])]
        table.append(cells)
    lines += [markdown_table(headers, table), ""]

    lines.append(
        "speedup: baseline time / speculative time; α: accepted / reached drafted tokens; tok/call: new tokens "
        "per target pass; t_d, t_t: one draft / target step, t_v(γ+1): one target pass over γ+1 tokens; "
        "c = t_d / t_t; predicted = E·t_t / (γ·t_d + t_v(γ+1)) with E = (1 − α^(γ+1)) / (1 − α); "
        "efficiency = speedup / predicted. The formula leaves out each run's start-up S (new KV caches, prompt "
        "prefill), paid once by both sides; eff. w/ start-up = speedup / ((S_t + n·t_t) / (S_t + S_d + "
        "(n/E)(γ·t_d + t_v(γ+1)))), n = max_gen, isolates the loop (`efficiency_with_start` in sweep.csv, "
        "with S_t, S_d). Every column is defined in sweep.json."
    )
    compared = sum(r["compared_runs"] for r in rows)
    if compared:
        identical = sum(r["identical_runs"] for r in rows)
        lines += ["", f"Greedy check: {identical} of {compared} speculative runs produced exactly the baseline's "
                  "tokens."]
    if s.peer and s.sampling.greedy:
        hf_identical = sum(r["hf_identical_runs"] for r in rows)
        lines.append(f"transformers' assisted runs identical to our baseline: {hf_identical} of {compared}.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------


def panel_title(alpha_sim: float | None, env: dict) -> str:
    if alpha_sim is not None:
        return f"SIMULATED acceptance α_sim = {alpha_sim:g}"
    if env.get("draft_is_target"):
        return "the target drafts for itself (α = 1)"
    return "real draft" + (" (random weights: α meaningless)" if env.get("weights") in ("random", "tiny") else "")


def plot_speedup(result: SweepResult, rows: list[dict], env: dict, path: Path) -> None:
    """Speedup vs gamma, one line per max_gen, the predicted curve dashed beside
    it (and transformers dotted); one panel per acceptance setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result.settings
    alphas = s.alpha_settings
    fig, axes = plt.subplots(1, len(alphas), figsize=(5.5 * len(alphas), 4.2), squeeze=False, sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, alpha_sim in zip(axes[0], alphas):
        for i, n in enumerate(s.max_gens):
            sel = [r for r in rows if r["max_gen"] == n and r["alpha_sim"] == alpha_sim]
            g = [r["gamma"] for r in sel]
            color = colors[i % len(colors)]
            y = [r["speedup"] for r in sel]
            err = [[r["speedup"] - r["speedup_min"] for r in sel], [r["speedup_max"] - r["speedup"] for r in sel]]
            ax.errorbar(g, y, yerr=err, color=color, marker="o", capsize=3, label=f"measured, max_gen {n}")
            ax.plot(g, [r["predicted_speedup"] for r in sel], color=color, linestyle="--", marker="x",
                    label=f"predicted, max_gen {n}")
            if s.peer:
                ax.plot(g, [r["hf_speedup"] for r in sel], color=color, linestyle=":", marker="^",
                        label=f"transformers, max_gen {n}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(s.gammas), [str(g) for g in s.gammas])
        ax.set_xlabel("γ (tokens drafted per step)")
        ax.set_title(panel_title(alpha_sim, env), fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("speedup over plain decoding")
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.suptitle(f"{env['models']['draft']} → {env['models']['target']}, {env['device_name']}, {env['dtype']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_acceptance(result: SweepResult, env: dict, path: Path) -> None:
    """P(draft position i accepted | reached) for i = 1..gamma, one line per
    gamma pooled over max_gen and prompts; one panel per acceptance setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result.settings
    alphas = s.alpha_settings
    fig, axes = plt.subplots(1, len(alphas), figsize=(5.5 * len(alphas), 4.0), squeeze=False, sharey=True)
    for ax, alpha_sim in zip(axes[0], alphas):
        for gamma in s.gammas:
            stats = [st for c in result.cells if c.gamma == gamma and c.alpha_sim == alpha_sim for st in c.stats]
            ax.plot(range(1, gamma + 1), position_acceptance(stats, gamma), marker="o", label=f"γ = {gamma}")
        if alpha_sim is not None:
            ax.axhline(alpha_sim, color="grey", linestyle="--", linewidth=0.8, label="α_sim")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xticks(range(1, max(s.gammas) + 1))
        ax.set_xlabel("draft position i")
        ax.set_title(panel_title(alpha_sim, env), fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("P(accepted | reached)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------
# All outputs
# ---------------------------------------------------------------------------


def write_all(result: SweepResult, folder: Path, env: dict, command: str) -> list[Path]:
    """Writes sweep.md, sweep.csv, sweep.json and the two PNGs into `folder`; returns their paths."""
    rows = [cell_row(result, c) for c in result.cells]
    cols = columns(result)
    s = result.settings
    paths = [folder / name for name in
             ("sweep.md", "sweep.csv", "sweep.json", "speedup_vs_gamma.png", "acceptance_per_position.png")]
    paths[0].write_text(markdown(result, rows, env, command), encoding="utf-8")
    write_csv(paths[1], cols, rows)
    payload = {
        "benchmark": "gamma_sweep",
        "labels": labels(result, env),
        "simulated_acceptance": list(s.simulate),
        "command": command,
        "environment": env,
        "settings": {
            "gammas": list(s.gammas),
            "max_gens": list(s.max_gens),
            "temperature": s.sampling.temperature,
            "top_k": s.sampling.top_k,
            "top_p": s.sampling.top_p,
            "seed": s.seed,
            "repeats": s.repeats,
            "warmup": s.warmup,
            "component_calls": s.component_calls,
            "peer": s.peer,
            "eos": "ignored: every run emits max_gen tokens",
        },
        "prompts": [{"name": name, "tokens": n} for name, n in result.prompts],
        "columns": {k: v for k, v in {**COLUMNS, **PEER_COLUMNS}.items() if k in cols},
        "rows": rows,
        "cells": [
            {
                "max_gen": c.max_gen,
                "gamma": c.gamma,
                "alpha_sim": c.alpha_sim,
                "position_acceptance": position_acceptance(c.stats, c.gamma),
                "accepted_hist": [sum(st.accepted_hist[k] for st in c.stats) for k in range(c.gamma + 1)],
                "spec_seconds": c.spec_seconds,
                "base_seconds": result.baselines[c.max_gen].seconds,
                "stats_per_prompt": [st.to_dict() for st in c.stats],
                **({"hf_spec_seconds": c.hf_spec_seconds, "hf_base_seconds": result.baselines[c.max_gen].hf_seconds}
                   if s.peer else {}),
            }
            for c in result.cells
        ],
        "components_seconds": {
            str(n): {
                "context_len": comp.context_len,
                "t_draft": comp.t_draft,
                "t_target": comp.t_target,
                "t_verify": {str(g): v for g, v in comp.t_verify.items()},
                "prompt_len": comp.prompt_len,
                "t_start_target": comp.t_start_target,
                "t_start_draft": comp.t_start_draft,
            }
            for n, comp in result.components.items()
        },
    }
    write_json(paths[2], payload)
    plot_speedup(result, rows, env, paths[3])
    plot_acceptance(result, env, paths[4])
    return paths
