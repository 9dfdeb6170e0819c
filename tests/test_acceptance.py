"""The verification rules and the stats arithmetic, on hand-made numbers.

No model is involved: `speculative_sampling_greedy`, `speculative_sampling`
and `residual_distribution` are pure functions of probabilities (or logits),
drafted tokens and random draws, so each case below has an outcome that can
be worked out on paper. Row i of the target's (K + 1, V) scores is its
prediction for draft position i; row K is the bonus position.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from gpt2.sampling import SamplingConfig, logits_to_probs
from spec_decoding import (
    BatchStats,
    SpecStats,
    Verdict,
    expected_tokens_per_step,
    improvement_factor,
    predicted_speedup,
    residual_distribution,
    speculative_sampling,
    speculative_sampling_greedy,
)


def one_hot_rows(tokens: list[int], V: int) -> torch.Tensor:
    """(len(tokens), V) float32 rows, row i all mass on tokens[i]."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


def logits_with_argmax(tokens: list[int], V: int) -> torch.Tensor:
    """(len(tokens), V) logits whose row i has its argmax at tokens[i] (the
    other entries are random and smaller)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.rand(len(tokens), V, generator=g)  # values in [0, 1)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


# ---------------------------------------------------------------------------
# Greedy verification
# ---------------------------------------------------------------------------

V = 8


def test_greedy_all_accepted_appends_the_bonus_token():
    logits = logits_with_argmax([3, 1, 4, 0], V)  # target's choices at rows 0..3
    verdict = speculative_sampling_greedy(logits, torch.tensor([3, 1, 4]))
    assert verdict == Verdict(accepted=(3, 1, 4), next_token=0)  # bonus = argmax of row K = 3
    assert verdict.num_accepted == 3
    assert verdict.tokens == [3, 1, 4, 0]


def test_greedy_first_mismatch_appends_the_correction_and_ignores_later_drafts():
    logits = logits_with_argmax([3, 1, 4, 0], V)
    # Position 1 disagrees (2 vs 1); position 2 agrees again (4) but comes after
    # a rejection, so it must not be kept.
    verdict = speculative_sampling_greedy(logits, torch.tensor([3, 2, 4]))
    assert verdict.accepted == (3,)
    assert verdict.next_token == 1  # argmax of row 1
    assert verdict.tokens == [3, 1]


def test_greedy_mismatch_at_the_first_position_keeps_nothing():
    logits = logits_with_argmax([3, 1, 4, 0], V)
    verdict = speculative_sampling_greedy(logits, torch.tensor([5, 1, 4]))
    assert verdict.accepted == ()
    assert verdict.tokens == [3]


def test_greedy_with_no_draft_is_a_plain_greedy_step():
    logits = logits_with_argmax([6], V)  # (1, V): K = 0
    verdict = speculative_sampling_greedy(logits, torch.tensor([], dtype=torch.long))
    assert verdict == Verdict(accepted=(), next_token=6)


def test_greedy_rejects_logits_of_the_wrong_length():
    with pytest.raises(ValueError, match=r"need \(4, V\) target scores for 3 drafted tokens, got \(3, 8\)"):
        speculative_sampling_greedy(torch.zeros(3, V), torch.tensor([1, 2, 3]))  # needs 4 rows


@pytest.mark.parametrize("how, message", [
    ({"draft_tokens": torch.tensor([[1, 2]])}, r"draft_tokens must be a \(K,\) tensor of token ids, got \(1, 2\)"),
    ({"draft_tokens": [1, 2]}, r"draft_tokens must be a \(K,\) tensor of token ids, got list"),
    ({"draft_tokens": torch.tensor([1.0, 2.0])}, r"draft_tokens must be a \(K,\) tensor of token ids"),
    ({"draft_probs": torch.full((2, V - 1), 1 / (V - 1))},
     rf"need \(2, {V}\) draft probabilities for 2 drafted tokens \(the target's V\), got \(2, {V - 1}\)"),
    ({"uniforms": torch.zeros(1)}, r"need \(2,\) uniforms for 2 drafted tokens, one per drafted token, got \(1,\)"),
    ({"target_probs": torch.full((2, V), 1 / V)}, r"need \(3, V\) target scores for 2 drafted tokens, got \(2, 8\)"),
])
def test_sampling_verification_refuses_shapes_that_would_broadcast_to_a_wrong_verdict(how, message):
    # (1, K) tokens, a draft of another vocabulary, or one uniform for every position: each gave a verdict.
    args = {"target_probs": torch.full((3, V), 1 / V), "draft_probs": torch.full((2, V), 1 / V),
            "draft_tokens": torch.tensor([1, 2]), "uniforms": torch.zeros(2)} | how
    with pytest.raises(ValueError, match=message):
        speculative_sampling(args["target_probs"], args["draft_probs"], args["draft_tokens"],
                             uniforms=args["uniforms"])


# ---------------------------------------------------------------------------
# Sampling verification, with the uniforms given
# ---------------------------------------------------------------------------


def test_equal_distributions_accept_everything_even_with_uniforms_near_one():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, V, generator=g), dim=-1)  # (K + 1, V)
    p[3] = one_hot_rows([5], V)[0]  # make the bonus draw known
    draft_tokens = torch.tensor([2, 7, 0])
    # p_target / p_draft = 1 everywhere, so r < 1 always accepts.
    verdict = speculative_sampling(p, p[:3], draft_tokens, uniforms=torch.tensor([0.0, 0.5, 0.999999]))
    assert verdict == Verdict(accepted=(2, 7, 0), next_token=5)


def test_the_residual_of_equal_distributions_has_no_mass_and_falls_back_to_p_target():
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    residual = residual_distribution(p, p.clone())
    assert not torch.isnan(residual).any()
    assert torch.equal(residual, p)


def test_residual_is_the_normalized_positive_part_of_the_difference():
    p_target = torch.tensor([0.5, 0.3, 0.2, 0.0])
    p_draft = torch.tensor([0.2, 0.3, 0.1, 0.4])
    # max(0, p_target - p_draft) = [0.3, 0, 0.1, 0], mass 0.4
    torch.testing.assert_close(residual_distribution(p_target, p_draft), torch.tensor([0.75, 0.0, 0.25, 0.0]))


def test_acceptance_threshold_is_p_target_over_p_draft():
    # Draft token 0: p_target = 0.3, p_draft = 0.6, accepted iff r < 0.5.
    p_target = torch.tensor([[0.3, 0.7, 0.0], [0.0, 0.0, 1.0]])  # (K + 1, V), bonus row one-hot on 2
    p_draft = torch.tensor([[0.6, 0.2, 0.2]])  # (K, V)
    draft_tokens = torch.tensor([0])

    accepted = speculative_sampling(p_target, p_draft, draft_tokens, uniforms=torch.tensor([0.49]))
    assert accepted == Verdict(accepted=(0,), next_token=2)  # the bonus token

    rejected = speculative_sampling(p_target, p_draft, draft_tokens, uniforms=torch.tensor([0.51]))
    # Residual: max(0, [0.3, 0.7, 0] - [0.6, 0.2, 0.2]) = [0, 0.5, 0] -> one-hot on 1.
    assert rejected == Verdict(accepted=(), next_token=1)


def test_one_hot_target_accepts_its_token_and_rejects_any_other():
    p_target = one_hot_rows([2, 0, 1], V)  # (K + 1, V)
    p_draft = torch.full((2, V), 1.0 / V)  # uniform draft
    # Draft 2 at row 0 matches (ratio V > 1: accepted whatever r); draft 3 at
    # row 1 has p_target = 0 (rejected even for r = 0); the residual
    # max(0, one_hot(0) - 1/V) is one-hot on 0, so the correction is 0.
    verdict = speculative_sampling(p_target, p_draft, torch.tensor([2, 3]), uniforms=torch.tensor([0.999, 0.0]))
    assert verdict == Verdict(accepted=(2,), next_token=0)


def test_zeros_in_p_draft_give_no_nan():
    # The draft gives token 0 no mass but the target does.
    p_target = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    p_draft = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.5, 0.5, 0.0]])

    # A drafted token with p_draft = 0 (which a correct draft never proposes)
    # is accepted when the target gives it mass: r * 0 < 0.5, no 0/0.
    verdict = speculative_sampling(p_target, p_draft, torch.tensor([0, 1]), uniforms=torch.tensor([0.7, 0.3]))
    assert verdict == Verdict(accepted=(0, 1), next_token=3)

    # Drafted token 2 has p_target = 0: rejected. The residual
    # max(0, [0.5, 0, -0.5, 0]) puts all its mass on token 0, where p_draft is 0.
    verdict = speculative_sampling(p_target, p_draft, torch.tensor([2, 1]), uniforms=torch.tensor([0.0, 0.0]))
    assert verdict == Verdict(accepted=(), next_token=0)


def test_a_rejection_after_accepted_tokens_returns_the_prefix_and_samples_the_residual_there():
    p_target = torch.tensor(
        [
            [0.25, 0.25, 0.25, 0.25],
            [0.6, 0.4, 0.0, 0.0],
            [0.0, 0.0, 1.0, 0.0],
            [0.0, 0.0, 0.0, 1.0],
        ]
    )
    p_draft = torch.tensor(
        [
            [0.25, 0.25, 0.25, 0.25],
            [0.2, 0.8, 0.0, 0.0],  # token 1: ratio 0.4 / 0.8 = 0.5
            [0.0, 0.0, 1.0, 0.0],
        ]
    )
    # Row 0 accepted (ratio 1); row 1 rejected (r = 0.9 >= 0.5); the residual
    # max(0, [0.4, -0.4, 0, 0]) is one-hot on 0; row 2 is never looked at.
    verdict = speculative_sampling(p_target, p_draft, torch.tensor([3, 1, 2]), uniforms=torch.tensor([0.5, 0.9, 0.0]))
    assert verdict == Verdict(accepted=(3,), next_token=0)


def test_generator_draws_accept_with_probability_min_one_ratio():
    # One draft token with p_target / p_draft = 0.18 / 0.6 = 0.3: over 4000
    # seeded draws the acceptance frequency has standard deviation
    # sqrt(0.21 / 4000) = 0.0072; the tolerance 0.036 is five of them. (Not 0.5,
    # where accepting on r >= ratio instead of r < ratio would pass too.)
    p_target = torch.tensor([[0.18, 0.82], [0.5, 0.5]])
    p_draft = torch.tensor([[0.6, 0.4]])
    g = torch.Generator().manual_seed(1234)
    n = 4000
    draft_tokens = torch.tensor([0])
    accepted = sum(speculative_sampling(p_target, p_draft, draft_tokens, generator=g).num_accepted for _ in range(n))
    assert abs(accepted / n - 0.3) < 5 * math.sqrt(0.3 * 0.7 / n)


@pytest.mark.parametrize("seed", range(20))
def test_sampling_with_one_hot_distributions_is_the_greedy_rule(seed):
    # Greedy is the temperature -> 0 limit: logits_to_probs turns logits into
    # one-hot rows, and a greedy draft's distribution is one-hot on its token.
    # Then min(1, p_target / p_draft) is 1 or 0 and the residual is the
    # target's one-hot row, whatever the random draws.
    g = torch.Generator().manual_seed(seed)
    K = 4
    target_logits = torch.randn(K + 1, V, generator=g)  # (K + 1, V)
    agree = torch.rand(K, generator=g) < 0.7  # draft mostly picks the target's argmax
    draft_tokens = torch.where(agree, target_logits[:K].argmax(dim=-1), torch.randint(0, V, (K,), generator=g))
    p_target = logits_to_probs(target_logits, SamplingConfig(temperature=0.0))
    p_draft = one_hot_rows(draft_tokens.tolist(), V)
    expected = speculative_sampling_greedy(target_logits, draft_tokens)
    assert speculative_sampling(p_target, p_draft, draft_tokens, generator=g) == expected


# ---------------------------------------------------------------------------
# Stats arithmetic
# ---------------------------------------------------------------------------


def test_record_step_counts_histogram_and_per_position_acceptance():
    stats = SpecStats(gamma=3)
    stats.record_step(drafted=3, accepted=3, target_token=True)  # all accepted + bonus
    stats.record_step(drafted=3, accepted=1, target_token=True)  # rejected at position 2
    stats.record_step(drafted=3, accepted=0, target_token=True)  # rejected at position 1
    stats.record_step(drafted=2, accepted=2, target_token=True)  # near the end: K shrank to 2
    stats.record_step(drafted=0, accepted=0, target_token=True)  # no room to draft: plain target step

    assert stats.target_calls == 5
    assert stats.plain_steps == 1
    assert stats.drafted == 11
    assert stats.accepted == 6
    assert stats.target_tokens == 5
    assert stats.new_tokens == 11
    assert stats.accepted_hist == [2, 1, 1, 1]  # accepted 0 (twice), 1, 2, 3
    # Position i is judged when drafts 1..i-1 were all accepted and i was drafted.
    assert stats.reached_at == [4, 3, 1]
    assert stats.accepted_at == [3, 2, 1]
    assert stats.position_acceptance == [3 / 4, 2 / 3, 1.0]
    assert stats.alpha == 6 / 8
    assert stats.accepted_per_drafted == 6 / 11
    assert stats.tokens_per_target_call == 11 / 5


def test_a_step_cut_at_an_accepted_end_of_text_counts_only_what_was_emitted():
    # gamma 5: the verifier accepted 4 drafts, the 2nd of which is end-of-text:
    # 2 drafts are emitted (the EOS among them), no target token; position 3
    # and beyond are not counted as judged.
    stats = SpecStats(gamma=5)
    stats.record_step(drafted=5, accepted=2, target_token=False)
    assert (stats.accepted, stats.target_tokens, stats.new_tokens) == (2, 0, 2)
    assert stats.accepted + stats.target_tokens == stats.new_tokens
    assert stats.reached_at == [1, 1, 0, 0, 0]
    assert stats.alpha == 1.0
    assert stats.accepted_hist == [0, 0, 1, 0, 0, 0]


def test_empty_stats_have_zero_rates_and_nan_per_position():
    stats = SpecStats(gamma=2)
    assert stats.alpha == 0.0 and stats.accepted_per_drafted == 0.0
    assert stats.tokens_per_target_call == 0.0
    assert all(math.isnan(a) for a in stats.position_acceptance)
    # NaN is not JSON: to_dict writes null instead.
    assert json.loads(json.dumps(stats.to_dict()))["position_acceptance"] == [None, None]
    batch = BatchStats(gamma=2, num_rows=3)  # a batch that never stepped: its rows', and its own, rates are 0
    assert len(batch.rows) == 3 and batch.alpha == 0.0 and batch.tokens_per_target_call == 0.0
    assert (batch.target_calls, batch.draft_calls, batch.new_tokens, batch.judged) == (0, 0, 0, 0)


def test_to_dict_carries_counters_and_derived_rates():
    stats = SpecStats(gamma=2)
    stats.record_step(drafted=2, accepted=1, target_token=True)
    d = stats.to_dict()
    assert d["accepted_hist"] == [0, 1, 0]
    assert d["alpha"] == 0.5 and d["accepted_per_drafted"] == 0.5
    assert d["tokens_per_target_call"] == 2.0
    assert d["position_acceptance"] == [1.0, 0.0]


def test_record_step_refuses_impossible_counts():
    stats = SpecStats(gamma=2)
    with pytest.raises(AssertionError):
        stats.record_step(drafted=1, accepted=2, target_token=True)  # more accepted than drafted
    with pytest.raises(AssertionError):
        stats.record_step(drafted=3, accepted=0, target_token=True)  # more drafted than gamma


@pytest.mark.parametrize(
    "alpha, gamma, expected",
    [
        (0.5, 3, 1.875),  # 1 + 0.5 + 0.25 + 0.125
        (0.5, 1, 1.5),
        (0.8, 4, (1 - 0.8**5) / 0.2),  # 3.3616
        (1.0, 4, 5.0),  # every draft accepted: gamma + 1
        (1.0, 1, 2.0),
        (0.0, 5, 1.0),  # nothing accepted: the target's own token only
    ],
)
def test_expected_tokens_per_step(alpha, gamma, expected):
    assert expected_tokens_per_step(alpha, gamma) == pytest.approx(expected, rel=1e-12)


def test_expected_tokens_per_step_is_the_sum_of_a_geometric_series():
    # E = sum_{i=0}^{gamma} alpha^i: step i + 1 is reached iff the first i drafts are accepted.
    for alpha in (0.1, 0.37, 0.9, 0.999999):
        for gamma in (1, 2, 5, 8):
            series = sum(alpha**i for i in range(gamma + 1))
            assert expected_tokens_per_step(alpha, gamma) == pytest.approx(series, rel=1e-6)


def test_alpha_counts_only_judged_drafts():
    # gamma 4: one step rejects position 1 (judged 1, accepted 0), one accepts 2
    # then rejects position 3 (judged 3, accepted 2), one accepts all 4 (judged 4).
    stats = SpecStats(4)
    stats.record_step(drafted=4, accepted=0, target_token=True)
    stats.record_step(drafted=4, accepted=2, target_token=True)
    stats.record_step(drafted=4, accepted=4, target_token=True)
    assert stats.accepted_per_drafted == 6 / 12
    assert stats.alpha == 6 / 8
    assert stats.to_dict()["alpha"] == 6 / 8


def test_improvement_factor_is_theorem_3_8():
    # (1 - a^(g+1)) / ((1 - a)(g c + 1)); at c = 0 it is E, and predicted_speedup
    # with t_v = t_t is the same number.
    assert improvement_factor(0.8, 4, 0.0) == pytest.approx(expected_tokens_per_step(0.8, 4))
    assert improvement_factor(0.8, 4, 0.1) == pytest.approx(3.3616 / 1.4)
    assert improvement_factor(0.0, 3, 0.5) == pytest.approx(1 / 2.5)
    assert predicted_speedup(0.6, 3, t_draft=0.2, t_target=1.0, t_verify=1.0) == pytest.approx(
        improvement_factor(0.6, 3, 0.2)
    )
    assert predicted_speedup(0.8, 4, t_draft=1.0, t_target=10.0, t_verify=12.0) == pytest.approx(3.3616 * 10 / 16)
