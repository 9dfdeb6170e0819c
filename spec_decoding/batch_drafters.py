"""Drafters for a batch: the draft model proposes for every unfinished row at
once, one forward pass per draft position.

Legend: B = rows, S_b = row b's committed length, K_b = tokens drafted for
row b this step, K = max_b K_b, W = tokens fed per row, V = vocab size.

Cache invariant, per row as ModelDrafter's: row b holds a prefix of its
committed tokens and lacks one or two of them between steps. A pass feeds
every row the same number of tokens, so a row that needs fewer re-feeds what
it already holds: catching up, its last cached committed token (when another
row lacks two); done drafting (K_b < K), its last token in place. No row ever
feeds a position past its own draft, so never past the draft's window. A row
with K_b = 0 finishes this step or has outgrown the draft's window for good.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch

from gpt2.generate import check_integer, check_model, prefill_rows
from gpt2.model import GPT2
from gpt2.sampling import SamplingConfig, logits_to_probs, sample

from .drafters import NOT_PROBABILITIES, check_reference, improper, out_of_range, position_coins
from .stats import check_number


@dataclass
class BatchDraft:
    """The tokens drafted for each row of a batch in one step.

    Attributes:
        tokens: (B, K) tensor of any integer dtype (the loop takes it as
            int64); row b's drafts are tokens[b, :num_drafted[b]] (the rest
            is filler).
        probs: (B, K, V) float32 draft distributions the tokens were sampled
            from (rows past num_drafted[b] are zero); None when greedy.
        num_drafted: K_b for each row.
        forward_calls: batched draft forward passes this proposal took (K).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None
    num_drafted: list[int]
    forward_calls: int


def drafted_mask(K: list[int], device: torch.device) -> torch.Tensor:
    """(B, max K) bool: [b, j] = row b drafted a j-th token (j < K_b)."""
    return torch.arange(max(K), device=device)[None] < torch.tensor(K, device=device)[:, None]


