"""Speculative sampling with token trees is lossless: recursive rejection
sampling (tree_acceptance.tree_sampling) gives the target's distribution.

The check of tests/test_lossless.py, extended to trees (the same 8-token
GPT-2 pair, first 3 new tokens, chi-square at the 0.999 quantile, fixed
seeds; top-k and top-p filters too). Two children at
depth 1 and 2 make the first step take every branch of the rule: the first
child accepted, the second after the first was rejected (p_target replaced by
the residual, p_draft by p_draft without the rejected token), both rejected,
and a full path (the bonus token at a leaf); a dynamic tree is checked too.
The check is shown to fail for a plausible wrong rule (each sibling judged as
a chain of one) and for a draft that misreports its top-k filter; at one
node, on hand-made distributions, the rule alone is checked against p_target
and shown to reject that rule and a subtler one (SpecInfer's
with-replacement rule on children drawn without replacement).
"""

from __future__ import annotations

import pytest
import torch

import spec_decoding.tree_acceptance
import spec_decoding.tree_loop
from gpt2 import GPT2, GPT2Config
from gpt2.sampling import SamplingConfig, logits_to_probs, sample
from spec_decoding import TreeShape, tree_speculative_generate
from spec_decoding.acceptance import residual_distribution
from spec_decoding.tree import TokenTree
from spec_decoding.tree_acceptance import accepted, tree_sampling
from spec_decoding.tree_drafting import TreeDrafter, draw_without_replacement
from helpers import chi_square, chi_square_quantile_0999, exact_continuation_distribution, perturbed_copy, tiny_gpt2

pytestmark = pytest.mark.usefixtures("single_thread")

# The pair of tests/test_lossless.py: alpha ~ 0.4-0.5 at depth 1.
CONFIG = GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=16, vocab_size=8)
TARGET_STD = 0.2
DRAFT_PERTURBATION = 0.25
PROMPT = [[3]]
N_TOKENS = 3  # the first step drafts depth 2 and may emit all 3

TEMPERATURE_1 = SamplingConfig(temperature=1.0)
# name: (tree, sampling, runs, the first step's accepted sibling ranks that must each be seen in >= 0.3% of runs).
# One case at 10^4 runs, the others fewer (a run takes ~3 ms).
CASES = {
    "2,2 at temperature 1": (
        TreeShape(branching=(2, 2)), TEMPERATURE_1, 10_000, [(), (0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)],
    ),
    "3,2 at temperature 0.7, top-k 4": (
        TreeShape(branching=(3, 2)), SamplingConfig(temperature=0.7, top_k=4), 1_500,
        [(0,), (1,), (2,), (0, 0), (1, 0), (2, 0)],
    ),
    "dynamic 4 nodes, depth 2": (TreeShape(nodes=4, depth=2), TEMPERATURE_1, 1_500, [(), (0,), (1,), (0, 0), (1, 0)]),
    # Filters that cut real mass (top-k 4 at temperature 0.7 cuts too light a tail to tell a misreported filter).
    "2,2 at temperature 1, top-k 2": (
        TreeShape(branching=(2, 2)), SamplingConfig(temperature=1.0, top_k=2), 1_500, [(), (0,), (1,), (0, 0), (1, 0)],
    ),
    "2,2 at temperature 0.8, top-p 0.8": (
        TreeShape(branching=(2, 2)), SamplingConfig(temperature=0.8, top_p=0.8), 1_500,
        [(), (0,), (1,), (0, 0), (1, 0)],
    ),
}
WRONG_RULE_RUNS = 1_000


@pytest.fixture(scope="module")
def target() -> GPT2:
    return tiny_gpt2(CONFIG, seed=0, std=TARGET_STD)


@pytest.fixture(scope="module")
def draft(target) -> GPT2:
    return perturbed_copy(target, scale=DRAFT_PERTURBATION, seed=2)


def exact_distribution(target: GPT2, sampling: SamplingConfig) -> torch.Tensor:
    return exact_continuation_distribution(target, torch.tensor(PROMPT), N_TOKENS, sampling)


