"""Token trees: the data structure, the verification rules on hand-made
scores, tree attention in the model, the KV cache after a tree, and drafting.

Tree attention is checked the way it is meant: a forward pass over a whole
tree with its ancestor mask gives, at every node, the logits of running that
node's root-to-node path alone on top of the same cache (<= 1e-4), on the
readable path and on the C fast path (there bit for bit, the kernels being
batch-invariant). Compaction: after keeping an accepted path, the next
token's logits equal those of a fresh run over the committed sequence.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpt2.fast
from gpt2 import GPT2, GPT2Config, SamplingConfig
from spec_decoding import (
    TokenTree,
    TreeDrafter,
    TreeShape,
    TreeVerdict,
    speculative_sampling,
    tree_greedy,
    tree_sampling,
)
from spec_decoding.tree_drafting import draw_without_replacement
from helpers import ForwardRecorder, tiny_gpt2

pytestmark = pytest.mark.usefixtures("single_thread")

ATOL = 1e-4
CONFIG = GPT2Config(n_layer=2, n_head=4, n_embd=32, n_ctx=64, vocab_size=101)  # head size 8: the kernels take it
PREFIX = [[5, 17, 3, 99, 42, 8, 61]]  # (1, 7)

#   0 (root)           depths 0
#   ├── 1                     1
#   │   ├── 3                 2
#   │   │   └── 5             3
#   │   └── 4                 2
#   └── 2                     1
#       └── 6                 2
TREE = TokenTree(tokens=(50, 51, 52, 53, 54, 55, 56), parents=(-1, 0, 0, 1, 1, 3, 2))


# ---------------------------------------------------------------------------
# The data structure
# ---------------------------------------------------------------------------


def test_a_tree_knows_its_depths_paths_children_and_positions():
    assert TREE.size == 7 and TREE.depth == 3
    assert TREE.depths == (0, 1, 1, 2, 2, 3, 2)
    assert TREE.children(0) == [1, 2] and TREE.children(1) == [3, 4] and TREE.children(5) == []
    assert TREE.path(5) == [0, 1, 3, 5] and TREE.path(0) == [0]
    assert TREE.positions(10).tolist() == [10, 11, 11, 12, 12, 13, 12]


def test_the_ancestor_mask():
    assert TREE.ancestor_mask().int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 1, 0, 1, 0],
        [1, 0, 1, 0, 0, 0, 1],
    ]


def test_a_chain_is_a_causal_mask():
    chain = TokenTree(tokens=(1, 2, 3, 4), parents=(-1, 0, 1, 2))
    assert torch.equal(chain.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())


def test_a_tree_takes_its_ids_as_ints_and_refuses_other_numbers():
    tree = TokenTree((torch.tensor(5), np.int64(7), 7), (-1, torch.tensor(0), 0))  # as torch and numpy draw them
    assert tree.tokens == (5, 7, 7) and all(type(t) is int for t in (*tree.tokens, *tree.parents))
    assert len(set(zip(tree.parents, tree.tokens))) == 2  # the repeated sibling is seen
    for tokens, parents in (((5, 7), (-1, 0.0)), ((5, 7.5), (-1, 0)), ((5, torch.tensor([7, 8])), (-1, 0))):
        with pytest.raises(ValueError, match="a tree's tokens and parents must be integers"):
            TokenTree(tokens, parents)
    with pytest.raises(ValueError, match="a tree's tokens are ids >= 0, got -1"):
        TokenTree((0, -1), (-1, 0))  # -1 read the last token's probability


def test_tree_verification_refuses_scores_of_the_wrong_shape():
    tree, V = TokenTree((0, 1, 2), (-1, 0, 0)), 5
    p, q = torch.full((3, V), 1 / V), torch.full((3, V), 1 / V)
    with pytest.raises(ValueError, match=r"need \(3, V\) target scores for a tree of 3 nodes, got \(2, 5\)"):
        tree_greedy(torch.zeros(2, V), tree)
    with pytest.raises(ValueError, match=r"need \(3, 5\) draft probabilities for a tree of 3 nodes \(the target's V\)"):
        tree_sampling(p, q[:, :3], tree)
    with pytest.raises(ValueError, match=r"need \(2,\) uniforms for a tree of 3 nodes"):
        tree_sampling(p, q, tree, uniforms=torch.zeros(3))


def test_a_tree_draws_itself_with_the_accepted_path_marked():
    text = TREE.draw(accepted=(1, 3), decode=lambda t: f"t{t}", next_token=77)
    assert text == "\n".join([
        "t50   (root)",
        "├── t51 ✓",
        "│   ├── t53 ✓",
        "│   │   └── t55",
        "│   └── t54",
        "└── t52",
        "    └── t56",
        "+ target: t77",
    ])  # fmt: skip
    assert TREE.draw(decode=lambda t: " a\nb").splitlines()[0] == " a\\nb   (root)"  # one line per node


def test_a_chain_a_thousand_deep_draws_itself():  # as --show-tree draws --gamma 1023
    chain = TokenTree(tokens=tuple(range(1024)), parents=(-1, *range(1023)))
    lines = chain.draw(accepted=(1, 2)).splitlines()
    assert len(lines) == 1024 and lines[2] == "    └── 2 ✓" and lines[-1] == " " * 4 * 1022 + "└── 1023"


def test_children_come_after_their_parents():
    # A ValueError, not an assert: under python -O the bad tree was built, and its mask hid the root from node 1.
    for parents in [(-1, 2, 0), (0, 0, 1), (-1, 0)]:
        with pytest.raises(ValueError, match="parent"):
            TokenTree(tokens=(1, 2, 3), parents=parents)


def test_tree_shapes():
    static = TreeShape.parse("3,2,1,1")
    assert static.branching == (3, 2, 1, 1) and static.max_depth == 4
    assert static.max_nodes == 3 + 6 + 6 + 6 and not static.is_chain and str(static) == "3,2,1,1"
    assert TreeShape.parse("1,1,1").is_chain
    dynamic = TreeShape(nodes=10, depth=4)
    assert (dynamic.max_nodes, dynamic.max_depth, dynamic.width) == (10, 4, 3)
    reaches = {(16, 5): 4, (6, 4): 3, (12, 4): 4, (5, 5): 5, (7, 1): 1}  # (nodes, depth): the depth it reaches
    assert {key: TreeShape(nodes=key[0], depth=key[1]).max_depth for key in reaches} == reaches


@pytest.mark.parametrize(
    "text, message",
    [("0,2", "integers >= 1"), ("abc", "integers >= 1"), ("", "integers >= 1"), ("3,,1", "integers >= 1")],
)
def test_bad_tree_text_says_what_a_shape_is(text, message):
    with pytest.raises(ValueError, match=message):
        TreeShape.parse(text)


def test_bad_tree_shapes_say_how_to_fix_them():
    with pytest.raises(ValueError, match="not both"):
        TreeShape(branching=(2,), nodes=4, depth=2)
    with pytest.raises(ValueError, match="depth must be an integer >= 1"):
        TreeShape(nodes=4)
    with pytest.raises(ValueError, match="give depth <= nodes"):
        TreeShape(nodes=2, depth=3)
    with pytest.raises(ValueError, match=r"every tree branching \(children per node\) must be an integer >= 1, got 0"):
        TreeShape(branching=(2, 0))  # a depth without nodes (parse refuses "2,0" on its own)
    # Not a sequence: a TypeError from `not 2`, a RuntimeError from a tensor's truth
    for branching in (2, "2,2", (), torch.tensor(2)):
        with pytest.raises(ValueError, match=r"a tree's branching needs one number per depth, such as \(3, 2, 1, 1\) "
                           r"\(TreeShape.parse reads '3,2,1,1'\); got"):
            TreeShape(branching=branching)
    assert TreeShape(branching=torch.tensor([2, 1])).branching == (2, 1)


# ---------------------------------------------------------------------------
# The rules on hand-made scores
# ---------------------------------------------------------------------------


def one_hot_scores(choices: list[int], V: int = 101) -> torch.Tensor:
    """(N, V) scores whose argmax at node i is choices[i]."""
    scores = torch.zeros(len(choices), V)
    scores[torch.arange(len(choices)), torch.tensor(choices)] = 1.0
    return scores


def test_greedy_follows_the_targets_argmax_down_the_tree():
    # At the root the target wants 52 (node 2, rank 1), at node 2 it wants 56 (node 6), then 9 (no child).
    verdict = tree_greedy(one_hot_scores([52, 0, 56, 0, 0, 0, 9]), TREE)
    assert verdict == TreeVerdict(accepted=(52, 56), next_token=9, nodes=(2, 6), ranks=(1, 0))
    assert verdict.tokens == [52, 56, 9]
    # The deepest path, then the bonus token at the leaf.
    assert tree_greedy(one_hot_scores([51, 53, 0, 55, 0, 7, 0]), TREE).tokens == [51, 53, 55, 7]
    # Nothing accepted: the target's token at the root.
    assert tree_greedy(one_hot_scores([60, 53, 0, 55, 0, 7, 0]), TREE).tokens == [60]


def test_sampling_a_chain_is_the_chain_rule_draw_for_draw():
    chain = TokenTree(tokens=(0, 4, 2, 7), parents=(-1, 0, 1, 2))
    g = torch.Generator().manual_seed(0)
    target_probs = torch.softmax(torch.randn(4, 10, generator=g), dim=-1)  # (K + 1, V)
    draft_probs = torch.softmax(torch.randn(4, 10, generator=g), dim=-1)  # (K + 1, V), the last row unused
    for seed in range(20):
        tree_verdict = tree_sampling(target_probs, draft_probs, chain, generator=torch.Generator().manual_seed(seed))
        chain_verdict = speculative_sampling(
            target_probs, draft_probs[:3], torch.tensor(chain.tokens[1:]), generator=torch.Generator().manual_seed(seed)
        )
        assert tree_verdict.tokens == chain_verdict.tokens


def test_sampling_judges_the_second_child_against_the_residual():
    # Root with children 0 then 1. p_target = (0.2, 0.5, 0.3), p_draft = (0.6, 0.3, 0.1).
    tree = TokenTree(tokens=(9, 0, 1), parents=(-1, 0, 0))
    target_probs = torch.tensor([[0.2, 0.5, 0.3]] * 3)
    draft_probs = torch.tensor([[0.6, 0.3, 0.1], [0.0] * 3, [0.0] * 3])
    # Child 0 is accepted iff r < 0.2 / 0.6 = 1/3.
    assert tree_sampling(target_probs, draft_probs, tree, uniforms=torch.tensor([0.3, 0.99])).nodes == (1,)
    # Rejected: the residual is norm(max(0, p - q)) = (0, 0.2, 0.2) / 0.4 = (0, 0.5, 0.5), and
    # p_draft without token 0 is (0, 0.75, 0.25): child 1 is accepted iff r < 0.5 / 0.75 = 2/3.
    assert tree_sampling(target_probs, draft_probs, tree, uniforms=torch.tensor([0.4, 0.6])).ranks == (1,)
    both_rejected = tree_sampling(
        target_probs, draft_probs, tree, uniforms=torch.tensor([0.4, 0.7]), generator=torch.Generator().manual_seed(0)
    )
    # Then the token comes from the second residual norm(max(0, (0, .5, .5) - (0, .75, .25))) = (0, 0, 1).
    assert both_rejected.nodes == () and both_rejected.next_token == 2


def test_sampling_rejects_a_child_the_target_gives_no_mass_even_at_a_zero_uniform():
    # As in the chain (test_acceptance.py): r p_draft < p_target is 0 < 0 for token 2, false; the residual
    # max(0, (0.5, 0.5, 0) - (0, 0.5, 0.5)) is one-hot on token 0.
    tree = TokenTree(tokens=(9, 2), parents=(-1, 0))
    target_probs = torch.tensor([[0.5, 0.5, 0.0]] * 2)
    draft_probs = torch.tensor([[0.0, 0.5, 0.5], [0.0] * 3])
    verdict = tree_sampling(target_probs, draft_probs, tree, uniforms=torch.zeros(1))
    assert verdict.nodes == () and verdict.next_token == 0


def test_sampling_takes_every_rejected_sibling_out_of_the_drafts_distribution():
    # Root with children 0, 1, 2. p_target = (.1, .3, .2, .4), p_draft = (.4, .4, .1, .1).
    tree = TokenTree(tokens=(9, 0, 1, 2), parents=(-1, 0, 0, 0))
    target_probs = torch.tensor([[0.1, 0.3, 0.2, 0.4]] * 4)
    draft_probs = torch.tensor([[0.4, 0.4, 0.1, 0.1]] + [[0.0] * 4] * 3)
    # Child 0 is rejected (r >= .1 / .4): p = (0, 0, 1/4, 3/4), q without 0 = (0, 2/3, 1/6, 1/6). Child 1 has
    # p = 0 there: rejected. p = norm(max(0, p - q)) = (0, 0, 1/8, 7/8), and q without 0 and 1 = (0, 0, 1/2, 1/2):
    # child 2 is accepted iff r < (1/8) / (1/2) = 1/4 (3/4 with q without 1 alone, token 0 back in).
    assert tree_sampling(target_probs, draft_probs, tree, uniforms=torch.tensor([0.5, 0.5, 0.2])).ranks == (2,)
    rejected = tree_sampling(target_probs, draft_probs, tree, uniforms=torch.tensor([0.5, 0.5, 0.5]),
                             generator=torch.Generator().manual_seed(0))
    # Then the token comes from norm(max(0, (0, 0, 1/8, 7/8) - (0, 0, 1/2, 1/2))) = (0, 0, 0, 1).
    assert rejected.nodes == () and rejected.next_token == 3


def test_draws_without_replacement_are_distinct_and_stop_when_q_runs_out():
    q = torch.tensor([0.5, 0.0, 0.3, 0.2])
    for seed in range(10):
        tokens = draw_without_replacement(q, 3, torch.Generator().manual_seed(seed))
        assert sorted(tokens) == [0, 2, 3]
    assert len(draw_without_replacement(q, 5, torch.Generator().manual_seed(0))) == 3


# ---------------------------------------------------------------------------
# Tree attention in the model, on both paths
# ---------------------------------------------------------------------------


@pytest.fixture(params=["readable", "fast"])
def model(request) -> GPT2:
    m = tiny_gpt2(CONFIG, seed=0)
    if request.param == "fast":
        request.getfixturevalue("fast_kernels")
        gpt2.fast.accelerate(m)
        assert m.accelerator is not None, gpt2.fast.status(m)
    return m


def prefixed_cache(model: GPT2):
    cache = model.new_cache(1)
    model(torch.tensor(PREFIX), cache)
    return cache


def path_logits(model: GPT2, tree: TokenTree, node: int) -> torch.Tensor:
    """(V,) the logits after the node's path from the root, run alone on the prefix."""
    path = torch.tensor([[tree.tokens[i] for i in tree.path(node)]])  # (1, depth + 1)
    return model(path, prefixed_cache(model))[0, -1]