def drafted_probs(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B, K) the probability of each drafted token under its row and position of `probs` (B, K, V)."""
    return probs.gather(2, tokens.long().unsqueeze(2)).squeeze(2)  # (B, K, V) -> (B, K, 1) -> (B, K)


def check_batch_draft(draft: BatchDraft, K: list[int], vocab_size: int, sampling: bool, drafter: object,
                      device: torch.device) -> BatchDraft:
    """`draft` with its tokens as int64, which indexing takes. Raises a
    ValueError naming the `drafter` (one written elsewhere) unless `draft` is
    what the batch loop can verify: a BatchDraft of num_drafted = the `K`
    asked of each row, tokens (B, >= max K) integer ids on `device`, in
    0..V-1 where drafted, and probs (B, >= max K, V) when `sampling`."""
    tokens, probs, B, K_max = getattr(draft, "tokens", None), getattr(draft, "probs", None), len(K), max(K)
    problem = None
    if not isinstance(draft, BatchDraft) or not isinstance(tokens, torch.Tensor):
        problem = f"a BatchDraft holding a tensor of tokens, got {type(draft).__name__}"
    elif list(draft.num_drafted) != list(K):
        problem = f"num_drafted = the tokens asked of each row, {list(K)}, got {draft.num_drafted}"
    elif tokens.dim() != 2 or tokens.size(0) != B or tokens.size(1) < K_max or tokens.device != device or \
            tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        problem = (f"({B}, >= {K_max}) integer token ids on {device}, got a {tokens.dtype} tensor of shape "
                   f"{tuple(tokens.shape)} on {tokens.device}")
    elif bool(out_of_range(tokens[:, :K_max], vocab_size)[drafted_mask(K, device)].any()):
        problem = f"token ids in 0..{vocab_size - 1}, got {tokens.tolist()}"
    elif sampling and (not isinstance(probs, torch.Tensor) or probs.dim() != 3 or probs.size(0) != B
                       or probs.size(1) < K_max or probs.size(2) != vocab_size or probs.device != device):
        where = f" on {probs.device}" if isinstance(probs, torch.Tensor) else ""
        problem = f"probs of shape ({B}, >= {K_max}, {vocab_size}) on {device} when sampling, got " \
                  f"{getattr(probs, 'shape', probs)}{where}"
    elif sampling and K_max and improper(
            q := drafted_probs(probs[:, :K_max], tokens[:, :K_max])[drafted_mask(K, device)]):  # (B, K_max) -> (n,)
        problem = NOT_PROBABILITIES.format(q.tolist())
    if problem is not None:
        raise ValueError(f"{type(drafter).__name__}.propose must return {problem}")
    return replace(draft, tokens=tokens.long())


class BatchDrafter:
    """Drafts for a batch with a (small) GPT-2: one forward pass per draft
    position for all rows together."""

    def __init__(self, model: GPT2) -> None:
        check_model(model, "draft")
        self.model = model
        self.cache = model.new_cache(1)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def n_ctx(self) -> int:
        return self.model.config.n_ctx

    def max_draft(self, seq_len: int) -> int:
        """The most tokens it can draft after `seq_len` tokens without feeding
        a position past its window (as ModelDrafter.max_draft)."""
        return max(0, self.n_ctx - seq_len + 1)

    def prefill(self, prompts: list[torch.Tensor], capacity: int) -> None:
        """Starts a new batch: caches every prompt ((T_b,) tokens) but its
        last token, in one pass per group of similar lengths (`prefill_rows`).
        A prompt its window cannot hold is not cached: that row can never
        draft (`max_draft` is 0).

        Args:
            prompts: the rows' prompts.
            capacity: the most positions a row will hold (clipped to n_ctx).
        """
        self.cache = self.model.new_cache(len(prompts), capacity=min(capacity, self.n_ctx))
        prefixes = [p[:-1] if p.numel() - 1 < self.n_ctx else p[:0] for p in prompts]
        prefill_rows(self.model, self.cache, prefixes)

    def propose(
        self,
        seqs: torch.Tensor,
        seq_lens: list[int],
        num_drafts: list[int],
        sampling: SamplingConfig,
        generators: list[torch.Generator | None],
        row_ids: list[int],
    ) -> BatchDraft:
        """Drafts num_drafts[b] tokens after row b's committed tokens.

        Args:
            seqs: (B, L) committed tokens; row b's are seqs[b, :seq_lens[b]].
            seq_lens: S_b for each row.
            num_drafts: K_b for each row, each <= max_draft(S_b).
            sampling: the one sampling filter.
            generators: the randomness of each row (the same object for
                rows that share one); within a pass rows draw in batch order.
            row_ids: each row's index in the caller's input (for `pick`).

        Returns:
            The BatchDraft; K = max(num_drafts) forward passes.
        """
        B, K = len(seq_lens), max(num_drafts)
        V = self.vocab_size
        tokens = seqs.new_zeros(B, K)  # (B, K)
        probs = None if sampling.greedy else torch.zeros(B, K, V, device=seqs.device)  # (B, K, V)
        if K == 0:
            return BatchDraft(tokens, probs, list(num_drafts), 0)

        # Catch up: row b feeds its committed tokens [start_b, S_b); W is the most any drafting row lacks.
        cached = self.cache.lengths.tolist()
        drafting = [k > 0 for k in num_drafts]
        W = max(S - c for S, c, d in zip(seq_lens, cached, drafting) if d)
        starts = [S - W if d else 0 for S, d in zip(seq_lens, drafting)]  # K_b = 0: re-feed the first W tokens
        assert all(0 <= s <= c for s, c in zip(starts, cached)), (starts, cached)
        assert all(S >= W for S in seq_lens), "every row holds at least W committed tokens"
        self.cache.rewind(torch.tensor(starts))
        index = torch.tensor(starts, device=seqs.device)[:, None] + torch.arange(W, device=seqs.device)  # (B, W)
        feed = seqs.gather(1, index)  # (B, W)

        for i in range(K):
            logits = self.model(feed, self.cache, last_logits_only=True)[:, -1]  # (B, W) -> (B, V)
            for b in range(B):
                if i < num_drafts[b]:
                    token, p = self.pick(row_ids[b], seq_lens[b] + i, logits[b], sampling, generators[b])
                    tokens[b, i] = token
                    if p is not None:
                        probs[b, i] = p
            if i + 1 < K:
                # Rows still drafting feed their new token; the others re-feed their last one in place.
                goes_on = torch.tensor([i + 1 < k for k in num_drafts])  # (B,)
                feed = torch.where(goes_on.to(seqs.device), tokens[:, i], feed[:, -1])[:, None]  # (B, 1)
                self.cache.rewind(self.cache.lengths - (~goes_on).long())
        return BatchDraft(tokens, probs, list(num_drafts), K)

    def pick(
        self, row: int, position: int, logits: torch.Tensor, sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafted token for sequence position `position` of input row
        `row` from the draft's (V,) logits, and the distribution it was drawn
        from (None if greedy)."""
        if sampling.greedy:
            return logits.argmax(), None
        p = logits_to_probs(logits, sampling)  # (V,)
        return sample(p, generator), p

    def commit(self, valid: list[int]) -> None:
        """Keeps each row's cached positions [0, valid[b]) whose tokens were committed."""
        self.cache.rewind(torch.minimum(self.cache.lengths, torch.tensor(valid)))

    def keep_rows(self, rows: list[int]) -> None:
        """Drops the finished rows: only `rows` (increasing) stay, in order."""
        self.cache.keep_rows(rows)


