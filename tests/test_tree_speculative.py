"""`speculative_generate(..., tree=...)` against the baseline `gpt2.generate`,
on tiny random GPT-2s (the setup of tests/test_speculative.py).

Greedy tree decoding must emit exactly the tokens greedy decoding of the
target alone emits, whatever the tree: static shapes and dynamic node
budgets, drafts that agree always, sometimes or never, a one-token prompt,
a token budget ending inside a tree, the context window's edge, and an
end-of-text token inside an accepted path. A chain is the tree with branching
1 everywhere: it gives the chain code's output and counts, draw for draw.
Then the statistics, the KV caches (each step feeds the target only the tree
on top of the committed tokens), the fast path, the simulated tree drafter
and the errors.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import gpt2.fast
from gpt2 import GPT2, GPT2Config, generate
from spec_decoding import (
    BatchDrafter,
    ModelDrafter,
    NgramDrafter,
    SimulatedDrafter,
    SimulatedTreeDrafter,
    SpecStats,
    TokenTree,
    TreeDrafter,
    TreeShape,
    speculative_generate,
    tree_speculative_generate,
)
from helpers import ForwardRecorder, perturbed_copy, tiny_gpt2

pytestmark = pytest.mark.usefixtures("single_thread")

TARGET_CONFIG = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_ctx=64, vocab_size=64)
DRAFT_CONFIG = GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=64, vocab_size=64)
PERTURBATION = 0.04  # the "perturbed" draft agrees with the target some of the time
PROMPTS = {"4 tokens": [[1, 2, 3, 4]], "1 token": [[7]]}
SHAPES = {
    "2": TreeShape.parse("2"),
    "3,1": TreeShape.parse("3,1"),
    "2,2,1": TreeShape.parse("2,2,1"),
    "3,2,1,1": TreeShape.parse("3,2,1,1"),
    "dynamic 6, depth 3": TreeShape(nodes=6, depth=3),
    "dynamic 16, depth 5": TreeShape(nodes=16, depth=5),
}
NEW_TOKENS = 40


@pytest.fixture(scope="module", params=[0, 1, 2], ids=lambda seed: f"seed {seed}")
def models(request):
    """(target, {draft name: draft}) for one seed."""
    target = tiny_gpt2(TARGET_CONFIG, seed=request.param)
    return target, {
        "self": target,
        "perturbed": perturbed_copy(target, scale=PERTURBATION, seed=request.param + 10),
        "unrelated": tiny_gpt2(DRAFT_CONFIG, seed=request.param + 20),
    }


def prompt(name: str = "4 tokens") -> torch.Tensor:
    return torch.tensor(PROMPTS[name])


def check_stats_consistent(stats: SpecStats, out: torch.Tensor, T: int, shape: TreeShape) -> None:
    """The counters of one tree run agree with each other and with its output."""
    hist = stats.accepted_hist
    assert stats.gamma == shape.max_depth and stats.tree == str(shape)
    assert stats.new_tokens == out.size(1) - T == stats.accepted + stats.target_tokens
    assert stats.target_calls == sum(hist) == sum(stats.gamma_hist)  # gamma_hist[K]: steps asking for depth K
    assert stats.gamma_hist[0] <= stats.plain_steps
    assert stats.accepted == sum(n * steps for n, steps in enumerate(hist))
    assert stats.drafted <= shape.max_nodes * stats.target_calls
    assert stats.accepted_at == [sum(hist[i + 1 :]) for i in range(shape.max_depth)]
    assert all(a <= r for a, r in zip(stats.accepted_at, stats.reached_at))
    # Each accepted node had one sibling rank: the ranks at depth d add up to the acceptances there.
    assert [sum(ranks) for ranks in stats.accepted_rank] == stats.accepted_at[: len(stats.accepted_rank)]
    assert stats.target_tokens in (stats.target_calls, stats.target_calls - int(stats.stopped_at_eos))


# ---------------------------------------------------------------------------
# Greedy: identical to the baseline
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_name", PROMPTS)
@pytest.mark.parametrize("shape_name", SHAPES)
@pytest.mark.parametrize("draft_name", ["self", "perturbed", "unrelated"])
def test_greedy_equals_baseline_token_for_token(models, draft_name, shape_name, prompt_name):
    target, drafts = models
    ids, shape = prompt(prompt_name), SHAPES[shape_name]
    out, stats = speculative_generate(target, drafts[draft_name], ids, tree=shape, max_new_tokens=NEW_TOKENS)
    assert out.tolist() == generate(target, ids, NEW_TOKENS).tolist()
    check_stats_consistent(stats, out, ids.size(1), shape)
    if draft_name == "self":  # the draft's first choice is always the target's
        assert stats.alpha == 1.0 and all(ranks[1:] == [0] * (len(ranks) - 1) for ranks in stats.accepted_rank)


def test_the_perturbed_draft_accepts_other_siblings_than_the_first(models):
    target, drafts = models
    _, stats = speculative_generate(target, drafts["perturbed"], prompt(), tree="3,2,1,1", max_new_tokens=NEW_TOKENS)
    assert 0 < stats.alpha < 1
    assert sum(stats.accepted_rank[0][1:]) > 0, "a second or third candidate was accepted at depth 1"


@pytest.mark.parametrize("max_new_tokens", range(10))
def test_a_budget_ending_inside_a_tree_gives_exactly_max_new_tokens(models, max_new_tokens):
    target, drafts = models
    ids = prompt()
    for draft_name in ("self", "perturbed"):
        out, _ = speculative_generate(target, drafts[draft_name], ids, tree="2,2,1", max_new_tokens=max_new_tokens)
        assert out.tolist() == generate(target, ids, max_new_tokens).tolist()


@pytest.mark.parametrize("shape_name", ["3,2,1,1", "dynamic 16, depth 5"])
@pytest.mark.parametrize("draft_name", ["self", "perturbed"])
def test_generation_stops_at_the_context_window(models, draft_name, shape_name):
    target, drafts = models
    shape = SHAPES[shape_name]
    for ids in (prompt(), torch.arange(TARGET_CONFIG.n_ctx - 5)[None] % 64):  # short, and 5 short of the edge
        out, stats = speculative_generate(target, drafts[draft_name], ids, tree=shape, max_new_tokens=1000)
        assert out.size(1) == TARGET_CONFIG.n_ctx
        assert out.tolist() == generate(target, ids, 1000).tolist()
        check_stats_consistent(stats, out, ids.size(1), shape)


def test_a_draft_with_a_shorter_window_stops_drafting_and_the_target_goes_on(models):
    target, _ = models
    short_draft = GPT2(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_ctx=24, vocab_size=64)).eval()
    weights = target.state_dict()
    weights["wpe.weight"] = weights["wpe.weight"][:24]
    short_draft.load_state_dict(weights)
    with ForwardRecorder(short_draft) as draft_calls:
        out, stats = speculative_generate(target, short_draft, prompt(), tree="2,2,2", max_new_tokens=1000)
    assert out.tolist() == generate(target, prompt(), 1000).tolist()
    assert max(c.cached + c.tokens for c in draft_calls.calls) <= 24  # never past the draft's window
    assert stats.plain_steps > 0
    # At the end of its window it still drafts a first level, as a chain drafts one token there: the deepest
    # level is never fed to the draft, so the tree's nodes need room in the target's window only.
    end = torch.arange(24)[None] % 64  # (1, 24): the draft's window full
    for how in ({"tree": "2,2,2"}, {"gamma": 3}):
        out, stats = speculative_generate(target, short_draft, end, max_new_tokens=2, **how)
        assert out.tolist() == generate(target, end, 2).tolist()
        assert stats.drafted == (2 if "tree" in how else 1), how
    # Two positions before its end the draft's window still takes a level of two nodes: the tree grows a second.
    trees = []
    near_end = torch.arange(22)[None] % 64  # (1, 22)
    tree_speculative_generate(target, short_draft, near_end, tree="2,2,2", max_new_tokens=3,
                              on_tree=lambda tree, verdict: trees.append(tree))
    assert trees[0].depth == 2


def test_a_dynamic_tree_stops_where_its_nodes_run_out(models):
    # 4 nodes, depth 3 grows two levels of 2: it reaches depth 2, and drafts nothing it would not verify.
    target, drafts = models
    shape = TreeShape(nodes=4, depth=3)
    out, stats = speculative_generate(target, drafts["perturbed"], prompt(), tree=shape, max_new_tokens=40)
    assert out.tolist() == generate(target, prompt(), 40).tolist()
    assert shape.max_depth == stats.gamma == 2 and stats.draft_calls <= 2 * (stats.target_calls - stats.plain_steps)


@pytest.mark.parametrize("shape_name", ["2,2,1", "3,2,1,1"])
def test_eos_inside_an_accepted_path_ends_the_output_there(models, shape_name):
    # With draft = target every step accepts a full path, then a bonus token.
    # An EOS at a drafted index is accepted with more of the path behind it.
    target, _ = models
    shape, ids = SHAPES[shape_name], prompt()
    T = ids.size(1)
    baseline = generate(target, ids, NEW_TOKENS)
    step = shape.max_depth + 1
    new = baseline[0, T:].tolist()
    index = next(i for i in range(5, NEW_TOKENS) if i % step < shape.max_depth - 1 and new[i] not in new[:i])
    eos_id = new[index]
    steps = []
    out, stats = speculative_generate(
        target, target, ids, tree=shape, max_new_tokens=NEW_TOKENS, eos_id=eos_id,
        on_step=lambda tokens, accepted: steps.append((list(tokens), accepted)),
    )
    assert out.tolist() == generate(target, ids, NEW_TOKENS, eos_id=eos_id).tolist()
    assert out[0, T:].tolist() == new[: index + 1]  # nothing after EOS
    last_tokens, last_accepted = steps[-1]
    assert last_tokens[-1] == eos_id and last_accepted == len(last_tokens) < step
    assert stats.stopped_at_eos and stats.target_tokens == stats.target_calls - 1
    check_stats_consistent(stats, out, T, shape)


# ---------------------------------------------------------------------------
# A chain is a tree of branching 1
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_a_chain_shaped_tree_gives_the_chain_codes_output_and_counts(models, gamma, temperature):
    target, drafts = models
    runs = {}
    for name, how in (("chain", {"gamma": gamma}), ("tree", {"tree": TreeShape(branching=(1,) * gamma)})):
        runs[name] = speculative_generate(
            target, drafts["perturbed"], prompt(), max_new_tokens=NEW_TOKENS, temperature=temperature,
            generator=torch.Generator().manual_seed(7), **how,
        )
    (chain_out, chain), (tree_out, tree) = runs["chain"], runs["tree"]
    assert tree_out.tolist() == chain_out.tolist()
    for counter in ("new_tokens", "target_calls", "draft_calls", "drafted", "accepted", "accepted_hist",
                    "reached_at", "accepted_at", "target_tokens"):  # fmt: skip
        assert getattr(tree, counter) == getattr(chain, counter), counter


# ---------------------------------------------------------------------------
# The KV caches are reused: no recompute
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_step_feeds_the_target_one_tree_on_its_cache(models, temperature):
    target, drafts = models
    draft = drafts["perturbed"]
    ids, shape = prompt(), TreeShape.parse("3,2,1")
    T = ids.size(1)
    committed, trees = [T], []
    with ForwardRecorder(target) as target_rec, ForwardRecorder(draft) as draft_rec:
        out, stats = tree_speculative_generate(
            target, draft, ids, tree=shape, max_new_tokens=NEW_TOKENS, temperature=temperature,
            generator=torch.Generator().manual_seed(0),
            on_step=lambda tokens, accepted: committed.append(committed[-1] + len(tokens)),
            on_tree=lambda tree, verdict: trees.append(tree),
        )
    verify = target_rec.calls[1:]  # after the prefill of T - 1 tokens
    assert (target_rec.calls[0].tokens, target_rec.calls[0].cached) == (T - 1, 0)
    assert [(c.tokens, c.cached) for c in verify] == [(tree.size, S - 1) for tree, S in zip(trees, committed)]
    # The draft: one prefill, then per step one pass per depth: the committed
    # tokens it lacks (one or two), then each level but the last (3, then 6).
    draft_steps = draft_rec.calls[1:]
    assert len(draft_steps) == stats.draft_calls == sum(min(3, tree.depth) for tree in trees)
    assert all(c.tokens in (1, 2, 3, 6) for c in draft_steps)
    check_stats_consistent(stats, out, T, shape)


# ---------------------------------------------------------------------------
# The fast path
# ---------------------------------------------------------------------------


def test_greedy_trees_on_the_fast_path_equal_the_fast_baseline(fast_kernels):
    target = gpt2.fast.accelerate(tiny_gpt2(TARGET_CONFIG, seed=0))
    draft = gpt2.fast.accelerate(perturbed_copy(target, scale=PERTURBATION, seed=10))
    assert target.accelerator is not None and draft.accelerator is not None
    ids = prompt()
    baseline = generate(target, ids, NEW_TOKENS)
    for shape in ("3,2,1,1", TreeShape(nodes=16, depth=5)):
        out, stats = speculative_generate(target, draft, ids, tree=shape, max_new_tokens=NEW_TOKENS)
        assert out.tolist() == baseline.tolist()
        assert 0 < stats.alpha < 1


# ---------------------------------------------------------------------------
# The simulated tree drafter (for benchmarks)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("profile", [(1.0,), (0.0, 1.0), (0.0,), (0.5, 0.3)])
def test_the_simulated_tree_drafter_keeps_the_output_and_follows_its_profile(models, profile):
    target, drafts = models
    ids = prompt()
    reference = generate(target, ids, NEW_TOKENS)
    drafter = SimulatedTreeDrafter(drafts["unrelated"], reference, tuple(map(np.float64, profile)), seed=0)
    out, stats = speculative_generate(target, drafter, ids, tree="2,2", max_new_tokens=NEW_TOKENS)
    assert out.tolist() == reference.tolist()
    depth1 = stats.accepted_rank[0] if stats.accepted_rank else []
    if profile == (1.0,):
        assert stats.alpha == 1.0 and depth1[1:] == []  # always the first candidate
    elif profile == (0.0, 1.0):
        assert stats.alpha == 1.0 and depth1[0] == 0  # always the second
    elif profile == (0.0,):
        assert stats.accepted == 0
    else:
        assert 0 < stats.alpha < 1 and depth1[0] > depth1[1] > 0


def test_the_simulated_tree_drafters_ranks_are_one_distribution(models):
    # Rank r has probability profile[r - 1]; the ranks past the profile share the rest alike. A dynamic tree ranks
    # candidates by these values, so they must add up to 1 over the vocabulary.
    target, drafts = models
    drafter = SimulatedTreeDrafter(drafts["unrelated"], generate(target, prompt(), 5), (0.5, 0.2))
    ranked = drafter.ranked(torch.zeros(64), 64)
    assert ranked[:3] == [0.5, 0.2, pytest.approx(0.3 / 62)] and sum(ranked) == pytest.approx(1.0)


def test_a_simulated_tree_as_wide_as_the_vocabulary_still_leaves_the_target_token_out():
    # With as many children as tokens, the wrong candidates wrapped round to the right one: profile (0,) accepted all.
    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=32, vocab_size=4)
    target, draft = tiny_gpt2(config, seed=0), tiny_gpt2(config, seed=1)
    ids = torch.tensor([[1, 2]])
    reference = generate(target, ids, 10)
    drafter = SimulatedTreeDrafter(draft, reference, (0.0,), seed=0)
    out, stats = speculative_generate(target, drafter, ids, tree="4,4", max_new_tokens=10)
    assert out.tolist() == reference.tolist() and stats.accepted == 0 and stats.judged > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_one_branch_tree_meets_the_same_luck_as_the_chain(models, seed):
    # Simulated tree and chain drafters with the same seed draw one coin per
    # position: a tree of one candidate per depth is then the chain, step for step.
    target, drafts = models
    ids = prompt()
    reference = generate(target, ids, NEW_TOKENS)
    chain = speculative_generate(target, SimulatedDrafter(drafts["unrelated"], reference, 0.6, seed=seed), ids,
                                 gamma=3, max_new_tokens=NEW_TOKENS)[1]
    tree = speculative_generate(target, SimulatedTreeDrafter(drafts["unrelated"], reference, (0.6, 0.2), seed=seed),
                                ids, tree="1,1,1", max_new_tokens=NEW_TOKENS)[1]
    assert 0 < chain.accepted < chain.drafted
    assert (tree.accepted, tree.target_calls, tree.accepted_hist, tree.gamma_hist) == (
        chain.accepted, chain.target_calls, chain.accepted_hist, chain.gamma_hist)


def test_the_simulated_tree_drafter_refuses_bad_settings(models):
    target, drafts = models
    reference = generate(target, prompt(), 8)
    for profile in ((0.8, 0.5), (float("nan"),), (0.5, float("nan")), (-0.1, 0.5), ("0.5",), 0.5, (True,)):
        with pytest.raises(ValueError, match="acceptance profile"):
            SimulatedTreeDrafter(drafts["unrelated"], reference, profile)
    with pytest.raises(ValueError, match="reference must be a tensor of the target's greedy token ids"):
        SimulatedTreeDrafter(drafts["unrelated"], None, (0.5,))
    with pytest.raises(ValueError, match="reference holds token id 64, outside the draft's vocabulary 0..63"):
        SimulatedTreeDrafter(drafts["unrelated"], torch.cat([reference, torch.tensor([[64]])], 1), (0.5,))
    drafter = SimulatedTreeDrafter(drafts["unrelated"], reference, (0.5,))
    with pytest.raises(ValueError, match="greedy decoding only"):
        speculative_generate(target, drafter, prompt(), tree="2", max_new_tokens=4, temperature=1.0)
    with pytest.raises(ValueError, match="a SimulatedDrafter drafts chains: .* SimulatedTreeDrafter"):
        speculative_generate(target, SimulatedDrafter(drafts["unrelated"], reference, 0.5), prompt(), tree="2",
                             max_new_tokens=4)


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "how, message",
    [
        ({"gamma": 3, "tree": "2,1"}, "give gamma .* or tree .*, not both"),
        ({"tree": "0,2"}, "integers >= 1 such as 3,2,1,1"),
        ({"tree": "abc"}, "integers >= 1 such as 3,2,1,1"),
        ({"tree": (2, 1)}, "tree must be a TreeShape or text"),
        ({}, r"give gamma \(tokens drafted per step.*\) or tree"),
        ({"tree": TreeShape(nodes=10**8, depth=10**8)}, "the tree's depth is 100000000, more tokens than the target"),
        ({"tree": "2,1", "stats": SpecStats(3)}, r"stats must be a fresh SpecStats\(2, tree='2,1'\)"),
        # SpecStats(2) without the tree ran, and counted the tree's steps as a chain's
        ({"tree": "2,1", "stats": SpecStats(2)}, r"stats must be a fresh SpecStats\(2, tree='2,1'\) \(the tree's "
                                                 r"depth and shape\)"),
        ({"tree": "2,1", "on_step": "print"}, "on_step must be a function"),
        ({"tree": "2,1", "draft": NgramDrafter(3)}, "a token tree is drafted by a model: .*: NgramDrafter drafts "
                                                    "chains, give gamma"),
        ({"tree": "2,1", "draft": "gpt2"}, "a token tree is drafted by a model: .* gpt2.load_model"),
        ({"tree": "2,1", "draft": "BatchDrafter"}, "got BatchDrafter: BatchDrafter drafts chains for a batch; a tree "
                                                   "takes one prompt"),
        ({"tree": "2,1", "draft": "p_min"}, "p_min stops a chain; a tree keeps its shape"),
    ],
)
def test_bad_tree_settings_raise_a_clear_error_before_any_work(models, how, message):
    target, drafts = models
    how = dict(how)  # the parameters are shared by every model seed
    draft = how.pop("draft", drafts["perturbed"])
    draft = ModelDrafter(drafts["perturbed"], p_min=0.5) if draft == "p_min" else draft
    draft = BatchDrafter(drafts["perturbed"]) if draft == "BatchDrafter" else draft
    with ForwardRecorder(target) as rec, pytest.raises(ValueError, match=message):
        speculative_generate(target, draft, prompt(), max_new_tokens=5, **how)
    assert rec.calls == []


def test_the_tree_loop_called_with_two_rows_refuses_them_before_any_work(models):
    """speculative_generate sends a batch to batch.py before the tree loop; called directly, the loop refuses it."""
    target, drafts = models
    two = torch.tensor([[1, 2, 3, 4], [4, 3, 2, 1]])  # (2, 4)
    with ForwardRecorder(target) as rec, pytest.raises(ValueError, match="one sequence at a time: got a batch of 2$"):
        tree_speculative_generate(target, drafts["perturbed"], two, tree="2,1", max_new_tokens=5)
    assert rec.calls == []


def test_a_chain_drafter_wrapped_in_a_tree_drafter_is_refused_as_it_is_bare(models):
    """TreeDrafter(ModelDrafter(d, p_min=...)) and TreeDrafter(SimulatedDrafter(...)) drafted with the plain model:
    p_min had no effect, and a simulated alpha 1.0 measured 0.6."""
    target, drafts = models
    reference = generate(target, prompt(), 10)
    for chain, message in ((ModelDrafter(drafts["perturbed"], p_min=0.5), "p_min stops a chain; a tree keeps"),
                           (SimulatedDrafter(drafts["perturbed"], reference, 1.0), "a SimulatedDrafter drafts chains")):
        with pytest.raises(ValueError, match=message):
            TreeDrafter(chain)
    assert TreeDrafter(ModelDrafter(drafts["perturbed"])).model is drafts["perturbed"]  # a plain one is fine


class WithReplacement(TreeDrafter):
    """Children drawn independently, so siblings can repeat: tree_sampling's residuals then judge the second copy
    against the wrong distribution (3,775 of 4,000 trees "4" had a repeat; chi-square 774 against 94.5)."""

    def candidates(self, path, q, count, sampling, generator):
        tokens = torch.multinomial(q, count, replacement=True, generator=generator).tolist()
        return [(t, float(q[t])) for t in tokens]


class Proposing(TreeDrafter):
    """Proposes whatever `edit` makes of the real proposal."""

    def __init__(self, model, edit) -> None:
        super().__init__(model)
        self.edit = edit

    def propose(self, seq, shape, **kwargs):
        return self.edit(super().propose(seq, shape, **kwargs))


class WithReplacementTensors(WithReplacement):
    """The same, its tokens as the 0-d tensors torch draws: they hash by identity, so a set saw no repeat
    (total variation 0.74 from the target on a 4-token vocabulary)."""

    def propose(self, seq, shape, **kwargs):
        draft = super().propose(seq, shape, **kwargs)
        tensors = tuple(torch.tensor(t) for t in draft.tree.tokens)  # 0-d int64 each
        return replace(draft, tree=TokenTree(tensors, tuple(torch.tensor(p) for p in draft.tree.parents)))


def test_a_tree_drafter_written_elsewhere_is_checked_and_named(models):
    target, drafts = models
    draft = drafts["unrelated"]
    for drafter in (WithReplacement, WithReplacementTensors):
        with pytest.raises(ValueError, match=f"{drafter.__name__}.propose must return distinct tokens among sib"):
            tree_speculative_generate(target, drafter(draft), prompt(), tree="16", max_new_tokens=20,
                                      temperature=1.0, generator=torch.Generator().manual_seed(0))
    # Greedy, a repeated sibling is harmless (the first match is followed): such trees still decode greedily.
    out, _ = tree_speculative_generate(target, WithReplacement(draft), prompt(), tree="16", max_new_tokens=20,
                                       generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, generate(target, prompt(), 20))
    bad = {
        "a TreeDraft holding a TokenTree": lambda d: d.tree,
        "a tree whose root is the last committed token 4": lambda d: replace(d, tree=TokenTree((5, *d.tree.tokens[1:]),
                                                                                        d.tree.parents)),
        "token ids in 0..63": lambda d: replace(d, tree=TokenTree((*d.tree.tokens[:-1], 64), d.tree.parents)),
        "at most 60 nodes 2 deep, got 5 nodes 3 deep": lambda d: replace(d, tree=TokenTree((*d.tree.tokens, 9),
                                                                          (*d.tree.parents, d.tree.size - 1))),
        "probs of shape": lambda d: replace(d, probs=None),
        "probs under which each drafted token has the probability it was drawn with": lambda d: replace(
            d, probs=d.probs.log()),
    }
    for message, edit in bad.items():
        with pytest.raises(ValueError, match=f"Proposing.propose must return {message}"):
            tree_speculative_generate(target, Proposing(draft, edit), prompt(), tree="2,1", max_new_tokens=20,
                                      temperature=1.0, generator=torch.Generator().manual_seed(0))


def test_on_tree_must_be_a_function_before_any_work(models):
    target, drafts = models
    with ForwardRecorder(target) as rec, pytest.raises(ValueError, match="on_tree must be a function"):
        tree_speculative_generate(target, drafts["perturbed"], prompt(), tree="2,1", max_new_tokens=3, on_tree="x")
    assert rec.calls == []


@pytest.mark.parametrize("shape", ["11", "12,2", "3,40"])
def test_a_tree_wider_than_the_vocabulary_drafts_each_token_once(shape):
    # 10 tokens: a node cannot have more distinct children than that.
    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=64, vocab_size=10)
    target = tiny_gpt2(config, seed=0)
    draft = perturbed_copy(target, scale=PERTURBATION, seed=1)
    ids = torch.tensor([[1, 2, 3]])
    out, stats = speculative_generate(target, draft, ids, tree=shape, max_new_tokens=12)
    assert out.tolist() == generate(target, ids, 12).tolist()
    level, most = 1, 0  # the most nodes a step can draft with each node's children capped at 10
    for branching in map(int, shape.split(",")):
        level *= min(branching, 10)
        most += level
    assert 0 < stats.drafted <= most * stats.target_calls
