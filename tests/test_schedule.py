"""γ schedules (spec_decoding/schedule.py) and the step costs they weigh (costs.py).

`best_gamma(α)` is the K that maximises E(α, K) / (K t_d + t_v(K + 1)). Here
it is checked against the formula written out independently (a sum of
powers instead of eq. 1's closed form) over a grid of α and costs, on golden
cases worked by hand, including K = 0 where drafting cannot pay. `AutoGamma`
takes the same formula's expectation over a Beta distribution of α: checked
against numerical integration. Then how α̂ moves (prior, window, return to
the prior after plain steps), the +2/-1 heuristic, and the calibration cache. Whether the output depends on the
schedule (it must not) is tested in test_drafting.py and test_drafting_lossless.py.
"""

from __future__ import annotations

import json
import statistics

import pytest
import torch

import spec_decoding.costs
from gpt2 import GPT2Config
from spec_decoding import AutoGamma, FixedGamma, HeuristicGamma, SimulatedDrafter, SpecStats, StepCosts, TreeShape
from spec_decoding import BatchStats, best_gamma, calibrate, expected_tokens_per_step, improvement_factor
from spec_decoding import predicted_speedup
from spec_decoding.batch_drafters import SimulatedBatchDrafter
from spec_decoding.costs import non_decreasing, relative_medians
from spec_decoding.drafters import ModelDrafter, NgramDrafter
from spec_decoding.schedule import expected_rate, fastest, make_schedule, posterior_tokens
from helpers import tiny_gpt2

pytestmark = pytest.mark.usefixtures("single_thread")


def linear_costs(t_draft: float, t_step: float, slope: float, max_tokens: int = 13) -> StepCosts:
    """t_v(k) = t_step + slope (k - 1): a verification pass that grows with k, as on a CPU."""
    return StepCosts(t_draft=t_draft, t_verify=tuple(t_step + slope * (k - 1) for k in range(1, max_tokens + 1)))


def rates_by_hand(alpha: float, costs: StepCosts, max_gamma: int) -> list[float]:
    """(1 + α + ... + α^K) / (K t_d + t_v(K + 1)) for K = 0 .. max_gamma."""
    return [sum(alpha**i for i in range(K + 1)) / (K * costs.t_draft + costs.t_verify[K]) for K in range(max_gamma + 1)]


# ---------------------------------------------------------------------------
# The choice: the argmax of the formula
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("t_draft", [0.0, 0.02, 0.1, 0.3, 1.0])
@pytest.mark.parametrize("slope", [0.0, 0.05, 0.2])
def test_auto_picks_the_argmax_of_the_formula(t_draft, slope):
    costs = linear_costs(t_draft, 1.0, slope)
    for alpha in [0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]:
        rates = rates_by_hand(alpha, costs, 12)
        K = best_gamma(alpha, costs, 12)
        assert rates[K] == pytest.approx(max(rates), rel=1e-12), (alpha, t_draft, slope)
        # Where the best K wins by a visible margin, it is that K (not a near-tie broken by rounding).
        runner_up = max(r for k, r in enumerate(rates) if k != rates.index(max(rates)))
        if max(rates) > runner_up * (1 + 1e-9):
            assert K == rates.index(max(rates)), (alpha, t_draft, slope)
            # AutoGamma with no outcomes and a prior that leaves no doubt decides at the prior's α.
            assert AutoGamma(costs, prior_alpha=alpha, prior_weight=1e12).choose() == K


def beta_tokens_by_integration(a: float, b: float, K: int, points: int = 200_000) -> float:
    """E[1 + α + ... + α^K], α ~ Beta(a, b), by the midpoint rule (a, b >= 1)."""
    x = (torch.arange(points, dtype=torch.float64) + 0.5) / points
    density = x ** (a - 1) * (1 - x) ** (b - 1)
    powers = sum(x**j for j in range(K + 1))
    return float((density * powers).sum() / density.sum())


