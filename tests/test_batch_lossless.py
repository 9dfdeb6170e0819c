"""Batched speculative sampling is lossless: every row of a batch has the
target's distribution for its own prompt.

As in test_lossless.py, on a GPT-2 with an 8-token vocabulary: two prompts of
different lengths, each 10 times over in one batch (B = 20 rows), run from one
seeded generator until each prompt has N = 10^4 samples; for each prompt the
empirical joint distribution of its rows' first 3 new tokens is compared with
the exact one by Pearson's chi-square test (0.999 quantile). The draft often
disagrees with the target (alpha ~ 0.5), so the rows of a step often accept
different numbers of drafts. The check is shown to reject a batched rule that
truncates every row to the batch's shortest acceptance m and draws each row's
next token from the residual at position m + 1, even for rows whose draft
there was accepted. Under a top-k 2 filter (10^3 samples) the rows stay
lossless, and a draft that misreports its filter is rejected.
"""

from __future__ import annotations

import pytest
import torch

import spec_decoding.batch
import spec_decoding.batch_drafters
from gpt2 import GPT2, GPT2Config
from gpt2.sampling import SamplingConfig, logits_to_probs, sample
from spec_decoding import Verdict, speculative_generate
from spec_decoding.acceptance import count_leading_true, residual_distribution
from helpers import chi_square, chi_square_quantile_0999, exact_continuation_distribution, perturbed_copy, tiny_gpt2

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIG = GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=16, vocab_size=8)
TARGET_STD = 0.2  # as test_lossless.py: spread 3-token distributions
DRAFT_PERTURBATION = 0.25  # alpha ~ 0.4-0.5
PROMPTS = [[3], [5, 1]]  # different prompts, of different lengths
COPIES = 10  # each prompt's rows in one batch (B = 20, the prompts alternating): one call gives 10 samples of each
N_TOKENS = 3  # the tokens whose joint distribution is compared, per prompt
GAMMA = 2  # the first step drafts 2 tokens and may emit all 3
SAMPLING = SamplingConfig(temperature=1.0)
FILTERED = SamplingConfig(temperature=1.0, top_k=2)  # a filter that cuts real mass
RUNS = 10_000
WRONG_RULE_RUNS = 2_000
FILTERED_RUNS = 1_000


@pytest.fixture(scope="module")
def target() -> GPT2:
    return tiny_gpt2(CONFIG, seed=0, std=TARGET_STD)


@pytest.fixture(scope="module")
def draft(target) -> GPT2:
    return perturbed_copy(target, scale=DRAFT_PERTURBATION, seed=2)


def exact_distribution(target: GPT2, prompt: list[int], sampling: SamplingConfig = SAMPLING) -> torch.Tensor:
    """(V^n,) float64: P(first n new tokens = x) after `prompt`, from the target alone."""
    return exact_continuation_distribution(target, torch.tensor([prompt]), N_TOKENS, sampling)


