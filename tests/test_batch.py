"""Batches of prompts of different lengths: the model and cache per row,
batched `gpt2.generate`, and batched speculative decoding (spec_decoding/batch.py).

The central property, as for one sequence: every row of a batch decodes
exactly as that row would alone. Greedy rows are compared token for token
with single-sequence greedy decoding; with one generator per row, sampled
rows are compared token for token with single-sequence sampling runs. The
distribution of sampled rows is checked in test_batch_lossless.py.
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gpt2 import GPT2Config, fast, generate
from gpt2.generate import PASS_POSITIONS, length_groups
from gpt2.sampling import SamplingConfig
from spec_decoding import BatchStats, HeuristicGamma, ModelDrafter, NgramDrafter, SimulatedBatchDrafter, SpecStats
from spec_decoding import BatchDrafter, speculative_generate
from helpers import PERTURBATION, ForwardRecorder, perturbed_copy, three_drafts, tiny_gpt2

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIG = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_ctx=64, vocab_size=64)
# A vocabulary of 8 tokens: greedy decoding soon emits any chosen end-of-text id.
SMALL_VOCAB = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_ctx=64, vocab_size=8)

# Mixed lengths: 1 token, a few, and 2 short of the context window (room for 2 new tokens).
PROMPTS = [[5, 9, 2, 7], [11], [(3 * i) % 64 for i in range(CONFIG.n_ctx - 2)], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
NEW_TOKENS = 30


@pytest.fixture(scope="module")
def target():
    return tiny_gpt2(CONFIG, seed=0)


@pytest.fixture(scope="module")
def drafts(target):
    return three_drafts(target)


@pytest.fixture(scope="module")
def fast_pair(fast_kernels):
    """A target and a perturbed draft of their own, on the C fast path."""
    target = fast.accelerate(tiny_gpt2(CONFIG, seed=0))
    draft = fast.accelerate(perturbed_copy(target, scale=PERTURBATION, seed=2))
    assert target.accelerator is not None and draft.accelerator is not None, fast.status(target)
    return target, draft


def alone(model, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """Single-sequence decoding of one prompt (today's (1, T) path)."""
    return generate(model, torch.tensor([prompt]), max_new_tokens, **kwargs)[0].tolist()


def spec_alone(target, draft, prompt: list[int], **kwargs) -> list[int]:
    return speculative_generate(target, draft, torch.tensor([prompt]), **kwargs)[0][0].tolist()


class BatchSizes:
    """Records the batch size of every forward pass of a model after the
    prefill (a pre-hook; prefill passes ask for the last logits only), and
    the (rows, tokens) shape of every prefill pass; `fed`: the tokens of each pass after the prefill."""

    def __init__(self, model) -> None:
        self.model, self.sizes, self.prefills, self.fed = model, [], [], []

    def __enter__(self):
        def record(module, args, kwargs):
            if kwargs.get("last_logits_only"):
                self.prefills.append(tuple(args[0].shape))
            else:
                self.sizes.append(args[0].size(0))
                self.fed.append(args[0].numel())

        self.handle = self.model.register_forward_pre_hook(record, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


# ---------------------------------------------------------------------------
# The model and the cache: each row of a batched pass is that row alone
# ---------------------------------------------------------------------------


def batched_then_alone(model, lengths: list[int], new: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For rows with `lengths[b]` cached tokens (prefilled together, padded,
    then rewound), `new` more tokens per row in one batched pass; and the
    same row prefilled and continued alone. Returns (batched, alone) logits per row."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, CONFIG.vocab_size, (n + new,), generator=g) for n in lengths]
    cache = model.new_cache(len(lengths))
    padded = torch.zeros(len(lengths), max(lengths), dtype=torch.long)  # (B, max length)
    for b, n in enumerate(lengths):
        padded[b, :n] = seqs[b][:n]
    model(padded, cache, last_logits_only=True)
    cache.rewind(torch.tensor(lengths))
    batched = model(torch.stack([s[n:] for s, n in zip(seqs, lengths)]), cache)  # (B, new, V)
    assert cache.lengths.tolist() == [n + new for n in lengths]
    pairs = []
    for b, n in enumerate(lengths):
        own = model.new_cache(1)
        model(seqs[b][None, :n], own)
        pairs.append((batched[b], model(seqs[b][None, n:], own)[0]))
    return pairs


@torch.inference_mode()
def test_each_row_of_a_batched_pass_is_that_row_alone(target):
    # Rows of 1, 7 and 58 cached positions, 5 new tokens each (a verification pass).
    for got, expected in batched_then_alone(target, [1, 7, 58], new=5, seed=0):
        assert (got - expected).abs().max() <= 1e-4


@torch.inference_mode()
def test_each_row_of_a_batched_pass_is_bit_identical_to_that_row_alone_on_the_fast_path(fast_pair):
    model, _ = fast_pair
    for got, expected in batched_then_alone(model, [1, 7, 58], new=5, seed=0):
        assert torch.equal(got, expected)


def test_a_batched_cache_starts_at_zero_so_masked_slots_hold_no_nan(target):
    cache = target.new_cache(3)
    assert cache.k.abs().sum() == 0 and cache.v.abs().sum() == 0


@torch.inference_mode()
@pytest.mark.parametrize("path", ["readable", "fast"])
def test_keep_rows_drops_rows_and_the_others_go_on_unchanged(target, path, request):
    model = request.getfixturevalue("fast_pair")[0] if path == "fast" else target
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 64, (n,), generator=g) for n in (9, 3, 14, 6)]
    cache = model.new_cache(4)
    padded = torch.zeros(4, 14, dtype=torch.long)
    for b, s in enumerate(seqs):
        padded[b, : len(s) - 2] = s[:-2]
    model(padded, cache, last_logits_only=True)
    cache.rewind(torch.tensor([len(s) - 2 for s in seqs]))
    buffer = cache.k.data_ptr()

    cache.keep_rows([1, 3])  # rows 1 and 3 go on, as rows 0 and 1
    assert cache.batch_size == 2 and cache.lengths.tolist() == [1, 4]
    assert cache.k.data_ptr() == buffer, "no new buffers: the kept rows move to the front"
    if path == "fast":  # the compacted cache is a view the C path still takes
        x = torch.zeros(2, 2, CONFIG.n_embd)
        assert model.accelerator.takes(model, x, cache, None)
    got = model(torch.stack([seqs[1][-2:], seqs[3][-2:]]), cache)  # (2, 2, V)
    for row, s in zip(got, (seqs[1], seqs[3])):
        expected = model(s[None])[0, -2:]  # the whole row alone, without a cache
        assert (row - expected).abs().max() <= 1e-4


def test_keep_rows_checks_its_rows(target):
    cache = target.new_cache(3)
    with pytest.raises(ValueError, match="increasing"):
        cache.keep_rows([2, 0])


# ---------------------------------------------------------------------------
# gpt2.generate with a batch of prompts of different lengths
# ---------------------------------------------------------------------------


def test_batched_generate_gives_each_row_its_own_greedy_decoding(target):
    rows = generate(target, PROMPTS, NEW_TOKENS)
    assert isinstance(rows, list) and len(rows) == len(PROMPTS)
    for prompt, row in zip(PROMPTS, rows):
        assert row == alone(target, prompt, NEW_TOKENS)
    assert len(rows[2]) == CONFIG.n_ctx, "the row near the window stops there; the others go on"
    assert [len(r) for r in rows] == [len(p) + NEW_TOKENS for p in PROMPTS[:2]] + [CONFIG.n_ctx, 10 + NEW_TOKENS]


def test_a_padded_tensor_with_lengths_is_the_same_batch_as_a_list(target):
    lengths = [len(p) for p in PROMPTS]
    padded = torch.full((len(PROMPTS), max(lengths)), 63)  # (B, T), padded with any id
    for b, p in enumerate(PROMPTS):
        padded[b, : len(p)] = torch.tensor(p)
    assert generate(target, padded, 12, lengths=torch.tensor(lengths)) == generate(target, PROMPTS, 12)
    assert generate(target, padded, 12, lengths=np.array(lengths)) == generate(target, PROMPTS, 12)  # was refused


def test_rows_of_near_lengths_share_a_prefill_pass_and_far_ones_do_not(target):
    """Equal prompts prefill in one pass; a 1-token and a 30-token prefix in
    two, so that the short row does not compute 29 padding positions; the
    benchmark's mixed lengths in the three passes `length_groups` chose. Rows
    are still each their own greedy decoding."""
    g = torch.Generator().manual_seed(3)
    equal = [torch.randint(0, CONFIG.vocab_size, (6,), generator=g).tolist() for _ in range(3)]
    far = [[5, 6], torch.randint(0, CONFIG.vocab_size, (31,), generator=g).tolist()]
    mixed = [[1] * n for n in (27, 3, 9, 10, 11, 18, 19, 26)]
    for prompts, passes in ((equal, [(3, 5)]), (far, [(1, 1), (1, 30)]), (mixed, [(2, 18), (2, 26), (4, 10)])):
        with BatchSizes(target) as calls:
            rows = generate(target, prompts, 4)
        assert rows == [alone(target, p, 4) for p in prompts]
        assert sorted(calls.prefills) == passes
    assert length_groups([2, 8, 9, 10, 17, 18, 25, 26]) == [[0, 1, 2, 3], [4, 5], [6, 7]]
    assert length_groups([4, 0, 4]) == [[1], [0, 2]]  # an empty row costs no pass


def set_partitions(items: list[int]):
    """Every way to split `items` into non-empty groups (Bell(n) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [[first], *partition]
        for i in range(len(partition)):
            yield [*partition[:i], [first, *partition[i]], *partition[i + 1 :]]


def test_length_groups_is_the_cheapest_of_all_groupings():
    """The dynamic programme over sorted runs finds the least total cost,
    PASS_POSITIONS + rows x longest per pass with a row, among *all* set
    partitions of the rows (brute force over Bell(7) = 877 for 7 rows), on
    200 random length lists; and its groups cover every row once."""
    def cost(groups, lengths):
        return sum(PASS_POSITIONS + len(g) * max(lengths[b] for b in g) for g in groups if max(lengths[b] for b in g))

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 8, (), generator=g))
        lengths = torch.randint(0, 40, (n,), generator=g).tolist()
        groups = length_groups(lengths)
        assert sorted(b for group in groups for b in group) == list(range(n))
        assert cost(groups, lengths) == min(cost(p, lengths) for p in set_partitions(list(range(n))))


def test_finished_rows_leave_the_batch_of_generate():
    model = tiny_gpt2(SMALL_VOCAB, seed=5)
    prompts = [[1, 2], [3], [4, 5, 6]]
    free = generate(model, prompts, 20)
    eos_id, ends = eos_with_different_end_times(free, prompts)
    with BatchSizes(model) as calls:
        rows = generate(model, prompts, 20, eos_id=eos_id)
    for prompt, row in zip(prompts, rows):
        assert row == alone(model, prompt, 20, eos_id=eos_id)
    assert calls.sizes == sorted(calls.sizes, reverse=True) and calls.sizes[-1] == 1, "the batch shrinks"
    # One forward per step; a row takes part until its last token is chosen.
    steps = max(len(r) - len(p) for r, p in zip(rows, prompts))
    assert calls.sizes == [sum(len(r) - len(p) > s for r, p in zip(rows, prompts)) for s in range(steps)]


def eos_with_different_end_times(free: list[list[int]], prompts: list[list[int]]) -> tuple[int, list[int | None]]:
    """A token that ends the rows of `free` (greedy, never stopped) at
    different steps, at least one of them early; and each row's end step."""
    for eos_id in range(8):
        ends = []
        for row, prompt in zip(free, prompts):
            new = row[len(prompt) :]
            ends.append(new.index(eos_id) if eos_id in new else None)
        early = [e for e in ends if e is not None]
        if early and len(set(ends)) == len(ends) and min(early) >= 1:
            return eos_id, ends
    raise AssertionError("no token ends the rows at different times: change the seed")


def test_sampled_generate_reproduces_with_a_seed(target):
    def run(seed):
        return generate(target, PROMPTS, 15, temperature=1.0, generator=torch.Generator().manual_seed(seed))

    assert run(3) == run(3) != run(4)


# ---------------------------------------------------------------------------
# Batched speculative decoding, greedy: each row is its own greedy decoding
# ---------------------------------------------------------------------------


def check_row_stats(row: SpecStats, out: list[int], prompt: list[int]) -> None:
    assert row.new_tokens == len(out) - len(prompt) == row.accepted + row.target_tokens
    assert row.target_calls == sum(row.accepted_hist)
    assert row.accepted == sum(n * steps for n, steps in enumerate(row.accepted_hist))
    assert row.accepted_at == [sum(row.accepted_hist[i + 1 :]) for i in range(row.gamma)]
    assert row.draft_calls == row.drafted <= row.gamma * row.target_calls


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("draft_name", ["self", "unrelated", "perturbed"])
def test_greedy_rows_equal_their_own_greedy_decoding(target, drafts, draft_name, gamma):
    rows, stats = speculative_generate(target, drafts[draft_name], PROMPTS, gamma=gamma, max_new_tokens=NEW_TOKENS)
    for prompt, row, row_stats in zip(PROMPTS, rows, stats.rows):
        assert row == alone(target, prompt, NEW_TOKENS)
        check_row_stats(row_stats, row, prompt)
    assert isinstance(stats, BatchStats) and stats.new_tokens == sum(len(r) - len(p) for r, p in zip(rows, PROMPTS))
    assert stats.target_calls == len(stats.active_rows) == max(r.target_calls for r in stats.rows)
    assert stats.active_rows[0] == len(PROMPTS) and stats.active_rows[-1] >= 1
    assert stats.active_rows == sorted(stats.active_rows, reverse=True)
    assert stats.tokens_per_target_call == stats.new_tokens / stats.target_calls
    if draft_name == "self":
        assert stats.alpha == 1.0
    elif draft_name == "perturbed":
        assert 0.0 < stats.alpha < 1.0


@pytest.mark.parametrize("gamma", [2, 4])
def test_rows_ending_at_different_times_end_as_they_would_alone(gamma):
    target = tiny_gpt2(SMALL_VOCAB, seed=5)
    draft = perturbed_copy(target, scale=0.1, seed=6)
    prompts = [[1, 2], [3], [4, 5, 6]]
    eos_id, ends = eos_with_different_end_times(generate(target, prompts, 20), prompts)
    draft_passes = []  # the (rows, tokens) of every draft forward pass: the prompts' prefill first
    hook = draft.register_forward_pre_hook(lambda module, args: draft_passes.append(tuple(args[0].shape)))
    try:
        with BatchSizes(target) as calls:
            rows, stats = speculative_generate(target, draft, prompts, gamma=gamma, max_new_tokens=20, eos_id=eos_id)
    finally:
        hook.remove()
    for prompt, row, end, row_stats in zip(prompts, rows, ends, stats.rows):
        assert row == alone(target, prompt, 20, eos_id=eos_id)
        if end is not None:
            assert len(row) == len(prompt) + end + 1 and row[-1] == eos_id and row_stats.stopped_at_eos
            assert eos_id not in row[len(prompt) : -1], "nothing follows end-of-text"
        check_row_stats(row_stats, row, prompt)
    # A finished row leaves the batch: the verification passes shrink with it.
    assert calls.sizes == stats.active_rows and stats.active_rows[-1] < len(prompts)
    assert stats.verified_tokens == sum(calls.fed), "every active row is fed its step's longest draft + 1 tokens"
    assert stats.draft_calls == len(draft_passes) - 1, "the batch's draft forward passes after the prefill"
    # The draft's cache is reused: the prefill held every prompt token but the pending one, and a step's first pass
    # feeds only the committed tokens the draft has not seen (the target's token, and the last draft if accepted).
    assert draft_passes[1][1] == 1 and all(tokens <= 2 for _, tokens in draft_passes[1:])
    # The batch's wall time per phase is the sum over its steps; a row that took part in every step has the same sum.
    longest = max(stats.rows, key=lambda row: row.target_calls)
    assert longest.target_calls == stats.target_calls
    assert 0 < stats.draft_seconds == longest.draft_seconds and 0 < stats.verify_seconds == longest.verify_seconds


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_batch_of_one_is_todays_single_sequence_path(target, drafts, temperature):
    kwargs = dict(gamma=3, max_new_tokens=NEW_TOKENS, temperature=temperature)
    for prompt in PROMPTS:
        rows, batch_stats = speculative_generate(
            target, drafts["perturbed"], [prompt], generator=torch.Generator().manual_seed(7), **kwargs
        )
        out, stats = speculative_generate(
            target, drafts["perturbed"], torch.tensor([prompt]), generator=torch.Generator().manual_seed(7), **kwargs
        )
        assert rows == out.tolist()
        timing = ("draft_seconds", "verify_seconds")
        assert ({k: v for k, v in batch_stats.rows[0].to_dict().items() if k not in timing}
                == {k: v for k, v in stats.to_dict().items() if k not in timing})


def test_the_order_of_the_rows_does_not_matter(target, drafts):
    order = [2, 0, 3, 1]
    rows, _ = speculative_generate(target, drafts["perturbed"], PROMPTS, gamma=4, max_new_tokens=NEW_TOKENS)
    shuffled, _ = speculative_generate(
        target, drafts["perturbed"], [PROMPTS[i] for i in order], gamma=4, max_new_tokens=NEW_TOKENS
    )
    assert shuffled == [rows[i] for i in order]


def test_a_tensor_without_lengths_gives_a_tensor_padded_with_eos(target, drafts):
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    expected = generate(target, ids, 10)
    out, stats = speculative_generate(target, drafts["perturbed"], ids, gamma=3, max_new_tokens=10)
    assert torch.equal(out, expected) and isinstance(stats, BatchStats)
    eos_id = expected[0, 5].item()  # row 0 ends at its 3rd new token
    out, _ = speculative_generate(target, drafts["perturbed"], ids, gamma=3, max_new_tokens=10, eos_id=eos_id)
    assert torch.equal(out, generate(target, ids, 10, eos_id=eos_id))


def test_a_draft_with_a_shorter_window_drafts_while_it_can(target):
    # Draft window 24 < 64: rows that outgrow it go on with plain target steps.
    short = tiny_gpt2(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_ctx=24, vocab_size=64), seed=0)
    weights = target.state_dict()
    weights["wpe.weight"] = weights["wpe.weight"][:24]
    short.load_state_dict(weights)
    prompts = [[1, 2, 3], [4] * 30, [7] * 22]  # row 1 never fits the draft; row 2 soon outgrows it
    rows, stats = speculative_generate(target, short, prompts, gamma=3, max_new_tokens=40)
    for prompt, row in zip(prompts, rows):
        assert row == alone(target, prompt, 40)
    assert stats.rows[1].drafted == 0 and stats.rows[1].plain_steps == stats.rows[1].target_calls
    assert stats.rows[0].accepted > 0 and stats.rows[2].plain_steps > 0
    # Row 2 (22 tokens) drafts all 3 at its first step: it feeds positions 21..23, the last the draft's window holds.
    assert stats.rows[2].gamma_hist[3] >= 1


