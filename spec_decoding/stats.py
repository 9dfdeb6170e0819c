"""What a speculative decoding run did, counted step by step.

Legend: K = gamma, alpha = acceptance rate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """E = (1 - alpha^(gamma+1)) / (1 - alpha): the mean number of tokens one
    target call emits when each drafted token is accepted independently with
    probability alpha (Leviathan et al. 2023, eq. (1)); gamma + 1 at alpha = 1."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclass
class SpecStats:
    """Counters of one `speculative_generate` run.

    Attributes:
        gamma: the requested draft length K (steps near the end may draft fewer).
        new_tokens: tokens emitted after the prompt.
        target_calls: target forward passes after prefill, one per step.
        draft_calls: draft forward passes after prefill.
        drafted: drafted tokens, summed over steps.
        accepted: drafted tokens the target accepted.
        accepted_hist: accepted_hist[n] = steps that accepted exactly n drafted
            tokens, n = 0..gamma.
        reached_at, accepted_at: for draft position i = 1..gamma (index i - 1),
            steps whose verification reached position i (every earlier draft
            accepted) and steps that accepted it.
        draft_seconds, verify_seconds: wall time drafting, and verifying
            (target forward + acceptance rule).
        stopped_at_eos: the run ended on the end-of-text token.
    """

    gamma: int
    new_tokens: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_hist: list[int] = field(default_factory=list)
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

    def record_step(self, drafted: int, accepted: int, emitted: int) -> None:
        """Counts one step that drafted `drafted` tokens, accepted the first
        `accepted` of them, and emitted `emitted` tokens."""
        assert 0 <= accepted <= drafted <= self.gamma, (drafted, accepted, self.gamma)
        self.target_calls += 1
        self.drafted += drafted
        self.accepted += accepted
        self.new_tokens += emitted
        self.accepted_hist[accepted] += 1
        # Verification reaches positions 1..accepted+1 (the last one only if it was drafted).
        for i in range(min(accepted + 1, drafted)):
            self.reached_at[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """alpha = accepted / drafted (0 if nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def judged_acceptance_rate(self) -> float:
        """accepted / judged: the estimate of Leviathan et al.'s alpha, the
        probability that a drafted token is accepted once verification reaches
        it. Drafted tokens after a rejection are never judged, so this is what
        E = (1 - alpha^(gamma+1)) / (1 - alpha) needs; `acceptance_rate`
        (accepted / drafted) is lower whenever gamma > 1 and rejections happen."""
        judged = sum(self.reached_at)
        return self.accepted / judged if judged else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        """Mean tokens emitted per target forward pass (1 for plain decoding)."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def position_acceptance(self) -> list[float]:
        """For each draft position i = 1..gamma, P(accepted | reached); NaN if never reached."""
        return [a / r if r else float("nan") for a, r in zip(self.accepted_at, self.reached_at)]

    def to_dict(self) -> dict:
        """Every counter plus the derived rates, JSON-ready."""
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["judged_acceptance_rate"] = self.judged_acceptance_rate
        d["tokens_per_target_call"] = self.tokens_per_target_call
        d["position_acceptance"] = [None if r != r else r for r in self.position_acceptance]  # NaN -> null
        return d