@pytest.mark.parametrize("a, b", [(2.4, 1.6), (10.4, 3.6), (1.0, 1.0), (30.0, 2.0), (1.5, 9.0)])
def test_posterior_tokens_are_the_beta_expectation(a, b):
    for K in (0, 1, 2, 5, 12):
        assert posterior_tokens(a, b, K) == pytest.approx(beta_tokens_by_integration(a, b, K), rel=1e-6)


def test_auto_maximises_the_expected_rate_over_its_beta():
    costs = linear_costs(0.1, 1.0, 0.05)
    schedule = AutoGamma(costs, prior_alpha=0.6, prior_weight=4, window=8)
    outcomes = [(4, 4), (5, 2), (6, 6), (3, 0), (6, 6), (8, 8), (2, 1)]  # (drafted, accepted)
    for drafted, accepted in [(0, 0)] + outcomes:
        if drafted:
            schedule.update(drafted, accepted)
        a, b = schedule.beta
        rates = [beta_tokens_by_integration(a, b, K) / costs.step_seconds(K) for K in range(13)]
        assert schedule.choose() == rates.index(max(rates))


def test_uncertainty_about_alpha_favours_longer_drafts():
    # The same mean α̂ = 0.75 known from 8 judged drafts or from 8000: α^j is
    # convex, so the uncertain estimate expects more of a long draft.
    costs = linear_costs(0.1, 1.0, 0.05)
    unsure = AutoGamma(costs, prior_alpha=0.75, prior_weight=8)
    sure = AutoGamma(costs, prior_alpha=0.75, prior_weight=8000)
    assert unsure.alpha_estimate == sure.alpha_estimate == pytest.approx(0.75)
    assert sure.choose() == best_gamma(0.75, costs, 12) < unsure.choose()


# Worked by hand (t_v(k) = 1 + 0.05 (k - 1), t_d = 0.1 unless stated):
#   α = 0.8: K = 4 gives 3.3616 / 1.6 = 2.101, K = 5: 3.6893 / 1.75 = 2.108,
#            K = 6: 3.9514 / 1.9 = 2.080  -> K = 5.
#   α = 0.5: K = 1: 1.5 / 1.15 = 1.304, K = 2: 1.75 / 1.3 = 1.346, K = 3: 1.875 / 1.45 = 1.293 -> K = 2.
#   α = 0.1: K = 0: 1 / 1 = 1, K = 1: 1.1 / 1.15 = 0.957 -> K = 0, a plain step.
#   α = 0.5, t_d = 0.6: K = 1: 1.5 / 1.65 = 0.909 < 1 -> K = 0.
#   α = 1, t_d = 0, no slope: every draft is free and accepted -> the largest K.
GOLDEN = [
    (0.8, 0.1, 0.05, 5),
    (0.5, 0.1, 0.05, 2),
    (0.1, 0.1, 0.05, 0),
    (0.5, 0.6, 0.05, 0),
    (1.0, 0.0, 0.0, 12),
]


@pytest.mark.parametrize("alpha, t_draft, slope, K", GOLDEN)
def test_auto_choice_golden_values(alpha, t_draft, slope, K):
    costs = linear_costs(t_draft, 1.0, slope)
    assert best_gamma(alpha, costs, 12) == K
    assert expected_rate(alpha, K, costs) >= max(expected_rate(alpha, k, costs) for k in range(13))


def test_auto_takes_plain_steps_when_drafting_cannot_pay():
    # A draft step as dear as a target step: even at α = 0.5 no K > 0 pays for itself.
    costs = linear_costs(1.0, 1.0, 0.05)
    assert best_gamma(0.5, costs, 12) == 0 == best_gamma(1.0, linear_costs(0.0, 1.0, 0.0), 0)  # K in 0 .. 0
    assert all(expected_rate(0.5, K, costs) < expected_rate(0.5, 0, costs) for K in range(1, 13))


# ---------------------------------------------------------------------------
# The running estimate α̂: prior, window, return to the prior
# ---------------------------------------------------------------------------


