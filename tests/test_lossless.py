"""Speculative sampling is lossless: its output has the target's distribution.

On a GPT-2 with an 8-token vocabulary the exact distribution of the first 3
generated tokens, P(x1, x2, x3) = p_target(x1) p_target(x2 | x1) p_target(x3 | x1, x2),
is enumerated (512 continuations, one batched pass of the target, the same
`logits_to_probs` filter as generation) and compared with the empirical
distribution of `speculative_generate` over many seeded runs, by Pearson's
chi-square test at its 0.999 quantile (helpers.chi_square: a correct sampler
fails with probability about 0.001 per seed; the seeds are fixed). The draft
often disagrees with the target (alpha ~ 0.5), so every branch of the rule is
taken: rejection at draft position 1, rejection at position 2 (correction
from the residual), and full acceptance (bonus token). The same check is shown
to fail, by a wide margin, for two plausible wrong rules (always accepting
the draft; drawing the correction from p_target instead of the residual), and
for a draft that reports its unfiltered distribution under top-k or top-p.
"""

from __future__ import annotations

import pytest
import torch

import spec_decoding.acceptance
import spec_decoding.drafters
import spec_decoding.loop
from gpt2 import GPT2, GPT2Config
from gpt2.sampling import SamplingConfig, logits_to_probs, sample
from spec_decoding import Verdict, speculative_generate
from helpers import chi_square, chi_square_quantile_0999, exact_continuation_distribution, perturbed_copy, tiny_gpt2

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIG = GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=16, vocab_size=8)
# std 0.2 keeps the 3-token distribution spread enough to fill ~240 cells at
# 10^4 runs (8 to 77 in the 2,000-run checks; with std 0.4 one continuation
# takes half the mass).
TARGET_STD = 0.2
# Weight noise for the draft: alpha ~ 0.4-0.5 on this target.
DRAFT_PERTURBATION = 0.25
PROMPT = [[3]]
N_TOKENS = 3  # the tokens whose joint distribution is compared
GAMMA = 2  # the first step drafts 2 tokens and may emit all 3

SETTINGS = {
    "temperature 1": SamplingConfig(temperature=1.0),
    "temperature 0.7, top-k 4": SamplingConfig(temperature=0.7, top_k=4),
    "top-p 0.8": SamplingConfig(temperature=1.0, top_p=0.8),
    "top-k 2": SamplingConfig(temperature=1.0, top_k=2),  # cuts enough mass to catch a filter the draft misreports
}
# One end-to-end case at 10^4 runs; the others at fewer, to keep the file
# under a minute: one run (~4 tiny forward passes) costs ~3 ms of CPU. The
# threshold follows the sample size through the pooling and the degrees of freedom.
RUNS = {"temperature 1": 10_000, "temperature 0.7, top-k 4": 2_000, "top-p 0.8": 2_000, "top-k 2": 2_000}
WRONG_RULE_RUNS = 2_000


@pytest.fixture(scope="module")
def target() -> GPT2:
    return tiny_gpt2(CONFIG, seed=0, std=TARGET_STD)


@pytest.fixture(scope="module")
def draft(target) -> GPT2:
    return perturbed_copy(target, scale=DRAFT_PERTURBATION, seed=2)


def exact_distribution(target: GPT2, sampling: SamplingConfig) -> torch.Tensor:
    """(V^n,) float64: P(first n new tokens = x) for every x, from the target alone."""
    return exact_continuation_distribution(target, torch.tensor(PROMPT), N_TOKENS, sampling)


def sampled_counts(
    target: GPT2, draft: GPT2, sampling: SamplingConfig, runs: int, seed: int
) -> tuple[torch.Tensor, list[int]]:
    """Counts of the first n new tokens over `runs` runs of speculative_generate,
    indexed like `exact_distribution`, and how often the first step accepted
    0, 1, ..., GAMMA drafts. One generator, seeded once, drives every run."""
    V, n = CONFIG.vocab_size, N_TOKENS
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V**n, dtype=torch.float64)
    first_step_accepted = [0] * (GAMMA + 1)
    prompt = torch.tensor(PROMPT)
    accepted_per_step: list[int] = []

    def record_step(tokens: list[int], accepted: int) -> None:
        accepted_per_step.append(accepted)

    for _ in range(runs):
        accepted_per_step.clear()
        out, _ = speculative_generate(
            target, draft, prompt, gamma=GAMMA, max_new_tokens=n,
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
            generator=generator, on_step=record_step,
        )
        index = 0
        for token in out[0, prompt.size(1) :].tolist():
            index = index * V + token
        counts[index] += 1
        first_step_accepted[accepted_per_step[0]] += 1
    return counts, first_step_accepted


def test_the_quantile_approximation():
    # Reference values of the 0.999 quantile of chi-square (standard tables), within what helpers.py states.
    for df, exact, rel in [(3, 16.266, 0.02), (7, 24.322, 0.01), (10, 29.588, 0.01), (30, 59.703, 0.003),
                           (50, 86.661, 0.003), (100, 149.449, 0.003), (282, 361.12, 0.003)]:
        assert chi_square_quantile_0999(df) == pytest.approx(exact, rel=rel), df


