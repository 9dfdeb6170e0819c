"""Speculative decoding (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023,
Algorithm 2): a drafter proposes K = gamma tokens, the target scores all K + 1
positions in one forward pass, and a pure rule (acceptance.py) decides how many
to keep.

Legend: S = committed sequence length, K = tokens drafted this step, V = vocab.

Both models keep a KV cache across steps and never recompute the sequence.
Invariant at the top of every step: the committed sequence is seq[:S]; the
target's cache holds positions [0, S - 1), so its last committed token is
"pending" and is the first of the K + 1 tokens it verifies. After verification
the target's cache is rewound to the S + n positions whose tokens stand (the
old sequence plus the n accepted drafts); the token the target appended becomes
the new pending token. The drafter's cache is rewound the same way and catches
up on what it has not seen the next time it drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from gpt2.generate import check_callback, check_eos_id, check_max_new_tokens, check_model, check_prompt
from gpt2.model import GPT2
from gpt2.sampling import SamplingConfig, check_generator, logits_to_probs

from .acceptance import speculative_sampling, speculative_sampling_greedy
from .batch import batch_speculative_generate, row_generators
from .batch_drafters import BatchDrafter
from .drafters import Draft, Drafter, ModelDrafter, check_draft, check_drafter_fits, drafting_room
from .schedule import GammaSchedule, make_schedule, next_gamma
from .stats import BatchStats, SpecStats, clock
from .tree import TreeShape
from .tree_drafting import TreeDrafter
from .tree_loop import tree_speculative_generate


@torch.no_grad()
def speculative_generate(
    target: GPT2,
    draft: GPT2 | Drafter,
    input_ids: torch.Tensor | Sequence[Sequence[int]],
    *,
    lengths: torch.Tensor | Sequence[int] | None = None,
    gamma: int | str | GammaSchedule | None = None,
    tree: TreeShape | str | None = None,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    on_step: Callable[..., None] | None = None,
    stats: SpecStats | BatchStats | None = None,
) -> tuple[torch.Tensor | list[list[int]], SpecStats | BatchStats]:
    """Generates like `gpt2.generate(target, ...)`, several tokens per target call.

    Greedy (temperature 0) output is token-for-token that of greedy decoding of
    the target alone; sampled output has exactly the target's (filtered)
    distribution. Stopping follows the baseline: after `max_new_tokens`, after
    the first `eos_id` (kept, nothing follows it), or at the target's context
    window. Near the end, fewer than gamma tokens are drafted so no model ever
    runs past its context window or past the token budget; a sequence longer
    than the draft's window goes on with plain target steps.

    A batch (a list of prompts, a tensor with `lengths`, or B != 1 rows) goes
    to spec_decoding/batch.py: see `batch_speculative_generate` for what it
    takes and returns. One (1, T) sequence runs here.

    Args:
        target: the large model whose output is reproduced.
        draft: a small GPT-2 (wrapped in a ModelDrafter) or any drafter.
        input_ids: (1, T) prompt token ids, on any device: the output
            comes back on it, as from `gpt2.generate`.
        lengths: for a batch only: each row's length in a padded tensor.
        gamma: tokens drafted per step, a chain: an integer >= 1; "auto", the
            K that maximises expected tokens per second at the running
            acceptance rate (calibrated once per pair and machine, then
            cached: see schedule.py); "heuristic", Hugging Face's +2/-1 rule;
            or a `GammaSchedule` (one sequence only). The greedy output and
            the sampled output's distribution do not depend on it.
        tree: a token tree instead of a chain, a TreeShape or text such as
            "3,2,1,1" (tree_loop.py); give exactly one of gamma and tree.
        max_new_tokens: the most tokens to add.
        temperature, top_k, top_p: the one sampling filter, applied alike to
            draft and target; temperature 0 is greedy.
        eos_id: end-of-text token id, or None.
        generator: randomness for drafting and verification (a
            torch.Generator, or a list of one; a batch takes one per row);
            the same seed reproduces the output (with gamma="auto", once
            its calibration is stored: its K follows the measured costs).
        on_step: optional callback `on_step(verdict_tokens, num_accepted)`
            called after each step with the tokens it committed (for streaming).
        stats: optional fresh `SpecStats(max_gamma)` (the integer gamma, or
            the schedule's `max_gamma`) to count into, so that the
            caller can still read the counts if the run is interrupted
            (Ctrl-C); a new one is made if None.

    Returns:
        (1, T + n) LongTensor of prompt + new tokens, and the run's SpecStats.

    Raises:
        ValueError: bad settings, a prompt that does not fit the target's
            window, a draft or target of the wrong type, or draft and target
            with different vocabularies.
    """
    if gamma is None and tree is None:
        raise ValueError("give gamma (tokens drafted per step: an integer >= 1, 'auto' or 'heuristic') or tree "
                         "(a token tree such as '3,2,1')")
    is_batch = not isinstance(input_ids, torch.Tensor) or lengths is not None
    if is_batch or (input_ids.dim() == 2 and len(input_ids) != 1):  # a batch of prompts: spec_decoding/batch.py
        one_only = ("a token tree" if tree is not None else f"gamma={gamma!r}" if gamma in ("auto", "heuristic")
                    else "a gamma schedule" if isinstance(gamma, GammaSchedule) else None)
        if one_only:
            raise ValueError(f"a batch takes an integer gamma, not {one_only}: give one prompt as a (1, T) tensor "
                             "(a list of prompts, even of one, is a batch)")
        return batch_speculative_generate(
            target, draft, input_ids, lengths=lengths, gamma=gamma, max_new_tokens=max_new_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id, generator=generator,
            on_step=on_step, stats=stats,
        )
    generator = row_generators(generator, 1)[0]  # one sequence: a generator, None, or a list of one
    if tree is not None:  # a token tree: tree_loop.py
        if gamma is not None:
            raise ValueError("give gamma (a chain of drafted tokens) or tree (a token tree), not both")
        return tree_speculative_generate(
            target, draft, input_ids, tree=tree, max_new_tokens=max_new_tokens, temperature=temperature,
            top_k=top_k, top_p=top_p, eos_id=eos_id, generator=generator, on_step=on_step, stats=stats,
        )
    sampling = SamplingConfig(temperature, top_k, top_p)
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    check_model(target, "target")
    check_callback(on_step, "on_step", ("tokens", "num_accepted"))
    if isinstance(draft, GPT2):
        draft = ModelDrafter(draft)
    if not isinstance(draft, Drafter):
        fix = ("it drafts token trees: give tree= instead of gamma" if isinstance(draft, TreeDrafter)
               else "it drafts for a batch: give the prompts as a list of token-id lists"
               if isinstance(draft, BatchDrafter) else "load it first with gpt2.load_model('gpt2')")
        raise ValueError(f"the draft must be a loaded GPT2 model or a drafter (spec_decoding.drafters), got "
                         f"{type(draft).__name__}: {fix}")
    drafter = draft
    check_drafter_fits(drafter, target)  # the vocabulary and the device
    check_prompt(input_ids, target.config.n_ctx, target.config.vocab_size)
    eos_id = check_eos_id(eos_id, target.config.vocab_size)
    check_generator(generator, sampling, target.device)

    if stats is not None and not (isinstance(stats, SpecStats) and stats.target_calls == 0):  # before "auto" times
        size = gamma if isinstance(gamma, int) and not isinstance(gamma, bool) else "max_gamma"
        raise ValueError(f"stats must be a fresh SpecStats({size}) (no step counted yet), or None")
    schedule = make_schedule(gamma, target, drafter)
    gamma = schedule.max_gamma  # the most tokens a step drafts

    device = target.device  # the prompt may be elsewhere: the output goes back there
    T = input_ids.size(1)
    max_len = T + min(max_new_tokens, target.config.n_ctx - T)  # as the baseline: never past n_ctx
    seq = torch.empty(1, max_len, dtype=torch.long, device=device)  # (1, max_len) committed tokens
    seq[:, :T] = input_ids
    S = T
    if stats is None:
        stats = SpecStats(gamma)
    if stats.gamma != gamma:  # a fresh SpecStats: checked above
        raise ValueError(f"stats must be a fresh SpecStats({gamma}) (the largest number of tokens a step drafts)")

    # Prefill: both caches take every prompt token but the last (the pending one).
    target_cache = target.new_cache(1)
    if T > 1:
        target(seq[:, : T - 1], target_cache, last_logits_only=True)
    drafter.prefill(seq[:, : T - 1])

    while S < max_len:
        # The step emits at most K + 1 tokens: K shrinks near the end.
        K = min(next_gamma(schedule), max_len - S - 1, drafting_room(drafter, S))

        t0 = clock(device)
        if K > 0:
            proposal = drafter.propose(seq[:, :S], K, sampling, generator)
            proposal = check_draft(proposal, K, target.config.vocab_size, drafter, device)  # int64 tokens
        else:  # nothing to draft: a plain target step, verifying only the pending token
            proposal = Draft(tokens=seq.new_empty(0), probs=None, forward_calls=0)  # (0,) tokens
        t1 = clock(device)
        drafted = proposal.tokens.numel()  # K, or fewer if the drafter stopped early (even 0)

        verify_ids = torch.cat([seq[0, S - 1 : S], proposal.tokens])  # (K + 1,): pending token + drafts
        logits = target(verify_ids[None], target_cache)[0]  # (1, K + 1) -> (K + 1, V)
        if sampling.greedy:
            verdict = speculative_sampling_greedy(logits, proposal.tokens)
        else:
            target_probs = logits_to_probs(logits, sampling)  # (K + 1, V)
            draft_probs = proposal.probs
            if draft_probs is None:  # deterministic proposals: p_draft is the point mass on each token
                draft_probs = F.one_hot(proposal.tokens, target.config.vocab_size).to(target_probs.dtype)  # (k, V)
            verdict = speculative_sampling(target_probs, draft_probs, proposal.tokens, generator=generator)
        t2 = clock(device)

        new = verdict.tokens  # n accepted drafts + the target's token
        if eos_id is not None and eos_id in new:
            new = new[: new.index(eos_id) + 1]  # nothing follows end-of-text
            stats.stopped_at_eos = True
        seq[0, S : S + len(new)] = torch.tensor(new, device=device)
        # Keep the positions whose tokens stand: the old sequence and the accepted drafts.
        target_cache.rewind(S + verdict.num_accepted)
        drafter.rewind(S + verdict.num_accepted)
        S += len(new)

        emitted_drafts = min(verdict.num_accepted, len(new))  # fewer if an accepted draft was end-of-text
        stats.record_step(drafted, emitted_drafts, target_token=len(new) > emitted_drafts)
        stats.gamma_hist[K] += 1  # counted with the step's other figures, once it is done
        schedule.update(drafted, verdict.num_accepted)
        stats.draft_calls += proposal.forward_calls
        stats.draft_seconds += t1 - t0
        stats.verify_seconds += t2 - t1
        if on_step is not None:
            on_step(new, emitted_drafts)
        if stats.stopped_at_eos:
            break
    return seq[:, :S].to(input_ids.device), stats