def test_simulated_batch_drafter_keeps_the_output_and_sets_alpha(target, drafts):
    references = generate(target, PROMPTS, NEW_TOKENS)
    for alpha in (0.0, 0.6, 1.0):
        drafter = SimulatedBatchDrafter(drafts["unrelated"], references, alpha, seed=0)
        rows, stats = speculative_generate(target, drafter, PROMPTS, gamma=4, max_new_tokens=NEW_TOKENS)
        assert rows == references
        assert stats.alpha == alpha if alpha in (0.0, 1.0) else 0.3 < stats.alpha < 0.9


def test_simulated_batch_drafter_accepts_at_alpha_within_four_standard_errors(target, drafts):
    prompts = [[b + 1] for b in range(16)]
    references = generate(target, prompts, 60)

    def measured(alpha: float) -> tuple[float, int]:
        drafter = SimulatedBatchDrafter(drafts["unrelated"], references, alpha, seed=0)
        rows, stats = speculative_generate(target, drafter, prompts, gamma=4, max_new_tokens=60)
        assert rows == references
        return stats.alpha, stats.judged

    alpha, judged = measured(0.6)
    assert judged >= 800, f"only {judged} judged positions: the check needs more"
    tolerance = 4 * math.sqrt(0.6 * 0.4 / judged)  # each judged position is one Bernoulli(0.6) coin: about 0.065
    assert abs(alpha - 0.6) < tolerance, (alpha, judged)
    wrong, _ = measured(0.6**0.5)  # coins compared with sqrt(alpha), 0.77: the check must see it
    assert abs(wrong - 0.6) > tolerance, wrong


