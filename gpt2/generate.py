"""Plain autoregressive generation with the KV cache: the baseline that
speculative decoding must reproduce (greedy) or match in distribution (sampling).

Legend: B = batch, T = prompt length, n = new tokens, V = vocab size.

The end-of-text rule, kept everywhere in this project: generation stops right
after the first `eos_id` it produces, and that EOS token is kept in the output
as the last token. Nothing follows it.
"""

from __future__ import annotations

import operator

import torch

from .model import GPT2
from .sampling import SamplingConfig, next_token


def check_integer(value, name: str, minimum: int) -> int:
    """`value` as an int if it is an integer (any integer type: int,
    numpy.int64, a 0-d integer tensor; not bool) >= minimum.

    Raises:
        ValueError: anything else, naming `name` and what it must be.
    """
    if not isinstance(value, bool):
        try:
            number = operator.index(value)
        except TypeError:
            number = None
        if number is not None and number >= minimum:
            return number
    raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_eos_id(eos_id, vocab_size: int) -> int | None:
    """None, or a token id in [0, vocab_size).

    Raises:
        ValueError: another value (e.g. -1, or an id past the vocabulary).
    """
    if eos_id is None:
        return None
    eos = check_integer(eos_id, "eos_id", 0)
    if eos >= vocab_size:
        raise ValueError(f"eos_id must be a token id in [0, {vocab_size}) or None, got {eos_id!r}")
    return eos


def check_prompt(input_ids: torch.Tensor, n_ctx: int, vocab_size: int) -> None:
    """Raises ValueError, saying how to fix it, if `input_ids` cannot be a prompt.

    A prompt is a (B, T) integer tensor with 1 <= T < n_ctx (there must be room
    for at least one new token) and every id in [0, vocab_size).
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a (batch, tokens) tensor, e.g. torch.tensor([[15496, 995]])")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    T = input_ids.size(1)
    if T == 0 or input_ids.size(0) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if T >= n_ctx:
        raise ValueError(
            f"the prompt has {T} tokens but the context window is {n_ctx}: shorten it to at most "
            f"{n_ctx - 1} tokens so there is room to generate"
        )
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got ids from {lo} to {hi}")


def check_max_new_tokens(max_new_tokens) -> int:
    """max_new_tokens as an int >= 0, or a ValueError."""
    return check_integer(max_new_tokens, "max_new_tokens", 0)


def check_model(model, role: str = "model") -> None:
    """Raises ValueError unless `model` is a GPT2 (e.g. a Hub id string given
    where a loaded model is meant)."""
    if not isinstance(model, GPT2):
        raise ValueError(
            f"the {role} must be a loaded GPT2 model, got {type(model).__name__}: "
            "load it first with gpt2.load_model('gpt2')"
        )


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ, or where the shorter one
    ends if it is a prefix of the other; None if they are equal. (Greedy
    speculative output must equal the baseline's: this says where it does not.)"""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # stops at the shorter
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def generate(
    model: GPT2,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Generates up to `max_new_tokens` tokens after `input_ids`, one per step.

    The prompt is prefilled once into a fresh KV cache; each later step feeds
    only the newest token.

    Args:
        model: the GPT-2 to decode with.
        input_ids: (B, T) prompt token ids on the model's device.
        max_new_tokens: the most tokens to add.
        temperature, top_k, top_p: see `SamplingConfig`; temperature 0 is greedy.
        eos_id: stop after this token (kept in the output); None: never stop early.
        generator: randomness for sampling; the same seed reproduces the output.

    Returns:
        (B, T + n) LongTensor, the prompt followed by n <= max_new_tokens new
        tokens. n is smaller when every row produced `eos_id` (a row that ends
        before the others is padded with `eos_id`) or when the sequence reached
        the context window n_ctx.

    Raises:
        ValueError: a bad prompt or setting (the message says how to fix it).
    """
    config = SamplingConfig(temperature, top_k, top_p)
    check_model(model)
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    check_prompt(input_ids, model.config.n_ctx, model.config.vocab_size)
    eos_id = check_eos_id(eos_id, model.config.vocab_size)
    B, T = input_ids.size()
    n_new = min(max_new_tokens, model.config.n_ctx - T)  # never past the context window
    if n_new == 0:
        return input_ids.clone()

    cache = model.new_cache(B)
    logits = model(input_ids, cache, last_logits_only=True)[:, -1]  # (B, V)
    out = [input_ids]
    finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)  # (B,)
    for step in range(n_new):
        token = next_token(logits, config, generator)  # (B,)
        if eos_id is not None:
            token = torch.where(finished, torch.full_like(token, eos_id), token)
            finished |= token == eos_id
        out.append(token[:, None])  # (B, 1)
        if step == n_new - 1 or (eos_id is not None and bool(finished.all())):
            break
        logits = model(token[:, None], cache)[:, -1]  # (B, 1) -> (B, V)
    return torch.cat(out, dim=1)  # (B, T + n)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ, the end of the shorter
    one counting as a difference; None if they are equal. (How a speculative
    run is compared with the baseline above.)"""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
