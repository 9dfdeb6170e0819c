"""Batched speculative decoding: many prompts at once, each row accepting its
own number of drafted tokens (Leviathan et al. 2023, Algorithm 1, per row).

Legend: B = unfinished rows, S_b = row b's committed length, K_b = tokens
drafted for row b this step, K = max_b K_b, V = vocab size.

Design: each row's cache positions stay contiguous, with a length of its own
(gpt2/kv_cache.py; attention masks the rest and position ids follow the row's
length), rather than left padding with an offset. Per step the draft drafts for
all rows, one pass per draft position (batch_drafters.py); the target verifies
all rows in one pass of K + 1 tokens a row (a row that drafted fewer re-feeds
its own last committed tokens in front); each row's verdict comes from the pure
rules of acceptance.py on its own scores, and each cache is rewound per row. No
row waits for the shortest acceptance; a finished row leaves the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gpt2.generate import (
    check_callback,
    check_eos_id,
    check_max_new_tokens,
    check_model,
    check_prompts,
    prefill_rows,
)
from gpt2.model import GPT2
from gpt2.sampling import SamplingConfig, check_generator, logits_to_probs

from .acceptance import Verdict, speculative_sampling, speculative_sampling_greedy
from .batch_drafters import BatchDraft, BatchDrafter, check_batch_draft
from .drafters import Drafter, ModelDrafter, check_drafter_fits, drafting_room
from .schedule import check_draft_length
from .stats import BatchStats, clock


def batch_drafter(draft, target: GPT2) -> BatchDrafter:
    """`draft` as a BatchDrafter (a GPT2 or a plain ModelDrafter is wrapped), checked against the target."""
    if isinstance(draft, GPT2):
        drafter = BatchDrafter(draft)
    elif type(draft) is ModelDrafter and draft.p_min is None:  # a plain model drafter: nothing of it is lost
        drafter = BatchDrafter(draft.model)
    elif type(draft) is ModelDrafter:
        raise ValueError("p_min stops a chain of one prompt; a batch drafts every row alike: pass the draft model "
                         "without p_min, or decode the prompts one at a time")
    elif isinstance(draft, BatchDrafter):
        drafter = draft
    else:
        one_prompt = ": it drafts for one prompt, given as a (1, T) tensor" if isinstance(draft, Drafter) else ""
        raise ValueError(
            f"for a batch the draft must be a loaded GPT2 model or a BatchDrafter (spec_decoding.batch_drafters), "
            f"got {type(draft).__name__}{one_prompt}"
        )
    check_drafter_fits(drafter, target)  # the vocabulary and the device
    return drafter


def row_generators(generator, B: int) -> list[torch.Generator | None]:
    """One generator per row: the same one (or None) for every row, or row b's own from a list of B."""
    if generator is None or isinstance(generator, torch.Generator):
        return [generator] * B
    if isinstance(generator, Sequence) and len(generator) == B and all(
        isinstance(g, torch.Generator) for g in generator
    ):
        return list(generator)
    raise ValueError(
        f"generator must be a torch.Generator, None, or a list of {B} generators (one per row), got {generator!r:.80}"
    )


def verify_rows(
    target_logits: list[torch.Tensor],
    draft: BatchDraft,
    sampling: SamplingConfig,
    generators: list[torch.Generator | None],
) -> list[Verdict]:
    """Each row's verdict, by the single-sequence rules (acceptance.py), rows in batch order.

    Args:
        target_logits: row b's (K_b + 1, V) target logits at its verified positions.
        draft: what was drafted; row b's drafts are draft.tokens[b, :K_b].
        sampling: the one sampling filter.
        generators: each row's randomness.
    """
    verdicts = []
    for b, logits in enumerate(target_logits):
        K_b = draft.num_drafted[b]
        tokens = draft.tokens[b, :K_b]  # (K_b,)
        if sampling.greedy:
            verdicts.append(speculative_sampling_greedy(logits, tokens))
        else:
            target_probs = logits_to_probs(logits, sampling)  # (K_b + 1, V)
            draft_probs = draft.probs[b, :K_b]  # (K_b, V)
            verdicts.append(speculative_sampling(target_probs, draft_probs, tokens, generator=generators[b]))
    return verdicts