def test_batch_drafters_refuse_bad_settings_with_a_value_error(target, drafts):
    references = generate(target, PROMPTS, NEW_TOKENS)
    draft = drafts["unrelated"]
    with pytest.raises(ValueError, match="the draft must be a loaded GPT2 model, got str"):
        BatchDrafter("gpt2")
    for alpha in ("0.5", True, 1.5, float("nan")):
        with pytest.raises(ValueError, match="the simulated acceptance rate must be a number in \\[0, 1\\]"):
            SimulatedBatchDrafter(draft, references, alpha)
    for bad in ([], references[0], ["abc"], [[1.5, 2.0]], None):
        with pytest.raises(ValueError, match="references must hold each row's greedy token ids"):
            SimulatedBatchDrafter(draft, bad, 0.5)
    too_few = SimulatedBatchDrafter(draft, references[:2], 0.5)
    with pytest.raises(ValueError, match=f"2 references for a batch of {len(PROMPTS)} prompts: give one reference"):
        speculative_generate(target, too_few, PROMPTS, gamma=4, max_new_tokens=NEW_TOKENS)
    # An id past the vocabulary was fed to the draft model: on CUDA a device-side assert that ends the process's CUDA.
    with pytest.raises(ValueError, match="the reference of row 1 holds token id 64, outside the draft's vocabulary"):
        SimulatedBatchDrafter(draft, [references[0], [*references[1], 64]], 0.5)
    as_tensor = SimulatedBatchDrafter(draft, torch.tensor([references[0], references[0]]), 1.0)  # rows of a tensor
    assert as_tensor.references == [references[0], references[0]]


