"""Drafting a token tree with a small GPT-2: one forward pass per depth.

Legend: S = committed sequence length, N = tree nodes, n = nodes of one
level, V = vocab size.

The first pass feeds the committed tokens the draft has not cached yet and
scores the root (the last committed token). Each later pass feeds a whole
level at once, with a tree mask whose window reaches back over the levels
already cached (gpt2/model.py): every node sees the committed tokens and its
own ancestors. A tree of depth D costs D passes, never one per node. Its
shape follows a `TreeShape`: fixed branching per depth, or EAGLE-2's rule
(Li et al. 2024), each level keeping the candidates of highest draft path
probability. Greedy decoding drafts the draft's top candidates; sampling
draws a node's children without replacement (as tree_acceptance.tree_sampling
verifies), deciding how many children a node gets before drawing them.
"""

from __future__ import annotations

import itertools
import numbers
from dataclasses import dataclass

import torch

from gpt2.kv_cache import KVCache
from gpt2.model import GPT2
from gpt2.sampling import SamplingConfig, logits_to_probs, sample

from .drafters import NOT_PROBABILITIES, ModelDrafter, check_reference, improper, position_coins
from .tree import TokenTree, TreeShape
from .tree_acceptance import without


@dataclass
class TreeDraft:
    """A drafted tree.

    Attributes:
        tree: the tree; its root is the last committed token.
        probs: (N, V) float32, row v: the draft distribution v's children were
            drawn from (zeros for a node without children); None when greedy.
        forward_calls: draft forward passes this proposal took.
        fed: nodes 1..fed went through the draft (their keys and values follow
            the committed tokens in its cache); the deepest level never does.
    """

    tree: TokenTree
    probs: torch.Tensor | None
    forward_calls: int
    fed: int


def check_tree_draft(draft: TreeDraft, root: int, vocab_size: int, max_depth: int, max_nodes: int, sampling: bool,
                     drafter: object) -> None:
    """Raises a ValueError naming the `drafter` (a subclass written elsewhere)
    unless `draft` is what the loop can verify: a TreeDraft whose tree has
    the pending token `root` as its root, at most `max_nodes` drafted nodes,
    at most `max_depth` levels, token ids in 0..V-1, and when `sampling`
    distinct siblings (`tree_sampling` judges each child against the draft
    distribution without its elder siblings) and (N, V) probs. Greedy, a
    repeated sibling is harmless: the first match is taken."""
    tree, probs = getattr(draft, "tree", None), getattr(draft, "probs", None)
    problem = None
    if not isinstance(draft, TreeDraft) or not isinstance(tree, TokenTree):
        problem = f"a TreeDraft holding a TokenTree, got {type(draft).__name__}"
    elif tree.tokens[0] != root:
        problem = f"a tree whose root is the last committed token {root}, got {tree.tokens[0]}"
    elif tree.size - 1 > max_nodes or tree.depth > max_depth:
        problem = f"at most {max_nodes} nodes {max_depth} deep, got {tree.size - 1} nodes {tree.depth} deep"
    elif any(not 0 <= t < vocab_size for t in tree.tokens):
        problem = f"token ids in 0..{vocab_size - 1}, got {list(tree.tokens)}"
    elif sampling and len(set(zip(tree.parents, tree.tokens))) < tree.size:  # a repeated (parent, token) pair
        problem = f"distinct tokens among siblings (draw them without replacement), got {list(tree.tokens)}"
    elif sampling and (not isinstance(probs, torch.Tensor) or probs.shape != (tree.size, vocab_size)):
        problem = f"probs of shape ({tree.size}, {vocab_size}) when sampling, got {getattr(probs, 'shape', probs)}"
    elif sampling and tree.size > 1:
        # node i was drawn from its parent's row: (size, V) -> (size - 1,)
        rows, tokens = (torch.tensor(ids[1:], device=probs.device) for ids in (tree.parents, tree.tokens))
        drawn = probs[rows, tokens]
        if improper(drawn):
            problem = NOT_PROBABILITIES.format(drawn.tolist())
    if problem is not None:
        raise ValueError(f"{type(drafter).__name__}.propose must return {problem}")