def test_alpha_estimate_is_the_window_plus_the_prior():
    schedule = AutoGamma(linear_costs(0.1, 1.0, 0.05), prior_alpha=0.6, prior_weight=4, window=3)
    assert schedule.alpha_estimate == pytest.approx(0.6)
    schedule.update(drafted=4, accepted=4)  # judged 4, accepted 4
    assert schedule.alpha_estimate == pytest.approx((4 + 2.4) / (4 + 4))
    schedule.update(drafted=4, accepted=1)  # judged 2 (the accepted one and the first rejected one)
    assert schedule.alpha_estimate == pytest.approx((5 + 2.4) / (6 + 4))
    schedule.update(drafted=0, accepted=0)  # a plain step judges nothing
    schedule.update(drafted=3, accepted=0)  # judged 1; the window of 3 steps drops the first
    assert schedule.alpha_estimate == pytest.approx((1 + 2.4) / (3 + 4))


def test_auto_follows_the_acceptance_rate_and_comes_back_after_plain_steps():
    schedule = AutoGamma(linear_costs(0.3, 1.0, 0.05), window=8)
    at_prior = schedule.choose()
    assert at_prior == 1  # the prior decides the first step
    for _ in range(8):
        schedule.update(drafted=schedule.choose(), accepted=schedule.choose())  # everything accepted
    assert schedule.alpha_estimate > 0.9 and schedule.choose() > 5
    for _ in range(8):
        schedule.update(drafted=max(schedule.choose(), 1), accepted=0)  # nothing accepted
    assert schedule.choose() == 0
    # Plain steps judge nothing but push the rejections out of the window: α̂
    # climbs back to the prior, and drafting resumes within `window` steps.
    plain_steps = 0
    while schedule.choose() == 0:
        schedule.update(drafted=0, accepted=0)
        plain_steps += 1
    assert 1 <= plain_steps <= 8
    for _ in range(8):
        schedule.update(drafted=0, accepted=0)
    assert schedule.alpha_estimate == pytest.approx(0.6) and schedule.choose() == at_prior


def test_auto_refuses_costs_that_do_not_cover_its_largest_gamma():
    with pytest.raises(ValueError, match="calibrate with max_tokens=13"):
        AutoGamma(linear_costs(0.1, 1.0, 0.05, max_tokens=5), max_gamma=12)
    for prior in ({"prior_alpha": 1.5}, {"prior_alpha": float("nan")}, {"prior_weight": 0.0},
                  {"prior_weight": float("nan")}, {"prior_weight": float("inf")}):
        with pytest.raises(ValueError, match="the prior needs 0 <= prior_alpha <= 1 and a finite prior_weight > 0"):
            AutoGamma(linear_costs(0.1, 1.0, 0.05), **prior)


# ---------------------------------------------------------------------------
# Hugging Face's +2/-1 heuristic, and the fixed schedule
# ---------------------------------------------------------------------------


def test_heuristic_adds_two_after_a_full_acceptance_and_takes_one_otherwise():
    schedule = HeuristicGamma(initial=5, max_gamma=10)
    seen = [schedule.choose()]
    for drafted, accepted in [(5, 5), (7, 7), (9, 2), (8, 8), (10, 10), (10, 0), (9, 9), (0, 0)]:
        schedule.update(drafted, accepted)
        seen.append(schedule.choose())
    # 5 -> 7 -> 9 -> 8 -> 10 -> 10 (capped) -> 9 -> 10 (capped) -> 10 (nothing drafted: unchanged)
    assert seen == [5, 7, 9, 8, 10, 10, 9, 10, 10]
    for _ in range(20):
        schedule.update(1, 0)
    assert schedule.choose() == 1  # never below 1


