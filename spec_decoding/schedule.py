"""γ schedules: how many tokens to draft in the next step.

Legend: K = tokens drafted in a step (γ), α = acceptance rate, α̂ = its estimate.

- `FixedGamma`: K = γ every step (Leviathan et al. 2023).
- `AutoGamma`: the K that maximises the expected tokens per second,
  E(α, K) / (K t_d + t_v(K + 1)), with E from Leviathan et al. 2023, eq. 1,
  the costs measured on this machine (costs.py), and the expectation over a
  Beta distribution of α around the running estimate α̂; K = 0 (a plain
  target step) when drafting cannot pay.
- `HeuristicGamma`: Hugging Face's `num_assistant_tokens_schedule="heuristic"`,
  K + 2 after a step that accepted every draft, K - 1 otherwise.

K comes from earlier steps only, before the step's draws, so every schedule gives
the target's greedy output and sampled distribution (not the same seeded sample).
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable

from gpt2.generate import check_integer
from gpt2.model import GPT2

from .costs import StepCosts, calibrate
from .drafters import Drafter
from .stats import check_number, expected_tokens_per_step

DEFAULT_MAX_GAMMA = 12  # the largest K of the adaptive schedules


def check_draft_length(value, name: str, n_ctx: int) -> int:
    """`value` as an int from 1 to n_ctx - 1, where n_ctx is the target's
    context window: a step drafts at most that many tokens (one pass of the
    target verifies them and the pending token, so no more could ever fit).

    Raises:
        ValueError: not an integer >= 1, or n_ctx or more.
    """
    length = check_integer(value, name, 1)
    if length >= n_ctx:
        raise ValueError(
            f"{name} is {length}, more tokens than the target's context window of {n_ctx} could ever verify: "
            f"give at most {n_ctx - 1}"
        )
    return length


class GammaSchedule(ABC):
    """Chooses K before each step, and learns from the step's outcome.

    A schedule keeps its state across `speculative_generate` calls when the
    same object is passed again (its α̂ carries over); `gamma="auto"` makes a
    fresh one per call.

    Attributes:
        max_gamma: the largest K it ever chooses (sizes the run's SpecStats).
    """

    max_gamma: int

    @abstractmethod
    def choose(self) -> int:
        """K for the next step, 0 <= K <= max_gamma (the loop may still
        lower it near the end of the budget or of the draft's window)."""

    def update(self, drafted: int, accepted: int) -> None:
        """The outcome of a step: `drafted` tokens proposed, the first
        `accepted` of them accepted by the target."""

    @abstractmethod
    def describe(self) -> str:
        """A short name for reports, e.g. 'auto' or 'fixed 4'."""


class FixedGamma(GammaSchedule):
    """K = gamma every step."""

    def __init__(self, gamma: int) -> None:
        self.max_gamma = check_integer(gamma, "gamma", 1)

    def choose(self) -> int:
        return self.max_gamma

    def describe(self) -> str:
        return f"fixed {self.max_gamma}"


def expected_rate(alpha: float, K: int, costs: StepCosts) -> float:
    """E(α, K) / (K t_d + t_v(K + 1)): expected tokens per second of steps
    that draft K tokens (K = 0: one token per plain step)."""
    return expected_tokens_per_step(alpha, K) / costs.step_seconds(K)


def fastest(rate: Callable[[int], float], max_gamma: int) -> int:
    """argmax over K = 0 .. max_gamma of rate(K) (the smallest K on a tie)."""
    return max(range(max_gamma + 1), key=lambda K: (rate(K), -K))


def best_gamma(alpha: float, costs: StepCosts, max_gamma: int) -> int:
    """The K of the highest `expected_rate` at a known α, K = 0 .. max_gamma. A ValueError unless α lies in
    [0, 1], `costs` is StepCosts and max_gamma an integer below costs.max_tokens (a cost for every pass)."""
    if not isinstance(costs, StepCosts):
        raise ValueError(f"costs must be StepCosts (spec_decoding.costs), got {type(costs).__name__}")
    max_gamma = check_integer(max_gamma, "max_gamma", 0)
    if max_gamma >= costs.max_tokens:
        raise ValueError(f"max_gamma {max_gamma} needs the cost of a pass over {max_gamma + 1} tokens; the costs "
                         f"go up to passes of {costs.max_tokens}: give max_gamma <= {costs.max_tokens - 1}")
    alpha = check_number(alpha, "alpha (an acceptance rate)", 0.0, 1.0)
    return fastest(lambda K: expected_rate(alpha, K, costs), max_gamma)


def posterior_tokens(a: float, b: float, K: int) -> float:
    """E[1 + α + α^2 + ... + α^K] for α ~ Beta(a, b): the expected tokens of a
    step that drafts K, when α is known only that far. E[α^j] is the product
    of (a + i) / (a + b + i) over i < j (the Beta distribution's moments)."""
    total, moment = 1.0, 1.0
    for j in range(K):
        moment *= (a + j) / (a + b + j)  # E[α^(j + 1)]
        total += moment
    return total


class AutoGamma(GammaSchedule):
    """Drafts the K that maximises the expected tokens per second, with α
    not known but learnt from the steps so far.

    What is known of α is a Beta(a, b) distribution: a = accepted +
    prior_alpha * prior_weight, b = rejected + (1 - prior_alpha) *
    prior_weight, where accepted and rejected drafts (a step judges its
    accepted drafts and the first rejected one) are summed over the last
    `window` steps. K maximises the expected tokens of the step under that
    distribution over its cost, E_Beta[1 + α + ... + α^K] / (K t_d + t_v(K + 1))
    (`posterior_tokens`). While α is uncertain, this is a little above
    E(α̂, K) at the mean α̂, and more so for long drafts, since α^j is convex: a
    long draft might be accepted in full. As steps accumulate it becomes
    `best_gamma(α̂)`.

    The prior is worth `prior_weight` judged drafts, so it decides the first
    step and fades as soon as drafts are judged. Plain steps judge nothing but
    still enter the window: after `window` of them α̂ is back at the prior, and
    if that makes drafting pay, drafting is tried again (a step that stopped
    drafting because α̂ fell is not final). If the prior alone says drafting
    does not pay (a slow draft), no draft is ever judged and α is never
    learnt: give a higher prior_alpha where the draft is known to agree.

    Args:
        costs: t_d and t_v(k) for k up to max_gamma + 1 (`costs.calibrate`).
        max_gamma: the largest K considered.
        prior_alpha, prior_weight, window: as above.
    """

    def __init__(
        self,
        costs: StepCosts,
        *,
        max_gamma: int = DEFAULT_MAX_GAMMA,
        prior_alpha: float = 0.6,
        prior_weight: float = 4.0,
        window: int = 32,
    ) -> None:
        self.max_gamma = check_integer(max_gamma, "max_gamma", 1)
        if not isinstance(costs, StepCosts):
            raise ValueError(f"costs must be StepCosts (spec_decoding.costs.calibrate(target, draft, max_gamma + 1)), "
                             f"got {type(costs).__name__}")
        if costs.max_tokens < self.max_gamma + 1:
            raise ValueError(
                f"the step costs cover target passes of up to {costs.max_tokens} tokens; max_gamma {max_gamma} "
                f"needs {self.max_gamma + 1}: calibrate with max_tokens={self.max_gamma + 1}"
            )
        real = all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in (prior_alpha, prior_weight))
        if not (real and 0.0 <= prior_alpha <= 1.0 and 0 < prior_weight < math.inf):  # NaN fails both
            raise ValueError(f"the prior needs 0 <= prior_alpha <= 1 and a finite prior_weight > 0, got "
                             f"{prior_alpha!r}, {prior_weight!r}")
        self.costs = costs
        self.prior_alpha = prior_alpha
        self.prior_weight = prior_weight
        self.outcomes: deque[tuple[int, int]] = deque(maxlen=check_integer(window, "window", 1))  # (accepted, judged)

    @property
    def beta(self) -> tuple[float, float]:
        """(a, b) of the Beta distribution of α: the window's accepted and
        rejected drafts, plus the prior's."""
        accepted = sum(a for a, _ in self.outcomes)
        rejected = sum(j for _, j in self.outcomes) - accepted
        prior = self.prior_alpha * self.prior_weight
        return accepted + prior, rejected + self.prior_weight - prior

    @property
    def alpha_estimate(self) -> float:
        """α̂, the mean of that distribution: the window with the prior."""
        a, b = self.beta
        return a / (a + b)

    def choose(self) -> int:
        a, b = self.beta
        return fastest(lambda K: posterior_tokens(a, b, K) / self.costs.step_seconds(K), self.max_gamma)

    def update(self, drafted: int, accepted: int) -> None:
        judged = min(accepted + 1, drafted)  # the accepted drafts and the first rejected one
        self.outcomes.append((accepted, judged))

    def describe(self) -> str:
        return "auto"


class HeuristicGamma(GammaSchedule):
    """Hugging Face's +2/-1 rule (transformers' AssistedCandidateGenerator
    with num_assistant_tokens_schedule="heuristic"): K grows by 2 after a
    step whose drafts were all accepted and shrinks by 1 (not below 1)
    otherwise; here it is also capped at max_gamma. It starts at 5, the
    default of transformers' num_assistant_tokens while this schedule was
    its default. A step that drafted nothing changes nothing."""

    def __init__(self, *, initial: int = 5, max_gamma: int = DEFAULT_MAX_GAMMA) -> None:
        self.max_gamma = check_integer(max_gamma, "max_gamma", 1)
        self.K = min(check_integer(initial, "initial", 1), self.max_gamma)

    def choose(self) -> int:
        return self.K

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.K = min(self.K + 2, self.max_gamma) if accepted == drafted else max(self.K - 1, 1)

    def describe(self) -> str:
        return "heuristic (+2/-1)"


SCHEDULE_NAMES = ("auto", "heuristic")  # what `gamma` may name; the CLI's --gamma takes the same (cli/arguments.py)


def make_schedule(gamma: int | str | GammaSchedule, target: GPT2, drafter: Drafter) -> GammaSchedule:
    """The schedule `speculative_generate(gamma=...)` asks for: a positive
    integer (fixed), "auto" (`AutoGamma`, with the costs of this pair on this
    machine, calibrated once and cached), "heuristic" (`HeuristicGamma`), or a
    schedule object, used as it is. The adaptive schedules draft at most
    DEFAULT_MAX_GAMMA tokens, fewer where the target's window is shorter.

    Raises:
        ValueError: anything else, or a largest K the target's window cannot
            verify (`check_draft_length`).
    """
    most = min(DEFAULT_MAX_GAMMA, target.config.n_ctx - 1)  # K + 1 tokens fit the window
    name = "gamma"
    if isinstance(gamma, GammaSchedule):
        schedule, name = gamma, f"the max_gamma of {type(gamma).__name__}"
    elif isinstance(gamma, str) and gamma == "auto":
        schedule = AutoGamma(calibrate(target, drafter.model, most + 1), max_gamma=most)
    elif isinstance(gamma, str) and gamma == "heuristic":
        schedule = HeuristicGamma(max_gamma=most)
    else:
        try:
            schedule = FixedGamma(gamma)
        except ValueError:
            raise ValueError(f"gamma must be an integer >= 1, 'auto' or 'heuristic', got {gamma!r}") from None
    check_draft_length(getattr(schedule, "max_gamma", None), name, target.config.n_ctx)
    return schedule


def next_gamma(schedule: GammaSchedule) -> int:
    """`schedule.choose()`, checked: one written elsewhere could return anything.

    Raises:
        ValueError: not an integer in 0..max_gamma.
    """
    K = schedule.choose()
    if isinstance(K, bool) or not isinstance(K, numbers.Integral) or not 0 <= K <= schedule.max_gamma:
        raise ValueError(f"{type(schedule).__name__}.choose() must return an integer in 0..{schedule.max_gamma} "
                         f"(its max_gamma), got {K!r}")
    return int(K)
