"""Drafters: whatever proposes the tokens the target then verifies.

Legend: S = committed sequence length, K = tokens asked for, V = vocab.

The decoding loop (loop.py) only talks to the `Drafter` interface, so drafters
are swappable: `ModelDrafter` runs a small GPT-2 with its own KV cache (and can
stop early when unsure, as llama.cpp's --draft-p-min does); `SimulatedDrafter`
runs that model (its real cost) but sets the acceptance rate, for benchmarks;
`NgramDrafter` runs no model and copies from the text so far (prompt lookup, as
in vLLM, Hugging Face and llama.cpp). A drafter may propose fewer than K tokens,
even none: the loop verifies what it got, or takes a plain target step.

`ModelDrafter`'s cache holds a prefix of the committed sequence (plus, right
after `propose`, its own drafts): before drafting it feeds the committed tokens
it has not seen; after verification the loop calls `rewind(valid)`.
"""

from __future__ import annotations

import numbers
import operator
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch

from gpt2.generate import check_integer, check_model
from gpt2.model import GPT2
from gpt2.sampling import SamplingConfig, logits_to_probs, sample

from .stats import check_number


@dataclass
class Draft:
    """The k <= K tokens a drafter proposed.

    Attributes:
        tokens: (k,) tensor of drafted token ids of any integer dtype (the
            loop takes them as int64; k may be 0).
        probs: (k, V) float32 draft distributions they were sampled from
            (`logits_to_probs` of the draft's logits); None when greedy, and
            None from a drafter whose proposals are not sampled (`NgramDrafter`):
            its p_draft is then the point mass on each token (see the loop).
        forward_calls: draft model forward passes this proposal took.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None
    forward_calls: int


def out_of_range(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Where integer `tokens` of any dtype lie outside 0..vocab_size-1 (bool, their shape)."""
    ids = tokens.long()  # unsigned dtypes have no < 0
    return (ids < 0) | (ids >= vocab_size)


# What a drafter's probs must give each drafted token: the probability it was drawn with, in (0, 1] (a little over
# 1 for rounding); log-probabilities or logits there would be taken for probabilities and bias the output.
NOT_PROBABILITIES = "probs under which each drafted token has the probability it was drawn with, in (0, 1] " \
                    "(not log-probabilities or logits), got {}"


def improper(q: torch.Tensor) -> bool:
    """Whether a drafted token's probability in `q` lies outside (0, 1] (NaN included)."""
    return not bool(((q > 0) & (q <= 1.001)).all())


def check_draft(draft: Draft, K: int, vocab_size: int, drafter: object, device: torch.device) -> Draft:
    """`draft` with its tokens as int64, which indexing takes. Raises a
    ValueError naming the `drafter` (one written elsewhere) unless `draft` is
    what the loop can verify: a Draft of at most K token ids in 0..V-1 (a
    1-D integer tensor on `device`), probs None or (k, V) on `device`, each
    drafted token's probability in (0, 1]."""
    tokens, probs = getattr(draft, "tokens", None), getattr(draft, "probs", None)
    problem = None
    if not isinstance(draft, Draft) or not isinstance(tokens, torch.Tensor):
        problem = f"a Draft holding a tensor of tokens, got {type(draft).__name__}"
    elif tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        problem = f"(k,) integer token ids, got a {tokens.dtype} tensor of shape {tuple(tokens.shape)}"
    elif tokens.numel() > K or tokens.device != device:
        problem = f"at most K = {K} tokens on {device}, got {tokens.numel()} on {tokens.device}"
    elif tokens.numel() and bool(out_of_range(tokens, vocab_size).any()):
        problem = f"token ids in 0..{vocab_size - 1}, got {tokens.tolist()}"
    elif probs is not None and (not isinstance(probs, torch.Tensor) or probs.shape != (tokens.numel(), vocab_size)
                                or probs.device != device):
        where = f" on {probs.device}" if isinstance(probs, torch.Tensor) else ""
        problem = f"probs None or of shape ({tokens.numel()}, {vocab_size}) on {device}, got " \
                  f"{getattr(probs, 'shape', probs)}{where}"
    elif probs is not None and tokens.numel() and improper(
            q := probs[torch.arange(tokens.numel(), device=device), tokens.long()]):  # (k, V) -> (k,)
        problem = NOT_PROBABILITIES.format(q.tolist())
    if problem is not None:
        raise ValueError(f"{type(drafter).__name__}.propose must return {problem}")
    return replace(draft, tokens=tokens.long())