def test_simulated_batch_acceptance_belongs_to_the_row_and_position(target, drafts):
    references = generate(target, PROMPTS, NEW_TOKENS)
    logits, greedy = torch.zeros(CONFIG.vocab_size), SamplingConfig(0.0)
    cells = [(row, p) for row in range(len(PROMPTS)) for p in range(len(PROMPTS[row]), len(references[row]))]

    def picks(order):
        drafter = SimulatedBatchDrafter(drafts["unrelated"], references, 0.5, seed=7)
        return {cell: int(drafter.pick(*cell, logits, greedy, None)[0]) for cell in order}

    forward = picks(cells)
    assert forward == picks(cells[::-1])
    right = sum(forward[(row, p)] == references[row][p] for row, p in cells)
    assert 0 < right < len(cells)

    # A batch cut from this one at row 1 (first_row=1) picks what rows 1.. picked here.
    cut = SimulatedBatchDrafter(drafts["unrelated"], references[1:], 0.5, seed=7, first_row=1)
    assert {(row, p): int(cut.pick(row - 1, p, logits, greedy, None)[0]) for row, p in cells if row >= 1} == {
        cell: token for cell, token in forward.items() if cell[0] >= 1
    }
    unshifted = SimulatedBatchDrafter(drafts["unrelated"], references[1:], 0.5, seed=7)
    assert any(int(unshifted.pick(row - 1, p, logits, greedy, None)[0]) != forward[(row, p)]
               for row, p in cells if row >= 1), "without first_row the cut batch meets other coins"