def test_fixed_schedule_and_the_names_gamma_accepts():
    drafter = NgramDrafter()
    target = tiny_gpt2(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=32, vocab_size=16), seed=0)
    assert FixedGamma(4).choose() == 4 and FixedGamma(4).max_gamma == 4
    assert make_schedule(3, target, drafter).describe() == "fixed 3"
    assert make_schedule("heuristic", target, drafter).describe() == "heuristic (+2/-1)"
    schedule = HeuristicGamma(initial=2)
    assert make_schedule(schedule, target, drafter) is schedule


@pytest.mark.parametrize("gamma", [0, -1, 2.5, True, "fast", "4", "Auto", None])
def test_bad_gamma_values_say_what_is_allowed(gamma):
    target = tiny_gpt2(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=32, vocab_size=16), seed=0)
    with pytest.raises(ValueError, match="gamma must be an integer >= 1, 'auto' or 'heuristic'"):
        make_schedule(gamma, target, NgramDrafter())


# ---------------------------------------------------------------------------
# Step costs: interpolation and the calibration cache
# ---------------------------------------------------------------------------


def test_measured_verification_costs_are_made_non_decreasing():
    assert non_decreasing([1.0, 0.9, 2.0, 1.5, 2.5]) == (1.0, 1.0, 2.0, 2.0, 2.5)


def test_calibration_takes_each_pass_relative_to_its_rounds_plain_pass():
    # Rounds at machine speeds 1, 1/1.1 and 1/3 (true costs: t_v(1) 1, t_v(2) 1.2, t_d 0.2), and one
    # noisy 2-token pass in round 0 (1.35 where 1.2 is due). Ratios within a round cancel the speed.
    seconds = {("target", 1): [1.0, 1.1, 3.0], ("target", 2): [1.35, 1.32, 3.6], ("draft", 1): [0.2, 0.22, 0.6]}
    costs = relative_medians(seconds, ("target", 1))
    assert costs == pytest.approx({("target", 1): 1.1, ("target", 2): 1.32, ("draft", 1): 0.22})
    # Medians kind by kind take t_v(2) from round 0 and t_v(1) from round 1: the noisy pass, a ratio of 1.23.
    assert statistics.median(seconds[("target", 2)]) / statistics.median(seconds[("target", 1)]) > 1.22


def test_step_costs_refuse_nonsense():
    with pytest.raises(ValueError, match="positive t_verify"):
        StepCosts(t_draft=0.1, t_verify=(1.0, 0.0))
    with pytest.raises(ValueError, match="t_draft >= 0"):
        StepCosts(t_draft=-1.0, t_verify=(1.0,))
    for t in (float("nan"), float("inf")):  # would make every K look free, or none
        with pytest.raises(ValueError, match="finite"):
            StepCosts(t_draft=t, t_verify=(1.0,))
        with pytest.raises(ValueError, match="finite"):
            StepCosts(t_draft=0.1, t_verify=(1.0, t))


CONFIG = GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=64, vocab_size=32)


def test_calibration_times_each_model_after_its_first_passes(monkeypatch):
    # On a fake clock: a target pass costs 10 + k, a draft pass 5 for its first 8 passes and 1 after them (the
    # fast path settling its thread count on a busy machine). Timed right after the prefill, t_d would be 5.
    now, calls = [0.0], {"target": 0, "draft": 0}
    monkeypatch.setattr(spec_decoding.costs, "clock", lambda device: now[0])
    target, draft = tiny_gpt2(CONFIG, seed=0), tiny_gpt2(CONFIG, seed=1)

    def costing(name):
        def hook(module, args):
            calls[name] += 1
            k = args[0].size(1)
            now[0] += 10.0 + k if name == "target" else 5.0 if calls[name] <= 8 else 1.0
        return hook

    target.register_forward_pre_hook(costing("target"))
    draft.register_forward_pre_hook(costing("draft"))
    costs = spec_decoding.costs.measure(target, draft, 4)
    assert costs.t_draft == pytest.approx(1.0)
    assert costs.t_verify == pytest.approx((11.0, 12.0, 13.0, 14.0))