@torch.inference_mode()
def test_a_tree_pass_equals_each_path_run_alone(model):
    logits = model(torch.tensor([TREE.tokens]), prefixed_cache(model), mask=TREE.ancestor_mask())[0]  # (N, V)
    for node in range(TREE.size):
        alone = path_logits(model, TREE, node)
        if model.accelerator is not None:
            assert torch.equal(logits[node], alone), f"node {node}: the fast path is batch-invariant"
        assert (logits[node] - alone).abs().max() <= ATOL, f"node {node}"


@torch.inference_mode()
def test_a_tree_fed_one_depth_per_pass_equals_each_path_run_alone(model):
    # How a drafter grows a tree: each pass feeds one level, with a mask whose
    # window reaches back over the levels cached by the passes before it.
    cache = prefixed_cache(model)
    model(torch.tensor([[TREE.tokens[0]]]), cache)  # the root
    mask = TREE.ancestor_mask()
    levels = [[1, 2], [3, 4, 6], [5]]  # node indices by depth (TREE lists node 6 after 5)
    order = [node for level in levels for node in level]  # the order they enter the cache
    for level in levels:
        fed = order[: order.index(level[-1]) + 1]  # (W,) the window: every tree node fed so far
        window = mask[level][:, fed]  # (T, W)
        logits = model(torch.tensor([[TREE.tokens[i] for i in level]]), cache, mask=window)[0]  # (T, V)
        for row, node in enumerate(level):
            alone = path_logits(model, TREE, node)
            if model.accelerator is not None:
                assert torch.equal(logits[row], alone), f"node {node}"
            assert (logits[row] - alone).abs().max() <= ATOL, f"node {node}"