# ---------------------------------------------------------------------------
# Sampling: seeds reproduce the batch; per-row generators reproduce single runs
# ---------------------------------------------------------------------------


def test_one_generator_reproduces_the_batch(target, drafts):
    def run(seed):
        return speculative_generate(
            target, drafts["perturbed"], PROMPTS, gamma=3, max_new_tokens=NEW_TOKENS, temperature=1.0,
            top_k=20, generator=torch.Generator().manual_seed(seed),
        )[0]

    assert run(1) == run(1) != run(2)


@pytest.mark.parametrize("path", ["readable", "fast"])
def test_with_a_generator_per_row_each_row_is_its_own_sampling_run(target, drafts, path, request):
    model, draft = request.getfixturevalue("fast_pair") if path == "fast" else (target, drafts["perturbed"])
    eos_id = 9
    rows, _ = speculative_generate(
        model, draft, PROMPTS, gamma=3, max_new_tokens=NEW_TOKENS, temperature=1.0, eos_id=eos_id,
        generator=[torch.Generator().manual_seed(100 + b) for b in range(len(PROMPTS))],
    )
    for b, (prompt, row) in enumerate(zip(PROMPTS, rows)):
        expected = spec_alone(
            model, draft, prompt, gamma=3, max_new_tokens=NEW_TOKENS, temperature=1.0, eos_id=eos_id,
            generator=torch.Generator().manual_seed(100 + b),
        )
        assert row == expected


