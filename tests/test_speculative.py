"""`speculative_generate` against the baseline `gpt2.generate`, on tiny random GPT-2s.

The central property: greedy speculative decoding emits exactly the tokens
greedy decoding of the target alone emits, in fp32, whatever the draft. It
is checked with three drafts that cover the acceptance range:

- "self": the target's own weights, so every drafted token is accepted (alpha = 1);
- "unrelated": a smaller random model, so almost nothing is (alpha near 0);
- "perturbed": the target plus weight noise, so some are (0 < alpha < 1):
  the case where rejections, corrections and cache rewinds all happen.

Then the edges (token budget ending mid-step, end-of-text, context window),
the stats, the errors, seeded sampling, and that no sequence is ever
recomputed: each model's KV cache is reused across steps.
"""

from __future__ import annotations

import copy

import pytest
import torch

from gpt2 import GPT2, GPT2Config, generate
from gpt2.sampling import SamplingConfig
from spec_decoding import BatchDrafter, ModelDrafter, SimulatedDrafter, SpecStats, TreeDrafter, speculative_generate
from spec_decoding.drafters import Draft, Drafter
from spec_decoding.schedule import GammaSchedule
from helpers import ForwardRecorder, three_drafts, tiny_gpt2

pytestmark = pytest.mark.usefixtures("single_thread")

TARGET_CONFIG = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_ctx=64, vocab_size=64)

PROMPTS = {"4 tokens": [[1, 2, 3, 4]], "2 tokens": [[5, 9]], "1 token": [[7]]}  # 2: a prefill of one token
GAMMAS = [1, 2, 3, 5, 8]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def target():
    return tiny_gpt2(TARGET_CONFIG, seed=0)


@pytest.fixture(scope="module")
def drafts(target):
    return three_drafts(target)


def prompt(name: str = "4 tokens") -> torch.Tensor:
    return torch.tensor(PROMPTS[name])  # (1, T)


def check_stats_consistent(stats: SpecStats, out: torch.Tensor, T: int, gamma: int) -> None:
    """The counters of one run agree with each other and with its output."""
    hist = stats.accepted_hist
    assert stats.gamma == gamma and len(hist) == gamma + 1
    assert stats.new_tokens == out.size(1) - T
    assert stats.target_calls == sum(hist)  # one verification per step
    assert stats.accepted == sum(n * steps for n, steps in enumerate(hist))
    assert stats.accepted <= stats.drafted <= gamma * stats.target_calls
    assert stats.draft_calls == stats.drafted  # ModelDrafter: one forward pass per drafted token
    # accepted_at[i] (draft position i + 1) counts the steps that accepted at least i + 1 drafts.
    assert stats.accepted_at == [sum(hist[i + 1 :]) for i in range(gamma)]
    assert all(a <= r for a, r in zip(stats.accepted_at, stats.reached_at))
    # Each step emits its accepted drafts and the target's token (none after an accepted EOS).
    assert stats.new_tokens == stats.accepted + stats.target_tokens
    assert stats.target_tokens == stats.target_calls or (
        stats.stopped_at_eos and stats.target_tokens == stats.target_calls - 1)
    assert stats.tokens_per_target_call == stats.new_tokens / stats.target_calls
    assert stats.draft_seconds >= 0.0 and stats.verify_seconds > 0.0


# ---------------------------------------------------------------------------
# Greedy: identical to the baseline
# ---------------------------------------------------------------------------


def test_the_outputs_are_ordinary_tensors_a_caller_may_change_and_score_with_gradients(target, drafts):
    """Made under torch.inference_mode they could not be changed in place, nor saved for backward when a caller
    scores the generated ids with gradients (as one does after transformers' generate)."""
    two = torch.tensor([PROMPTS["4 tokens"][0], PROMPTS["4 tokens"][0][::-1]])  # (2, 4): a batch
    outputs = {
        "generate": generate(target, prompt(), 6),
        "chain": speculative_generate(target, drafts["perturbed"], prompt(), gamma=3, max_new_tokens=6)[0],
        "tree": speculative_generate(target, drafts["perturbed"], prompt(), tree="2,1", max_new_tokens=6)[0],
        "batch": speculative_generate(target, drafts["perturbed"], two, gamma=2, max_new_tokens=6)[0],
    }
    model = GPT2(TARGET_CONFIG)
    model.load_state_dict(target.state_dict())
    for name, out in outputs.items():
        assert isinstance(out, torch.Tensor) and not out.is_inference(), name
        out[:, -1] = 0  # in place
        model.zero_grad()
        model(out)[:, :-1].log_softmax(-1).gather(-1, out[:, 1:, None]).sum().backward()  # the ids' log-likelihood
        assert model.wte.weight.grad.abs().sum() > 0, name


