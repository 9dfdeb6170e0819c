"""What a speculative decoding run did, and what theory predicts from it.

Legend: K = gamma (tokens drafted per step), α = acceptance rate,
c = t_d / t_t (the cost of a draft step relative to a target step).

Leviathan et al. 2023, section 3: if each drafted token is accepted with
probability α once verification reaches it (independently), one step emits
on average E(α, γ) tokens (eq. 1), and speculative decoding is faster than
plain decoding by the improvement factor of Theorem 3.8. `SpecStats.alpha` is
that α, estimated from a run; `predicted_speedup` generalises the factor to a
verification pass that costs t_v(γ + 1) instead of one target step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """E = (1 - α^(γ+1)) / (1 - α): the mean number of tokens one target call
    emits (Leviathan et al. 2023, eq. 1); γ + 1 at α = 1."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def improvement_factor(alpha: float, gamma: int, c: float) -> float:
    """(1 - α^(γ+1)) / ((1 - α)(γ c + 1)): the expected speedup in wall time
    (Leviathan et al. 2023, Theorem 3.8), with c = t_d / t_t and a
    verification pass that costs one target step."""
    return expected_tokens_per_step(alpha, gamma) / (gamma * c + 1.0)


def predicted_speedup(alpha: float, gamma: int, t_draft: float, t_target: float, t_verify: float) -> float:
    """E t_t / (γ t_d + t_v(γ+1)): Theorem 3.8 with the verification pass at
    its measured cost t_v(γ+1) (on a CPU it exceeds t_t). With t_verify =
    t_target it is `improvement_factor(alpha, gamma, t_draft / t_target)`.

    Args:
        alpha: acceptance rate in [0, 1].
        gamma: tokens drafted per step, >= 1.
        t_draft, t_target, t_verify: seconds of one draft step, one target step
            and one target pass over gamma + 1 tokens.
    """
    return expected_tokens_per_step(alpha, gamma) * t_target / (gamma * t_draft + t_verify)


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
            tokens), one per step unless the step ended at end-of-text.
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

    def __post_init__(self) -> None:
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

    @property
    def alpha(self) -> float:
        """α = accepted / judged (0 if nothing was judged): Leviathan et al.'s
        acceptance rate, the probability that a drafted token is accepted once
        verification reaches it. Drafts after a rejection are never judged."""
        judged = sum(self.reached_at)
        return self.accepted / judged if judged else 0.0

    @property
    def accepted_per_drafted(self) -> float:
        """accepted / drafted: the share of the draft's work that was kept
        (below α whenever γ > 1 and rejections happen)."""
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