def test_greedy_batches_are_bit_identical_to_greedy_decoding_on_the_fast_path(fast_pair):
    target, draft = fast_pair
    rows, stats = speculative_generate(target, draft, PROMPTS, gamma=4, max_new_tokens=NEW_TOKENS)
    assert rows == generate(target, PROMPTS, NEW_TOKENS) == [alone(target, p, NEW_TOKENS) for p in PROMPTS]
    assert 0.0 < stats.alpha < 1.0


# ---------------------------------------------------------------------------
# Bad input: a ValueError that names the row, before any work
# ---------------------------------------------------------------------------

BAD_BATCHES = {
    "empty batch": ([], None, "the batch is empty"),
    "empty tensor batch": (torch.zeros(0, 3, dtype=torch.long), None, "the batch is empty"),
    "empty row": ([[1, 2], []], None, "row 1: the prompt is empty"),
    "empty row by length": (torch.tensor([[1, 2], [3, 4]]), [2, 0], "row 1: the prompt is empty"),
    "id past the vocabulary": ([[1], [2, 64]], None, r"row 1: token ids must lie in \[0, 64\)"),
    "negative id": ([[-1, 2], [3]], None, r"row 0: token ids must lie in \[0, 64\)"),
    "row too long": ([[1], [2] * 64], None, "row 1: the prompt has 64 tokens .* at most 63 tokens"),
    "not integers": ([[1.5, 2.0]], None, "row 0 must be a list of integer token ids"),
    "a string": (["hello"], None, "row 0 must be a list of integer token ids"),
    "booleans": ([[3], [True, 2]], None, "row 1 must be a list of integer token ids"),  # torch reads True as 1
    "one flat list": ([15, 7, 3], None, r"prompts is one list of token ids, \[15, 7, 3\]: a batch is a list of such"),
    "lengths for a list": ([[1, 2]], [2], "lengths goes with a padded"),
    "lengths too long": (torch.tensor([[1, 2]]), [3], r"row 0: lengths\[0\] = 3 is longer"),
    "lengths miscounted": (torch.tensor([[1, 2], [3, 4]]), [2], "one length per row: 2 integers"),
}


