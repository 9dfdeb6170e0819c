"""The verification rules of speculative decoding, as pure functions.

Legend: K = gamma, the number of drafted tokens; V = vocab size.

Notation: the papers swap p and q (Leviathan et al. 2023 call the target p and
the draft q; Chen et al. 2023 call the target q and the draft p). Here the
target's distribution is always `p_target` / `target_probs` and the draft's
`p_draft` / `draft_probs`; the docstrings follow Leviathan et al. 2023.

Nothing here calls a model or touches a cache: each function takes the target's
scores at the K + 1 verified positions, the K drafted tokens (and, for
sampling, the draft's distributions and the randomness) and returns a
`Verdict`. Row i (i = 0..K) of the target's scores is its prediction for
drafted token i (counting from 0), given the prefix and the drafted tokens
before it; row K predicts the token after the whole draft (the "bonus" token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpt2.sampling import sample


@dataclass(frozen=True)
class Verdict:
    """What one verification step decided.

    Attributes:
        accepted: the drafted tokens kept, a prefix of the draft (n of them, 0..K).
        next_token: the token the target adds after them: its correction at the
            first rejected position (n < K), or the bonus token (n = K).
    """

    accepted: tuple[int, ...]
    next_token: int

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)

    @property
    def tokens(self) -> list[int]:
        """The n + 1 tokens this step appends to the sequence."""
        return [*self.accepted, self.next_token]


def check_draft_tokens(draft_tokens: torch.Tensor) -> int:
    """K, the number of drafted tokens, or a ValueError unless `draft_tokens`
    is a (K,) tensor of integer ids. (Their range is the caller's: the
    decoding loops check every draft, `spec_decoding.drafters.check_draft`.)"""
    if not (isinstance(draft_tokens, torch.Tensor) and draft_tokens.dim() == 1 and not draft_tokens.is_floating_point()
            and not draft_tokens.is_complex() and draft_tokens.dtype != torch.bool):
        got = tuple(draft_tokens.shape) if isinstance(draft_tokens, torch.Tensor) else type(draft_tokens).__name__
        raise ValueError(f"draft_tokens must be a (K,) tensor of token ids, got {got}")
    return draft_tokens.numel()


def check_shapes(target: torch.Tensor, rows: int, what: str, draft_probs: torch.Tensor | None = None,
                 draft_rows: int = 0, uniforms: torch.Tensor | None = None, draws: int = 0) -> None:
    """Raises a ValueError unless `target` is (rows, V) scores, `draft_probs`
    (draft_rows, V) and `uniforms` (draws,): these functions are public, and
    called directly a wrong shape would index or broadcast its way to a wrong
    verdict."""
    if not (isinstance(target, torch.Tensor) and target.dim() == 2 and target.size(0) == rows):
        got = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
        raise ValueError(f"need ({rows}, V) target scores for {what}, got {got}")
    if draft_probs is not None and tuple(draft_probs.shape) != (draft_rows, target.size(1)):
        raise ValueError(f"need ({draft_rows}, {target.size(1)}) draft probabilities for {what} (the target's V), "
                         f"got {tuple(draft_probs.shape)}")
    if uniforms is not None and tuple(uniforms.shape) != (draws,):
        raise ValueError(f"need ({draws},) uniforms for {what}, one per drafted token, got {tuple(uniforms.shape)}")


def count_leading_true(flags: torch.Tensor) -> int:
    """The length of the all-True prefix of a (K,) bool tensor (one host sync)."""
    return int(flags.to(torch.int64).cumprod(dim=0).sum())  # (K,) -> ()


def speculative_sampling_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> Verdict:
    """Greedy verification: keep the longest draft prefix the target agrees with.

    Draft token i is accepted while it equals the target's argmax at row i;
    the target's argmax at the first disagreement (or at row K) is appended.
    Every appended token is therefore exactly the token greedy decoding of the
    target alone would have produced, so the output is identical to it.

    Args:
        target_logits: (K + 1, V) the target's logits (or any scores whose
            argmax is the target's greedy choice) at the verified positions.
        draft_tokens: (K,) LongTensor, the drafted tokens.

    Returns:
        The Verdict.
    """
    K = check_draft_tokens(draft_tokens)
    check_shapes(target_logits, K + 1, f"{K} drafted tokens")
    target_choice = target_logits.argmax(dim=-1)  # (K + 1, V) -> (K + 1,)
    n = count_leading_true(draft_tokens == target_choice[:K])  # (K,) == (K,)
    return Verdict(accepted=tuple(draft_tokens[:n].tolist()), next_token=int(target_choice[n]))


def residual_distribution(p_target: torch.Tensor, p_draft: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p_target - p_draft)): what to sample from after a rejection
    (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, eq. (1)).

    Args:
        p_target, p_draft: (V,) probabilities at the rejected position.

    Returns:
        (V,) probabilities. If the residual has no mass (p_target == p_draft up
        to rounding, where a rejection cannot really happen), p_target itself,
        never a division by zero.
    """
    residual = (p_target - p_draft).clamp(min=0.0)  # (V,)
    mass = residual.sum()
    if mass <= 0:
        return p_target
    return residual / mass


def speculative_sampling(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> Verdict:
    """Lossless verification of sampled drafts (Leviathan et al. 2023,
    Algorithm 1; Chen et al. 2023, Algorithm 2).

    Draft token x_i is accepted with probability min(1, p_target(x_i) / p_draft(x_i)),
    in order, until the first rejection. At a rejection the target's token is
    drawn from the residual norm(max(0, p_target - p_draft)) at that position;
    if all K are accepted, a bonus token is drawn from p_target at row K. The
    appended tokens are then distributed exactly as sampling from the target.

    Args:
        target_probs: (K + 1, V) the target's filtered probabilities
            (`gpt2.sampling.logits_to_probs`) at the verified positions.
        draft_probs: (K, V) the draft's probabilities, processed by the same
            filter, from which `draft_tokens` were actually sampled.
        draft_tokens: (K,) LongTensor, the drafted tokens.
        generator: randomness for the acceptance draws (unless `uniforms` is
            given) and for the correction / bonus draw.
        uniforms: optional (K,) draws r_i ~ U[0, 1); token i is accepted iff
            r_i < p_target(x_i) / p_draft(x_i). For tests with known outcomes.

    Returns:
        The Verdict.
    """
    K = check_draft_tokens(draft_tokens)
    check_shapes(target_probs, K + 1, f"{K} drafted tokens", draft_probs, K, uniforms, K)
    rows = torch.arange(K, device=draft_tokens.device)  # (K,)
    p_target_of_draft = target_probs[rows, draft_tokens]  # (K + 1, V) gather -> (K,)
    p_draft_of_draft = draft_probs[rows, draft_tokens]  # (K, V) gather -> (K,)
    if uniforms is None:
        uniforms = torch.rand(K, generator=generator, device=target_probs.device)  # (K,)
    # r < p_target / p_draft, written without the division so a zero in p_draft
    # cannot make a NaN (a token the draft could not have drawn is accepted only
    # if the target gives it mass).
    accept = uniforms * p_draft_of_draft < p_target_of_draft  # (K,)
    n = count_leading_true(accept)

    if n < K:
        dist = residual_distribution(target_probs[n], draft_probs[n])  # (V,)
    else:
        dist = target_probs[K]  # (V,): the bonus token
    next_token = int(sample(dist, generator))
    return Verdict(accepted=tuple(draft_tokens[:n].tolist()), next_token=next_token)