def drafting_room(drafter: object, seq_len: int, method: str = "max_draft") -> int:
    """`drafter.<method>(seq_len)`, the most tokens (or depths) it can draft after `seq_len` tokens, as an int >= 0
    (a negative count: no room). Raises a ValueError naming a drafter written elsewhere that answers anything but an
    integer."""
    room = getattr(drafter, method)(seq_len)
    if not isinstance(room, bool):
        try:
            return max(0, operator.index(room))
        except TypeError:
            pass
    raise ValueError(f"{type(drafter).__name__}.{method} must return an integer (the most it can draft after "
                     f"{seq_len} tokens), got {room!r}")


def check_drafter_fits(drafter: object, target: GPT2) -> None:
    """Raises a ValueError unless the drafter's vocabulary (if it has one) is the
    target's and its model (if it has one) is on the target's device."""
    vocab_size = getattr(drafter, "vocab_size", None)
    if vocab_size is not None and vocab_size != target.config.vocab_size:
        raise ValueError(
            f"draft and target have different vocabularies ({vocab_size} vs "
            f"{target.config.vocab_size} tokens): pick a draft model from the target's family"
        )
    model = getattr(drafter, "model", None)
    if isinstance(model, GPT2) and model.device != target.device:
        raise ValueError(f"the draft is on {model.device}, the target on {target.device}: load both on one "
                         f"device (load_model(..., device=...) or model.to(device))")