def test_the_exact_distribution_is_a_distribution(target):
    for sampling in SETTINGS.values():
        probs = exact_distribution(target, sampling)
        assert float(probs.sum()) == pytest.approx(1.0, abs=1e-6)  # float32 probabilities
        assert bool((probs >= 0).all())


@pytest.mark.parametrize("setting", SETTINGS)
def test_sampled_tokens_have_the_target_distribution(target, draft, setting):
    sampling, runs = SETTINGS[setting], RUNS[setting]
    counts, first_step_accepted = sampled_counts(target, draft, sampling, runs, seed=0)
    statistic, df = chi_square(counts, exact_distribution(target, sampling))
    threshold = chi_square_quantile_0999(df)
    # Measured (seed 0): temperature 1: 191.8 < 307.8 (df 235); top-k: 23.1 < 54.2 (df 26);
    # top-p: 34.3 < 84.1 (df 48); top-k 2: 4.4 < 24.5 (df 7).
    assert statistic < threshold, f"chi-square {statistic:.1f} >= {threshold:.1f} (df {df}, {runs} runs)"
    # Every branch of the rule was taken often: the first step rejected draft 1,
    # rejected draft 2 after accepting draft 1, and accepted both (bonus token).
    # The rarest (top-k 2, exactly one accepted) has p = 0.116: fewer than 5% of 2,000 runs has chance 1e-24.
    assert min(first_step_accepted) >= 0.05 * runs, first_step_accepted


# ---------------------------------------------------------------------------
# Power: the same check fails for wrong rules
# ---------------------------------------------------------------------------


def always_accept(target_probs, draft_probs, draft_tokens, *, generator=None, uniforms=None) -> Verdict:
    """WRONG: keeps every drafted token, then draws the bonus token from p_target.
    The output follows the draft's distribution, not the target's."""
    K = draft_tokens.numel()
    return Verdict(accepted=tuple(draft_tokens.tolist()), next_token=int(sample(target_probs[K], generator)))


def target_instead_of_residual(p_target, p_draft):
    """WRONG: the correction after a rejection drawn from p_target. Tokens the
    draft over-proposes then get min(p_draft, p_target) + (1 - beta) p_target > p_target."""
    return p_target


# (module, name, replacement): the loop calls `speculative_sampling` from its own
# namespace, and `speculative_sampling` calls `residual_distribution` from acceptance.py.
WRONG_RULES = {
    "always accept the draft": (spec_decoding.loop, "speculative_sampling", always_accept),
    "correction from p_target": (spec_decoding.acceptance, "residual_distribution", target_instead_of_residual),
}


def unfiltered_draft_probs(self, position, logits, sampling, generator):
    """WRONG: the draft samples from its top-k/top-p filtered distribution but reports the unfiltered one as
    p_draft, so the acceptance ratio p_target / p_draft is too large where the filter cut mass."""
    if sampling.greedy:
        return logits.argmax(), None
    drawn_from = logits_to_probs(logits, sampling)  # (V,)
    return sample(drawn_from, generator), logits_to_probs(logits, SamplingConfig(sampling.temperature))


@pytest.mark.parametrize("setting", ["top-k 2", "top-p 0.8"])
def test_the_check_fails_for_a_draft_that_misreports_its_filter(target, draft, monkeypatch, setting):
    monkeypatch.setattr(spec_decoding.drafters.ModelDrafter, "pick", unfiltered_draft_probs)
    sampling = SETTINGS[setting]
    counts, _ = sampled_counts(target, draft, sampling, WRONG_RULE_RUNS, seed=0)
    statistic, df = chi_square(counts, exact_distribution(target, sampling))
    # Measured (seed 0): top-k 2: 321.2 > 24.5; top-p 0.8: 562.1 > 84.1. (At top-k 4, temperature 0.7 the tail it
    # cuts is too light for 2,000 runs to tell: 28.7 < 54.2.)
    threshold = chi_square_quantile_0999(df)
    assert statistic > threshold, f"chi-square {statistic:.1f} < {threshold:.1f} (df {df}): wrong rule undetected"


@pytest.mark.parametrize("rule", WRONG_RULES)
def test_the_check_fails_for_a_wrong_rule(target, draft, monkeypatch, rule):
    module, name, wrong = WRONG_RULES[rule]
    monkeypatch.setattr(module, name, wrong)
    sampling = SETTINGS["temperature 1"]
    counts, _ = sampled_counts(target, draft, sampling, WRONG_RULE_RUNS, seed=0)
    statistic, df = chi_square(counts, exact_distribution(target, sampling))
    # Measured (seed 0, df 76, threshold 119.9): always accept 6447; correction from p_target 368.
    threshold = chi_square_quantile_0999(df)
    assert statistic > threshold, f"chi-square {statistic:.1f} < {threshold:.1f} (df {df}): wrong rule undetected"