@pytest.mark.parametrize("case", BAD_BATCHES)
def test_bad_batches_raise_a_value_error_naming_the_row(target, drafts, case):
    prompts, lengths, message = BAD_BATCHES[case]
    with BatchSizes(target) as calls, pytest.raises(ValueError, match=message):
        speculative_generate(target, drafts["perturbed"], prompts, lengths=lengths, gamma=3, max_new_tokens=5)
    with pytest.raises(ValueError, match=message):
        generate(target, prompts, 5, lengths=lengths)
    assert calls.sizes == [] and calls.prefills == []


def test_bad_batch_settings_raise_a_value_error(target, drafts):
    kwargs = dict(gamma=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="a list of 2 generators"):
        speculative_generate(target, target, [[1], [2]], generator=[torch.Generator()], **kwargs)
    with pytest.raises(ValueError, match="could ever verify: give at most 63"):
        speculative_generate(target, target, [[1], [2]], gamma=2**63, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"fresh BatchStats\(gamma=2, num_rows=2\)"):
        speculative_generate(target, target, [[1], [2]], stats=SpecStats(2), **kwargs)
    with pytest.raises(ValueError, match="for a batch the draft must be a loaded GPT2 model or a BatchDrafter"):
        speculative_generate(target, "gpt2", [[1], [2]], **kwargs)
    for bad_target in ("gpt2-large", None):  # checked before anything reads its config
        with pytest.raises(ValueError, match="the target must be a loaded GPT2 model"):
            speculative_generate(bad_target, target, [[1], [2]], **kwargs)
    with pytest.raises(ValueError, match="on_step must be a function"):
        speculative_generate(target, target, [[1], [2]], on_step=5, **kwargs)
    with ForwardRecorder(target) as rec, pytest.raises(  # a batch names the row: a TypeError after its first step
            ValueError, match=r"on_step is called as on_step\(row, tokens, num_accepted\), but it takes \(tokens, n\)"):
        speculative_generate(target, target, [[1], [2]], on_step=lambda tokens, n: None, **kwargs)
    assert rec.calls == []
    speculative_generate(target, target, [[1], [2]], on_step=lambda *args: None, **kwargs)  # *args: taken
    with pytest.raises(ValueError, match="gamma must be an integer >= 1, got 'abc'"):
        speculative_generate(target, target, [[1], [2]], gamma="abc", max_new_tokens=4)
    with pytest.raises(ValueError, match="p_min stops a chain of one prompt; a batch drafts every row alike"):
        speculative_generate(target, ModelDrafter(drafts["perturbed"], p_min=0.5), [[1], [2]], **kwargs)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 64\), got ids from 1 to 64 \(row 1\)"):
        generate(target, torch.tensor([[1, 2], [3, 64]]), 4)


