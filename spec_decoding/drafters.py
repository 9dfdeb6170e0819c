"""Drafters: whatever proposes the K tokens the target then verifies.

Legend: S = committed sequence length, K = gamma (tokens to draft), V = vocab.

The decoding loop (loop.py) only talks to this small interface, so a drafter is
swappable: `ModelDrafter` runs a small GPT-2 with its own KV cache;
`SimulatedDrafter` runs that same model (its real cost) but replaces what it
proposes, to control the acceptance rate in benchmarks.

Cache invariant shared with the loop: a drafter's cache holds the keys and
values of a prefix of the committed sequence (plus, right after `propose`, of
its own drafted tokens). Before drafting it feeds the committed tokens it has
not seen yet; after verification the loop calls `rewind(valid)` with the
number of leading positions whose tokens are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpt2.model import GPT2
from gpt2.sampling import SamplingConfig, logits_to_probs, sample


@dataclass
class Draft:
    """K proposed tokens.

    Attributes:
        tokens: (K,) LongTensor of drafted token ids.
        probs: (K, V) float32 draft distributions they were sampled from
            (`logits_to_probs` of the draft's logits); None when greedy.
        forward_calls: draft model forward passes this proposal took.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None
    forward_calls: int


class ModelDrafter:
    """Drafts with a (small) GPT-2, one token per forward pass."""

    def __init__(self, model: GPT2) -> None:
        self.model = model
        self.cache = model.new_cache(1)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def n_ctx(self) -> int:
        return self.model.config.n_ctx

    def prefill(self, prefix: torch.Tensor) -> None:
        """Starts a new sequence: caches `prefix`, (1, P) tokens (P may be 0).
        A prefix its window cannot hold is not cached: it could never draft
        after it (`max_draft` is 0), and the loop takes plain target steps."""
        self.cache.rewind(0)
        if 0 < prefix.size(1) < self.n_ctx:
            self.model(prefix, self.cache, last_logits_only=True)

    def max_draft(self, seq_len: int) -> int:
        """The most tokens it can draft after a sequence of `seq_len` tokens
        without running past its context window (it feeds positions up to
        seq_len + K - 2)."""
        return max(0, self.n_ctx - seq_len + 1)

    def propose(
        self, seq: torch.Tensor, K: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        """Drafts K tokens after `seq`, (1, S) committed tokens.

        Feeds the committed tokens its cache lacks (one, or two after a fully
        accepted draft), then its own drafts one at a time: K forward passes.
        """
        assert K >= 1, "propose needs K >= 1"
        feed = seq[:, self.cache.length :]  # (1, S - cached): the unseen committed tokens
        tokens, probs = [], []
        for i in range(K):
            logits = self.model(feed, self.cache, last_logits_only=True)[0, -1]  # (V,)
            token, p = self.pick(seq.size(1) + i, logits, sampling, generator)
            tokens.append(token)
            probs.append(p)
            feed = token.view(1, 1)  # (1, 1)
        return Draft(
            tokens=torch.stack(tokens),  # K x () -> (K,)
            probs=None if sampling.greedy else torch.stack(probs),  # K x (V,) -> (K, V)
            forward_calls=K,
        )

    def pick(
        self, position: int, logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafted token for sequence position `position` from the draft's
        (V,) logits, and the distribution it was drawn from (None if greedy)."""
        if sampling.greedy:
            return logits.argmax(), None
        p = logits_to_probs(logits, sampling)  # (V,)
        return sample(p, generator), p

    def rewind(self, valid: int) -> None:
        """Keeps the cached positions [0, valid) whose tokens were committed."""
        self.cache.rewind(min(self.cache.length, valid))


class SimulatedDrafter(ModelDrafter):
    """A drafter with a chosen acceptance rate, for measuring the loop.

    It runs the draft model exactly as `ModelDrafter` does (every forward pass,
    its cache fed the tokens it proposes), but proposes, for each position, the
    target's own greedy token with probability `alpha` and a wrong token
    otherwise. The target's greedy continuation is known in advance
    (`reference`: plain greedy decoding of the target from the same prompt,
    which speculative greedy decoding reproduces exactly). Each drafted token is
    then accepted with probability alpha, independently: the i.i.d. model of
    Leviathan et al. 2023, section 3.

    Greedy only: with sampling there is no single "right" token.
    """

    def __init__(self, model: GPT2, reference: torch.Tensor, alpha: float, *, seed: int = 0) -> None:
        super().__init__(model)
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"the simulated acceptance rate must lie in [0, 1], got {alpha}")
        self.reference = reference.flatten().tolist()  # the target's greedy sequence, prompt included
        self.alpha = alpha
        self.coins = torch.Generator().manual_seed(seed)  # its own randomness: the run's stays untouched

    def pick(
        self, position: int, logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not sampling.greedy:
            raise ValueError("simulated acceptance works with greedy decoding only (temperature 0)")
        right = self.reference[position] if position < len(self.reference) else 0
        if torch.rand((), generator=self.coins) < self.alpha:
            token = right
        else:
            token = (right + 1) % self.vocab_size  # any token but the target's choice
        return torch.tensor(token, device=logits.device), None