def sampled_counts(target: GPT2, draft: GPT2, runs: int, seed: int,
                   sampling: SamplingConfig = SAMPLING) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Per prompt: counts of its rows' first n new tokens over `runs` samples
    (`runs` / COPIES batched calls), indexed like `exact_distribution`; and how
    often its rows' first step accepted 0, 1, ..., GAMMA drafts. One
    generator, seeded once, drives every call."""
    V = CONFIG.vocab_size
    generator = torch.Generator().manual_seed(seed)
    counts = [torch.zeros(V**N_TOKENS, dtype=torch.float64) for _ in PROMPTS]
    first_step_accepted = [[0] * (GAMMA + 1) for _ in PROMPTS]
    first_step_seen: set[int] = set()
    batch = PROMPTS * COPIES  # row i holds prompt i % len(PROMPTS)

    def record_step(row: int, tokens: list[int], accepted: int) -> None:
        if row not in first_step_seen:
            first_step_seen.add(row)
            first_step_accepted[row % len(PROMPTS)][accepted] += 1

    for _ in range(runs // COPIES):
        first_step_seen.clear()
        rows, _ = speculative_generate(
            target, draft, batch, gamma=GAMMA, max_new_tokens=N_TOKENS, temperature=sampling.temperature,
            top_k=sampling.top_k, top_p=sampling.top_p, generator=generator, on_step=record_step,
        )
        for i, (prompt, row) in enumerate(zip(batch, rows)):
            index = 0
            for token in row[len(prompt) :]:
                index = index * V + token
            counts[i % len(PROMPTS)][index] += 1
    return counts, first_step_accepted


def test_every_row_has_the_target_distribution_of_its_own_prompt(target, draft):
    counts, first_step_accepted = sampled_counts(target, draft, RUNS, seed=0)
    for b, prompt in enumerate(PROMPTS):
        assert counts[b].sum() == RUNS
        statistic, df = chi_square(counts[b], exact_distribution(target, prompt))
        threshold = chi_square_quantile_0999(df)
        # Measured (seed 0): prompt 0: 238.9 < 307.8 (df 235); prompt 1: 308.4 < 361.2 (df 282).
        assert statistic < threshold, f"prompt {b}: chi-square {statistic:.1f} >= {threshold:.1f} (df {df})"
        # Every branch of the rule was taken often in the first step of this prompt's rows.
        assert min(first_step_accepted[b]) >= 0.1 * RUNS, first_step_accepted[b]


# ---------------------------------------------------------------------------
# Power: the same check rejects the biased batch rule
# ---------------------------------------------------------------------------


def truncate_to_the_shortest(target_logits, draft, sampling, generators) -> list[Verdict]:
    """WRONG: each row's drafts are judged as usual (n_b accepted), but every
    row keeps only m = min_b n_b of them and draws its next token from the
    residual at position m + 1, even a row whose draft there was accepted."""
    judged = []
    for b, logits in enumerate(target_logits):
        K_b = draft.num_drafted[b]
        tokens, p_draft = draft.tokens[b, :K_b], draft.probs[b, :K_b]  # (K_b,), (K_b, V)
        p_target = logits_to_probs(logits, sampling)  # (K_b + 1, V)
        rows = torch.arange(K_b)
        uniforms = torch.rand(K_b, generator=generators[b])
        n = count_leading_true(uniforms * p_draft[rows, tokens] < p_target[rows, tokens])
        judged.append((tokens, p_target, p_draft, n))
    m = min(n for *_, n in judged)
    verdicts = []
    for b, (tokens, p_target, p_draft, _) in enumerate(judged):
        dist = residual_distribution(p_target[m], p_draft[m]) if m < tokens.numel() else p_target[m]
        verdicts.append(Verdict(accepted=tuple(tokens[:m].tolist()), next_token=int(sample(dist, generators[b]))))
    return verdicts


def test_the_check_rejects_truncating_every_row_to_the_shortest_acceptance(target, draft, monkeypatch):
    monkeypatch.setattr(spec_decoding.batch, "verify_rows", truncate_to_the_shortest)
    counts, _ = sampled_counts(target, draft, WRONG_RULE_RUNS, seed=0)
    rejected = []
    for b, prompt in enumerate(PROMPTS):
        statistic, df = chi_square(counts[b], exact_distribution(target, prompt))
        rejected.append(statistic > chi_square_quantile_0999(df))
    # Measured (seed 0, 2,000 samples): prompt 0: 2664.7 > 119.9 (df 76); prompt 1: 2850.2 > 149.5 (df 100).
    assert all(rejected), "the biased batch rule went undetected"


# ---------------------------------------------------------------------------
# A sampling filter: the rows stay lossless, and a misreported filter is seen
# ---------------------------------------------------------------------------


def misreported_filter(self, row, position, logits, sampling, generator):
    """WRONG: the draft samples from its top-k filtered distribution but reports the unfiltered one as p_draft."""
    drawn_from = logits_to_probs(logits, sampling)  # (V,)
    return sample(drawn_from, generator), logits_to_probs(logits, SamplingConfig(sampling.temperature))


@pytest.mark.parametrize("wrong", [False, True])
def test_every_row_has_the_filtered_target_distribution_and_a_misreported_filter_is_seen(target, draft, monkeypatch,
                                                                                        wrong):
    if wrong:
        monkeypatch.setattr(spec_decoding.batch_drafters.BatchDrafter, "pick", misreported_filter)
    counts, _ = sampled_counts(target, draft, FILTERED_RUNS, seed=0, sampling=FILTERED)
    statistics = [chi_square(counts[b], exact_distribution(target, prompt, FILTERED)) for b, prompt in
                  enumerate(PROMPTS)]
    # Measured (seed 0, 1,000 samples, df 7, threshold 24.5): right: prompts 5.9, 7.4; misreported: 202.8, 41.8.
    passed = [statistic < chi_square_quantile_0999(df) for statistic, df in statistics]
    assert passed == [not wrong] * len(PROMPTS), statistics
