"""What spec_decoding_generate.py prints around the streamed text: the header,
the stats block of the run, and the comparison with the target alone; for
--prompts-file, one block per prompt and the stats of the batches.

Names follow Leviathan et al. 2023: α is the acceptance rate (accepted /
judged drafts, `SpecStats.alpha`), γ the draft length, E(α, γ) the expected
tokens per target call (eq. 1), and the speedup that α and the measured step
costs predict is Theorem 3.8 with the verification at its measured cost and
each step's own K (`expected_tokens`; `spec_decoding.stats.predicted_speedup`
when every step drafts γ).
"""

from __future__ import annotations

import math

from gpt2.sampling import GREEDY_BELOW_TEMPERATURE, SamplingConfig
from spec_decoding import BatchStats, SpecStats, expected_tokens_per_step

from .stream import ACCEPTED_STYLE, RESET, TARGET_STYLE

LABEL_WIDTH = 20
# The measured and the predicted speedup "disagree" when one exceeds the other
# by more than this fraction: more than the noise of two quiet runs.
SPEEDUP_TOLERANCE = 0.3
# When more than this share of the speculative run went outside its drafting and verifying steps (the prompt's
# prefill in both models, above all), that share, which the prediction leaves out, explains a disagreement.
OUTSIDE_STEPS_SHARE = 0.2
INTERRUPTED = "interrupted (Ctrl-C)"  # the stop reason of a run that Ctrl-C cut short


