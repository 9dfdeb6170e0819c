"""Smarter and cheaper drafting keeps sampling exact: the output has the target's distribution.

The method of test_lossless.py: on a GPT-2 with an 8-token vocabulary, the
exact distribution of the first 3 generated tokens is compared by Pearson's
chi-square test (0.999 quantile) with that of `speculative_generate` over
10^4 seeded runs (the int8 draft: 5,000), for: `gamma=AutoGamma(...)` with a
short window, one schedule for all runs, so that its choice moves between 0
and 4 within and across runs (at most 2 drafts fit the 3 tokens compared),
with a drafter whose `p_min` sometimes stops before K; `NgramDrafter`,
whose proposals are point masses, on a prompt where the first step copies two
tokens and later steps often find no match (plain target steps); an int8
draft against the float32 target. Each check is shown to fail for a wrong
variant: a p_min test made after sampling (which biases the proposals), and a
correction drawn from p_target instead of the residual (for the point masses
and for the int8 draft).
"""

from __future__ import annotations

import pytest
import torch

import spec_decoding.acceptance
from gpt2 import GPT2, GPT2Config
from gpt2.fast.quantize import quantize_model_int8
from gpt2.sampling import SamplingConfig, logits_to_probs
from spec_decoding import AutoGamma, Draft, ModelDrafter, NgramDrafter, SpecStats, StepCosts, speculative_generate
from helpers import chi_square, chi_square_quantile_0999, exact_continuation_distribution, perturbed_copy, tiny_gpt2


pytestmark = pytest.mark.usefixtures("single_thread")

CONFIG = GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=16, vocab_size=8)
TARGET_STD = 0.2  # as test_lossless.py: spread distributions, ~100-240 cells
DRAFT_PERTURBATION = 0.25  # alpha ~ 0.4-0.5
N_TOKENS = 3
SAMPLING = SamplingConfig(temperature=1.0)
RUNS = 10_000
INT8_RUNS = 5_000  # the int8 draft runs the same rule as any model draft: a lighter check, to keep the file short
WRONG_RUNS = 2_000

# Costs under which auto's K moves with α̂ around this pair's α (K = 0 below
# α̂ ~ 0.27, 1 up to ~0.55, more above), with a short window and a light prior so
# that α̂ moves a lot: over the runs the schedule asks for every K from 0 to 4.
COSTS = StepCosts(t_draft=0.25, t_verify=tuple(1.0 + 0.02 * k for k in range(13)))
P_MIN = 0.45  # the draft's top probability is below this at ~1 position in 5


class RecordingAutoGamma(AutoGamma):
    """AutoGamma that counts its choices."""

    def __init__(self) -> None:
        super().__init__(COSTS, max_gamma=4, window=2, prior_weight=1.0)
        self.choices = [0] * 5

    def choose(self) -> int:
        K = super().choose()
        self.choices[K] += 1
        return K


@pytest.fixture(scope="module")
def target() -> GPT2:
    return tiny_gpt2(CONFIG, seed=0, std=TARGET_STD)


@pytest.fixture(scope="module")
def draft(target) -> GPT2:
    return perturbed_copy(target, scale=DRAFT_PERTURBATION, seed=2)


def exact_distribution(target: GPT2, prompt: list[int]) -> torch.Tensor:
    """(V^n,) float64: P(first n new tokens = x) after `prompt`, from the target alone."""
    return exact_continuation_distribution(target, torch.tensor([prompt]), N_TOKENS, SAMPLING)


def sampled_counts(target, make_drafter, prompt: list[int], runs: int, gamma, seed: int = 0):
    """Counts of the first n new tokens over `runs` runs (indexed like
    `exact_distribution`), and the runs' SpecStats summed where it matters:
    steps by K asked, drafts proposed, and steps that asked for drafts and got none."""
    V = CONFIG.vocab_size
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V**N_TOKENS, dtype=torch.float64)
    total = SpecStats(gamma.max_gamma if not isinstance(gamma, int) else gamma)
    no_proposal = 0
    drafter = make_drafter()
    for _ in range(runs):
        out, stats = speculative_generate(
            target, drafter, torch.tensor([prompt]), gamma=gamma, max_new_tokens=N_TOKENS,
            temperature=SAMPLING.temperature, generator=generator,
        )
        index = 0
        for token in out[0, len(prompt) :].tolist():
            index = index * V + token
        counts[index] += 1
        total.gamma_hist = [a + b for a, b in zip(total.gamma_hist, stats.gamma_hist)]
        total.accepted_hist = [a + b for a, b in zip(total.accepted_hist, stats.accepted_hist)]
        total.drafted += stats.drafted
        total.accepted += stats.accepted
        no_proposal += stats.plain_steps - stats.gamma_hist[0]
    return counts, total, no_proposal


def check(counts, probs) -> tuple[float, float, int]:
    """Pearson's statistic, the 0.999 quantile it is held to, and the degrees of freedom."""
    statistic, df = chi_square(counts, probs)
    return statistic, chi_square_quantile_0999(df), df


# ---------------------------------------------------------------------------
# The three cases, exact
# ---------------------------------------------------------------------------

AUTO_PROMPT = [3]
# The first step copies "4 5" (the suffix 2 was seen at 0): a copy the target
# accepts whole ~18% of the time, in half ~23%, never ~59%.
NGRAM_PROMPT = [2, 4, 5, 1, 2]


