"""Speculative decoding with token trees (SpecInfer, Miao et al. 2024;
Medusa, Cai et al. 2024; EAGLE-2, Li et al. 2024): the draft proposes a tree
of candidates (tree_drafting.py), the target scores every node in one forward
pass with the tree's ancestor mask, and a pure rule (tree_acceptance.py) keeps
the longest path it agrees with.

Legend: S = committed sequence length, N = tree nodes (root included).

The loop keeps loop.py's invariant: at the top of every step the committed
sequence is seq[:S] and the target's cache holds [0, S - 1); the pending
token seq[S - 1] is the tree's root. After verification the keys and values
of the root and the accepted path are moved to the contiguous slots
[S - 1, S + n) (`KVCache.keep`), the rest of the tree is dropped, and the
target's token becomes the new pending token. The draft's cache keeps the
accepted nodes it fed the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpt2.generate import check_callback, check_eos_id, check_max_new_tokens, check_model, check_prompt
from gpt2.model import GPT2
from gpt2.sampling import SamplingConfig, check_generator, logits_to_probs

from .batch_drafters import BatchDrafter
from .drafters import Drafter, ModelDrafter, check_drafter_fits, drafting_room
from .schedule import check_draft_length
from .stats import SpecStats, clock
from .tree import TokenTree, TreeShape
from .tree_acceptance import TreeVerdict, tree_greedy, tree_sampling
from .tree_drafting import TreeDraft, TreeDrafter, check_tree_draft


@torch.no_grad()
def tree_speculative_generate(
    target: GPT2,
    draft: GPT2 | ModelDrafter | TreeDrafter,
    input_ids: torch.Tensor,
    *,
    tree: TreeShape | str,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    on_step: Callable[[list[int], int], None] | None = None,
    on_tree: Callable[[TokenTree, TreeVerdict], None] | None = None,
    stats: SpecStats | None = None,
) -> tuple[torch.Tensor, SpecStats]:
    """`speculative_generate` with a token tree in place of a chain: same
    output (greedy: token for token that of the target alone; sampling:
    exactly the target's distribution), same stopping rules.

    Args:
        target, draft, input_ids, max_new_tokens, temperature, top_k, top_p,
            eos_id, generator, on_step: as `speculative_generate`; the draft
            may also be a TreeDrafter (e.g. a SimulatedTreeDrafter).
        tree: the shape, a TreeShape or text such as "3,2,1,1". Near the end
            of the budget or the context window the tree is cut to fit.
        on_tree: optional `on_tree(tree, verdict)` after each verified tree
            (for drawing it).
        stats: optional fresh `SpecStats(depth, tree=str(shape))` to count into.

    Returns:
        (1, T + n) LongTensor of prompt + new tokens, and the run's SpecStats.

    Raises:
        ValueError: as `speculative_generate`, or a bad tree shape.
    """
    shape = TreeShape.parse(tree) if isinstance(tree, str) else tree
    if not isinstance(shape, TreeShape):
        raise ValueError(f"tree must be a TreeShape or text such as '3,2,1,1', got {type(tree).__name__}")
    sampling = SamplingConfig(temperature, top_k, top_p)
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    check_model(target, "target")
    check_callback(on_step, "on_step", ("tokens", "num_accepted"))
    check_callback(on_tree, "on_tree", ("tree", "verdict"))
    if isinstance(draft, (GPT2, ModelDrafter)):
        draft = TreeDrafter(draft)  # refuses a chain drafter of its own kind, or with p_min
    if not isinstance(draft, TreeDrafter):
        name = type(draft).__name__
        fix = (f"{name} drafts chains, give gamma" if isinstance(draft, Drafter)
               else f"{name} drafts chains for a batch; a tree takes one prompt and the GPT2 draft model"
               if isinstance(draft, BatchDrafter) else "load it first with gpt2.load_model('gpt2')")
        raise ValueError(f"a token tree is drafted by a model: pass a loaded GPT2 draft (or a TreeDrafter), got "
                         f"{name}: {fix}")
    drafter = draft
    check_drafter_fits(drafter, target)  # the vocabulary and the device
    check_prompt(input_ids, target.config.n_ctx, target.config.vocab_size)
    eos_id = check_eos_id(eos_id, target.config.vocab_size)
    generator = check_generator(generator, sampling, target.device)
    if input_ids.size(0) != 1:
        raise ValueError(f"speculative decoding runs one sequence at a time: got a batch of {input_ids.size(0)}")
    depth = check_draft_length(shape.max_depth, "the tree's depth", target.config.n_ctx)

    device = target.device  # the prompt may be elsewhere: the output goes back there
    T = input_ids.size(1)
    max_len = T + min(max_new_tokens, target.config.n_ctx - T)  # as the baseline: never past n_ctx
    seq = torch.empty(1, max_len, dtype=torch.long, device=device)  # (1, max_len) committed tokens
    seq[:, :T] = input_ids
    S = T
    if stats is None:
        stats = SpecStats(depth, tree=str(shape))
    if not (isinstance(stats, SpecStats) and stats.gamma == depth and stats.tree == str(shape)
            and stats.target_calls == 0):
        raise ValueError(f"stats must be a fresh SpecStats({depth}, tree={str(shape)!r}) (the tree's depth and shape)")

    # Prefill: both caches take every prompt token but the last (the pending one, the first root).
    target_cache = target.new_cache(1)
    if T > 1:
        target(seq[:, : T - 1], target_cache, last_logits_only=True)
    drafter.prefill(seq[:, : T - 1])

    while S < max_len:
        # The step emits at most depth + 1 tokens, and the tree's nodes take the target's cache slots
        # [S, S + nodes); the draft, which is never fed the deepest level, stops growing the tree at its own window.
        max_depth = min(shape.max_depth, max_len - S - 1, drafting_room(drafter, S, "max_depth"))
        max_nodes = target.config.n_ctx - S

        t0 = clock(device)
        proposal: TreeDraft | None = None
        if max_depth > 0 and max_nodes > 0:
            proposal = drafter.propose(
                seq[:, :S], shape, max_depth=max_depth, max_nodes=max_nodes, sampling=sampling, generator=generator
            )
            check_tree_draft(proposal, int(seq[0, S - 1]), target.config.vocab_size, max_depth, max_nodes,
                             not sampling.greedy, drafter)
            tree_now = proposal.tree
        else:  # no room to draft: a plain target step, verifying only the pending token
            tree_now = TokenTree((int(seq[0, S - 1]),), (-1,))
        t1 = clock(device)

        ids = torch.tensor([tree_now.tokens], device=device)  # (1, N): the root, then the drafted nodes
        logits = target(ids, target_cache, mask=tree_now.ancestor_mask())[0]  # (1, N) -> (N, V)
        if sampling.greedy:
            verdict = tree_greedy(logits, tree_now)
        else:
            no_probs = torch.zeros(1, target.config.vocab_size, device=device)  # (1, V): a root without children
            draft_probs = no_probs if proposal is None else proposal.probs
            verdict = tree_sampling(logits_to_probs(logits, sampling), draft_probs, tree_now, generator=generator)
        t2 = clock(device)

        new = verdict.tokens  # the accepted path + the target's token
        if eos_id is not None and eos_id in new:
            new = new[: new.index(eos_id) + 1]  # nothing follows end-of-text
            stats.stopped_at_eos = True
        seq[0, S : S + len(new)] = torch.tensor(new, device=device)
        # Keep the root and the accepted path, moved to the slots after the committed tokens.
        kept = torch.tensor([0, *verdict.nodes], dtype=torch.long)  # (n + 1,) tree nodes
        target_cache.keep(0, S - 1, S - 1 + kept)
        drafter.keep(S, proposal, verdict.nodes)

        emitted = min(verdict.num_accepted, len(new))  # fewer if an accepted draft was end-of-text
        target_token = len(new) > emitted
        last = verdict.nodes[emitted - 1] if emitted else 0
        judged = emitted + int(target_token and bool(tree_now.children(last)))
        stats.record_tree_step(tree_now.size - 1, verdict.ranks[:emitted], judged, target_token)
        stats.gamma_hist[max_depth] += 1  # counted with the step's other figures, once it is done
        stats.draft_calls += 0 if proposal is None else proposal.forward_calls
        stats.draft_seconds += t1 - t0
        stats.verify_seconds += t2 - t1
        S += len(new)
        if on_tree is not None:
            on_tree(tree_now, verdict)
        if on_step is not None:
            on_step(new, emitted)
        if stats.stopped_at_eos:
            break
    return seq[:, :S].to(input_ids.device), stats
