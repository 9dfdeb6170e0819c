"""Baseline generation (gpt2/generate.py) and the one sampling filter
(gpt2/sampling.py).

Greedy decoding is checked token for token against transformers' `generate`
with the same weights; sampling against a seeded `torch.Generator`; the filter
on hand-made logits whose answers can be worked out by hand.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import TINY, hub_state_dict, make_hf_model, write_checkpoint
from gpt2 import GPT2, GPT2Config, SamplingConfig, generate, load_model, logits_to_probs, next_token, sample
from gpt2.sampling import GREEDY_BELOW_TEMPERATURE, MAX_TEMPERATURE, check_generator


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(our tiny GPT-2, transformers' GPT2LMHeadModel), same weights via model.safetensors."""
    hf = make_hf_model(TINY, seed=11)
    folder = write_checkpoint(tmp_path_factory.mktemp("tiny"), TINY, hub_state_dict(hf))
    return load_model(folder), hf


def prompt(B: int = 1, T: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------


def test_greedy_equals_transformers_greedy_token_for_token(models):
    ours, hf = models
    ids = prompt(B=2, T=8)
    got = generate(ours, ids, 40)
    with torch.no_grad():
        expected = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False, pad_token_id=0
        )
    assert got.shape == (2, 48)
    assert torch.equal(got[:, :8], ids), "the prompt comes first, unchanged"
    assert got.tolist() == expected.tolist()


def test_greedy_is_deterministic(models):
    ours, _ = models
    ids = prompt(seed=1)
    assert torch.equal(generate(ours, ids, 20), generate(ours, ids, 20))


def test_sampling_with_the_same_seed_reproduces_and_another_seed_differs(models):
    ours, _ = models
    ids = prompt(seed=2)

    def run(seed: int) -> torch.Tensor:
        return generate(ours, ids, 30, temperature=1.0, generator=torch.Generator().manual_seed(seed))

    first = run(123)
    assert first.shape == (1, 38)
    assert torch.equal(first, run(123))
    assert not torch.equal(first, run(124))
    assert not torch.equal(first, generate(ours, ids, 30)), "sampling at temperature 1 is not greedy"


@pytest.mark.parametrize("sampling_filter", [{"top_k": 1}, {"top_p": 1e-9}])
def test_sampling_with_a_filter_that_keeps_one_token_is_greedy(models, sampling_filter):
    ours, _ = models
    ids = prompt(seed=3)
    sampled = generate(ours, ids, 15, temperature=0.7, generator=torch.Generator().manual_seed(0), **sampling_filter)
    assert torch.equal(sampled, generate(ours, ids, 15))


def test_eos_stops_generation_and_is_kept_as_the_last_token(models):
    ours, _ = models
    ids = prompt(seed=4)
    free = generate(ours, ids, 20)[0, 8:].tolist()  # greedy, never stopped
    # The first token that greedy decoding produces for the first time at a
    # step k >= 2: with it as EOS, the output must end right at step k.
    k = next(k for k in range(2, len(free)) if free[k] not in free[:k])
    eos_id = free[k]

    stopped = generate(ours, ids, 20, eos_id=eos_id)
    assert stopped[0].tolist() == ids[0].tolist() + free[: k + 1]
    assert stopped[0, -1].item() == eos_id


def test_a_row_that_ends_early_is_padded_with_eos(models):
    ours, _ = models
    ids = prompt(B=2, T=8, seed=4)
    free = generate(ours, ids, 12)[:, 8:].tolist()  # (2, 12) greedy, never stopped
    # A token that row 0 produces first at step k >= 1 and row 1 never produces.
    k = next(k for k in range(1, 12) if free[0][k] not in free[0][:k] and free[0][k] not in free[1])
    eos_id = free[0][k]

    out = generate(ours, ids, 12, eos_id=eos_id)
    assert out.shape == (2, 20), "row 1 never ends, so all 12 steps run"
    assert out[0, 8:].tolist() == free[0][: k + 1] + [eos_id] * (11 - k)
    assert out[1, 8:].tolist() == free[1]


