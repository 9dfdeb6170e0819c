"""What a speculative decoding run did (one sequence: SpecStats; a batch:
BatchStats), the clock that times it, and what theory predicts from it.

Legend: K = gamma (tokens drafted per step), α = acceptance rate,
c = t_d / t_t (the cost of a draft step relative to a target step).

Leviathan et al. 2023, section 3: if each drafted token is accepted with
probability α once verification reaches it (independently), one step emits
on average E(α, γ) tokens (eq. 1), and speculative decoding is faster than
plain decoding by the improvement factor of Theorem 3.8. `SpecStats.alpha` is
that α, estimated from a run; `predicted_speedup` generalises the factor to a
verification pass that costs t_v(γ + 1) instead of one target step.
`clock` is the wall clock the decoding loops time their phases with.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch

from gpt2.generate import check_integer


def check_number(value, name: str, low: float, high: float = math.inf, *, low_open: bool = False) -> float:
    """`value` as a float, or a ValueError naming `name` unless it is a finite number in [low, high] ((low, high]
    if `low_open`); NaN and infinities never are."""
    number = None
    if not isinstance(value, (str, bytes, bool)):
        try:
            number = float(value)  # int, float, numpy and 0-d tensor numbers
        except (TypeError, ValueError, RuntimeError, OverflowError):  # OverflowError: an int past float's range
            pass
    finite = number is not None and math.isfinite(number)
    if not (finite and (number > low if low_open else number >= low) and number <= high):
        bound = "(" if low_open else "["
        where = f"in {bound}{low:g}, {high:g}]" if high < math.inf else f"{'>' if low_open else '>='} {low:g}"
        raise ValueError(f"{name} must be a number {where}, got {value!r}")
    return number


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """E = (1 - α^(γ+1)) / (1 - α): the mean number of tokens one target call
    emits (Leviathan et al. 2023, eq. 1); γ + 1 at α = 1. A ValueError unless
    α lies in [0, 1] and γ is an integer in 0 .. 2**53 - 1 (what a float
    counts exactly; no context window comes near it)."""
    alpha = check_number(alpha, "alpha (an acceptance rate)", 0.0, 1.0)
    gamma = check_integer(gamma, "gamma (tokens drafted per step)", 0)
    if gamma >= 2**53:
        raise ValueError(f"gamma (tokens drafted per step) must be below 2**53, got {gamma}")
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def improvement_factor(alpha: float, gamma: int, c: float) -> float:
    """(1 - α^(γ+1)) / ((1 - α)(γ c + 1)): the expected speedup in wall time
    (Leviathan et al. 2023, Theorem 3.8), with c = t_d / t_t and a
    verification pass that costs one target step."""
    return expected_tokens_per_step(alpha, gamma) / (gamma * check_number(c, "c = t_d / t_t", 0.0) + 1.0)


def predicted_speedup(alpha: float, gamma: int, t_draft: float, t_target: float, t_verify: float) -> float:
    """E t_t / (γ t_d + t_v(γ+1)): Theorem 3.8 with the verification pass at
    its measured cost t_v(γ+1) (on a CPU it exceeds t_t). With t_verify =
    t_target it is `improvement_factor(alpha, gamma, t_draft / t_target)`.

    Args:
        alpha: acceptance rate in [0, 1].
        gamma: tokens drafted per step, >= 0 (0: a plain step).
        t_draft, t_target, t_verify: seconds of one draft step, one target step
            and one target pass over gamma + 1 tokens.

    Raises:
        ValueError: α outside [0, 1], γ not an integer >= 0, t_draft < 0, or
            a target time that is not > 0 (NaN and infinities too).
    """
    E = expected_tokens_per_step(alpha, gamma)
    t_draft = check_number(t_draft, "t_draft", 0.0, math.inf)
    t_target, t_verify = (check_number(t, name, 0.0, math.inf, low_open=True)
                          for t, name in ((t_target, "t_target"), (t_verify, "t_verify")))
    return E * t_target / (gamma * t_draft + t_verify)


@dataclass
class SpecStats:
    """Counters of one `speculative_generate` run. Only what was emitted is
    counted: in a step cut at end-of-text, the accepted drafts after it are
    not, so that accepted + target_tokens = new_tokens.

    Attributes:
        gamma: the requested draft length K, or under a schedule
            (schedule.py) the largest K it may ask for.
        new_tokens: tokens emitted after the prompt.
        target_calls: target forward passes after prefill, one per step.
        plain_steps: steps that drafted nothing (no room left in the draft's
            context window or the token budget, a schedule that chose K = 0,
            or a drafter that proposed nothing): plain target steps.
        draft_calls: draft forward passes after prefill.
        drafted: drafted tokens, summed over steps.
        accepted: drafted tokens accepted and emitted.
        target_tokens: tokens the target chose itself (corrections and bonus
            tokens), one per step unless the step ended at an accepted
            end-of-text draft.
        accepted_hist: accepted_hist[n] = steps that accepted exactly n drafted
            tokens, n = 0..gamma.
        gamma_hist: gamma_hist[K] = steps that asked the drafter for K tokens,
            K = 0..gamma (the schedule's choice, lowered near the end of the
            budget or of the draft's window; a drafter may propose fewer).
        reached_at, accepted_at: for draft position i = 1..gamma (index i - 1),
            steps whose verification judged position i (every earlier draft
            accepted) and steps that accepted it.
        draft_seconds, verify_seconds: wall time drafting, and verifying
            (target forward + acceptance rule).
        stopped_at_eos: the run ended on the end-of-text token.
        tree: for a token tree (tree_loop.py), its shape; gamma is then its
            depth, a "draft position" a depth, `drafted` counts tree nodes,
            and reached_at[i] counts the steps that judged the candidates at
            depth i + 1, gamma_hist[K] the steps that asked for a tree of depth
            K. None for a chain.
        accepted_rank: trees only: accepted_rank[i][r] = steps that accepted,
            at depth i + 1, the sibling of rank r (0 = the first drafted).
    """

    gamma: int
    new_tokens: int = 0
    target_calls: int = 0
    plain_steps: int = 0
    draft_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    target_tokens: int = 0
    accepted_hist: list[int] = field(default_factory=list)
    gamma_hist: list[int] = field(default_factory=list)
    reached_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    stopped_at_eos: bool = False
    tree: str | None = None
    accepted_rank: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.gamma = check_integer(self.gamma, "SpecStats' gamma (the most tokens a step drafts)", 0)
        if not self.accepted_hist:
            self.accepted_hist = [0] * (self.gamma + 1)
            self.reached_at = [0] * self.gamma
            self.accepted_at = [0] * self.gamma
        if not self.gamma_hist:
            self.gamma_hist = [0] * (self.gamma + 1)

    def record_step(self, drafted: int, accepted: int, target_token: bool) -> None:
        """Counts one step that drafted `drafted` tokens and emitted the first
        `accepted` of them, then the target's own token if `target_token`
        (not when the step ended at an accepted end-of-text)."""
        assert 0 <= accepted <= drafted <= self.gamma, (drafted, accepted, self.gamma)
        self.target_calls += 1
        self.plain_steps += int(drafted == 0)
        self.drafted += drafted
        self.accepted += accepted
        self.target_tokens += int(target_token)
        self.new_tokens += accepted + int(target_token)
        self.accepted_hist[accepted] += 1
        # Verification judged positions 1..accepted+1 (the last one only if it
        # was drafted and the step did not end on an accepted end-of-text).
        judged = accepted + 1 if target_token else accepted
        for i in range(min(judged, drafted)):
            self.reached_at[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1

    def record_tree_step(self, nodes: int, ranks: tuple[int, ...], judged: int, target_token: bool) -> None:
        """Counts one step of a token tree that drafted `nodes` tokens and
        emitted an accepted path whose nodes had the sibling ranks `ranks`
        (depth 1 down), then the target's own token if `target_token`.
        `judged`: how many depths verification judged (the accepted ones, and
        the one where it rejected every candidate)."""
        accepted = len(ranks)
        assert 0 <= accepted <= judged <= self.gamma and judged <= accepted + 1, (accepted, judged, self.gamma)
        self.target_calls += 1
        self.plain_steps += int(nodes == 0)
        self.drafted += nodes
        self.accepted += accepted
        self.target_tokens += int(target_token)
        self.new_tokens += accepted + int(target_token)
        self.accepted_hist[accepted] += 1
        for i in range(judged):
            self.reached_at[i] += 1
        for i, rank in enumerate(ranks):
            self.accepted_at[i] += 1
            self.accepted_rank.extend([] for _ in range(i + 1 - len(self.accepted_rank)))
            counts = self.accepted_rank[i]
            counts.extend(0 for _ in range(rank + 1 - len(counts)))
            counts[rank] += 1

    @property
    def judged(self) -> int:
        """Drafts that verification reached: the accepted ones and each step's first rejected one."""
        return sum(self.reached_at)

    @property
    def alpha(self) -> float:
        """α = accepted / judged (0 if nothing was judged): Leviathan et al.'s
        acceptance rate, the probability that a drafted token is accepted once
        verification reaches it. Drafts after a rejection are never judged."""
        return self.accepted / self.judged if self.judged else 0.0

    @property
    def accepted_per_drafted(self) -> float:
        """accepted / drafted: the share of the draft's work that was kept
        (at most α: below it when drafts after a rejection go unjudged)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        """Mean tokens emitted per target forward pass (1 for plain decoding)."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def position_acceptance(self) -> list[float]:
        """For each draft position i = 1..gamma, P(accepted | judged); NaN if never judged."""
        return [a / r if r else float("nan") for a, r in zip(self.accepted_at, self.reached_at)]

    def to_dict(self) -> dict:
        """Every counter plus the derived rates, JSON-ready."""
        d = asdict(self)
        d["alpha"] = self.alpha
        d["accepted_per_drafted"] = self.accepted_per_drafted
        d["tokens_per_target_call"] = self.tokens_per_target_call
        d["position_acceptance"] = [None if r != r else r for r in self.position_acceptance]  # NaN -> null
        return d


def clock(device: torch.device) -> float:
    """Wall time in seconds, read after `device` has finished its queued work
    (GPUs run ahead of Python: an unsynchronised clock times the launch only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
    return time.perf_counter()


@dataclass
class BatchStats:
    """Counters of one batched speculative decoding run (spec_decoding/batch.py):
    a SpecStats per row, and what the batch as a whole did.

    Attributes:
        gamma: the requested draft length K.
        rows: row b's own counters, in input order. Its target_calls are the
            verification passes it took part in; its draft_seconds and
            verify_seconds the wall time of those steps (shared with the
            other rows of the batch).
        target_calls: batched target forward passes after prefill, one per step.
        draft_calls: batched draft forward passes after prefill.
        active_rows: active_rows[s] = rows still in the batch at step s.
        verified_tokens: tokens the target was fed, summed over steps: each
            step feeds every active row K + 1 tokens (K the step's longest
            draft), re-fed committed tokens included.
        draft_seconds, verify_seconds: wall time drafting, and verifying.
    """

    gamma: int
    num_rows: int
    rows: list[SpecStats] = field(default_factory=list)
    target_calls: int = 0
    draft_calls: int = 0
    active_rows: list[int] = field(default_factory=list)
    verified_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.num_rows = check_integer(self.num_rows, "BatchStats' num_rows (the prompts in the batch)", 1)
        if not self.rows:
            self.rows = [SpecStats(self.gamma) for _ in range(self.num_rows)]

    def record_batch_step(
        self, active: int, longest_draft: int, draft_calls: int, draft_seconds: float, verify_seconds: float
    ) -> None:
        """Counts one step of the batch (the rows count their own part)."""
        self.target_calls += 1
        self.draft_calls += draft_calls
        self.active_rows.append(active)
        self.verified_tokens += active * (longest_draft + 1)
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds

    @property
    def new_tokens(self) -> int:
        return sum(row.new_tokens for row in self.rows)

    @property
    def accepted(self) -> int:
        return sum(row.accepted for row in self.rows)

    @property
    def drafted(self) -> int:
        return sum(row.drafted for row in self.rows)

    @property
    def judged(self) -> int:
        """Drafts that verification reached, summed over the rows."""
        return sum(row.judged for row in self.rows)

    @property
    def alpha(self) -> float:
        """α over the batch: accepted / judged, summed over the rows."""
        return self.accepted / self.judged if self.judged else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        """New tokens of all rows per batched target forward pass."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def mean_active_rows(self) -> float:
        return sum(self.active_rows) / len(self.active_rows) if self.active_rows else 0.0

    def to_dict(self) -> dict:
        """The batch's counters and rates, and every row's `SpecStats.to_dict()`, JSON-ready."""
        d = {name: getattr(self, name) for name in (
            "gamma", "num_rows", "target_calls", "draft_calls", "active_rows", "verified_tokens",
            "draft_seconds", "verify_seconds", "new_tokens", "accepted", "drafted", "alpha",
            "tokens_per_target_call", "mean_active_rows",
        )}  # fmt: skip
        d["rows"] = [row.to_dict() for row in self.rows]
        return d
