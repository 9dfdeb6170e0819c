"""Smarter and cheaper drafting keeps greedy output identical to the target's.

Checked token for token against `gpt2.generate` of the target alone, on tiny
random GPT-2s (the models of test_speculative.py):

- γ schedules: `gamma="auto"`, the +2/-1 heuristic, and a schedule that
  cycles through K = 0, 3, 1, 5, 2 (plain steps mid-run included);
- `ModelDrafter(p_min=...)`, which may stop before K tokens, even at 0;
- `NgramDrafter` (prompt lookup), whose proposals run out when nothing
  matches: the loop then takes plain target steps; plus its matching rule on
  hand-made sequences (golden proposals);
- an int8 draft (weights rounded to int8) against the float32 target, on the
  readable path and on the C fast path: the output stays the float32 target's.

Sampling exactness for the same cases is in test_drafting_lossless.py.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import spec_decoding.costs
from gpt2 import GPT2Config, fast, generate
from gpt2.fast.quantize import quantize_model_int8
from gpt2.sampling import SamplingConfig
from spec_decoding import (
    BatchDrafter,
    AutoGamma,
    GammaSchedule,
    HeuristicGamma,
    ModelDrafter,
    NgramDrafter,
    StepCosts,
    speculative_generate,
)
from helpers import ForwardRecorder, perturbed_copy, three_drafts, tiny_gpt2

pytestmark = pytest.mark.usefixtures("single_thread")

TARGET_CONFIG = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_ctx=64, vocab_size=64)
PROMPT = [[1, 2, 3, 4]]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def target():
    return tiny_gpt2(TARGET_CONFIG, seed=0)


@pytest.fixture(scope="module")
def drafts(target):
    return three_drafts(target)


def baseline(target, ids=None, n=NEW_TOKENS) -> list[list[int]]:
    return generate(target, torch.tensor(PROMPT) if ids is None else ids, n).tolist()


class CyclingGamma(GammaSchedule):
    """K = 0, 3, 1, 5, 2, 0, 3, ...: a schedule that varies every step, plain steps included."""

    def __init__(self, cycle=(0, 3, 1, 5, 2)) -> None:
        self.cycle, self.step, self.max_gamma = cycle, 0, max(cycle)

    def choose(self) -> int:
        return self.cycle[self.step % len(self.cycle)]

    def update(self, drafted: int, accepted: int) -> None:
        self.step += 1

    def describe(self) -> str:
        return "cycling"


# Costs under which auto's K moves with α̂ on this pair (K = 1..5 for α̂ 0.3..0.8).
VARYING_COSTS = StepCosts(t_draft=0.15, t_verify=tuple(1.0 + 0.05 * k for k in range(13)))


# ---------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------

SCHEDULES = {
    "auto": lambda: AutoGamma(VARYING_COSTS, window=4),
    "heuristic": lambda: HeuristicGamma(initial=3, max_gamma=8),
    "cycling": CyclingGamma,
}


@pytest.mark.parametrize("draft_name", ["self", "unrelated", "perturbed"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_greedy_output_does_not_depend_on_the_schedule(target, drafts, draft_name, schedule):
    out, stats = speculative_generate(
        target, drafts[draft_name], torch.tensor(PROMPT), gamma=SCHEDULES[schedule](), max_new_tokens=NEW_TOKENS
    )
    assert out.tolist() == baseline(target)
    assert sum(stats.gamma_hist) == stats.target_calls
    assert stats.drafted == sum(K * steps for K, steps in enumerate(stats.gamma_hist))  # ModelDrafter drafts all K
    if draft_name == "perturbed" or schedule == "cycling":
        assert sum(steps > 0 for steps in stats.gamma_hist) >= 3, stats.gamma_hist  # K really varied


def test_auto_drafts_long_for_a_perfect_draft_and_stops_drafting_for_a_useless_one(target, drafts):
    ids = torch.tensor(PROMPT)
    _, perfect = speculative_generate(target, drafts["self"], ids, gamma=AutoGamma(VARYING_COSTS), max_new_tokens=60)
    assert perfect.alpha == 1.0 and max(K for K, n in enumerate(perfect.gamma_hist) if n) >= 10
    _, useless = speculative_generate(
        target, drafts["unrelated"], ids, gamma=AutoGamma(VARYING_COSTS), max_new_tokens=60
    )
    assert useless.alpha < 0.2 and useless.gamma_hist[0] > useless.target_calls / 2  # mostly plain steps


def test_gamma_auto_by_name(target, drafts, tmp_path, monkeypatch):
    monkeypatch.setattr(spec_decoding.costs, "default_cache_dir", lambda: tmp_path)  # the calibration goes here
    out, stats = speculative_generate(
        target, drafts["perturbed"], torch.tensor(PROMPT), gamma="auto", max_new_tokens=NEW_TOKENS
    )
    assert out.tolist() == baseline(target) and stats.gamma == 12


# ---------------------------------------------------------------------------
# p_min: stop drafting when the draft is unsure
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("p_min", [0.0, 0.3, 0.6, 1.0])
def test_p_min_keeps_the_output_and_drafts_less(target, drafts, p_min):
    drafter = ModelDrafter(drafts["perturbed"], p_min=p_min)
    with ForwardRecorder(drafts["perturbed"]) as recorder:
        out, stats = speculative_generate(target, drafter, torch.tensor(PROMPT), gamma=4, max_new_tokens=NEW_TOKENS)
    assert out.tolist() == baseline(target)
    asked = sum(K * steps for K, steps in enumerate(stats.gamma_hist))
    assert stats.draft_calls == len(recorder.calls) - 1  # every pass after the prefill is counted
    if p_min == 0.0:
        assert stats.drafted == asked
    elif p_min == 1.0:  # never sure enough: one pass per step, nothing proposed
        assert stats.drafted == 0 and stats.plain_steps == stats.target_calls
    else:
        assert 0 < stats.drafted < asked
        assert stats.drafted <= stats.draft_calls <= asked


def test_p_min_that_stops_every_chain_at_once_when_sampling_takes_plain_steps(target, drafts):
    # Sampling, an empty draft carries (0, V) probs, which the loop checks like any draft.
    drafter = ModelDrafter(drafts["perturbed"], p_min=1.0)
    out, stats = speculative_generate(target, drafter, torch.tensor(PROMPT), gamma=4, max_new_tokens=NEW_TOKENS,
                                      temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert out.size(1) == len(PROMPT[0]) + NEW_TOKENS == len(PROMPT[0]) + stats.new_tokens
    assert stats.drafted == 0 and stats.plain_steps == stats.target_calls == NEW_TOKENS


def test_p_min_reads_the_draft_under_the_runs_own_filter():
    # When sampling, the draft's confidence is the top probability it samples from (here sharpened by a
    # temperature of 0.5: 0.87, not the 0.64 at temperature 1); greedy has no such distribution and reads
    # temperature 1.
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    sharp = SamplingConfig(temperature=0.5, top_k=3)
    assert ModelDrafter.confidence(logits, sharp) == pytest.approx(float(torch.softmax(2 * logits[:3], -1)[0]))
    assert ModelDrafter.confidence(logits, SamplingConfig(0.0)) == pytest.approx(float(torch.softmax(logits, -1)[0]))


@pytest.mark.parametrize("p_min", [1.5, -0.1, True, "0.5"])  # True was a threshold of 1: it drafted nothing
def test_p_min_must_be_a_probability(drafts, p_min):
    with pytest.raises(ValueError, match=r"p_min must be a probability in \[0, 1\]"):
        ModelDrafter(drafts["perturbed"], p_min=p_min)
    assert ModelDrafter(drafts["perturbed"], p_min=np.float32(0.5)).p_min == 0.5  # was refused as no probability


@pytest.mark.parametrize("model", ["gpt2", None])
def test_a_model_drafter_needs_a_loaded_model(model):
    with pytest.raises(ValueError, match="the draft must be a loaded GPT2 model, got .*gpt2.load_model"):
        ModelDrafter(model)


# ---------------------------------------------------------------------------
# Prompt lookup
# ---------------------------------------------------------------------------

# (sequence, n, K, proposal): the longest suffix first, its latest earlier
# occurrence, a copy that runs on into what it has just proposed.
NGRAM_GOLDEN = [
    ([1, 2, 3, 4, 1, 2, 3], 3, 4, [4, 1, 2, 3]),  # suffix 1 2 3 found at 0: copy from 3
    ([5, 2, 3, 9, 2, 3, 7, 1, 2, 3], 3, 2, [7, 1]),  # 1 2 3 is new; 2 3 last seen at 4: copy from 6
    ([2, 3, 9, 8, 3, 6, 2, 3], 1, 2, [6, 2]),  # n = 1: only the last token, latest occurrence (4)
    ([2, 3, 9, 8, 3, 6, 2, 3], 2, 2, [9, 8]),  # n = 2: 2 3 at 0 beats the later 3
    ([7, 7, 7], 3, 3, [7, 7, 7]),  # a loop of period 1 goes on
    ([1, 2, 1, 2], 3, 3, [1, 2, 1]),  # period 2: the copy reads its own proposal
    ([1, 2, 3], 3, 4, []),  # nothing repeats: no proposal
    ([5], 3, 4, []),  # a single token has nothing before it
]


@pytest.mark.parametrize("sequence, n, K, proposal", NGRAM_GOLDEN)
def test_ngram_proposals(sequence, n, K, proposal):
    draft = NgramDrafter(n).propose(torch.tensor([sequence]), K, SamplingConfig(), None)
    assert draft.tokens.tolist() == proposal
    assert draft.probs is None and draft.forward_calls == 0


def test_ngram_needs_a_positive_n():
    with pytest.raises(ValueError, match="n-gram length n"):
        NgramDrafter(0)


# A prompt that repeats itself, and one that never does.
NGRAM_PROMPTS = {"repeating": [[5, 9, 13, 5, 9, 13, 5, 9]], "no repeats": [[1, 2, 3, 4]]}


INTEGER_DTYPES = [torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64]


class CastNgramDrafter(NgramDrafter):
    """Prompt lookup proposing ids of another integer dtype, which check_draft allows."""

    def __init__(self, n: int, dtype: torch.dtype) -> None:
        super().__init__(n)
        self.dtype = dtype

    def propose(self, *args, **kwargs):
        draft = super().propose(*args, **kwargs)
        draft.tokens = draft.tokens.to(self.dtype)
        return draft


class CastBatchDrafter(BatchDrafter):
    """The batch drafter proposing ids of another integer dtype."""

    def __init__(self, model, dtype: torch.dtype) -> None:
        super().__init__(model)
        self.dtype = dtype

    def propose(self, *args):
        draft = super().propose(*args)
        return replace(draft, tokens=draft.tokens.to(self.dtype))


@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=str)
def test_a_drafter_proposing_ids_of_any_integer_dtype_samples_as_with_int64(target, dtype):
    """int32 sampling made p_draft with one_hot, which takes int64 only; int16 and int8 indexed the probabilities
    with a dtype indexing refuses, uint8 as a mask, and the unsigned ones had no < 0 for the range check."""
    ids = torch.tensor(NGRAM_PROMPTS["repeating"])
    runs = [speculative_generate(target, drafter, ids, gamma=4, max_new_tokens=NEW_TOKENS, temperature=1.0,
                                 generator=torch.Generator().manual_seed(3))
            for drafter in (NgramDrafter(2), CastNgramDrafter(2, dtype))]
    (out64, stats64), (out_cast, stats_cast) = runs
    assert torch.equal(out_cast, out64) and stats_cast.drafted == stats64.drafted > 0
    draft = perturbed_copy(target, scale=0.05, seed=4)
    batches = [speculative_generate(target, drafter, [[5, 9, 13], [2]], gamma=3, max_new_tokens=NEW_TOKENS,
                                    temperature=1.0, generator=[torch.Generator().manual_seed(s) for s in (1, 2)])[0]
               for drafter in (BatchDrafter(draft), CastBatchDrafter(draft, dtype))]
    assert batches[0] == batches[1]


@pytest.mark.parametrize("prompt_name", NGRAM_PROMPTS)
@pytest.mark.parametrize("gamma", [1, 4, "heuristic"])
@pytest.mark.parametrize("n", [1, 3])
def test_ngram_greedy_equals_baseline_with_plain_steps_where_nothing_matches(target, prompt_name, gamma, n):
    ids = torch.tensor(NGRAM_PROMPTS[prompt_name])
    out, stats = speculative_generate(target, NgramDrafter(n), ids, gamma=gamma, max_new_tokens=NEW_TOKENS)
    assert out.tolist() == baseline(target, ids)
    assert stats.draft_calls == 0
    no_proposal = stats.plain_steps - stats.gamma_hist[0]  # asked for K > 0, got nothing
    assert no_proposal >= 1  # steps where nothing matched
    assert stats.accepted > 0  # and steps where a copy was right


def test_ngram_drafter_has_no_vocabulary_to_check(target):
    # A target of another vocabulary size: the drafter only repeats the sequence's own tokens.
    other = tiny_gpt2(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=64, vocab_size=200), seed=5)
    ids = torch.tensor([[150, 7, 150, 7]])
    out, _ = speculative_generate(other, NgramDrafter(), ids, gamma=3, max_new_tokens=12)
    assert out.tolist() == baseline(other, ids, 12)


# ---------------------------------------------------------------------------
# An int8 draft for a float32 target
# ---------------------------------------------------------------------------


def int8_copy(model):
    copy = perturbed_copy(model, scale=0.0, seed=0)  # an exact copy
    quantize_model_int8(copy)
    return copy


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_int8_draft_keeps_the_float32_targets_output(target, drafts, gamma):
    draft = int8_copy(drafts["perturbed"])
    assert not torch.equal(draft.h[0].mlp.c_fc.weight, drafts["perturbed"].h[0].mlp.c_fc.weight)  # really rounded
    out, stats = speculative_generate(target, draft, torch.tensor(PROMPT), gamma=gamma, max_new_tokens=NEW_TOKENS)
    assert out.tolist() == baseline(target)
    assert 0 < stats.alpha < 1


@pytest.mark.parametrize("gamma", [3, "heuristic"])
def test_int8_draft_on_the_fast_path_keeps_the_float32_targets_output(target, drafts, fast_kernels, gamma):
    fast_target = perturbed_copy(target, scale=0.0, seed=0)
    fast.accelerate(fast_target)
    draft = fast.accelerate(perturbed_copy(drafts["perturbed"], scale=0.0, seed=0), int8=True)
    assert "int8 weights" in fast.status(draft) and "float32 weights" in fast.status(fast_target)
    expected = baseline(fast_target)
    assert expected == baseline(target)  # the fast float32 target is the readable one, token for token
    out, stats = speculative_generate(fast_target, draft, torch.tensor(PROMPT), gamma=gamma, max_new_tokens=NEW_TOKENS)
    assert out.tolist() == expected and stats.accepted > 0