def test_the_context_window_stops_generation(models):
    ours, _ = models
    n_ctx = TINY.n_ctx
    ids = prompt(T=n_ctx - 5, seed=6)
    out = generate(ours, ids, 20)
    assert out.shape == (1, n_ctx)
    assert torch.equal(out[:, : n_ctx - 5], ids)

    last = generate(ours, prompt(T=n_ctx - 1, seed=7), 10, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert last.shape == (1, n_ctx), "one token of room: one new token"


@pytest.mark.parametrize("prompts, where", [(torch.tensor([[1]]), ""), ([[1], [2]], "row 0: ")])
def test_a_window_of_one_token_says_no_prompt_fits(prompts, where):
    # It said "shorten it to at most 0 tokens", a prompt that cannot be given.
    model = GPT2(GPT2Config(n_layer=1, n_head=1, n_embd=8, vocab_size=10, n_ctx=1)).eval()
    with pytest.raises(ValueError, match=rf"^{where}the context window is 1, too small for a prompt and a new token: "
                                         r"use a model with a larger window \(n_ctx\)$"):
        generate(model, prompts, 5)


def test_zero_new_tokens_returns_the_prompt(models):
    ours, _ = models
    ids = prompt(seed=8)
    assert torch.equal(generate(ours, ids, 0), ids)


@pytest.mark.parametrize(
    "make_ids, match",
    [
        (lambda: prompt(T=TINY.n_ctx), rf"{TINY.n_ctx} tokens but the context window is {TINY.n_ctx}"),
        (lambda: prompt(T=TINY.n_ctx + 3), "context window"),
        (lambda: torch.zeros(1, 0, dtype=torch.long), "empty"),
        (lambda: torch.tensor([1, 2, 3]), r"\(batch, tokens\) tensor"),
        (lambda: torch.tensor([[1.0, 2.0]]), "integer token ids"),
        (lambda: torch.tensor([[1, TINY.vocab_size]]),
         rf"token ids must lie in \[0, {TINY.vocab_size}\), got ids from 1 to {TINY.vocab_size}$"),  # no row named
        (lambda: torch.tensor([[-1, 2]]), "token ids must lie in"),
        (lambda: torch.tensor([[1, 2]], dtype=torch.uint16), r"input_ids must hold integer token ids \(int64, .*\), "
                                                             r"got torch.uint16: convert them with .long\(\)"),
        (lambda: [np.array([1, 2], dtype=np.uint16)], r"row 0 must hold integer token ids \(int64, .*\), got "
                                                      r"torch.uint16: convert them with .long\(\)"),
    ],
    ids=["prompt_fills_context", "prompt_too_long", "empty", "1d", "float", "id_too_large", "negative_id", "uint16",
         "uint16_row"],
)
def test_bad_prompts_raise_value_error(models, make_ids, match):
    ours, _ = models
    with pytest.raises(ValueError, match=match):
        generate(ours, make_ids(), 5)


@pytest.mark.parametrize("max_new_tokens", [-1, 2.5, True, "10"])
def test_bad_max_new_tokens_raises_value_error(models, max_new_tokens):
    ours, _ = models
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0"):
        generate(ours, prompt(), max_new_tokens)


@pytest.mark.parametrize(
    "setting, match",
    [
        ({"temperature": -0.5}, "temperature must be a number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a number >= 0"),
        ({"temperature": float("inf")}, "temperature must be a number >= 0"),
        ({"temperature": 2**1024}, "temperature must be a number >= 0"),  # an int past float's range
        ({"temperature": 1e39}, r"temperature must be a number >= 0 \(0 = greedy\) and <= 3.4e\+38, got 1e\+39"),
        ({"temperature": 1.0, "top_k": 0}, "top_k must be an integer >= 1"),
        ({"temperature": 1.0, "top_k": 2.5}, "top_k must be an integer >= 1"),
        ({"temperature": 1.0, "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"temperature": 1.0, "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_sampling_settings_raise_value_error(models, setting, match):
    ours, _ = models
    with pytest.raises(ValueError, match=match):
        generate(ours, prompt(), 5, **setting)


def test_an_integer_temperature_past_64_bits_samples_like_its_float(models):
    # torch cannot divide float logits by such an int ("int too big to convert"): the config keeps a float
    ours, _ = models
    assert SamplingConfig(2**100).temperature == float(2**100) and SamplingConfig(1).temperature == 1.0
    out = generate(ours, prompt(), 5, temperature=2**100, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, prompt().size(1) + 5)


def test_the_temperature_bounds_are_where_the_config_says():
    # Greedy strictly below GREEDY_BELOW_TEMPERATURE; the largest float32 is still a temperature.
    assert SamplingConfig(math.nextafter(GREEDY_BELOW_TEMPERATURE, 0.0)).greedy
    assert not SamplingConfig(GREEDY_BELOW_TEMPERATURE).greedy
    assert SamplingConfig(MAX_TEMPERATURE).temperature == MAX_TEMPERATURE


# ---------------------------------------------------------------------------
# logits_to_probs, on hand-made logits
# ---------------------------------------------------------------------------

# Probabilities 0.5, 0.3, 0.15, 0.05, stored out of order to check that the
# filters map their decisions back to vocabulary order.
HAND_PROBS = torch.tensor([0.15, 0.5, 0.05, 0.3])
HAND_LOGITS = HAND_PROBS.log()


def kept(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


def test_greedy_is_one_hot_on_the_argmax_with_ties_to_the_lowest_id():
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    probs = logits_to_probs(logits, SamplingConfig(temperature=0.0))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    assert next_token(logits, SamplingConfig()).tolist() == [1, 0]


def test_temperature_divides_the_logits():
    logits = torch.tensor([1.0, 2.0, 4.0, -3.0])
    for temperature in (0.5, 1.0, 3.0):
        probs = logits_to_probs(logits, SamplingConfig(temperature=temperature))
        assert torch.allclose(probs, torch.softmax(logits / temperature, dim=-1), atol=1e-7)
    # Lower temperature sharpens: the most likely token gains probability.
    cold = logits_to_probs(logits, SamplingConfig(temperature=0.5))
    hot = logits_to_probs(logits, SamplingConfig(temperature=3.0))
    assert cold[2] > hot[2]


def test_top_k_keeps_k_tokens_at_the_largest_temperature():
    # Divided by 3e38, 1e-7 and 2e-7 both round to 0 in float32: top-k ranks the logits as given, not the divided ones.
    logits = torch.tensor([1e-7, 2e-7, 0.0, float("-inf")])
    probs = logits_to_probs(logits, SamplingConfig(temperature=3e38, top_k=1))
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]
    probs = logits_to_probs(logits, SamplingConfig(temperature=3e38, top_k=3))
    assert torch.allclose(probs, torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0]))  # the masked token stays impossible


@pytest.mark.parametrize("k, expected", [(1, {1}), (2, {1, 3}), (3, {0, 1, 3}), (4, {0, 1, 2, 3}), (10, {0, 1, 2, 3})])
def test_top_k_keeps_exactly_the_k_most_likely(k, expected):
    probs = logits_to_probs(HAND_LOGITS, SamplingConfig(temperature=1.0, top_k=k))
    assert kept(probs) == expected
    # The kept tokens keep their relative odds, renormalised.
    idx = sorted(expected)
    assert torch.allclose(probs[idx], HAND_PROBS[idx] / HAND_PROBS[idx].sum(), atol=1e-6)


@pytest.mark.parametrize(
    "p, expected",
    [
        (0.4, {1}),  # 0.5 alone reaches 0.4
        (0.6, {1, 3}),  # 0.5 < 0.6 <= 0.5 + 0.3
        (0.85, {1, 3, 0}),  # 0.8 < 0.85 <= 0.95
        (0.99, {1, 3, 0, 2}),
        (1.0, {1, 3, 0, 2}),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(p, expected):
    probs = logits_to_probs(HAND_LOGITS, SamplingConfig(temperature=1.0, top_p=p))
    assert kept(probs) == expected
    idx = sorted(expected)
    assert torch.allclose(probs[idx], HAND_PROBS[idx] / HAND_PROBS[idx].sum(), atol=1e-6)


def test_a_top_p_of_any_real_number_type_samples_as_the_float():
    # A Fraction passed the check, then failed at the first step: '<' between a tensor and a Fraction.
    from fractions import Fraction

    config = SamplingConfig(temperature=1.0, top_p=Fraction(3, 4))
    assert type(config.top_p) is float and config == SamplingConfig(temperature=1.0, top_p=0.75)
    as_float = SamplingConfig(temperature=1.0, top_p=0.75)
    assert torch.equal(logits_to_probs(HAND_LOGITS, config), logits_to_probs(HAND_LOGITS, as_float))


def test_top_p_stops_as_soon_as_the_mass_reaches_p_exactly():
    # Four equal logits: each probability is exactly 0.25, so two tokens reach
    # top_p = 0.5 exactly and a third is not needed.
    probs = logits_to_probs(torch.zeros(4), SamplingConfig(temperature=1.0, top_p=0.5))
    assert len(kept(probs)) == 2
    assert probs.sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize("p", [1e-9, 1e-45, 1e-50, 5e-324])
def test_a_tiny_top_p_keeps_the_most_likely_token(p):
    # Below float32's smallest number (~1.4e-45) top_p compares as 0 against the
    # float32 masses: the most likely token must still be kept.
    probs = logits_to_probs(HAND_LOGITS, SamplingConfig(temperature=1.0, top_p=p))
    assert kept(probs) == {1} and probs[1].item() == 1.0


def test_top_k_applies_before_top_p():
    # top_k=3 leaves 0.5, 0.3, 0.15 -> renormalised 0.526, 0.316, 0.158;
    # top_p=0.8 then needs the first two (0.526 < 0.8 <= 0.842).
    probs = logits_to_probs(HAND_LOGITS, SamplingConfig(temperature=1.0, top_k=3, top_p=0.8))
    assert kept(probs) == {1, 3}
    assert probs[1].item() == pytest.approx(0.5 / 0.8, abs=1e-6)


@pytest.mark.parametrize(
    "config",
    [
        SamplingConfig(temperature=0.5, top_p=0.6),
        SamplingConfig(temperature=2.0, top_p=0.6),
        SamplingConfig(temperature=0.5, top_k=5),
        SamplingConfig(temperature=2.0, top_k=5, top_p=0.7),
    ],
    ids=str,
)
def test_the_filters_match_transformers_warpers_at_any_temperature(config):
    # The tests above run at temperature 1, where they cannot tell whether top-p reads the tempered
    # distribution or whether the temperature divides twice: transformers' warpers, in generate's order, can.
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = 3.0 * torch.randn(8, 50, generator=torch.Generator().manual_seed(0))  # (rows, V)
    scores = TemperatureLogitsWarper(config.temperature)(None, logits.clone())
    if config.top_k is not None:
        scores = TopKLogitsWarper(config.top_k)(None, scores)
    if config.top_p is not None:
        scores = TopPLogitsWarper(config.top_p)(None, scores)
    expected = torch.softmax(scores, dim=-1)  # (rows, V)
    probs = logits_to_probs(logits, config)
    assert torch.equal(probs > 0, expected > 0), "the same tokens are kept"
    assert torch.allclose(probs, expected, atol=1e-6)


@pytest.mark.parametrize(
    "config",
    [
        SamplingConfig(temperature=0.0),
        SamplingConfig(temperature=0.7),
        SamplingConfig(temperature=1.3, top_k=5),
        SamplingConfig(temperature=1.0, top_p=0.9),
        SamplingConfig(temperature=0.8, top_k=20, top_p=0.5),
    ],
)
def test_probs_sum_to_one_over_any_leading_dims(config):
    logits = 3.0 * torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(0))
    probs = logits_to_probs(logits.to(torch.bfloat16), config)
    assert probs.shape == (2, 3, 50) and probs.dtype == torch.float32
    assert (probs >= 0).all()
    assert torch.allclose(probs.sum(dim=-1), torch.ones(2, 3), atol=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_sample_from_logits_that_overflowed_says_so(bad):
    """torch's RuntimeError ("probability tensor contains either `inf`, `nan` or element < 0") became the
    command's "unexpected RuntimeError", exit 1; any other refusal of torch's is left as it is."""
    probs = torch.tensor([[0.5, 0.5, 0.0], [0.2, bad, 0.3]])  # (2, 3): the second row not finite
    with pytest.raises(ValueError, match=r"^the next-token distribution holds NaN or inf: .* compute in float32$"):
        sample(probs, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="element < 0"):
        sample(torch.tensor([[0.5, -0.1, 0.6]]))  # (1, 3) finite, but not a distribution


def test_sample_reproduces_with_a_seeded_generator_and_follows_the_distribution():
    p = torch.tensor([0.1, 0.0, 0.6, 0.3])
    N = 40_000
    draws = sample(p.expand(N, 4), torch.Generator().manual_seed(0))  # (N,) from (N, V)
    assert draws.shape == (N,)
    assert torch.equal(draws, sample(p.expand(N, 4), torch.Generator().manual_seed(0)))
    assert (draws != 1).all(), "a zero-probability token is never drawn"
    freq = torch.bincount(draws, minlength=4).float() / N
    # Each token's frequency within 5 of its standard errors, 5 sqrt(p (1 - p) / N): 0.0075 to 0.012. A sampler
    # from p^0.9 (renormalised) is off by 0.009 to 0.024, 0.015 on token 0 (limit 0.0075), and fails.
    assert ((freq - p).abs() <= 5 * torch.sqrt(p * (1 - p) / N)).all(), freq


def test_a_generator_of_another_kind_of_device_is_refused_before_sampling():
    """torch draws on the device of the probabilities, with a generator of that device; a CPU generator for a
    GPU model gets one line saying how to make the right one (tests/test_cuda.py runs it on a GPU)."""
    cpu, sampled, greedy = torch.Generator().manual_seed(0), SamplingConfig(temperature=1.0), SamplingConfig()
    assert check_generator(cpu, sampled, torch.device("cpu")) is cpu
    assert check_generator(cpu, greedy, torch.device("cuda")) is cpu  # greedy: the generator is never used
    assert check_generator(None, sampled, torch.device("cuda")) is None
    with pytest.raises(ValueError, match=r"a cpu generator, but the model samples on cuda: make it there, "
                                         r"torch.Generator\(device='cuda'\)"):
        check_generator(cpu, sampled, torch.device("cuda"))