@pytest.mark.parametrize("prompt_name", PROMPTS)
@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("draft_name", ["self", "unrelated", "perturbed"])
def test_greedy_equals_baseline_token_for_token(target, drafts, draft_name, gamma, prompt_name):
    ids = prompt(prompt_name)
    baseline = generate(target, ids, NEW_TOKENS)
    out, stats = speculative_generate(target, drafts[draft_name], ids, gamma=gamma, max_new_tokens=NEW_TOKENS)

    assert out.tolist() == baseline.tolist()
    check_stats_consistent(stats, out, ids.size(1), gamma)
    alpha = stats.alpha
    if draft_name == "self":
        assert alpha == 1.0
    elif draft_name == "unrelated":
        assert alpha < 0.1
    else:
        assert 0.0 < alpha < 1.0, "the perturbed draft must exercise both acceptances and rejections"


@pytest.mark.parametrize("max_new_tokens", range(12))
def test_a_budget_ending_mid_step_gives_exactly_max_new_tokens(target, drafts, max_new_tokens):
    # With draft = target every step emits K + 1 tokens; with gamma = 3 a
    # budget that is not a multiple of 4 ends with a shorter last step.
    ids, gamma = prompt(), 3
    for draft_name in ("self", "perturbed"):
        out, stats = speculative_generate(target, drafts[draft_name], ids, gamma=gamma, max_new_tokens=max_new_tokens)
        assert out.size(1) == ids.size(1) + max_new_tokens
        assert out.tolist() == generate(target, ids, max_new_tokens).tolist()
        if draft_name == "self":
            assert stats.drafted == max_new_tokens - stats.target_calls  # all accepted, K shrank at the end
            assert stats.target_calls == -(-max_new_tokens // (gamma + 1))  # ceil(n / (gamma + 1)) steps


# ---------------------------------------------------------------------------
# End-of-text
# ---------------------------------------------------------------------------


def first_new_occurrences(baseline: torch.Tensor, T: int) -> dict[int, int]:
    """{token: index among the new tokens of its first occurrence}."""
    first: dict[int, int] = {}
    for i, token in enumerate(baseline[0, T:].tolist()):
        first.setdefault(token, i)
    return first


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("draft_name", ["self", "unrelated", "perturbed"])
def test_eos_stops_where_the_baseline_stops(target, drafts, draft_name, gamma):
    ids = prompt()
    T = ids.size(1)
    # EOS = a token the baseline first emits well into the run.
    first = first_new_occurrences(generate(target, ids, NEW_TOKENS), T)
    eos_id, index = next((tok, i) for tok, i in first.items() if i >= 10)

    out, stats = speculative_generate(
        target, drafts[draft_name], ids, gamma=gamma, max_new_tokens=NEW_TOKENS, eos_id=eos_id
    )
    assert out.tolist() == generate(target, ids, NEW_TOKENS, eos_id=eos_id).tolist()
    assert out.size(1) == T + index + 1
    assert out[0, -1].item() == eos_id  # EOS is kept, as the last token...
    assert eos_id not in out[0, T:-1].tolist()  # ...the first one produced, and nothing follows it
    assert stats.stopped_at_eos
    check_stats_consistent(stats, out, T, gamma)


@pytest.mark.parametrize("gamma", [2, 4, 5, 8])
def test_eos_among_accepted_drafts_drops_the_rest_of_the_step(target, gamma):
    # With draft = target, every step accepts gamma drafts and adds a bonus
    # token, so new tokens (gamma + 1) j + 0 .. gamma - 1 are drafted. An EOS
    # at a drafted index is accepted with more drafts (and a bonus) behind it.
    ids = prompt()
    T = ids.size(1)
    baseline = generate(target, ids, NEW_TOKENS)
    first = first_new_occurrences(baseline, T)
    eos_id, index = next((tok, i) for tok, i in first.items() if i >= 5 and i % (gamma + 1) < gamma - 1)

    steps = []
    out, stats = speculative_generate(
        target, target, ids, gamma=gamma, max_new_tokens=NEW_TOKENS, eos_id=eos_id,
        on_step=lambda tokens, accepted: steps.append((list(tokens), accepted)),
    )
    assert out.tolist() == generate(target, ids, NEW_TOKENS, eos_id=eos_id).tolist()
    assert out[0, T:].tolist() == baseline[0, T : T + index + 1].tolist()
    last_tokens, last_accepted = steps[-1]
    assert last_tokens[-1] == eos_id
    assert last_accepted == len(last_tokens) < gamma + 1  # all drafted: no correction, no bonus after EOS
    # Only what was emitted is counted: the drafts after EOS (which the verifier
    # accepted) are not, and the last step has no target token.
    assert stats.new_tokens == index + 1 == stats.accepted + stats.target_tokens
    assert stats.target_tokens == stats.target_calls - 1
    assert stats.accepted_hist[last_accepted] >= 1 and stats.alpha == 1.0
    check_stats_consistent(stats, out, T, gamma)


def test_an_eos_that_never_comes_changes_nothing(target, drafts):
    ids = prompt()
    baseline = generate(target, ids, NEW_TOKENS)
    unused = next(tok for tok in range(TARGET_CONFIG.vocab_size) if tok not in baseline[0].tolist())
    out, stats = speculative_generate(
        target, drafts["perturbed"], ids, gamma=3, max_new_tokens=NEW_TOKENS, eos_id=unused
    )
    assert out.tolist() == baseline.tolist()
    assert not stats.stopped_at_eos


# ---------------------------------------------------------------------------
# Context window
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1, 3, 8])
@pytest.mark.parametrize("draft_name", ["self", "perturbed"])
def test_generation_stops_at_the_context_window(target, drafts, draft_name, gamma):
    ids = prompt()
    out, stats = speculative_generate(target, drafts[draft_name], ids, gamma=gamma, max_new_tokens=1000)
    assert out.size(1) == TARGET_CONFIG.n_ctx
    assert out.tolist() == generate(target, ids, 1000).tolist()
    check_stats_consistent(stats, out, ids.size(1), gamma)