class Proposing(BatchDrafter):
    """Proposes whatever `edit` makes of the real proposal."""

    def __init__(self, model, edit) -> None:
        super().__init__(model)
        self.edit = edit

    def propose(self, *args):
        return self.edit(super().propose(*args))


def test_a_batch_drafter_written_elsewhere_is_checked_and_named(target, drafts):
    # The batch loop checked nothing: a column short was a RuntimeError, probs None when sampling a TypeError, and
    # an id past the vocabulary reached the target (on CUDA, a device-side assert).
    bad = {
        "num_drafted = the tokens asked of each row": lambda d: replace(d, num_drafted=[0] * len(d.num_drafted)),
        r"\(2, >= 2\) integer token ids on cpu, got a torch.int64 tensor of shape \(2, 1\)":
            lambda d: replace(d, tokens=d.tokens[:, :1]),
        "token ids in 0..63": lambda d: replace(d, tokens=d.tokens + 64),
        r"probs of shape \(2, >= 2, 64\) on cpu when sampling, got None": lambda d: replace(d, probs=None),
        "probs under which each drafted token has the probability it was drawn with": lambda d: replace(
            d, probs=d.probs.log()),
        "a BatchDraft holding a tensor of tokens, got tuple": lambda d: (d.tokens, d.probs),
        # a look-alike with the fields of a BatchDraft is no BatchDraft either
        "a BatchDraft holding a tensor of tokens, got SimpleNamespace": lambda d: SimpleNamespace(**vars(d)),
        r"probs of shape \(2, >= 2, 64\) on cpu when sampling, got torch.Size\(\[2, 1, 64\]\)": lambda d: replace(
            d, probs=d.probs[:, :1]),
        r"probs of shape \(2, >= 2, 64\) on cpu when sampling, got torch.Size\(\[2, 2, 63\]\)": lambda d: replace(
            d, probs=d.probs[:, :, :63]),
    }
    for message, edit in bad.items():
        with pytest.raises(ValueError, match=f"Proposing.propose must return {message}"):
            speculative_generate(target, Proposing(drafts["unrelated"], edit), [[1, 2], [3]], gamma=2,
                                 max_new_tokens=6, temperature=1.0, generator=torch.Generator().manual_seed(0))


def test_a_draft_on_another_device_than_the_target_is_named(target, drafts):
    # It was found inside the draft's forward pass: "input_ids are on cuda:0, the model on cpu", input_ids the
    # user never passed. A draft on the meta device stands in for a GPU here.
    elsewhere = tiny_gpt2(CONFIG, seed=3).to("meta")
    for prompts in ([[1, 2], [3]], [[1, 2]], torch.tensor([[1, 2]])):
        with pytest.raises(ValueError, match="the draft is on meta, the target on cpu: load both on one device"):
            speculative_generate(target, elsewhere, prompts, gamma=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="the draft is on meta, the target on cpu"):
        speculative_generate(target, elsewhere, torch.tensor([[1, 2]]), tree="2,1", max_new_tokens=4)


@pytest.mark.parametrize("setting, named", [
    (dict(tree="2,1"), "a token tree"), (dict(gamma="auto"), "gamma='auto'"),
    (dict(gamma=HeuristicGamma()), "a gamma schedule"), (dict(draft=NgramDrafter(n=2), gamma=2), "NgramDrafter"),
])
def test_a_list_of_one_prompt_is_a_batch_and_the_message_says_so(target, drafts, setting, named):
    """Trees, gamma schedules and single-sequence drafters take one (1, T) tensor; a list of one prompt is a batch."""
    setting = {"draft": drafts["perturbed"], **setting}
    with pytest.raises(ValueError, match=rf"{named}.*one prompt.* a \(1, T\) tensor"):
        speculative_generate(target, setting.pop("draft"), [[1, 2, 3]], max_new_tokens=4, **setting)