class SimulatedBatchDrafter(BatchDrafter):
    """A batch drafter with a chosen acceptance rate, for benchmarks (the
    batch form of `SimulatedDrafter`): it runs the draft model exactly as
    BatchDrafter does, but proposes for each row the target's own greedy
    token with probability `alpha` and a wrong token otherwise.

    `references[b]` is row b's greedy decoding by the target alone (prompt
    included), which greedy speculative decoding reproduces. Greedy only.
    As in `SimulatedDrafter`, each (row, position) has its own coin, drawn
    once per seed: every γ sees the same accepted positions. Row b takes the
    coins of row `first_row` + b of the seed, so that a batch cut from a
    larger one meets that one's coins.
    """

    def __init__(self, model: GPT2, references: list[list[int]], alpha: float, *, seed: int = 0,
                 first_row: int = 0) -> None:
        super().__init__(model)
        first_row = check_integer(first_row, "first_row", 0)
        alpha = check_number(alpha, "the simulated acceptance rate", 0.0, 1.0)
        try:
            self.references = [list(map(operator.index, reference)) for reference in references]
        except TypeError:
            self.references = []
        if not self.references:
            raise ValueError(f"references must hold each row's greedy token ids, prompt included (gpt2.generate's "
                             f"output for the batch, a list of token-id lists), got {references!r:.60}")
        for b, reference in enumerate(self.references):
            check_reference(reference, self.vocab_size, f"the reference of row {b}")
        self.alpha = alpha
        length = max(max(map(len, self.references)), model.config.n_ctx) + 1
        self.coins = position_coins(seed, first_row + len(self.references), length)[first_row:]  # [row][position]

    def prefill(self, prompts: list[torch.Tensor], capacity: int) -> None:
        if len(prompts) > len(self.references):
            raise ValueError(f"{len(self.references)} references for a batch of {len(prompts)} prompts: give one "
                             "reference per prompt")
        super().prefill(prompts, capacity)

    def pick(
        self, row: int, position: int, logits: torch.Tensor, sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not sampling.greedy:
            raise ValueError("simulated acceptance works with greedy decoding only (temperature 0)")
        reference = self.references[row]
        right = reference[position] if position < len(reference) else 0
        accept = position < len(self.coins[row]) and self.coins[row][position] < self.alpha
        token = right if accept else (right + 1) % self.vocab_size
        return torch.tensor(token, device=logits.device), None