def test_a_prompt_one_short_of_the_window_gets_exactly_one_token(target, drafts):
    ids = torch.arange(TARGET_CONFIG.n_ctx - 1)[None] % TARGET_CONFIG.vocab_size  # (1, n_ctx - 1)
    out, stats = speculative_generate(target, drafts["self"], ids, gamma=4, max_new_tokens=10)
    assert out.tolist() == generate(target, ids, 10).tolist()
    assert out.size(1) == TARGET_CONFIG.n_ctx
    assert (stats.target_calls, stats.drafted) == (1, 0)  # no room to draft: one plain target step


def test_a_draft_with_a_shorter_window_stops_drafting_and_the_target_goes_on(target):
    # Draft window 24 < target window 64: once the sequence outgrows the draft,
    # the loop drafts fewer tokens, then none (plain target steps).
    # The target's own weights with only its first 24 positions: it agrees with the target while it can draft.
    short_draft = GPT2(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_ctx=24, vocab_size=64)).eval()
    weights = target.state_dict()
    weights["wpe.weight"] = weights["wpe.weight"][:24]  # (n_ctx, C) -> (24, C)
    short_draft.load_state_dict(weights)

    ids = prompt()
    with ForwardRecorder(short_draft) as draft_calls:
        out, stats = speculative_generate(target, short_draft, ids, gamma=3, max_new_tokens=1000)
    assert out.tolist() == generate(target, ids, 1000).tolist()
    assert out.size(1) == TARGET_CONFIG.n_ctx
    assert max(c.cached + c.tokens for c in draft_calls.calls) <= 24  # never past the draft's window
    # From a sequence length of 24 + 1 on the draft cannot draft at all (it
    # would feed position 24), and the steps before overshoot 25 by at most
    # gamma: the rest are plain target steps, one token each, counted as 0 accepted.
    assert stats.accepted_hist[0] >= TARGET_CONFIG.n_ctx - (24 + 1) - 3