def test_calibration_is_measured_once_then_read_from_disk(tmp_path, monkeypatch):
    target, draft = tiny_gpt2(CONFIG, seed=0), tiny_gpt2(CONFIG, seed=1)
    costs = calibrate(target, draft, 13, cache_dir=tmp_path)
    assert costs.max_tokens == 13 and costs.t_draft > 0
    assert all(a <= b for a, b in zip(costs.t_verify, costs.t_verify[1:]))
    (stored,) = tmp_path.glob("step-costs-*.json")
    record = json.loads(stored.read_text())
    assert record["key"]["target"]["config"]["n_embd"] == 16 and record["key"]["draft"]["dtype"] == "float32"
    assert record["key"]["machine"] and record["key"]["threads"] == 1

    def no_measuring(*args, **kwargs):
        raise AssertionError("the stored calibration should have been read")

    monkeypatch.setattr(spec_decoding.costs, "measure", no_measuring)
    assert calibrate(target, draft, 13, cache_dir=tmp_path) == costs
    # Another draft shape, no draft at all (prompt lookup), or another largest pass: a new calibration.
    monkeypatch.undo()
    other = tiny_gpt2(GPT2Config(n_layer=2, n_head=2, n_embd=16, n_ctx=64, vocab_size=32), seed=1)
    calibrate(target, other, 13, cache_dir=tmp_path)
    no_draft = calibrate(target, None, 13, cache_dir=tmp_path)
    assert no_draft.t_draft == 0.0
    assert len(list(tmp_path.glob("step-costs-*.json"))) == 3


def test_a_stored_calibration_that_is_edited_or_short_is_measured_again(tmp_path):
    target, draft = tiny_gpt2(CONFIG, seed=0), tiny_gpt2(CONFIG, seed=1)
    costs = calibrate(target, draft, 13, cache_dir=str(tmp_path))  # a folder given as text works too
    (stored,) = tmp_path.glob("step-costs-*.json")
    record = json.loads(stored.read_text())
    edits = [
        json.dumps({**record, "t_draft": float("nan")}),
        json.dumps({**record, "t_verify": record["t_verify"][:5]}),  # short
        # Decreasing: no pass measures that. (Reversing the record is no edit when its times are flat.)
        json.dumps({**record, "t_verify": [t * (13 - i) for i, t in enumerate(record["t_verify"])]}),
        json.dumps({**record, "t_draft": 10**400}),  # past any float
        "[" * 100_000,  # nested past the recursion limit
    ]
    for text in edits:
        stored.write_text(text)
        again = calibrate(target, draft, 13, cache_dir=tmp_path)
        # Measured anew: whole, finite, non-decreasing, and not the first measurement.
        assert again.max_tokens == 13 and 0 < again.t_draft < 1 and again != costs
        assert list(again.t_verify) == sorted(again.t_verify)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        calibrate(target, draft, 2.5, cache_dir=tmp_path)


def test_a_calibration_folder_that_cannot_be_looked_into_is_measured_without_it(tmp_path):
    # A name the file system refuses (too long here; a folder without permission alike) raised from gamma="auto".
    target, draft = tiny_gpt2(CONFIG, seed=0), tiny_gpt2(CONFIG, seed=1)
    costs = calibrate(target, draft, 13, cache_dir=tmp_path / ("x" * 300))
    assert costs.max_tokens == 13 and costs.t_draft > 0


def test_the_calibration_key_names_the_forward_path(tmp_path, fast_kernels):
    from gpt2 import fast

    target, draft = tiny_gpt2(CONFIG, seed=0), tiny_gpt2(CONFIG, seed=1)
    readable = spec_decoding.costs.calibration_key(target, draft, 13)
    fast.accelerate(draft, int8=True)
    quantised = spec_decoding.costs.calibration_key(target, draft, 13)
    assert "int8 weights" in quantised["draft"]["path"] and readable["draft"]["path"] != quantised["draft"]["path"]
    assert readable["target"] == quantised["target"]