def sampled_counts(
    target: GPT2, draft: GPT2, tree: TreeShape, sampling: SamplingConfig, runs: int, seed: int
) -> tuple[torch.Tensor, dict[tuple[int, ...], int]]:
    """Counts of the first n new tokens over `runs` runs (indexed like
    `exact_distribution`), and how often the first step accepted each
    sequence of sibling ranks. One generator, seeded once, drives every run."""
    V = CONFIG.vocab_size
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V**N_TOKENS, dtype=torch.float64)
    first_step: dict[tuple[int, ...], int] = {}
    prompt = torch.tensor(PROMPT)
    verdicts = []
    for _ in range(runs):
        verdicts.clear()
        out, _ = tree_speculative_generate(
            target, draft, prompt, tree=tree, max_new_tokens=N_TOKENS,
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, generator=generator,
            on_tree=lambda tree, verdict: verdicts.append(verdict),
        )
        index = 0
        for token in out[0, prompt.size(1) :].tolist():
            index = index * V + token
        counts[index] += 1
        first_step[verdicts[0].ranks] = first_step.get(verdicts[0].ranks, 0) + 1
    return counts, first_step


@pytest.mark.parametrize("case", CASES)
def test_sampled_tokens_have_the_target_distribution(target, draft, case):
    tree, sampling, runs, branches = CASES[case]
    counts, first_step = sampled_counts(target, draft, tree, sampling, runs, seed=0)
    statistic, df = chi_square(counts, exact_distribution(target, sampling))
    threshold = chi_square_quantile_0999(df)
    # Measured (seed 0): 2,2: 263.4 < 307.8 (df 235); 3,2 top-k: 21.2 < 48.4 (df 22); dynamic: 40.9 < 91.9 (df 54);
    # 2,2 top-k 2: 2.8 < 24.5 (df 7); 2,2 top-p 0.8: 24.5 < 48.4 (df 22).
    assert statistic < threshold, f"chi-square {statistic:.1f} >= {threshold:.1f} (df {df}, {runs} runs)"
    # The branches of the rule were all taken: () = every depth-1 child
    # rejected, (1,) = the second accepted after the first was rejected, ...
    # The rarest ((2,) under 3,2 top-k 4) has p = 0.017: fewer than 0.3% of 1,500 runs has chance 1e-7.
    for ranks in branches:
        assert first_step.get(ranks, 0) >= 0.003 * runs, (ranks, first_step)


# ---------------------------------------------------------------------------
# Power: the same check fails for wrong rules
# ---------------------------------------------------------------------------


def no_residual_between_siblings(target_probs, draft_probs, tree, *, generator=None, uniforms=None):
    """WRONG: the chain rule applied to each sibling alone: every child judged
    against the same p_target and p_draft, the residual taken once, after the
    last rejection. A token rejected once gets a second chance at full weight."""
    if uniforms is None:
        uniforms = torch.rand(tree.size - 1, generator=generator)
    node, nodes = 0, []
    while True:
        p_target, p_draft = target_probs[node], draft_probs[node]
        kids = tree.children(node)
        follow = [c for c in kids if uniforms[c - 1] * p_draft[tree.tokens[c]] < p_target[tree.tokens[c]]]
        if not follow:
            dist = residual_distribution(p_target, p_draft) if kids else p_target
            return accepted(tree, nodes, int(sample(dist, generator)))
        node = follow[0]
        nodes.append(node)


def test_the_check_fails_for_a_wrong_rule(target, draft, monkeypatch):
    monkeypatch.setattr(spec_decoding.tree_loop, "tree_sampling", no_residual_between_siblings)
    tree, sampling, _, _ = CASES["2,2 at temperature 1"]
    counts, _ = sampled_counts(target, draft, tree, sampling, WRONG_RULE_RUNS, seed=0)
    statistic, df = chi_square(counts, exact_distribution(target, sampling))
    threshold = chi_square_quantile_0999(df)
    # Measured (seed 0): 179.5 > 64.0 (df 33).
    assert statistic > threshold, f"chi-square {statistic:.1f} < {threshold:.1f} (df {df}): wrong rule undetected"