# ---------------------------------------------------------------------------
# The KV caches are reused: no recompute
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("prompt_name", PROMPTS)
def test_each_step_feeds_the_target_only_its_new_tokens(target, drafts, prompt_name, temperature):
    ids, gamma = prompt(prompt_name), 3
    T = ids.size(1)
    committed = [T]  # sequence length before each step, from the streaming callback
    with ForwardRecorder(target) as target_rec, ForwardRecorder(drafts["perturbed"]) as draft_rec:
        out, stats = speculative_generate(
            target, drafts["perturbed"], ids, gamma=gamma, max_new_tokens=NEW_TOKENS,
            temperature=temperature, generator=torch.Generator().manual_seed(0),
            on_step=lambda tokens, accepted: committed.append(committed[-1] + len(tokens)),
        )
    assert out.size(1) == committed[-1]

    # Target: one prefill of the prompt minus its last token (none for a
    # 1-token prompt), then exactly one call per step, each fed K + 1 <= gamma + 1
    # tokens on top of a cache that already holds every committed token but the last.
    prefill = [c for c in target_rec.calls[:1] if T > 1]
    verify = target_rec.calls[len(prefill) :]
    assert [(c.tokens, c.cached) for c in prefill] == ([(T - 1, 0)] if T > 1 else [])
    assert len(verify) == stats.target_calls
    assert all(1 <= c.tokens <= gamma + 1 for c in verify)
    assert [c.cached for c in verify] == [S - 1 for S in committed[:-1]]
    assert sum(c.tokens for c in target_rec.calls) == (T - 1) + stats.drafted + stats.target_calls

    # Draft: one prefill, then one call per drafted token, each fed at most two
    # tokens (the committed ones it has not seen: the target's token, plus the
    # last draft after a fully accepted step).
    draft_steps = draft_rec.calls[len(prefill) :]
    assert len(draft_steps) == stats.draft_calls
    assert all(1 <= c.tokens <= 2 for c in draft_steps)
    assert sum(c.tokens for c in draft_rec.calls) <= (T - 1) + stats.drafted + stats.target_calls


# ---------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------


def sample_run(target, draft, seed: int, **filters) -> tuple[list[int], SpecStats]:
    out, stats = speculative_generate(
        target, draft, prompt(), gamma=3, max_new_tokens=30, temperature=1.0,
        generator=torch.Generator().manual_seed(seed), **filters,
    )
    return out[0].tolist(), stats


@pytest.mark.parametrize("filters", [{}, {"top_k": 5}, {"top_p": 0.8}], ids=["plain", "top_k", "top_p"])
def test_same_seed_same_sample_different_seed_different_sample(target, drafts, filters):
    first, first_stats = sample_run(target, drafts["perturbed"], seed=123, **filters)
    again, again_stats = sample_run(target, drafts["perturbed"], seed=123, **filters)
    other, _ = sample_run(target, drafts["perturbed"], seed=124, **filters)
    assert again == first
    assert again_stats.accepted_hist == first_stats.accepted_hist
    assert other != first
    check_stats_consistent(first_stats, torch.tensor([first]), prompt().size(1), 3)


def test_a_model_drafter_can_be_reused_across_runs(target, drafts):
    # prefill restarts the drafter's cache, so a second run is not polluted by the first.
    drafter = ModelDrafter(drafts["perturbed"])
    first, _ = sample_run(target, drafter, seed=5)
    again, _ = sample_run(target, drafter, seed=5)
    assert again == first == sample_run(target, drafts["perturbed"], seed=5)[0]


@pytest.mark.parametrize("tree", [None, "2,1"])
def test_a_drafter_kept_across_runs_follows_its_model_to_another_dtype(target, drafts, tree):
    # Its cache was made once: after draft.to(bfloat16) a run failed with "the cache holds torch.float32 ... use
    # model.new_cache()", a cache the caller cannot reach.
    draft = copy.deepcopy(drafts["perturbed"])
    kept = TreeDrafter(draft) if tree else ModelDrafter(draft)
    how = {"tree": tree} if tree else {"gamma": 3}
    speculative_generate(target, kept, prompt(), max_new_tokens=6, **how)
    draft.to(torch.bfloat16)
    again, _ = speculative_generate(target, kept, prompt(), max_new_tokens=6, **how)
    fresh, _ = speculative_generate(target, TreeDrafter(draft) if tree else ModelDrafter(draft), prompt(),
                                    max_new_tokens=6, **how)
    assert torch.equal(again, fresh) and torch.equal(again, generate(target, prompt(), 6))


