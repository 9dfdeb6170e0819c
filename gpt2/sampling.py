"""Turning logits into a next-token distribution: temperature, top-k, top-p.

Legend: V = vocab size; `...` = any leading dimensions (batch, positions).

This is the one sampling filter of the project. The baseline, the draft model
and the target model all go through `logits_to_probs`, so that in speculative
sampling the draft's p_draft and the target's p_target are processed exactly
alike (the lossless guarantee holds for the filtered target distribution).
Filters apply in the order Hugging Face applies them: temperature, then top-k,
then top-p (nucleus sampling, Holtzman et al. 2020); top-k ranks the logits
before the division, which keeps the same tokens and cannot round them to ties.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass

import torch

# Below this temperature sampling is greedy: logits / temperature would
# overflow float32 (for 1e-39, every logit becomes +-inf and the softmax NaN),
# and at 1e-4 a logit gap of 0.01 is already a factor e^100.
GREEDY_BELOW_TEMPERATURE = 1e-4
# Logits are divided by the temperature in float32, where a larger one is infinite (every logit 0, or NaN).
MAX_TEMPERATURE = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a distribution.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by
            it. A temperature below GREEDY_BELOW_TEMPERATURE (1e-4) is greedy too.
        top_k: keep only the k most likely tokens, and any tied with the k-th
            (as Hugging Face's filter does; None: all).
        top_p: keep the smallest set of most likely tokens whose probability
            reaches top_p (None or 1.0: all).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        try:
            finite = math.isfinite(float(self.temperature))  # an int past float's range is not finite
        except (TypeError, ValueError, OverflowError):
            finite = False
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, numbers.Real)
            or not finite
            or not 0 <= self.temperature <= MAX_TEMPERATURE
        ):
            raise ValueError(
                f"temperature must be a number >= 0 (0 = greedy) and <= {MAX_TEMPERATURE:.3g}, got {self.temperature!r}"
            )
        object.__setattr__(self, "temperature", float(self.temperature))  # torch cannot divide by an int past 64 bits
        if self.top_k is not None:
            try:
                k = None if isinstance(self.top_k, bool) else operator.index(self.top_k)
            except TypeError:
                k = None
            if k is None or k < 1:
                raise ValueError(f"top_k must be an integer >= 1 (or None for no limit), got {self.top_k!r}")
            object.__setattr__(self, "top_k", k)  # numpy.int64 and friends become int
        if self.top_p is not None and (
            isinstance(self.top_p, bool) or not isinstance(self.top_p, numbers.Real) or not (0.0 < self.top_p <= 1.0)
        ):
            raise ValueError(f"top_p must be in (0, 1] (or None for no limit), got {self.top_p!r}")
        if self.top_p is not None:
            object.__setattr__(self, "top_p", float(self.top_p))  # a Fraction does not compare with a tensor

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """The filtered next-token distribution.

    Args:
        logits: (..., V) raw model logits, any float dtype.
        config: the sampling settings.

    Returns:
        (..., V) float32 probabilities that sum to 1 over V. When greedy, the
        one-hot distribution on the argmax (ties go to the lowest id).
    """
    logits = logits.float()
    if config.greedy:
        V = logits.size(-1)
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), V).float()  # (..., V)

    if config.top_k is not None and config.top_k < logits.size(-1):
        # On the logits as given: dividing by a huge temperature could round distinct logits to one value.
        kth_best = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    probs = torch.softmax(logits / config.temperature, dim=-1)  # (..., V)

    if config.top_p is not None and config.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)  # (..., V) each
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # (..., V)
        # Keep a token while the more likely ones have not yet reached top_p,
        # and the most likely token always (a top_p below float32's smallest
        # number would otherwise compare as 0 and keep nothing).
        keep_sorted = mass_before < config.top_p  # (..., V)
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)  # back to vocab order
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def check_generator(
    generator, sampling: SamplingConfig | None = None, device: torch.device | None = None
) -> torch.Generator | None:
    """`generator` if it is a torch.Generator or None, else a ValueError; also
    a ValueError if `sampling` samples (not greedy) on `device` and the
    generator belongs to another kind of device (greedy draws nothing: any
    generator will do)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__}: "
            "e.g. torch.Generator().manual_seed(0)"
        )
    samples = sampling is not None and not sampling.greedy and device is not None
    if generator is not None and samples and generator.device.type != device.type:
        raise ValueError(
            f"the generator is a {generator.device.type} generator, but the model samples on {device.type}: "
            f"make it there, torch.Generator(device='{device.type}').manual_seed(0)"
        )
    return generator


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draws one token per row.

    Args:
        probs: (..., V) probabilities.
        generator: the source of randomness (on probs' device); a seeded
            generator reproduces the draws.

    Returns:
        (...) LongTensor of token ids.

    Raises:
        ValueError: probs hold NaN or inf (the logits were not finite), where
            torch's draw refuses them with an error of its own.
    """
    V = probs.size(-1)
    flat = probs.reshape(-1, V)  # (N, V)
    try:
        drawn = torch.multinomial(flat, 1, generator=generator)  # (N, 1)
    except RuntimeError:
        if bool(torch.isfinite(flat).all()):
            raise
        raise ValueError("the next-token distribution holds NaN or inf: a model's forward pass overflowed (its "
                         "weights are too large, as in a damaged or mis-scaled checkpoint, or float16 could not hold "
                         "its activations): check the checkpoint, or compute in float32") from None
    return drawn.view(probs.shape[:-1])  # (N, 1) -> (...)


def next_token(
    logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Picks the next token from (..., V) logits: the argmax when greedy,
    otherwise a draw from `logits_to_probs`. Returns (...) LongTensor."""
    if config.greedy:
        return logits.argmax(dim=-1)  # (..., V) -> (...)
    return sample(logits_to_probs(logits, config), generator)