@torch.inference_mode()
def test_a_causal_mask_changes_nothing(model):
    ids = torch.tensor([[7, 1, 30, 4]])
    plain = model(ids, prefixed_cache(model))
    masked = model(ids, prefixed_cache(model), mask=torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(plain, masked) if model.accelerator is not None else (plain - masked).abs().max() <= 1e-6


@torch.inference_mode()
@pytest.mark.parametrize("leaf", [5, 4, 6, 2, 0])
def test_keeping_an_accepted_path_equals_a_fresh_run(model, leaf):
    cache = prefixed_cache(model)
    start = cache.length
    model(torch.tensor([TREE.tokens]), cache, mask=TREE.ancestor_mask())
    path = TREE.path(leaf)
    cache.keep(0, start, start + torch.tensor(path))
    assert cache.length == start + len(path)
    nxt = model(torch.tensor([[11, 12]]), cache)[0]  # (2, V): the next step, on the compacted cache
    committed = torch.tensor([PREFIX[0] + [TREE.tokens[i] for i in path] + [11, 12]])
    fresh = model(committed, model.new_cache(1))[0, -2:]  # (2, V)
    if model.accelerator is not None:
        assert torch.equal(nxt, fresh)
    assert (nxt - fresh).abs().max() <= ATOL


# ---------------------------------------------------------------------------
# Drafting: one pass per depth
# ---------------------------------------------------------------------------


@torch.inference_mode()
@pytest.mark.parametrize("shape", [TreeShape.parse("3,2,1"), TreeShape(nodes=7, depth=3)], ids=str)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafting_feeds_one_level_per_pass(shape, temperature):
    draft = tiny_gpt2(CONFIG, seed=1)
    drafter = TreeDrafter(draft)
    seq = torch.tensor(PREFIX)
    drafter.prefill(seq[:, :-1])
    sampling = SamplingConfig(temperature)
    with ForwardRecorder(draft) as rec:
        proposal = drafter.propose(
            seq, shape, max_depth=3, max_nodes=64, sampling=sampling, generator=torch.Generator().manual_seed(0)
        )
    tree = proposal.tree
    levels = [sum(1 for d in tree.depths if d == depth) for depth in (1, 2, 3)]
    if shape.is_static:
        assert levels == [3, 6, 6]
    else:
        assert levels == [3, 3, 1]  # 7 nodes, at most ceil(7 / 3) per level
    # Pass 1: the pending token; then each level but the last, whole.
    assert [c.tokens for c in rec.calls] == [1, levels[0], levels[1]] == [1, *levels[:2]]
    assert proposal.forward_calls == 3 and proposal.fed == levels[0] + levels[1]
    assert drafter.cache.length == seq.size(1) + proposal.fed
    for node in range(tree.size):  # siblings are distinct tokens
        kids = [tree.tokens[c] for c in tree.children(node)]
        assert len(set(kids)) == len(kids)
    if temperature == 0.0:  # greedy: the draft's top candidates, best first
        top3 = torch.topk(draft(seq)[0, -1], 3).indices.tolist()
        assert [tree.tokens[c] for c in tree.children(0)] == top3
        assert proposal.probs is None
    else:
        assert proposal.probs.shape == (tree.size, CONFIG.vocab_size)


@torch.inference_mode()
def test_keep_holds_the_accepted_path_up_to_its_last_fed_node():
    # "3,2,1" feeds depths 1 and 2 (nodes 1..9); the path through node 9, the last fed one, to its child keeps
    # two fed nodes: a cache that dropped node 9 would feed it again, and one that kept it must hold its keys.
    draft = tiny_gpt2(CONFIG, seed=1)
    drafter = TreeDrafter(draft)
    seq = torch.tensor(PREFIX)
    S = seq.size(1)
    drafter.prefill(seq[:, :-1])
    proposal = drafter.propose(seq, TreeShape.parse("3,2,1"), max_depth=3, max_nodes=64, sampling=SamplingConfig(),
                               generator=None)
    tree = proposal.tree
    assert proposal.fed == 9 and tree.depths[9] == 2
    nodes = tuple(tree.path(tree.children(9)[0])[1:])  # depth 1, node 9, its child
    drafter.keep(S, proposal, nodes)
    assert drafter.cache.length == S + 2
    text = torch.cat([seq, torch.tensor([[tree.tokens[v] for v in nodes]])], dim=1)  # (1, S + 3)
    cached = draft(text[:, drafter.cache.length :], drafter.cache)[0, -1]  # (V,)
    assert torch.allclose(cached, draft(text)[0, -1], atol=1e-5)


@torch.inference_mode()
def test_a_level_that_gets_no_children_is_not_fed_to_the_draft():
    # 4 nodes left (the target's window ending): "2,2,2" grows 2 + 2 and stops; feeding depth 2 would buy nothing.
    drafter = TreeDrafter(tiny_gpt2(CONFIG, seed=1))
    seq = torch.tensor(PREFIX)
    drafter.prefill(seq[:, :-1])
    proposal = drafter.propose(seq, TreeShape.parse("2,2,2"), max_depth=3, max_nodes=4, sampling=SamplingConfig(),
                               generator=None)
    assert proposal.tree.size == 5 and proposal.forward_calls == 2  # the root's pass and depth 1's


@torch.inference_mode()
def test_a_dynamic_tree_expands_the_likeliest_paths():
    # The draft's own model as a reference: at depth 2 the kept candidates are
    # the `width` children with the highest path probability p(child) p(grandchild).
    draft = tiny_gpt2(CONFIG, seed=1)
    drafter = TreeDrafter(draft)
    seq = torch.tensor(PREFIX)
    drafter.prefill(seq[:, :-1])
    shape = TreeShape(nodes=6, depth=2)  # width 3
    tree = drafter.propose(seq, shape, max_depth=2, max_nodes=6, sampling=SamplingConfig(), generator=None).tree
    p_root = torch.softmax(draft(seq)[0, -1], -1)
    first = tree.children(0)
    assert [tree.tokens[c] for c in first] == torch.topk(p_root, 3).indices.tolist()
    scores = {}
    for c in first:
        p_child = torch.softmax(draft(torch.cat([seq, torch.tensor([[tree.tokens[c]]])], 1))[0, -1], -1)
        for p, token in zip(*torch.topk(p_child, 3)):
            scores[(c, int(token))] = float(p_root[tree.tokens[c]] * p)
    best = sorted(scores, key=scores.get, reverse=True)[:3]
    assert sorted((tree.parents[i], tree.tokens[i]) for i in range(tree.size) if tree.depths[i] == 2) == sorted(best)


@torch.inference_mode()
def test_the_drafts_cache_keeps_the_accepted_path():
    draft = tiny_gpt2(CONFIG, seed=1)
    drafter = TreeDrafter(draft)
    seq = torch.tensor(PREFIX)
    drafter.prefill(seq[:, :-1])
    proposal = drafter.propose(
        seq, TreeShape.parse("2,2,2"), max_depth=3, max_nodes=64, sampling=SamplingConfig(), generator=None
    )
    tree = proposal.tree
    leaf = max(range(tree.size), key=lambda i: (tree.depths[i], -i))  # the first node of the deepest level
    accepted = tuple(tree.path(leaf)[1:])
    S = seq.size(1)
    drafter.keep(S, proposal, accepted)
    assert drafter.cache.length == S + 2  # the depth-3 node was never fed: the next step feeds it
    committed = torch.cat([seq, torch.tensor([[tree.tokens[i] for i in accepted]])], dim=1)  # (1, S + 3)
    nxt = draft(committed[:, S + 2 :], drafter.cache)[0, -1]
    assert (nxt - draft(committed)[0, -1]).abs().max() <= ATOL