def test_auto_gamma_with_p_min_is_exact(target, draft):
    schedule = RecordingAutoGamma()  # one object for every run: α̂ and K move throughout
    counts, total, _ = sampled_counts(target, lambda: ModelDrafter(draft, p_min=P_MIN), AUTO_PROMPT, RUNS, schedule)
    statistic, threshold, df = check(counts, exact_distribution(target, AUTO_PROMPT))
    # Measured (seed 0): 250.7 < 307.8 (df 235).
    assert statistic < threshold, f"chi-square {statistic:.1f} >= {threshold:.1f} (df {df})"
    # K really varied, plain steps included, and p_min cut drafts short.
    assert min(schedule.choices) >= 0.03 * RUNS, schedule.choices
    assert min(total.gamma_hist[:3]) >= 0.1 * RUNS, total.gamma_hist  # K asked: 0, 1, 2 (at most 2 fit 3 tokens)
    assert total.drafted < sum(K * steps for K, steps in enumerate(total.gamma_hist))


def test_ngram_point_masses_are_exact(target):
    counts, total, no_proposal = sampled_counts(target, NgramDrafter, NGRAM_PROMPT, RUNS, 2)
    statistic, threshold, df = check(counts, exact_distribution(target, NGRAM_PROMPT))
    # Measured (seed 0): 273.3 < 326.0 (df 251).
    assert statistic < threshold, f"chi-square {statistic:.1f} >= {threshold:.1f} (df {df})"
    # Every branch: the first step's copy rejected, half accepted, all accepted; and steps with no proposal.
    assert min(total.accepted_hist) >= 0.02 * RUNS, total.accepted_hist
    assert no_proposal >= 0.1 * RUNS, no_proposal


def test_int8_draft_is_exact_for_the_float32_target(target, draft):
    int8_draft = perturbed_copy(draft, scale=0.0, seed=0)
    quantize_model_int8(int8_draft)
    counts, total, _ = sampled_counts(target, lambda: ModelDrafter(int8_draft), AUTO_PROMPT, INT8_RUNS, 2)
    statistic, threshold, df = check(counts, exact_distribution(target, AUTO_PROMPT))
    # Measured (seed 0): 171.0 < 225.7 (df 164).
    assert statistic < threshold, f"chi-square {statistic:.1f} >= {threshold:.1f} (df {df})"
    assert min(total.accepted_hist) >= 0.1 * INT8_RUNS, total.accepted_hist


# ---------------------------------------------------------------------------
# Power: each check fails for a wrong variant
# ---------------------------------------------------------------------------


class SampleThenTestDrafter(ModelDrafter):
    """WRONG p_min: samples the token first and stops if *its* probability is
    below p_min. The tokens it keeps are then drawn from p_draft restricted
    to likely tokens, but verified as if drawn from p_draft."""

    def propose(self, seq, K, sampling, generator):
        feed = seq[:, self.cache.length :]
        tokens, probs = [], []
        for _ in range(K):
            logits = self.model(feed, self.cache, last_logits_only=True)[0, -1]  # (V,)
            p = logits_to_probs(logits, sampling)  # (V,)
            token = torch.multinomial(p, 1, generator=generator)[0]
            if p[token] < self.p_min:
                break
            tokens.append(token)
            probs.append(p)
            feed = token.view(1, 1)
        if not tokens:
            return Draft(seq.new_empty(0), logits.new_empty(0, self.vocab_size), len(tokens) + 1)
        return Draft(torch.stack(tokens), torch.stack(probs), len(tokens) + 1)


def target_instead_of_residual(p_target, p_draft):
    """WRONG: the correction after a rejection drawn from p_target. With point
    masses, the rejected token x comes back with probability (1 - p_target(x)) p_target(x)."""
    return p_target


def test_the_check_fails_for_p_min_tested_after_sampling(target, draft):
    schedule = RecordingAutoGamma()
    counts, _, _ = sampled_counts(
        target, lambda: SampleThenTestDrafter(draft, p_min=P_MIN), AUTO_PROMPT, WRONG_RUNS, schedule
    )
    statistic, threshold, df = check(counts, exact_distribution(target, AUTO_PROMPT))
    # Measured (seed 0): 303.4 > 119.9 (df 76).
    assert statistic > threshold, f"chi-square {statistic:.1f} < {threshold:.1f} (df {df}): wrong rule undetected"


@pytest.mark.parametrize("case", ["ngram", "int8"])
def test_the_check_fails_for_a_correction_from_p_target(target, draft, monkeypatch, case):
    monkeypatch.setattr(spec_decoding.acceptance, "residual_distribution", target_instead_of_residual)
    if case == "ngram":
        counts, _, _ = sampled_counts(target, NgramDrafter, NGRAM_PROMPT, WRONG_RUNS, 2)
        probs = exact_distribution(target, NGRAM_PROMPT)
    else:
        int8_draft = perturbed_copy(draft, scale=0.0, seed=0)
        quantize_model_int8(int8_draft)
        counts, _, _ = sampled_counts(target, lambda: ModelDrafter(int8_draft), AUTO_PROMPT, WRONG_RUNS, 2)
        probs = exact_distribution(target, AUTO_PROMPT)
    statistic, threshold, df = check(counts, probs)
    # Measured (seed 0): n-gram 1068.4 > 132.3 (df 86); int8 draft 359.8 > 119.9 (df 76).
    assert statistic > threshold, f"chi-square {statistic:.1f} < {threshold:.1f} (df {df}): wrong rule undetected"