def test_gamma_auto_calibrates_once_per_pair(tmp_path, monkeypatch):
    from spec_decoding import speculative_generate

    monkeypatch.setattr(spec_decoding.costs, "default_cache_dir", lambda: tmp_path)
    target, draft = tiny_gpt2(CONFIG, seed=0), tiny_gpt2(CONFIG, seed=1)
    ids = torch.tensor([[1, 2, 3]])
    out, stats = speculative_generate(target, ModelDrafter(draft), ids, gamma="auto", max_new_tokens=10)
    assert stats.gamma == 12 and sum(stats.gamma_hist) == stats.target_calls
    assert len(list(tmp_path.glob("step-costs-*.json"))) == 1
    speculative_generate(target, draft, ids, gamma="auto", max_new_tokens=10)
    assert len(list(tmp_path.glob("step-costs-*.json"))) == 1


@pytest.mark.parametrize("n_ctx, vocab_size", [(64, 5), (8, 32), (2, 32)])
def test_gamma_auto_fits_a_small_vocabulary_and_a_short_window(tmp_path, monkeypatch, n_ctx, vocab_size):
    # The calibration times passes of up to K + 1 tokens: their ids must be in the
    # vocabulary, and their length within the window (the largest K shrinks with it).
    from gpt2 import generate
    from spec_decoding import speculative_generate

    monkeypatch.setattr(spec_decoding.costs, "default_cache_dir", lambda: tmp_path)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=n_ctx, vocab_size=vocab_size)
    target, draft = tiny_gpt2(config, seed=0), tiny_gpt2(config, seed=1)
    ids = torch.tensor([[1]])
    for drafter in (ModelDrafter(draft), NgramDrafter()):
        out, stats = speculative_generate(target, drafter, ids, gamma="auto", max_new_tokens=n_ctx)
        assert stats.gamma == min(12, n_ctx - 1)
        assert out.tolist() == generate(target, ids, n_ctx).tolist()
    assert make_schedule("heuristic", target, NgramDrafter()).max_gamma == min(12, n_ctx - 1)


def test_a_draft_whose_window_is_shorter_than_the_largest_gamma_is_calibrated(tmp_path):
    target = tiny_gpt2(CONFIG, seed=0)
    draft = tiny_gpt2(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=4, vocab_size=32), seed=1)
    costs = calibrate(target, draft, 13, cache_dir=tmp_path)  # the draft's passes are one token
    assert costs.max_tokens == 13 and costs.t_draft > 0


@pytest.mark.parametrize("gamma", [32, 10**8, 2**63, HeuristicGamma(max_gamma=40)])
def test_a_gamma_the_window_could_never_verify_says_the_most_it_can_be(gamma):
    target = tiny_gpt2(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=32, vocab_size=16), seed=0)
    with pytest.raises(ValueError, match="context window of 32 could ever verify: give at most 31"):
        make_schedule(gamma, target, NgramDrafter())
    assert make_schedule(31, target, NgramDrafter()).max_gamma == 31


def test_gamma_auto_takes_a_drafter_written_to_the_abc_without_a_model(tmp_path, monkeypatch):
    from gpt2 import generate
    from spec_decoding import Draft, Drafter, speculative_generate

    class RepeatLast(Drafter):
        """Proposes the last token again: no model, so drafting costs nothing (`Drafter.model` is None)."""

        vocab_size = None

        def prefill(self, prefix):
            pass

        def max_draft(self, seq_len):
            return 10**9

        def propose(self, seq, K, sampling, generator):
            return Draft(tokens=seq[0, -1:].repeat(K), probs=None, forward_calls=0)

        def rewind(self, valid):
            pass

    monkeypatch.setattr(spec_decoding.costs, "default_cache_dir", lambda: tmp_path)
    target = tiny_gpt2(CONFIG, seed=0)
    ids = torch.tensor([[1, 2, 3]])
    out, stats = speculative_generate(target, RepeatLast(), ids, gamma="auto", max_new_tokens=10)
    assert out.tolist() == generate(target, ids, 10).tolist()
    assert sum(stats.gamma_hist) == stats.target_calls and stats.draft_calls == 0
    (stored,) = tmp_path.glob("step-costs-*.json")
    assert json.loads(stored.read_text())["t_draft"] == 0.0