def count(n: int, noun: str) -> str:
    """ "1 target call", "2 target calls"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def print_rows(rows: list[tuple[str, str]]) -> None:
    for label, value in rows:
        print(f"{label:<{LABEL_WIDTH}} {value}")


def describe_decoding(sampling: SamplingConfig, seed: int) -> str:
    """ "greedy", or the sampling settings and seed."""
    if sampling.greedy:
        if sampling.temperature > 0:
            return f"greedy (a temperature below {GREEDY_BELOW_TEMPERATURE:g} is greedy)"
        return "greedy"
    text = f"sampling at temperature {sampling.temperature:g}"
    text += f", top-k {sampling.top_k}" if sampling.top_k is not None else ""
    text += f", top-p {sampling.top_p:g}" if sampling.top_p is not None else ""
    return text + f", seed {seed}"


def describe_gamma(gamma: int | str) -> str:
    """How many tokens a step drafts: --gamma as given (an integer, or a schedule's name)."""
    if gamma == "auto":
        return "the number of tokens per step that pays best (--gamma auto)"
    if gamma == "heuristic":
        return "a number of tokens per step set by Hugging Face's +2/-1 rule (--gamma heuristic)"
    return f"{gamma} tokens per step"


def print_header(
    *, draft: str, target: str, gamma: int | str | None, tree=None, target_n_ctx: int | None = None, max_gen: int,
    decoding: str, device, dtype, quantize: str | None, color: bool,
) -> None:
    """`draft`: how the drafter is named (`describe_drafter`); `tree`: the
    TreeShape drafted instead of a chain of `gamma` tokens, or None, of which
    the target's window (`target_n_ctx`, if given) holds at most n_ctx - 1 tokens."""
    if tree is None:
        print(f"draft {draft} proposes {describe_gamma(gamma)}, target {target} verifies them")
    else:
        nodes = tree.max_nodes if target_n_ctx is None else min(tree.max_nodes, target_n_ctx - 1)
        print(f"draft {draft} proposes a token tree per step ({tree}: up to {nodes} tokens"
              f"{' (what the window holds)' if nodes < tree.max_nodes else ''}, {tree.max_depth} deep), target "
              f"{target} verifies it in one pass")
    weights = f", {quantize} weights (the output is the {quantize} target's)" if quantize else ""
    print(f"{decoding}, up to {max_gen} new tokens, {device} {str(dtype).removeprefix('torch.')}{weights}")
    if color:
        print(
            f"legend: {ACCEPTED_STYLE}drafted and accepted{RESET}  "
            f"{TARGET_STYLE}chosen by the target (correction or bonus token){RESET}"
        )
    print()


def stop_reason(stats: SpecStats, *, interrupted: bool, max_gen: int, length: int, target_n_ctx: int) -> str:
    """Why the run ended. Only the target's context window can end it: past
    the draft's window the target goes on with plain steps. A Ctrl-C
    (`interrupted`) ended it only if nothing else had: a batch's row that
    had finished before it keeps its own reason."""
    if stats.stopped_at_eos:
        return "stopped at <|endoftext|>"
    if stats.new_tokens >= max_gen:
        return "stopped at --max-gen"
    if length >= target_n_ctx:
        return f"stopped at the target's context window ({target_n_ctx} tokens)"
    assert interrupted, (length, target_n_ctx)
    return INTERRUPTED


def describe_drafter(draft: str, *, ngram: int | None, quantize: str | None, p_min: float | None) -> str:
    """The drafter as the header and the stats name it: the draft model (its
    weights' quantisation, its p_min), or prompt lookup (`ngram`: its n)."""
    if ngram is not None:
        return f"prompt lookup (n-gram, suffixes of up to {ngram} tokens, no model)"
    name = draft + (f" ({quantize} weights)" if quantize else "")
    return name + (f", stopping below top probability {p_min:g}" if p_min is not None else "")


def describe_gammas(stats: SpecStats, schedule: str) -> str:
    """The schedule and the K it asked for, e.g. 'auto: K = 0 x 2, 4 x 10, 5 x 3 steps (mean 4.1)'."""
    steps = sum(stats.gamma_hist)
    if not steps:
        return schedule
    asked = ", ".join(f"{K} x {n}" for K, n in enumerate(stats.gamma_hist) if n)
    mean = sum(K * n for K, n in enumerate(stats.gamma_hist)) / steps
    return f"{schedule}: K = {asked} steps (mean {mean:.1f})"


def plain_step_reasons(stats: SpecStats, *, schedule: str, drafter: str, length: int, draft_n_ctx: int | None) -> str:
    """Why steps drafted nothing: none was asked for (the schedule's K = 0, the
    end of the budget, the draft's window), or the drafter proposed none."""
    asked_none, proposed_none = stats.gamma_hist[0], stats.plain_steps - stats.gamma_hist[0]
    reasons = []
    if asked_none:
        if draft_n_ctx is not None and length > draft_n_ctx:
            why = f"the sequence outgrew the draft's context window of {draft_n_ctx} tokens"
            if schedule == "auto" and length - stats.new_tokens <= draft_n_ctx:  # steps before that were auto's
                why = f"auto chose a plain step where drafting did not pay, or {why}"
        elif schedule == "auto":
            why = "auto chose a plain step where drafting did not pay, or no room was left before the end"
        else:
            why = "no room to draft before the end"
        reasons.append(why if not proposed_none else f"{asked_none}: {why}")
    if proposed_none:
        why = "no earlier occurrence matched" if drafter.startswith("prompt lookup") else "the draft was unsure"
        reasons.append(f"{proposed_none}: the drafter proposed nothing ({why})")
    return "; ".join(reasons)


def cut_by_end_of_text(stats: SpecStats) -> bool:
    """Whether a step ended on an accepted end-of-text draft: its later drafts were neither emitted nor judged,
    and no target token followed, so eq. 1 does not describe it."""
    return stats.target_tokens < stats.target_calls


def expected_tokens(stats: SpecStats) -> float:
    """Eq. 1 at the run's α for the K each step asked, averaged over the steps:
    E(α, γ) when every step asked γ; K shrinks near the end of --max-gen, is 0
    once the text outgrows the draft's window, and varies under a schedule."""
    steps = sum(stats.gamma_hist)
    return sum(n * expected_tokens_per_step(stats.alpha, K) for K, n in enumerate(stats.gamma_hist)) / max(1, steps)


def print_stats(
    stats: SpecStats, *, stop: str, length: int, draft_n_ctx: int | None, timings: dict, drafter: str,
    schedule: str | None, drafts_in_full: bool = True,
) -> None:
    """The stats block: tokens, the drafter and (a chain) the K it was asked
    for, α, tokens per target call, plain steps, forward calls, speed.
    `length`: prompt + new tokens; `draft_n_ctx`: None without a draft
    model; `schedule`: `GammaSchedule.describe()`, None for a tree;
    `drafts_in_full`: the drafter proposes every token asked for, so eq. 1
    applies (not prompt lookup or p_min, which may propose fewer)."""
    judged = stats.judged
    gamma = stats.gamma
    rows = [
        ("new tokens", f"{stats.new_tokens} in {count(stats.target_calls, 'target call')}, {stop}"),
        ("drafter", drafter),
    ]
    if stats.tree is None:
        rows.append(("γ per step", describe_gammas(stats, schedule)))
    expected = f"; {expected_tokens(stats):.2f} expected at this α, Leviathan et al. eq. 1" if drafts_in_full else ""
    cut_short = cut_by_end_of_text(stats)
    if cut_short:
        expected += "; end-of-text cut the last step short"
    if stats.drafted and stats.tree is not None:
        rows += tree_rows(stats)
    elif stats.drafted:
        rows += [
            ("acceptance α", f"{stats.alpha:.3f} ({stats.accepted} of the {judged} drafted tokens the target judged)"),
            (
                "accepted per drafted",
                f"{stats.accepted_per_drafted:.3f} ({stats.accepted} of {stats.drafted}: drafts after a rejection "
                f"{'or the end-of-text ' if cut_short else ''}are never judged)",
            ),
            (
                "tokens/target call",
                f"{stats.tokens_per_target_call:.2f} (at most {gamma + 1}{expected})",
            ),
        ]
    else:
        rows.append(("acceptance α", "n/a: nothing was drafted"))
    if stats.plain_steps and stats.tree is None:
        why = plain_step_reasons(stats, schedule=schedule, drafter=drafter, length=length, draft_n_ctx=draft_n_ctx)
        rows.append(("plain steps", f"{count(stats.plain_steps, 'target call')} drafted nothing ({why})"))
    elif stats.plain_steps:
        why = (
            f"the sequence outgrew the draft's context window of {draft_n_ctx} tokens"
            if length > draft_n_ctx
            else "no room to draft before the end"
        )
        rows.append(("plain steps", f"{count(stats.plain_steps, 'target call')} drafted nothing ({why})"))
    rows += [
        ("forward calls", f"target {stats.target_calls}, draft {stats.draft_calls} (after the prompt's prefill)"),
        (
            "speed",
            f"{timings['tokens_per_second']:.1f} tokens/s ({timings['generate_seconds']:.2f} s: "
            f"drafting {stats.draft_seconds:.2f} s, verifying {stats.verify_seconds:.2f} s)",
        ),
    ]
    print()
    print_rows(rows)


def tree_rows(stats: SpecStats) -> list[tuple[str, str]]:
    """The stats rows of a token tree: α per depth, which sibling was
    accepted there, tokens per target call."""
    rows = [
        ("tree", f"{stats.tree}: {stats.drafted / stats.target_calls:.1f} drafted tokens per step"),
        ("acceptance α", f"{stats.alpha:.3f} (depths accepted / depths the target judged: {stats.accepted} of "
                         f"{stats.judged})"),
    ]
    for depth, (reached, accepted) in enumerate(zip(stats.reached_at, stats.accepted_at), start=1):
        if not reached:
            break
        ranks = stats.accepted_rank[depth - 1] if depth <= len(stats.accepted_rank) else []
        which = ", ".join(f"#{rank + 1} {n}" for rank, n in enumerate(ranks) if n)
        which = f" (candidate {which})" if which else ""
        rows.append((f"  depth {depth}", f"accepted {accepted} of {reached}{which}"))
    rows.append(("tokens/target call", f"{stats.tokens_per_target_call:.2f} (at most {stats.gamma + 1}: the deepest "
                                       "path and the target's own token)"))
    return rows


def tree_drawer(tokenizer):
    """An `on_tree(tree, verdict)` callback that draws each verified tree on
    stderr, the accepted path ticked and the target's own token below."""
    import sys

    steps = [0]

    def draw(tree, verdict) -> None:
        steps[0] += 1
        picture = tree.draw(verdict.nodes, decode=lambda t: tokenizer.decode([t]), next_token=verdict.next_token)
        print(f"\nstep {steps[0]}:\n{picture}", file=sys.stderr, flush=True)

    return draw


def print_comparison(comparison: dict | None, spec_tokens: list[int], tokenizer, started: bool = False) -> None:
    """The target alone: its speed, the measured and predicted speedups, and
    (greedy) whether both outputs are identical. None: interrupted, after it
    `started` or before."""
    if comparison is None:
        print_rows([("target alone", "interrupted (Ctrl-C) before it finished" if started
                     else "not run: interrupted (Ctrl-C)")])
        return
    i = comparison["first_difference"]
    baseline = comparison["baseline_token_ids"]
    if not comparison["greedy"]:
        verdict = "sampled: both follow the target's distribution, so they need not match token for token"
    elif i is None:
        verdict = f"identical to the target alone, token for token ({count(len(spec_tokens), 'token')})"
    else:

        def show(tokens: list[int]) -> str:
            return repr(tokenizer.decode(tokens[i : i + 1])) if i < len(tokens) else "(end)"

        verdict = (
            f"DIFFERENT from the target alone from new token {i}: speculative {show(spec_tokens)} vs "
            f"target alone {show(baseline)} (in float16/bfloat16 a near-tie can flip an argmax)"
        )
    step = comparison["step_seconds"]
    print_rows([
        (
            "target alone",
            f"{comparison['baseline_tokens_per_second']:.1f} tokens/s "
            f"({count(len(baseline), 'token')} in {comparison['baseline_seconds']:.2f} s)",
        ),
        (
            "step costs",
            f"draft {1e3 * step['draft']:.2f} ms, target {1e3 * step['target']:.2f} ms, verification "
            f"{1e3 * step['verify']:.2f} ms (this run; the target alone took "
            f"{1e3 * comparison['baseline_seconds'] / max(1, len(baseline)):.2f} ms per token)",
        ),
        ("speedup", describe_speedup(comparison)),
        ("outputs", verdict),
    ])


def speedups_agree(measured: float, predicted: float) -> bool:
    """Whether two speedups lie within SPEEDUP_TOLERANCE of each other."""
    return max(measured, predicted) <= (1.0 + SPEEDUP_TOLERANCE) * min(measured, predicted)


def describe_speedup(comparison: dict) -> str:
    """The measured speedup next to the one α and the step costs predict, and
    a plain warning when they disagree."""
    measured, predicted = comparison["speedup"], comparison["predicted_speedup"]
    basis = ("α and the step costs (Leviathan et al. Thm 3.8)" if comparison["predicted_from"] == "alpha"
             else "the tokens per target call and the step costs")
    text = f"{measured:.2f}x measured, {predicted:.2f}x predicted by {basis}"
    outside, seconds = comparison["outside_steps_seconds"], comparison["spec_seconds"]
    if comparison["speedup_matches_prediction"]:
        return text
    # Time outside the steps can only pull the measured speedup down: it is the cause only where leaving it out
    # would bring the measured speedup up to the predicted one.
    steps_only = measured * seconds / (seconds - outside) if outside < seconds else math.inf
    if outside > OUTSIDE_STEPS_SHARE * seconds and measured < predicted <= (1.0 + SPEEDUP_TOLERANCE) * steps_only:
        return text + (
            f": they disagree by more than {SPEEDUP_TOLERANCE:.0%}: {outside:.2f} s of the run's {seconds:.2f} s "
            "went outside its steps, mostly the prompt's prefill in both models, which the measured speedup counts "
            "and the predicted one leaves out; give a longer --max-gen to see the steps' speedup"
        )
    return text + (
        f": they disagree by more than {SPEEDUP_TOLERANCE:.0%}, so the measured one is not reliable: the "
        "machine's load changed between the two runs (or per-call overheads outweigh tiny models); "
        "run again on a quiet machine"
    )


def print_row_block(index: int, total: int, line: int, prompt: str, text: str, stats: SpecStats, stop: str) -> None:
    """One prompt of --prompts-file: a title, the prompt and its generated
    `text` (coloured as streamed), and the row's own counts."""
    print(f"=== prompt {index + 1} of {total} (line {line}) ===")
    print(prompt + text)
    alpha = f"α {stats.alpha:.3f}" if stats.drafted else "α n/a: nothing was drafted"
    print(
        f"[{count(stats.new_tokens, 'new token')} in {count(stats.target_calls, 'target call')}, {stop}; {alpha}; "
        f"{stats.tokens_per_target_call:.2f} tokens/target call]"
    )
    print()


def print_batch_summary(batches: list[BatchStats], batch_size: int, seconds: float, *, interrupted: bool) -> None:
    """The stats of all batches of a --prompts-file run: tokens, batched
    target calls, α over every row, rows still active per step, speed."""
    rows = [row for batch in batches for row in batch.rows]
    new_tokens = sum(row.new_tokens for row in rows)
    target_calls = sum(batch.target_calls for batch in batches)
    accepted, judged = sum(row.accepted for row in rows), sum(row.judged for row in rows)
    active = [n for batch in batches for n in batch.active_rows]
    print_rows([
        ("prompts", f"{len(rows)} in {len(batches)} {'batch' if len(batches) == 1 else 'batches'} of up to {batch_size}"
                    + (", interrupted (Ctrl-C)" if interrupted else "")),
        ("new tokens", f"{new_tokens} in {count(target_calls, 'batched target call')} "
                       f"({new_tokens / target_calls if target_calls else 0.0:.2f} tokens per target call)"),
        ("acceptance α", f"{accepted / judged:.3f} over every row ({accepted} of {judged} judged drafts)"
                         if judged else "n/a: nothing was drafted"),
        ("rows per step", f"{sum(active) / len(active) if active else 0.0:.2f} still active on average "
                          "(a finished row leaves its batch)"),
        ("speed", f"{new_tokens / seconds if seconds > 0 else 0.0:.1f} tokens/s ({seconds:.2f} s)"),
    ])