def draw_without_replacement(q: torch.Tensor, count: int, generator: torch.Generator | None) -> list[int]:
    """`count` distinct tokens drawn one after another from q, (V,): each from
    q without the tokens drawn before it, renormalised (fewer if q has fewer
    tokens). The children `tree_sampling` verifies."""
    tokens, rest = [], q
    for _ in range(min(count, int((q > 0).sum()))):
        tokens.append(int(sample(rest, generator)))
        rest = without(rest, tokens[-1])  # (V,)
    return tokens


class TreeDrafter:
    """Drafts token trees with a (small) GPT-2 and its KV cache."""

    spare_tokens = 0  # tokens of the vocabulary never among a node's children (a node has at most V - this)

    def __init__(self, draft: GPT2 | ModelDrafter) -> None:
        """Raises a ValueError for a chain drafter whose way of choosing tokens a tree would drop: a subclass
        (SimulatedDrafter, ...) or one with p_min."""
        if isinstance(draft, ModelDrafter) and type(draft) is not ModelDrafter:
            raise ValueError(f"a {type(draft).__name__} drafts chains: for a tree pass the GPT2 draft model, or a "
                             "SimulatedTreeDrafter to simulate acceptance")
        if isinstance(draft, ModelDrafter) and draft.p_min is not None:
            raise ValueError("p_min stops a chain; a tree keeps its shape: pass the draft model without p_min, "
                             "or draft a chain (gamma)")
        self.chain = draft if isinstance(draft, ModelDrafter) else ModelDrafter(draft)  # prefill, limits, cache
        self.committed = 0  # the committed length of the sequence being drafted for

    @property
    def model(self) -> GPT2:
        return self.chain.model

    @property
    def cache(self) -> KVCache:
        """The chain drafter's cache (a new one after its model has moved, `ModelDrafter.prefill`)."""
        return self.chain.cache

    @property
    def vocab_size(self) -> int:
        return self.chain.vocab_size

    @property
    def n_ctx(self) -> int:
        return self.chain.n_ctx

    def prefill(self, prefix: torch.Tensor) -> None:
        """Starts a new sequence: caches `prefix`, (1, P) tokens."""
        self.chain.prefill(prefix)

    def max_depth(self, seq_len: int) -> int:
        """The deepest tree it can draft after `seq_len` tokens within its window."""
        return self.chain.max_draft(seq_len)

    def propose(
        self,
        seq: torch.Tensor,
        shape: TreeShape,
        *,
        max_depth: int,
        max_nodes: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> TreeDraft:
        """Drafts a tree after `seq`, (1, S) committed tokens.

        Args:
            seq: the committed tokens.
            shape: how the tree grows.
            max_depth, max_nodes: limits below the shape's own (the token
                budget, the target's window), >= 1. No level is fed to the
                draft unless it gets children: the tree stops where its nodes
                run out or feeding a level would pass the draft's window.
            sampling: greedy drafts the top candidates; otherwise children
                are drawn without replacement.
            generator: randomness for the draws.
        """
        assert max_depth >= 1 and max_nodes >= 1, "propose needs room for one node"
        S = seq.size(1)
        self.committed = S
        feed = seq[:, self.cache.length :]  # (1, S - cached): the unseen committed tokens
        logits = self.model(feed, self.cache, last_logits_only=True)[0]  # (1, V): at the root
        tokens, parents, values = [int(seq[0, S - 1])], [-1], [1.0]  # values: draft path probabilities
        rows: dict[int, torch.Tensor] = {}  # node -> the draft distribution its children come from
        level, calls, fed = [0], 1, 0
        max_nodes = min(max_nodes, shape.max_nodes)
        for depth in range(1, min(shape.max_depth, max_depth) + 1):
            budget = max_nodes - (len(tokens) - 1)  # nodes it may still add (the root is not one)
            if depth > 1:  # feed the last level; its window reaches back over the levels cached before it
                first, end = level[0], level[-1] + 1
                if budget <= 0 or self.cache.length + end - first > self.cache.capacity:
                    break  # no node left to add, or past the draft's window: the last level stays the leaves
                mask = TokenTree(tuple(tokens), tuple(parents)).ancestor_mask()[first:end, 1:end]  # (n, end - 1)
                ids = torch.tensor([tokens[first:end]], device=seq.device)  # (1, n)
                logits = self.model(ids, self.cache, mask=mask)[0]  # (n, V)
                calls, fed = calls + 1, end - 1
            probs = self.distributions(logits, sampling)  # (n, V)
            paths = [[tokens[u] for u in TokenTree(tuple(tokens), tuple(parents)).path(v)] for v in level]
            counts = self.level_counts(shape, depth, [values[v] for v in level], probs, budget)
            next_level = []
            for v, path, q, count in zip(level, paths, probs, counts):
                if count == 0:
                    continue
                rows[v] = q
                for token, p in self.candidates(path, q, count, sampling, generator):
                    tokens.append(token)
                    parents.append(v)
                    values.append(values[v] * p)
                    next_level.append(len(tokens) - 1)
            if not next_level:
                break
            level = next_level
        tree = TokenTree(tuple(tokens), tuple(parents))
        draft_probs = None
        if not sampling.greedy:
            draft_probs = torch.zeros(tree.size, self.vocab_size, device=seq.device)  # (N, V)
            for v, q in rows.items():
                draft_probs[v] = q
        return TreeDraft(tree=tree, probs=draft_probs, forward_calls=calls, fed=fed)

    def keep(self, committed: int, draft: TreeDraft | None, nodes: tuple[int, ...]) -> None:
        """After verification: keeps the committed tokens [0, committed) and the
        accepted nodes it fed, moved to the slots right after them."""
        if draft is None:
            self.cache.rewind(min(self.cache.length, committed))
            return
        fed_path = [node for node in nodes if node <= draft.fed]  # a path: its fed nodes come first
        slots = committed - 1 + torch.tensor(fed_path, dtype=torch.long)  # node i sits at slot committed + i - 1
        self.cache.keep(0, committed, slots)

    # -- what to draft: the parts SimulatedTreeDrafter replaces ----------------

    def distributions(self, logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
        """(n, V) logits -> (n, V) the draft's distributions: the sampling
        filter's, or (greedy) the plain softmax that ranks candidates."""
        if sampling.greedy:
            return torch.softmax(logits.float(), dim=-1)
        return logits_to_probs(logits, sampling)

    def ranked(self, q: torch.Tensor, k: int) -> list[float]:
        """The k largest probabilities of q, (V,), in decreasing order: what
        the i-th child would add to its parent's path probability."""
        return torch.topk(q, k).values.tolist()

    def candidates(
        self, path: list[int], q: torch.Tensor, count: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> list[tuple[int, float]]:
        """`count` children of the node whose path from the root is `path`,
        with their draft probabilities: the top `count` tokens of q (greedy),
        or draws without replacement (fewer if q has fewer tokens)."""
        if sampling.greedy:
            top = torch.topk(q, count)
            return list(zip(top.indices.tolist(), top.values.tolist()))
        return [(token, float(q[token])) for token in draw_without_replacement(q, count, generator)]

    def level_counts(
        self, shape: TreeShape, depth: int, values: list[float], probs: torch.Tensor, budget: int
    ) -> list[int]:
        """How many children each node of a level gets (at most `budget` in all).

        Static: branching[depth - 1] each, in order, until the budget is spent.
        Dynamic: the level keeps the `width` candidates (node v's i-th child)
        of highest path probability values[v] * (i-th largest of q_v). The
        counts are set from this level's path probabilities and distributions
        before any child is drawn, never from the children drawn, which keeps
        sampled trees lossless.
        """
        most = probs.size(-1) - self.spare_tokens  # per node: no more distinct tokens can follow it
        if shape.is_static:
            counts = []
            for _ in values:
                counts.append(min(shape.branching[depth - 1], budget, most))
                budget -= counts[-1]
            return counts
        width = min(shape.width, budget, most)
        scored = [
            (-value * p, v, i)
            for v, (value, q) in enumerate(zip(values, probs))
            for i, p in enumerate(self.ranked(q, width))
        ]
        counts = [0] * len(values)
        for _, v, _ in sorted(scored)[:width]:
            counts[v] += 1
        return counts


class SimulatedTreeDrafter(TreeDrafter):
    """A tree drafter with a chosen acceptance profile, for benchmarks.

    It runs the draft model exactly as `TreeDrafter` does (every pass, the
    same shapes and masks) but chooses the tokens: at each depth the target's
    greedy token (`reference`, from plain greedy decoding of the target) is
    the draft's rank-r candidate with probability profile[r - 1], and none of
    them with the remaining probability, independently per depth. Its draft
    is calibrated: rank r has draft probability profile[r - 1], which is what
    a dynamic shape ranks by. Greedy only.

    The draw at a position is its coin (`position_coins`, as in
    `SimulatedDrafter`): rank 1 exactly when the coin is below profile[0].
    A chain `SimulatedDrafter` with alpha = profile[0] and the same seed meets
    the same right and wrong first candidates, so a tree and a chain are
    compared on the same luck.
    """

    spare_tokens = 1  # at most V - 1 children: the target's token is none of them when no rank is drawn

    def __init__(
        self, draft: GPT2 | ModelDrafter, reference: torch.Tensor, profile: tuple[float, ...], *, seed: int = 0
    ) -> None:
        super().__init__(draft)
        numeric = isinstance(profile, (tuple, list)) and all(
            isinstance(p, numbers.Real) and not isinstance(p, bool) for p in profile)  # numpy floats too
        if not numeric or not profile or not all(0 <= p <= 1 for p in profile) or sum(profile) > 1 + 1e-9:  # NaN too
            raise ValueError(f"an acceptance profile is P(rank 1), P(rank 2), ... >= 0 summing to <= 1, got {profile}")
        if not isinstance(reference, torch.Tensor):
            raise ValueError(f"reference must be a tensor of the target's greedy token ids, prompt included "
                             f"(gpt2.generate's output), got {type(reference).__name__}")
        self.reference = reference.flatten().tolist()
        check_reference(self.reference, self.vocab_size)
        self.profile = tuple(map(float, profile))
        self.coins = position_coins(seed, 1, max(len(self.reference), self.model.config.n_ctx) + 1)[0]
        self.cumulative = list(itertools.accumulate(self.profile))  # P(rank <= r + 1)

    def distributions(self, logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
        if not sampling.greedy:
            raise ValueError("simulated acceptance works with greedy decoding only (temperature 0)")
        return logits  # unused: `ranked` and `candidates` follow the profile

    def ranked(self, q: torch.Tensor, k: int) -> list[float]:
        rest = (1.0 - sum(self.profile)) / max(1, self.vocab_size - len(self.profile))
        return [self.profile[i] if i < len(self.profile) else rest for i in range(k)]

    def candidates(
        self, path: list[int], q: torch.Tensor, count: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> list[tuple[int, float]]:
        position = self.committed - 1 + len(path)  # the children's index in the sequence
        start = self.committed - 1
        on_reference = all(  # only children of a node the target would accept can be judged
            start + i < len(self.reference) and token == self.reference[start + i] for i, token in enumerate(path)
        )
        right = self.reference[position] if position < len(self.reference) else 0
        u = self.coins[position] if position < len(self.coins) else 1.0
        rank = None  # None: the right token is none of them
        for r, cumulative in enumerate(self.cumulative):
            if u < cumulative:
                rank = r
                break
        wrong = [(right + 1 + i) % self.vocab_size for i in range(count)]  # never the right token: count < V
        tokens = [right if on_reference and r == rank else wrong.pop(0) for r in range(count)]
        return list(zip(tokens, self.ranked(q, count)))