HELPER_MISTAKES = {
    "StepCosts of text": (lambda m: StepCosts("1", (0.01,)), "step costs need a finite t_draft"),
    "StepCosts of one time": (lambda m: StepCosts(0.0, 0.01), "step costs need a finite t_draft"),
    "AutoGamma without costs": (lambda m: AutoGamma(None), "costs must be StepCosts"),
    "a prior as text": (lambda m: AutoGamma(StepCosts(0.001, (0.01,) * 13), prior_alpha="0.5"),
                        "the prior needs 0 <= prior_alpha <= 1 and a finite prior_weight > 0, got '0.5'"),
    "calibrate with a name": (lambda m: calibrate(m, "gpt2", 4), "calibrate times loaded GPT2 models"),
    "SpecStats of 2.5": (lambda m: SpecStats(2.5), r"SpecStats' gamma .* must be an integer >= 0, got 2.5"),
    "SpecStats of -1": (lambda m: SpecStats(-1), r"SpecStats' gamma .* must be an integer >= 0, got -1"),
    "TreeShape.parse(None)": (lambda m: TreeShape.parse(None), "a tree shape is children per depth"),
    "a seed of 1.5": (lambda m: SimulatedDrafter(m, torch.tensor([1, 2]), 0.5, seed=1.5),
                      "the simulated drafter's seed must be an integer"),
    "first_row -1": (lambda m: SimulatedBatchDrafter(m, [[1, 2]], 0.5, first_row=-1),
                     "first_row must be an integer >= 0, got -1"),
    # An AssertionError, a meaningless ValueError, an AttributeError, a TypeError, a K of 0 for NaN:
    "best_gamma past its costs": (lambda m: best_gamma(0.5, StepCosts(0.1, (1.0, 1.1)), 5),
                                  "max_gamma 5 needs the cost of a pass over 6 tokens; .* give max_gamma <= 1"),
    "best_gamma one past its costs": (lambda m: best_gamma(0.5, StepCosts(0.1, (1.0, 1.1)), 2),
                                      "max_gamma 2 needs the cost of a pass over 3 tokens; .* give max_gamma <= 1"),
    "best_gamma of -1": (lambda m: best_gamma(0.5, StepCosts(0.1, (1.0, 1.1)), -1), "max_gamma must be an integer"),
    "best_gamma of 1.5": (lambda m: best_gamma(0.5, StepCosts(0.1, (1.0, 1.1)), 1.5), "max_gamma must be an integer"),
    "best_gamma without costs": (lambda m: best_gamma(0.5, None, 1), "costs must be StepCosts"),
    "best_gamma at alpha NaN": (lambda m: best_gamma(float("nan"), StepCosts(0.1, (1.0, 1.1)), 1),
                                r"alpha \(an acceptance rate\) must be a number in \[0, 1\], got nan"),
    "BatchStats of 2.5 rows": (lambda m: BatchStats(2, 2.5), "BatchStats' num_rows .* must be an integer >= 1"),
    "BatchStats of -1 rows": (lambda m: BatchStats(2, -1), "BatchStats' num_rows .* must be an integer >= 1"),
    "eq. 1 at alpha 1.2": (lambda m: expected_tokens_per_step(1.2, 3), r"alpha .* must be a number in \[0, 1\]"),
    "Theorem 3.8 of c as text": (lambda m: improvement_factor(0.5, 3, "0.1"), "c = t_d / t_t must be a number >= 0"),
    "a verification that costs nothing": (lambda m: predicted_speedup(0.5, 0, 0.0, 1.0, 0.0),
                                          "t_verify must be a number > 0, got 0.0"),
    "a target step that never ends": (lambda m: predicted_speedup(0.5, 2, 1.0, float("inf"), 1.0),
                                      "t_target must be a number > 0, got inf"),  # it returned inf
    "an infinite c": (lambda m: improvement_factor(0.5, 0, float("inf")), "c = t_d / t_t must be a number >= 0"),
    # An AssertionError (none under python -O: K = -1 read the last pass's cost), an IndexError, a TypeError.
    "a step of K = -1": (lambda m: StepCosts(0.1, (1.0, 1.1)).step_seconds(-1), r"K must be an integer in 0\.\.1"),
    "a step of K = 2": (lambda m: StepCosts(0.1, (1.0, 1.1)).step_seconds(2), r"no verification cost for K = 2"),
    "a step of K = 0.5": (lambda m: StepCosts(0.1, (1.0, 1.1)).step_seconds(0.5), r"K must be an integer"),
    # An OverflowError: Python's int had no float to become.
    "eq. 1 at gamma 10^400": (lambda m: expected_tokens_per_step(0.8, 10**400), r"gamma .* must be below 2\*\*53"),
    "eq. 1 at alpha 1, gamma 10^400": (lambda m: expected_tokens_per_step(1.0, 10**400), r"must be below 2\*\*53"),
    "a c of 10^400": (lambda m: improvement_factor(0.5, 2, 10**400), "c = t_d / t_t must be a number >= 0"),
}


