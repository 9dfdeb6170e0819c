"""Token trees: several drafted candidates per position, verified by the
target in one forward pass (SpecInfer, Miao et al. 2024; Medusa, Cai et al.
2024; EAGLE-2, Li et al. 2024).

Legend: N = nodes (the root and the drafted tokens), D = depth, V = vocab.

Node 0 is the root: the last committed token (the loop's pending token), at
depth 0. Every other node is a drafted token whose parent comes earlier in the
list, so the nodes can be fed to a model in list order. A path from the root
is one possible continuation; siblings are alternatives for the same position.
The target scores every node in one pass: node i sits at position
`prefix_length + depth[i]` and attends to the cache and to its ancestors only
(`ancestor_mask`). `TreeShape` says how a drafter grows a tree.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpt2.generate import check_integer


@dataclass(frozen=True)
class TokenTree:
    """A tree of tokens in parent-before-child order.

    Attributes:
        tokens: (N,) token ids; tokens[0] is the root.
        parents: (N,) parent indices, parents[0] = -1 and parents[i] < i.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        """Takes the ids and indices as Python ints (a 0-d tensor hashes by identity: two equal siblings would look
        distinct). Raises a ValueError unless they are integers, ids >= 0, with a root and one parent per node,
        each before its node."""
        try:  # operator.index: ints, numpy and 0-d tensor integers; not floats
            object.__setattr__(self, "tokens", tuple(map(operator.index, self.tokens)))
            object.__setattr__(self, "parents", tuple(map(operator.index, self.parents)))
        except TypeError:
            raise ValueError(f"a tree's tokens and parents must be integers, got {self.tokens!r} and "
                             f"{self.parents!r}") from None
        if not len(self.tokens) == len(self.parents) >= 1:
            raise ValueError(f"a tree has a root and one parent per node: {len(self.tokens)} tokens, "
                             f"{len(self.parents)} parents")
        if self.parents[0] != -1 or not all(0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError(f"parents must be -1 for the root (node 0), then each node's parent an earlier "
                             f"node: {self.parents}")
        if min(self.tokens) < 0:  # as an index, -1 would read the last token's probability
            raise ValueError(f"a tree's tokens are ids >= 0, got {min(self.tokens)}")

    @property
    def size(self) -> int:
        """N, the root included."""
        return len(self.tokens)

    @property
    def depths(self) -> tuple[int, ...]:
        """(N,) each node's depth: the root 0, its children 1, ..."""
        depths = [0] * self.size
        for i in range(1, self.size):
            depths[i] = depths[self.parents[i]] + 1
        return tuple(depths)

    @property
    def depth(self) -> int:
        """D, the deepest node's depth (0 for a root alone)."""
        return max(self.depths)

    def children(self, node: int) -> list[int]:
        """The node's children, in list order (rank 0 first)."""
        return [i for i in range(node + 1, self.size) if self.parents[i] == node]

    def path(self, node: int) -> list[int]:
        """The nodes from the root down to `node`, both included."""
        nodes = [node]
        while self.parents[nodes[-1]] >= 0:
            nodes.append(self.parents[nodes[-1]])
        return nodes[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """(N, N) bool: mask[i, j] = node j is node i or one of its ancestors.
        As a model's attention mask, each node sees its own path only."""
        mask = torch.eye(self.size, dtype=torch.bool)  # (N, N): every node sees itself
        for i in range(1, self.size):
            mask[i] |= mask[self.parents[i]]  # ... and what its parent sees (rows are filled parents first)
        return mask

    def positions(self, prefix_length: int) -> torch.Tensor:
        """(N,) position ids: node i follows `prefix_length` tokens at its depth
        (the root, the last committed token, at prefix_length itself)."""
        return prefix_length + torch.tensor(self.depths)  # (N,)

    def draw(
        self, accepted: tuple[int, ...] = (), decode: Callable[[int], str] = str, next_token: int | None = None
    ) -> str:
        """The tree as text, one node per line, the accepted path marked.

        Args:
            accepted: the accepted nodes (a path from a child of the root down).
            decode: how to show a token (default its id).
            next_token: the token the target added after the accepted path.

        Returns:
            Lines like

                 The             (root)
                 ├── cat   ✓
                 │   ├── sat ✓
                 │   └── is
                 └── dog
                 + target: on
        """
        on_path = set(accepted)
        label = {i: repr(decode(t))[1:-1] for i, t in enumerate(self.tokens)}  # escapes, no quotes
        lines = [f"{label[0]}   (root)"]

        def children_of(node: int, indent: str) -> list[tuple[int, str, bool]]:
            """(child, its line's indent, is it the last child), last first: popped in order."""
            kids = self.children(node)
            return [(child, indent, k == len(kids) - 1) for k, child in enumerate(kids)][::-1]

        stack = children_of(0, "")  # depth first, with a stack: a chain may be a thousand deep
        while stack:
            child, indent, last = stack.pop()
            mark = " ✓" if child in on_path else ""
            lines.append(f"{indent}{'└── ' if last else '├── '}{label[child]}{mark}")
            stack += children_of(child, indent + ("    " if last else "│   "))
        if next_token is not None:
            lines.append(f"+ target: {repr(decode(next_token))[1:-1]}")
        return "\n".join(lines)


# The shape `--tree` drafts when given no value: two candidates at each of two depths, the best tree
# of benchmarks/tree_speed.py on a CPU at the weak profile and on the noisy pair (docs/performance.md),
# where verifying more tokens costs more (docs/speculative_decoding.md, "What a tree trades off").
DEFAULT_TREE = "2,2"


@dataclass(frozen=True)
class TreeShape:
    """How a drafter grows a token tree: either a static shape, `branching[d]`
    children for every node at depth d (so (1, 1, 1) is a chain of 3), or a
    dynamic one (EAGLE-2, Li et al. 2024) of at most `nodes` drafted tokens and
    `depth` levels, where each level keeps the ceil(nodes / depth) candidates
    with the highest draft path probability.
    """

    branching: tuple[int, ...] | None = None
    nodes: int | None = None
    depth: int | None = None

    def __post_init__(self) -> None:
        if self.branching is not None:
            if self.nodes is not None or self.depth is not None:
                raise ValueError("a tree shape is static (branching) or dynamic (nodes and depth), not both")
            try:
                branching = () if isinstance(self.branching, (str, bytes)) else tuple(self.branching)
            except TypeError:  # not a sequence: branching=2
                branching = ()
            if not branching:
                raise ValueError(f"a tree's branching needs one number per depth, such as (3, 2, 1, 1) "
                                 f"(TreeShape.parse reads '3,2,1,1'); got {self.branching!r}")
            branching = tuple(check_integer(b, "every tree branching (children per node)", 1) for b in branching)
            object.__setattr__(self, "branching", branching)
        else:
            object.__setattr__(self, "nodes", check_integer(self.nodes, "a dynamic tree's nodes", 1))
            object.__setattr__(self, "depth", check_integer(self.depth, "a dynamic tree's depth", 1))
            if self.depth > self.nodes:
                raise ValueError(f"a tree of {self.nodes} nodes cannot be {self.depth} deep: give depth <= nodes")

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """A static shape from text such as "3,2,1,1"."""
        try:
            branching = tuple(int(part) for part in text.split(","))
        except (ValueError, AttributeError):  # not numbers, or not text
            branching = ()
        if not branching or min(branching) < 1:
            raise ValueError(f"a tree shape is children per depth, integers >= 1 such as 3,2,1,1; got {text!r}")
        return cls(branching=branching)

    @property
    def is_static(self) -> bool:
        return self.branching is not None

    @property
    def max_depth(self) -> int:
        """The deepest level it reaches: a dynamic shape's levels of `width` nodes
        may spend its nodes before `depth` (16 nodes, depth 5: four levels of 4)."""
        return len(self.branching) if self.is_static else -(-self.nodes // self.width)

    @property
    def max_nodes(self) -> int:
        """Drafted tokens at most (the root not counted)."""
        if self.is_static:
            return sum(math.prod(self.branching[: d + 1]) for d in range(len(self.branching)))
        return self.nodes

    @property
    def width(self) -> int:
        """A dynamic tree's nodes per level, ceil(nodes / depth)."""
        assert not self.is_static
        return -(-self.nodes // self.depth)

    @property
    def is_chain(self) -> bool:
        return self.is_static and all(b == 1 for b in self.branching)

    def __str__(self) -> str:
        if self.is_static:
            return ",".join(map(str, self.branching))
        return f"dynamic {self.nodes} nodes, depth {self.depth}"
