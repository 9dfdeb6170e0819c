"""The verification rules of token trees, as pure functions (beside
acceptance.py's chain rules, whose notation they follow: `p_target`, `p_draft`).

Legend: N = tree nodes (the root and the drafted tokens), V = vocab size.

Each function takes the target's scores at every node (row v predicts the
token after the path root..v), the tree, and for sampling the draft's
distributions and the randomness; it walks down from the root and returns a
`TreeVerdict`: the accepted path and the target's own next token.

Greedy: at each node follow the child that is the target's argmax (Medusa,
Cai et al. 2024). Sampling: recursive rejection sampling (Jeon et al. 2024,
"Recursive Speculative Decoding"), for children drawn without replacement;
its losslessness argument is in docs/speculative_decoding.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpt2.sampling import sample

from .acceptance import Verdict, check_shapes, residual_distribution
from .tree import TokenTree


@dataclass(frozen=True)
class TreeVerdict(Verdict):
    """A Verdict (accepted tokens, next token) that also says where in the
    tree the accepted path ran.

    Attributes:
        nodes: the accepted nodes, from depth 1 down (the root not included).
        ranks: each accepted node's rank among its siblings (0 = first drafted).
    """

    nodes: tuple[int, ...] = ()
    ranks: tuple[int, ...] = ()


def accepted(tree: TokenTree, nodes: list[int], next_token: int) -> TreeVerdict:
    """The verdict of a walk that accepted `nodes` (from depth 1 down)."""
    parents = [0, *nodes[:-1]]
    ranks = tuple(tree.children(parent).index(node) for parent, node in zip(parents, nodes))
    tokens = tuple(tree.tokens[node] for node in nodes)
    return TreeVerdict(accepted=tokens, next_token=next_token, nodes=tuple(nodes), ranks=ranks)


def tree_greedy(target_logits: torch.Tensor, tree: TokenTree) -> TreeVerdict:
    """Greedy verification of a tree: from the root, move to the child whose
    token is the target's argmax at the current node; stop where no child is.
    The target's argmax there is the next token.

    Every appended token is the target's greedy choice after the tokens
    before it, so the output is identical to greedy decoding of the target.

    Args:
        target_logits: (N, V) the target's logits (or any scores whose argmax
            is its greedy choice) at every node.
        tree: the verified tree.

    Returns:
        The TreeVerdict.
    """
    check_shapes(target_logits, tree.size, f"a tree of {tree.size} nodes")
    target_choice = target_logits.argmax(dim=-1).tolist()  # (N, V) -> (N,)
    node, nodes = 0, []
    while True:
        follow = [child for child in tree.children(node) if tree.tokens[child] == target_choice[node]]
        if not follow:
            return accepted(tree, nodes, target_choice[node])
        node = follow[0]
        nodes.append(node)


def without(p_draft: torch.Tensor, token: int) -> torch.Tensor:
    """p_draft with `token` removed and the rest renormalised: the distribution
    of the next draw without replacement. (V,) -> (V,)"""
    rest = p_draft.clone()
    rest[token] = 0.0
    mass = rest.sum()
    return rest / mass if mass > 0 else rest


def tree_sampling(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    tree: TokenTree,
    *,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> TreeVerdict:
    """Lossless verification of a sampled tree: recursive rejection sampling
    (Jeon et al. 2024, "Recursive Speculative Decoding", arXiv:2402.14160),
    for children drawn one after another without replacement from the draft.

    At node v, with p = p_target(. | v) and q = p_draft(. | v), the children
    x_1, x_2, ... are judged in the order they were drawn: x_i is accepted with
    probability min(1, p(x_i) / q(x_i)); on a rejection, p becomes the
    residual norm(max(0, p - q)) and q becomes q without x_i (renormalised),
    and the next child is judged. An accepted child becomes the new v. When
    every child is rejected, the next token is drawn from the last residual p;
    at a leaf, from p_target(. | leaf). With one child per node this is
    Leviathan et al.'s chain rule (acceptance.py), draw for draw.

    Args:
        target_probs: (N, V) the target's filtered probabilities
            (`gpt2.sampling.logits_to_probs`) at every node.
        draft_probs: (N, V) row v: the draft's probabilities, processed by the
            same filter, from which v's children were drawn, without
            replacement, in list order (rows of childless nodes are unused).
        tree: the verified tree.
        generator: randomness for the acceptance draws (unless `uniforms` is
            given) and for the target's token.
        uniforms: optional (N - 1,) draws r ~ U[0, 1), one per drafted node
            (node i uses uniforms[i - 1]); node i is accepted iff
            r * q(x_i) < p(x_i). For tests with known outcomes.

    Returns:
        The TreeVerdict.
    """
    N = tree.size
    check_shapes(target_probs, N, f"a tree of {N} nodes", draft_probs, N, uniforms, N - 1)
    if uniforms is None:
        uniforms = torch.rand(N - 1, generator=generator, device=target_probs.device)  # (N - 1,)
    node, nodes = 0, []
    while True:
        p_target, p_draft = target_probs[node], draft_probs[node]  # (V,) each
        for child in tree.children(node):
            x = tree.tokens[child]
            # r < p_target / p_draft, without the division, in float32 (as acceptance.py)
            if bool(uniforms[child - 1] * p_draft[x] < p_target[x]):
                break
            p_target = residual_distribution(p_target, p_draft)  # (V,)
            p_draft = without(p_draft, x)  # (V,)
        else:  # no child, or all rejected: the target's own token
            return accepted(tree, nodes, int(sample(p_target, generator)))
        node = child
        nodes.append(node)