@torch.no_grad()
def batch_speculative_generate(
    target: GPT2,
    draft: GPT2 | ModelDrafter | BatchDrafter,
    input_ids: torch.Tensor | Sequence[Sequence[int]],
    *,
    lengths: torch.Tensor | Sequence[int] | None = None,
    gamma: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    on_step: Callable[[int, list[int], int], None] | None = None,
    stats: BatchStats | None = None,
) -> tuple[torch.Tensor | list[list[int]], BatchStats]:
    """`speculative_generate` for a batch of prompts of any lengths (it calls
    this for a list of prompts, a tensor with `lengths`, or several rows).

    Every row follows the single-sequence rules: greedy rows are token for
    token the target's greedy decoding of that row alone; sampled rows have
    exactly the target's distribution; a row stops after its own `eos_id`,
    budget or context window. Randomness: with one generator (or None) the
    draws come in a fixed order, so a seed reproduces the batch: at each draft
    position the drafting rows in batch order, then each row's verification
    in batch order. With a list of B generators, row b draws only from
    generators[b], in the order a single-sequence run does: its output is
    then that of `speculative_generate` on its prompt alone with that
    generator (bit for bit on the batch-invariant fast path, gpt2/fast).

    Args:
        input_ids, lengths: the prompts, as for `gpt2.generate`: a list of
            token-id lists, or a (B, T) tensor padded on the right with each
            row's length in `lengths` (or none: every row is T long).
        draft: a GPT2, or a BatchDrafter (spec_decoding/batch_drafters.py).
        generator: a torch.Generator shared by the rows, or a list of B.
        on_step: optional `on_step(row, tokens, num_accepted)` after each
            step of each row, `row` being its index in the input.
        stats: optional fresh `BatchStats(gamma, B)` to count into.
        (the others: see `speculative_generate`)

    Returns:
        The rows as `gpt2.generate` returns them (a (B, T) tensor without
        lengths: a (B, T + n) tensor, rows that end early padded with eos_id;
        otherwise B lists of prompt + new tokens, in input order), and the
        run's BatchStats.

    Raises:
        ValueError: bad settings, or a bad prompt (the message names the row).
    """
    check_model(target, "target")
    check_callback(on_step, "on_step", ("row", "tokens", "num_accepted"))  # a batch names the row
    sampling = SamplingConfig(temperature, top_k, top_p)
    gamma = check_draft_length(gamma, "gamma", target.config.n_ctx)  # tokens drafted per step
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    drafter = batch_drafter(draft, target)
    as_tensor = isinstance(input_ids, torch.Tensor) and lengths is None
    rows = check_prompts(input_ids, lengths, target.config.n_ctx, target.config.vocab_size)
    eos_id = check_eos_id(eos_id, target.config.vocab_size)
    generators = [check_generator(g, sampling, target.device) for g in row_generators(generator, len(rows))]
    if stats is None:
        stats = BatchStats(gamma, len(rows))
    if not (isinstance(stats, BatchStats) and stats.gamma == gamma and len(stats.rows) == len(rows)
            and stats.target_calls == 0):
        raise ValueError(f"stats must be a fresh BatchStats(gamma={gamma}, num_rows={len(rows)}) for a batch")
    out = decode_rows(target, drafter, rows, gamma, max_new_tokens, sampling, eos_id, generators, on_step, stats)
    if not as_tensor:
        return out, stats
    width = max(len(row) for row in out)  # rows differ only where one ended at eos_id
    return torch.tensor([row + [eos_id] * (width - len(row)) for row in out], device=input_ids.device), stats