def check_reference(reference: list[int], vocab_size: int, what: str = "reference") -> None:
    """Raises a ValueError unless every id of a simulated drafter's `reference`
    is an integer in 0..vocab_size-1: it feeds them to its draft model."""
    bad = next((t for t in reference if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if isinstance(bad, int):
        raise ValueError(f"{what} holds token id {bad}, outside the draft's vocabulary 0..{vocab_size - 1}: give "
                         "the target's greedy output (gpt2.generate)")
    if bad is not None:  # a float tensor's .tolist(): the first error named input_ids, mid-run
        raise ValueError(f"{what} holds {bad!r}, not an integer token id: give the target's greedy output "
                         "(gpt2.generate), a tensor of integer ids")


class Drafter(ABC):
    """What the decoding loop asks of a drafter.

    Attributes:
        model: the GPT-2 it runs, whose step cost `gamma="auto"` measures;
            None (the default) for a drafter without a model: its cost is taken as 0.
    """

    model: GPT2 | None = None

    @property
    @abstractmethod
    def vocab_size(self) -> int | None:
        """Its vocabulary size, checked against the target's; None if it has
        no vocabulary of its own (it only repeats tokens of the sequence)."""

    @abstractmethod
    def prefill(self, prefix: torch.Tensor) -> None:
        """Starts a new sequence whose committed tokens begin with `prefix`, (1, P)."""

    @abstractmethod
    def max_draft(self, seq_len: int) -> int:
        """The most tokens it can draft after a sequence of `seq_len` tokens."""

    @abstractmethod
    def propose(
        self, seq: torch.Tensor, K: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        """At most K >= 1 tokens to follow `seq`, (1, S) committed tokens."""

    @abstractmethod
    def rewind(self, valid: int) -> None:
        """Forgets everything past the first `valid` positions, whose tokens were committed."""


class ModelDrafter(Drafter):
    """Drafts with a (small) GPT-2, one token per forward pass.

    With `p_min`, it stops drafting at the first position where the draft's
    top probability (under the run's sampling filter; at temperature 1 when
    greedy) is below p_min, as llama.cpp's --draft-p-min does: that position's
    forward pass is spent, but no token the target would likely reject is
    proposed. The test looks at the distribution before sampling from it, so
    every proposed token is still an exact sample of p_draft and the
    verification stays exact.
    """

    def __init__(self, model: GPT2, *, p_min: float | None = None) -> None:
        if p_min is not None and not (isinstance(p_min, numbers.Real) and not isinstance(p_min, bool)
                                      and 0.0 <= p_min <= 1.0):  # numpy floats too
            raise ValueError(f"p_min must be a probability in [0, 1] (or None to always draft K), got {p_min!r}")
        check_model(model, "draft")
        self.model = model
        self.p_min = None if p_min is None else float(p_min)
        self.cache = model.new_cache(1)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def n_ctx(self) -> int:
        return self.model.config.n_ctx

    def prefill(self, prefix: torch.Tensor) -> None:
        """Caches `prefix`, (1, P) tokens (P may be 0). A prefix its window
        cannot hold is not cached: it could never draft after it (`max_draft`
        is 0), and the loop takes plain target steps."""
        if (self.cache.k.dtype, self.cache.k.device) != (self.model.dtype, self.model.device):
            self.cache = self.model.new_cache(1)  # the model has moved (.to()) since this drafter was made
        self.cache.rewind(0)
        if 0 < prefix.size(1) < self.n_ctx:
            self.model(prefix, self.cache, last_logits_only=True)

    def max_draft(self, seq_len: int) -> int:
        """The most tokens it can draft without running past its context
        window (it feeds positions up to seq_len + K - 2)."""
        return max(0, self.n_ctx - seq_len + 1)

    def propose(
        self, seq: torch.Tensor, K: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        """Drafts up to K tokens after `seq`, (1, S) committed tokens.

        Feeds the committed tokens its cache lacks (one, or two after a fully
        accepted draft), then its own drafts one at a time: K forward passes,
        fewer if `p_min` stops it.
        """
        assert K >= 1, "propose needs K >= 1"
        feed = seq[:, self.cache.length :]  # (1, S - cached): the unseen committed tokens
        tokens, probs = [], []
        for i in range(K):
            logits = self.model(feed, self.cache, last_logits_only=True)[0, -1]  # (V,)
            if self.p_min is not None and self.confidence(logits, sampling) < self.p_min:
                break
            token, p = self.pick(seq.size(1) + i, logits, sampling, generator)
            tokens.append(token)
            probs.append(p)
            feed = token.view(1, 1)  # (1, 1)
        if not tokens:  # stopped at the first position
            no_probs = None if sampling.greedy else logits.new_empty(0, self.vocab_size)  # (0, V)
            return Draft(tokens=seq.new_empty(0), probs=no_probs, forward_calls=1)  # (0,) tokens
        return Draft(
            tokens=torch.stack(tokens),  # k x () -> (k,)
            probs=None if sampling.greedy else torch.stack(probs),  # k x (V,) -> (k, V)
            forward_calls=min(len(tokens) + 1, K),  # a p_min stop spent one pass more than it drafted
        )

    @staticmethod
    def confidence(logits: torch.Tensor, sampling: SamplingConfig) -> float:
        """The draft's top probability at a position, from its (V,) logits:
        under the run's filter, or at temperature 1 when greedy (the greedy
        filter is one-hot, which would always say 1)."""
        filter_ = SamplingConfig(temperature=1.0) if sampling.greedy else sampling
        return float(logits_to_probs(logits, filter_).max())

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


def position_coins(seed: int, rows: int, length: int) -> list[list[float]]:
    """coins[row][position]: uniform numbers in [0, 1), one per position of
    each row's sequence, the simulated drafters' coins. The same seed and
    length give the same coins to a chain, a tree and a batch drafter (row 0),
    so that their runs meet the same accepted positions."""
    seed = check_integer(seed, "the simulated drafter's seed", -2**63)  # manual_seed takes 64-bit integers
    return torch.rand(rows, length, generator=torch.Generator().manual_seed(seed)).tolist()  # (rows, length)


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

    The coin of a position is drawn once per seed, for the position, not in
    the order the drafts come: a chain drafts each position at most once, so
    runs with the same seed and any γ or schedule see the same accepted and
    rejected positions, and differ only in how their steps cut that string.
    Comparisons between them then measure the method, not the luck of the draw.

    Greedy only: with sampling there is no single "right" token.
    """

    def __init__(self, model: GPT2, reference: torch.Tensor, alpha: float, *, seed: int = 0) -> None:
        super().__init__(model)
        alpha = check_number(alpha, "the simulated acceptance rate", 0.0, 1.0)
        if not isinstance(reference, torch.Tensor):
            raise ValueError(f"reference must be a tensor of the target's greedy token ids, prompt included "
                             f"(gpt2.generate's output), got {type(reference).__name__}")
        self.reference = reference.flatten().tolist()  # the target's greedy sequence, prompt included
        check_reference(self.reference, self.vocab_size)
        self.alpha = alpha
        self.coins = position_coins(seed, 1, max(len(self.reference), model.config.n_ctx) + 1)[0]

    def pick(
        self, position: int, logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not sampling.greedy:
            raise ValueError("simulated acceptance works with greedy decoding only (temperature 0)")
        right = self.reference[position] if position < len(self.reference) else 0
        if position < len(self.coins) and self.coins[position] < self.alpha:
            token = right
        else:
            token = (right + 1) % self.vocab_size  # any token but the target's choice
        return torch.tensor(token, device=logits.device), None


class NgramDrafter(Drafter):
    """Prompt lookup: proposes what followed the last time the text looked
    like it does now (Saxena 2023; vLLM's and Hugging Face's prompt lookup,
    llama.cpp's lookup decoding).

    For m = n, n - 1, ..., 1 (the longest suffix first), it looks for the
    most recent earlier occurrence of the sequence's last m tokens in the
    committed sequence (prompt + output) and proposes the K tokens that
    followed it. The copy may run into the suffix itself, and then goes on
    copying what it has just proposed: a text that repeats a period of d
    tokens is continued with the same period. With no match for any m, it
    proposes nothing and the loop takes a plain target step.

    It has no model, no cache and no probabilities: it is cheap (a few tensor
    comparisons), and it has no vocabulary of its own. Exactness with sampling:
    a deterministic proposal x is a sample of the point mass p_draft = 1[x], so
    the rule accepts it with probability min(1, p_target(x) / 1) = p_target(x)
    and otherwise draws from norm(max(0, p_target - 1[x])), which is p_target
    without x, renormalised: every token y ends up with probability p_target(y).
    """

    model = None

    def __init__(self, n: int = 3) -> None:
        self.n = check_integer(n, "the n-gram length n (the longest suffix to match)", 1)

    @property
    def vocab_size(self) -> None:
        return None

    def prefill(self, prefix: torch.Tensor) -> None:
        pass  # nothing to cache: each proposal searches the sequence it is given

    def max_draft(self, seq_len: int) -> int:
        return sys.maxsize  # no context window of its own

    def propose(
        self, seq: torch.Tensor, K: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        """Up to K tokens copied from after the latest earlier match of the
        longest matching suffix of `seq`, (1, S); none without a match."""
        assert K >= 1, "propose needs K >= 1"
        tokens = seq[0].cpu()  # (S,)
        S = tokens.numel()
        start = self.match(tokens)
        if start is None:
            return Draft(tokens=seq.new_empty(0), probs=None, forward_calls=0)  # (0,): no proposal
        text = tokens.tolist()
        for j in range(start, start + K):  # j < len(text): the copy may read what it just appended
            text.append(text[j])
        return Draft(tokens=torch.tensor(text[S:], device=seq.device), probs=None, forward_calls=0)  # (K,)

    def match(self, tokens: torch.Tensor) -> int | None:
        """Where the copy starts: the position right after the most recent
        earlier occurrence of the longest suffix (n tokens at most) of
        `tokens`, (S,), that occurs earlier; None if even its last token is new."""
        S = tokens.numel()
        for m in range(min(self.n, S - 1), 0, -1):
            suffix = tokens[S - m :]  # (m,)
            windows = tokens[: S - 1].unfold(0, m, 1)  # (S - m, m): the windows starting at 0 .. S - m - 1
            hits = (windows == suffix).all(dim=1).nonzero()  # (h, 1) starts of earlier occurrences
            if hits.numel():
                return int(hits[-1]) + m  # the latest one
        return None

    def rewind(self, valid: int) -> None:
        pass  # nothing cached