class MisreportsItsFilter(TreeDrafter):
    """WRONG: the children are drawn from the top-k filtered distribution, but the unfiltered one is reported as
    p_draft, so p_target / p_draft is too large wherever the filter cut mass."""

    def distributions(self, logits, sampling):
        return logits_to_probs(logits, SamplingConfig(sampling.temperature))  # the filter left out

    def candidates(self, path, q, count, sampling, generator):
        kept = q >= torch.topk(q, sampling.top_k).values[-1]  # (V,): drawn as the filter would
        filtered = torch.where(kept, q, torch.zeros_like(q))
        return [(token, float(q[token])) for token in draw_without_replacement(filtered / filtered.sum(), count,
                                                                               generator)]


def test_the_check_fails_for_a_tree_draft_that_misreports_its_filter(target, draft, monkeypatch):
    for name in ("distributions", "candidates"):
        monkeypatch.setattr(TreeDrafter, name, getattr(MisreportsItsFilter, name))
    tree, sampling, _, _ = CASES["2,2 at temperature 1, top-k 2"]
    counts, _ = sampled_counts(target, draft, tree, sampling, WRONG_RULE_RUNS, seed=0)
    statistic, df = chi_square(counts, exact_distribution(target, sampling))
    threshold = chi_square_quantile_0999(df)
    # Measured (seed 0, 1,000 runs): 263.3 > 24.5 (df 7); the right rule: 3.0.
    assert statistic > threshold, f"chi-square {statistic:.1f} < {threshold:.1f} (df {df}): wrong rule undetected"


# ---------------------------------------------------------------------------
# The rule alone, at one node, on hand-made distributions
# ---------------------------------------------------------------------------

# The target favours token 0, the draft token 3: three children drawn without
# replacement from p_draft are judged in turn, so every branch of the rule
# matters. (Exact enumeration: the wrong rules below are 0.61 and 0.54 away
# from p_target in total variation.)
P_TARGET = torch.tensor([0.7, 0.1, 0.1, 0.1])
P_DRAFT = torch.tensor([0.01, 0.04, 0.15, 0.8])
CHILDREN = 3
DRAWS = 5_000


def draft_kept_with_replacement(p_draft, token):
    """WRONG: after a rejection, the next child is judged against the same
    p_draft, as if the children were drawn with replacement (SpecInfer's
    rule), though they were drawn without."""
    return p_draft


def next_token_counts(rule, draws: int, seed: int) -> torch.Tensor:
    """(V,) how often each token came first out of one node with CHILDREN
    children, over `draws` draws of the children and of the rule."""
    generator = torch.Generator().manual_seed(seed)
    V = P_TARGET.numel()
    target_probs = P_TARGET.expand(CHILDREN + 1, V)  # (N, V): the target at the root and at each child
    draft_probs = torch.zeros(CHILDREN + 1, V)  # (N, V): only the root has children
    draft_probs[0] = P_DRAFT
    counts = torch.zeros(V, dtype=torch.float64)
    for _ in range(draws):
        children = draw_without_replacement(P_DRAFT, CHILDREN, generator)
        tree = TokenTree((0, *children), (-1, *[0] * CHILDREN))
        verdict = rule(target_probs, draft_probs, tree, generator=generator)
        counts[verdict.tokens[0]] += 1
    return counts


def test_the_rule_at_one_node_gives_p_target():
    counts = next_token_counts(tree_sampling, DRAWS, seed=0)
    statistic, df = chi_square(counts, P_TARGET.double())
    # Measured (seed 0): 3.3 < 16.6 (df 3).
    assert statistic < chi_square_quantile_0999(df), (statistic, counts)


@pytest.mark.parametrize("rule", ["no residual between siblings", "p_draft not updated"])
def test_the_one_node_check_fails_for_a_wrong_rule(monkeypatch, rule):
    if rule == "p_draft not updated":  # drafting keeps its own `without`: only the rule changes
        monkeypatch.setattr(spec_decoding.tree_acceptance, "without", draft_kept_with_replacement)
        wrong = tree_sampling
    else:
        wrong = no_residual_between_siblings
    counts = next_token_counts(wrong, DRAWS, seed=0)
    statistic, df = chi_square(counts, P_TARGET.double())
    # Measured (seed 0, threshold 16.6, df 3): no residual between siblings 12141; p_draft not updated 16656.
    assert statistic > chi_square_quantile_0999(df), (statistic, counts)