@pytest.mark.parametrize("tree", [None, "2,1"])
def test_a_run_stopped_mid_step_counts_only_the_steps_it_finished(target, drafts, tree):
    # Ctrl-C lands anywhere: here in the third step's verification (the target's 4th call, after the
    # prefill). The stats passed in describe the two finished steps, gamma_hist with the rest.
    calls = []

    def interrupt_fourth_call(module, args):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt

    stats = SpecStats(2, tree="2,1") if tree else SpecStats(3)
    handle = target.register_forward_pre_hook(interrupt_fourth_call)
    try:
        with pytest.raises(KeyboardInterrupt):
            speculative_generate(target, drafts["perturbed"], prompt(), gamma=None if tree else 3, tree=tree,
                                 max_new_tokens=NEW_TOKENS, stats=stats)
    finally:
        handle.remove()
    assert stats.target_calls == sum(stats.accepted_hist) == 2
    assert sum(stats.gamma_hist) == 2, stats.gamma_hist


def test_sampling_with_the_target_as_its_own_draft_accepts_almost_everything(target):
    # p_draft and p_target are the same model's distributions, equal up to
    # float rounding (the draft scores one token at a time, the target K + 1
    # at once), so min(1, p_target / p_draft) is 1 up to ~1e-6.
    tokens, stats = sample_run(target, target, seed=0)
    assert stats.alpha > 0.95
    assert all(0 <= t < TARGET_CONFIG.vocab_size for t in tokens)


# ---------------------------------------------------------------------------
# The simulated drafter (for benchmarks)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_simulated_drafter_keeps_the_output_and_sets_the_acceptance_rate(target, drafts, alpha):
    ids = prompt()
    reference = generate(target, ids, NEW_TOKENS)
    drafter = SimulatedDrafter(drafts["unrelated"], reference, alpha, seed=0)
    out, stats = speculative_generate(target, drafter, ids, gamma=4, max_new_tokens=NEW_TOKENS)
    assert out.tolist() == reference.tolist()
    if alpha == 0.0:
        assert stats.accepted == 0
    elif alpha == 1.0:
        assert stats.alpha == 1.0
    else:
        assert 0.0 < stats.alpha < 1.0


def test_simulated_acceptance_belongs_to_the_position_not_to_the_order_of_drafting(target, drafts):
    # Runs with the same seed and different γ see the same accepted positions
    # (common random numbers for benchmarks): a coin is the position's.
    reference = generate(target, prompt(), NEW_TOKENS)
    positions = list(range(prompt().size(1), reference.size(1)))
    logits = torch.zeros(TARGET_CONFIG.vocab_size)
    greedy = SamplingConfig(0.0)

    def picks(order):
        drafter = SimulatedDrafter(drafts["unrelated"], reference, 0.5, seed=7)
        return {p: int(drafter.pick(p, logits, greedy, None)[0]) for p in order}

    forward, backward = picks(positions), picks(positions[::-1])
    assert forward == backward
    right = [p for p in positions if forward[p] == int(reference[0, p])]
    assert 0 < len(right) < len(positions)  # both outcomes occur, so the comparison means something


def test_simulated_drafter_refuses_bad_settings(target, drafts):
    reference = generate(target, prompt(), 8)
    for alpha in (1.5, "0.5", True):
        with pytest.raises(ValueError, match=r"acceptance rate must be a number in \[0, 1\]"):
            SimulatedDrafter(drafts["unrelated"], reference, alpha)
    with pytest.raises(ValueError, match="reference must be a tensor of the target's greedy token ids"):
        SimulatedDrafter(drafts["unrelated"], reference.tolist(), 0.5)
    for bad in (-1, 10**6):  # fed to the draft model: on CUDA a device-side assert
        with pytest.raises(ValueError, match=f"reference holds token id {bad}, outside the draft's vocabulary"):
            SimulatedDrafter(drafts["unrelated"], torch.cat([reference, torch.tensor([[bad]])], 1), 0.5)
    with pytest.raises(ValueError, match=r"reference holds \d+\.5, not an integer token id: give the target's greedy"):
        SimulatedDrafter(drafts["unrelated"], reference + 0.5, 0.5)  # it named input_ids, once the run had started
    drafter = SimulatedDrafter(drafts["unrelated"], reference, 0.5)
    with pytest.raises(ValueError, match="greedy decoding only"):
        speculative_generate(target, drafter, prompt(), gamma=2, max_new_tokens=4, temperature=1.0)