@pytest.mark.parametrize("mistake", HELPER_MISTAKES)
def test_the_exported_helpers_refuse_what_they_cannot_use_in_one_line(mistake):
    # Each was a TypeError, AttributeError or RuntimeError from inside, or (-1, first_row -1) taken.
    make, message = HELPER_MISTAKES[mistake]
    with pytest.raises(ValueError, match=message):
        make(tiny_gpt2(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=32, vocab_size=50), seed=0))


def test_gamma_auto_refuses_bad_stats_before_it_calibrates(tmp_path, monkeypatch):
    from spec_decoding import speculative_generate

    def calibrate(*args, **kwargs):
        raise AssertionError("a bad stats argument must be refused before the step costs are timed")

    monkeypatch.setattr(spec_decoding.schedule, "calibrate", calibrate)
    target, draft = tiny_gpt2(CONFIG, seed=0), tiny_gpt2(CONFIG, seed=1)
    used = SpecStats(12)
    used.record_step(2, 1, target_token=True)
    for stats in (object(), used):
        with pytest.raises(ValueError, match=r"stats must be a fresh SpecStats"):
            speculative_generate(target, draft, torch.tensor([[1, 2, 3]]), gamma="auto", max_new_tokens=4,
                                 stats=stats)


def test_a_schedule_learns_from_the_drafts_a_step_made_not_the_k_it_asked_for():
    # Prompt lookup proposes fewer tokens than asked, or none, where the text does not repeat: a schedule told
    # it drafted K judged a rejection that never happened (AutoGamma's α would fall for nothing).
    from spec_decoding import speculative_generate

    class Recording(FixedGamma):
        def __init__(self, gamma: int) -> None:
            super().__init__(gamma)
            self.updates: list[tuple[int, int]] = []

        def update(self, drafted: int, accepted: int) -> None:
            self.updates.append((drafted, accepted))

    target = tiny_gpt2(CONFIG, seed=0)
    schedule = Recording(4)
    ids = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3, 6, 7]])
    _, stats = speculative_generate(target, NgramDrafter(n=2), ids, gamma=schedule, max_new_tokens=20)
    drafted = [d for d, _ in schedule.updates]
    assert len(drafted) == stats.target_calls and sum(drafted) == stats.drafted
    assert min(drafted) < 4, "some step must draft fewer tokens than asked for the test to tell them apart"


def test_on_a_tie_the_shortest_draft_wins():
    # Drafting costs work and risks nothing it can gain: of K that promise the same rate, the smallest.
    assert fastest(lambda K: [1.0, 2.0, 3.0, 3.0, 1.0][K], 4) == 2
    assert fastest(lambda K: 1.0, 4) == 0