def decode_rows(
    target: GPT2, drafter: BatchDrafter, rows: list[torch.Tensor], gamma: int, max_new_tokens: int,
    sampling: SamplingConfig, eos_id: int | None, generators: list[torch.Generator | None],
    on_step: Callable[[int, list[int], int], None] | None, stats: BatchStats,
) -> list[list[int]]:
    """The loop of `batch_speculative_generate` over checked prompts ((T_b,) tensors)."""
    B, device = len(rows), target.device
    out = [row.tolist() for row in rows]
    T = [len(row) for row in out]
    max_len = [t + min(max_new_tokens, target.config.n_ctx - t) for t in T]  # as the baseline: never past n_ctx
    ids = [b for b in range(B) if max_len[b] > T[b]]  # the unfinished rows' input indices, in order
    if not ids:
        return out

    # Committed tokens of the unfinished rows, (B, L) padded; row i's are seqs[i, :S[i]].
    L = max(max_len[b] for b in ids)
    seqs = torch.zeros(len(ids), L, dtype=torch.long, device=device)  # (B, L)
    for i, b in enumerate(ids):
        seqs[i, : T[b]] = rows[b].to(device)
    S = [T[b] for b in ids]
    generators = [generators[b] for b in ids]

    # Prefill: both caches take every prompt token but the last (the pending one).
    target_cache = target.new_cache(len(ids), capacity=L)
    prefill_rows(target, target_cache, [rows[b][:-1].to(device) for b in ids])
    drafter.prefill([rows[b].to(device) for b in ids], capacity=L)

    while ids:
        # Row i's step emits at most K_i + 1 tokens: K_i shrinks near its end.
        K = [min(gamma, max_len[b] - s - 1, drafting_room(drafter, s)) for b, s in zip(ids, S)]
        t0 = clock(device)
        proposal = drafter.propose(seqs, S, K, sampling, generators, ids)
        proposal = check_batch_draft(proposal, K, target.config.vocab_size, not sampling.greedy, drafter, device)
        t1 = clock(device)

        # Verify: row i feeds its pending token and its K_i drafts, after
        # K - K_i of its own committed tokens re-fed (one width for all rows).
        K_max = max(K)
        starts = [s - 1 - (K_max - k) for s, k in zip(S, K)]
        assert min(starts) >= 0, f"a row too short to re-feed: {S}, {K}"
        target_cache.rewind(torch.tensor(starts))
        feed = seqs.clone()  # (B, L): the committed tokens, then each row's drafts after them
        for i, (s, k) in enumerate(zip(S, K)):
            feed[i, s : s + k] = proposal.tokens[i, :k]
        index = torch.tensor(starts, device=device)[:, None] + torch.arange(K_max + 1, device=device)  # (B, K + 1)
        logits = target(feed.gather(1, index), target_cache)  # (B, K + 1, V)
        row_logits = [logits[i, K_max - k :] for i, k in enumerate(K)]  # (K_i + 1, V) each
        verdicts = verify_rows(row_logits, proposal, sampling, generators)
        t2 = clock(device)

        stats.record_batch_step(len(ids), K_max, proposal.forward_calls, t1 - t0, t2 - t1)
        valid = []  # per row, the positions whose tokens stand: the old sequence and the accepted drafts
        keep = []
        for i, (b, verdict) in enumerate(zip(ids, verdicts)):
            valid.append(S[i] + verdict.num_accepted)
            new = verdict.tokens  # n accepted drafts + the target's token
            row_stats = stats.rows[b]
            if eos_id is not None and eos_id in new:
                new = new[: new.index(eos_id) + 1]  # nothing follows end-of-text
                row_stats.stopped_at_eos = True
            seqs[i, S[i] : S[i] + len(new)] = torch.tensor(new, device=device)
            out[b] += new
            S[i] += len(new)
            emitted_drafts = min(verdict.num_accepted, len(new))  # fewer if an accepted draft was end-of-text
            row_stats.record_step(K[i], emitted_drafts, target_token=len(new) > emitted_drafts)
            row_stats.gamma_hist[K[i]] += 1
            row_stats.draft_calls += K[i]
            row_stats.draft_seconds += t1 - t0
            row_stats.verify_seconds += t2 - t1
            if on_step is not None:
                on_step(b, new, emitted_drafts)
            if not row_stats.stopped_at_eos and S[i] < max_len[b]:
                keep.append(i)
        target_cache.rewind(torch.tensor(valid))
        drafter.commit(valid)
        if len(keep) < len(ids):  # finished rows leave the batch
            target_cache.keep_rows(keep)
            drafter.keep_rows(keep)
            seqs = seqs[keep]
            ids, S, generators = [ids[i] for i in keep], [S[i] for i in keep], [generators[i] for i in keep]
    return out