# ---------------------------------------------------------------------------
# Errors: raised before any model runs, with a message that says what to do
# ---------------------------------------------------------------------------

BAD_CALLS = {
    "gamma 0": ({"gamma": 0}, "gamma must be an integer >= 1"),
    "gamma negative": ({"gamma": -2}, "gamma must be an integer >= 1"),
    "gamma not an integer": ({"gamma": 2.5}, "gamma must be an integer >= 1"),
    "gamma a bool": ({"gamma": True}, "gamma must be an integer >= 1"),
    "neither gamma nor tree": ({"gamma": None}, r"give gamma \(tokens drafted per step.*\) or tree"),
    "a batch without gamma": ({"gamma": None, "input_ids": [[1, 2]]}, r"give gamma .* or tree"),
    "top_k a bool": ({"top_k": True, "temperature": 1.0}, "top_k must be an integer >= 1"),
    "eos_id negative": ({"eos_id": -1}, "eos_id must be an integer >= 0"),
    "eos_id past the vocabulary": ({"eos_id": 10**9}, r"eos_id must be a token id in \[0, 64\)"),
    "draft a string": ({"draft": "gpt2"}, "the draft must be a loaded GPT2 model or a drafter.* gpt2.load_model"),
    "a tree drafter with gamma": ({"draft": "TreeDrafter"}, "got TreeDrafter: it drafts token trees: give tree="),
    "a batch drafter, one prompt": ({"draft": "BatchDrafter"}, "got BatchDrafter: it drafts for a batch: give the "
                                                               "prompts as a list of token-id lists"),
    "target a string": ({"target": "gpt2-large"}, "the target must be a loaded GPT2 model"),
    "negative budget": ({"max_new_tokens": -1}, "max_new_tokens must be an integer >= 0"),
    "negative temperature": ({"temperature": -1.0}, "temperature must be a number >= 0"),
    "empty prompt": ({"input_ids": torch.zeros(1, 0, dtype=torch.long)}, "the prompt is empty"),
    "prompt too long": ({"input_ids": torch.zeros(1, 64, dtype=torch.long)}, "shorten it to at most 63 tokens"),
    "token out of vocabulary": ({"input_ids": torch.tensor([[1, 64]])}, r"token ids must lie in \[0, 64\)"),
    "gamma past the window": ({"gamma": 64}, "gamma is 64, more tokens than the target's context window of 64"),
    "gamma past any integer": ({"gamma": 2**63}, "could ever verify: give at most 63"),
    "generator a number": ({"generator": 5}, "generator must be a torch.Generator, None, or a list of 1"),
    "two generators for one row": ({"generator": [torch.Generator()] * 2}, "a list of 1 generators"),
    "stats of another kind": ({"stats": object()}, r"stats must be a fresh SpecStats\(3\)"),
    "stats of another gamma": ({"stats": SpecStats(2)}, r"stats must be a fresh SpecStats\(3\)"),
    "temperature past float": ({"temperature": 2**1024}, "temperature must be a number >= 0"),
    "on_step not a function": ({"on_step": "print"}, "on_step must be a function \\(or None\\), got str"),
    "on_step of a batch's arguments": ({"on_step": lambda row, tokens, n: None},
                                       r"on_step is called as on_step\(tokens, num_accepted\), but it takes "
                                       r"\(row, tokens, n\): give it those arguments"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_arguments_raise_a_clear_error_before_any_work(target, drafts, case):
    overrides, message = BAD_CALLS[case]
    kwargs = {"input_ids": prompt(), "gamma": 3, "max_new_tokens": 5} | overrides
    input_ids = kwargs.pop("input_ids")
    target_model, draft_model = kwargs.pop("target", target), kwargs.pop("draft", drafts["perturbed"])
    wrapped = {"TreeDrafter": TreeDrafter, "BatchDrafter": BatchDrafter}  # a drafter for another loop
    draft_model = wrapped[draft_model](drafts["perturbed"]) if draft_model in wrapped else draft_model
    with (
        ForwardRecorder(target) as target_rec,
        ForwardRecorder(drafts["perturbed"]) as draft_rec,
        pytest.raises(ValueError, match=message),
    ):
        speculative_generate(target_model, draft_model, input_ids, **kwargs)
    assert target_rec.calls == [] and draft_rec.calls == []


def test_any_integer_type_is_an_integer_and_a_tiny_temperature_is_greedy(target, drafts):
    import numpy as np

    ids = prompt()
    baseline = generate(target, ids, 12)
    for gamma, budget in ((np.int64(3), np.int32(12)), (torch.tensor(3), 12)):
        out, _ = speculative_generate(target, drafts["perturbed"], ids, gamma=gamma, max_new_tokens=budget)
        assert out.tolist() == baseline.tolist()
    # Dividing logits by 1e-39 would overflow float32: below 1e-4 sampling is greedy.
    out, _ = speculative_generate(target, drafts["perturbed"], ids, gamma=3, max_new_tokens=12, temperature=1e-39)
    assert out.tolist() == baseline.tolist()
    assert generate(target, ids, 12, temperature=1e-39, top_k=np.int64(5)).tolist() == baseline.tolist()


class ChoosesBadly(GammaSchedule):
    """A schedule written outside the project that returns whatever it was given."""

    def __init__(self, K, max_gamma=3) -> None:
        self.K = K
        if max_gamma is not None:
            self.max_gamma = max_gamma

    def choose(self):
        return self.K

    def describe(self) -> str:
        return "chooses badly"


@pytest.mark.parametrize("K", [5, 2.0, -1, True], ids=["past max_gamma", "a float", "negative", "a bool"])
def test_a_schedule_choosing_outside_its_range_is_refused(target, drafts, K):
    # K = 5 raised IndexError, 2.0 TypeError; -1 ran, counting its steps as K = 3 in gamma_hist.
    with pytest.raises(ValueError, match=r"ChoosesBadly.choose\(\) must return an integer in 0..3 \(its max_gamma\)"):
        speculative_generate(target, drafts["perturbed"], prompt(), gamma=ChoosesBadly(K), max_new_tokens=5)
    with pytest.raises(ValueError, match="the max_gamma of ChoosesBadly must be an integer >= 1"):
        speculative_generate(target, drafts["perturbed"], prompt(), gamma=ChoosesBadly(1, None), max_new_tokens=5)


class ProposesThis(Drafter):
    """A drafter written outside the project that proposes whatever it was given."""

    def __init__(self, draft: Draft) -> None:
        self.draft = draft

    vocab_size = None

    def prefill(self, prefix: torch.Tensor) -> None:
        pass

    def max_draft(self, seq_len: int) -> int:
        return 64

    def propose(self, seq, K, sampling, generator) -> Draft:
        return self.draft

    def rewind(self, valid: int) -> None:
        pass


@pytest.mark.parametrize(
    "draft, message",
    [
        (Draft(torch.tensor([1, 2, 3, 4, 5]), None, 0), "at most K = 2 tokens on cpu, got 5"),  # an AssertionError
        (Draft(torch.tensor([1.0, 2.0]), None, 0), r"\(k,\) integer token ids, got a torch.float32 tensor"),
        (Draft(torch.tensor([1, 999]), None, 0), r"token ids in 0..63, got \[1, 999\]"),  # an IndexError
        (Draft(torch.tensor([1, 2]), torch.ones(2, 5) / 5, 0), r"probs None or of shape \(2, 64\)"),
        (Draft(torch.tensor([1, 2]), torch.ones(2, 64, device="meta"), 0),
         r"probs None or of shape \(2, 64\) on cpu, got .* on meta"),
        (Draft(torch.tensor([1, 2]), (torch.ones(2, 64) / 64).log(), 0),  # taken for probabilities: a biased output
         r"probs under which each drafted token has the probability it was drawn with, in \(0, 1\] \(not "
         r"log-probabilities or logits\), got \[-4.15"),
        (Draft(torch.tensor([1, 2]), torch.full((2, 64), float("nan")), 0), "probs under which .* got \\[nan, nan\\]"),
        # a drafted token its probabilities never draw
        (Draft(torch.tensor([1, 2]), torch.eye(64)[[0, 0]], 0), r"probs under which .* got \[0.0, 0.0\]"),
        (Draft(torch.tensor([1, 2]), torch.full((2, 64), 2.0), 0), r"probs under which .* got \[2.0, 2.0\]"),
        ([1, 2], "a Draft holding a tensor of tokens, got list"),
    ],
    ids=["too many", "floats", "past the vocabulary", "probs of another shape", "probs on another device",
         "log-probs", "NaN probs", "probability 0", "probability 2", "not a Draft"],
)
def test_a_proposal_the_loop_cannot_verify_is_refused(target, draft, message):
    with pytest.raises(ValueError, match=r"ProposesThis.propose must return " + message):
        speculative_generate(target, ProposesThis(draft), prompt(), gamma=2, max_new_tokens=5)


@pytest.mark.parametrize("room", [-1, 2.5, None])
def test_a_drafters_room_must_be_an_integer_and_a_negative_one_is_none(target, room):
    # A window rule without max(0, ...) counted its plain steps under K = 4 (gamma_hist[-1]), then an IndexError.
    class Answers(ModelDrafter):
        def max_draft(self, seq_len: int):
            return room

    if room == -1:
        out, stats = speculative_generate(target, Answers(target), prompt(), gamma=4, max_new_tokens=5)
        assert torch.equal(out, generate(target, prompt(), 5))
        assert stats.gamma_hist == [stats.target_calls, 0, 0, 0, 0] and stats.drafted == 0
    else:
        with pytest.raises(ValueError, match=f"Answers.max_draft must return an integer .* got {room}"):
            speculative_generate(target, Answers(target), prompt(), gamma=4, max_new_tokens=5)

        class Shallow(TreeDrafter):
            def max_depth(self, seq_len: int):
                return room

        class Narrow(BatchDrafter):
            def max_draft(self, seq_len: int):
                return room

        with pytest.raises(ValueError, match=f"Shallow.max_depth must return an integer .* got {room}"):
            speculative_generate(target, Shallow(target), prompt(), tree="2,1", max_new_tokens=5)
        with pytest.raises(ValueError, match=f"Narrow.max_draft must return an integer .* got {room}"):
            speculative_generate(target, Narrow(target), [[1, 2], [3]], gamma=2, max_new_tokens=5)


def test_a_vocabulary_mismatch_is_refused_before_any_work(target):
    other_vocab = tiny_gpt2(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=64, vocab_size=65), seed=3)
    with (
        ForwardRecorder(target) as target_rec,
        ForwardRecorder(other_vocab) as draft_rec,
        pytest.raises(ValueError, match=r"different vocabularies \(65 vs 64 tokens\)"),
    ):
        speculative_generate(target, other_vocab, prompt(), gamma=3, max_new_tokens=5)
    assert target_rec.calls == [] and draft_rec.calls == []


def test_a_prompt_that_fits_the_target_but_not_the_draft_gets_plain_target_steps(target):
    short_draft = tiny_gpt2(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=16, vocab_size=64), seed=3)
    ids = torch.arange(20)[None] % 64  # (1, 20): longer than the draft's window of 16
    with ForwardRecorder(short_draft) as draft_calls:
        out, stats = speculative_generate(target, short_draft, ids, gamma=3, max_new_tokens=5)
    assert out.tolist() == generate(target, ids, 5).tolist()
    assert draft_calls.calls == []  # the draft never ran
    assert stats.plain_steps == stats.target_calls == 5 and stats.drafted == 0


def test_one_sequence_takes_its_generator_alone_or_as_a_list_of_one(target, drafts):
    def run(generator):
        out, _ = speculative_generate(target, drafts["perturbed"], prompt(), gamma=3, max_new_tokens=12,
                                      temperature=1.0, generator=generator)
        return out.tolist()

    assert run([torch.Generator().manual_seed(7)]) == run(torch.Generator().manual_seed(7))
    with pytest.raises(ValueError, match="generator must be a torch.Generator or None, got int"):
        generate(target, prompt(), 4, temperature=1.0, generator=5)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8, torch.uint8])
def test_token_ids_of_any_integer_dtype_give_the_same_output(target, drafts, dtype):
    ids = prompt()
    baseline = generate(target, ids, 8).tolist()
    assert generate(target, ids.to(dtype), 8).tolist() == baseline
    out, _ = speculative_generate(target, drafts["perturbed"], ids.to(dtype), gamma=3, max_new_tokens=8)
    assert out.tolist() == baseline
    rows, _ = speculative_generate(target, drafts["perturbed"], [ids[0].to(dtype)], gamma=3, max_new_tokens=8)
    assert rows == baseline
