"""Plain autoregressive generation with the KV cache: the baseline that
speculative decoding must reproduce (greedy) or match in distribution (sampling).

Legend: B = batch, T = prompt length, n = new tokens, V = vocab size, G = rows of
a prefill group (`prefill_rows`), L = layers, nh = heads, hs = head size.

The end-of-text rule, kept everywhere in this project: generation stops right
after the first `eos_id` it produces, and that EOS token is kept in the output
as the last token. Nothing follows it.

A batch may hold prompts of different lengths: the KV cache keeps a length per
row, so each row decodes at its own positions with no padding in attention,
and a row that has ended leaves the batch (`KVCache.keep_rows`). Prompts of
similar length are prefilled together (`prefill_rows`), so that a short one
beside a long one computes little padding.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Sequence

import torch

from .kv_cache import KVCache
from .model import GPT2
from .sampling import SamplingConfig, check_generator, next_token

# The tensor dtypes a prompt's token ids may come in (they are copied into int64).
TOKEN_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def id_dtype_error(what: str, dtype: torch.dtype) -> ValueError:
    """The error for token ids of a dtype outside TOKEN_ID_DTYPES (uint16 ids, as nanoGPT stores them, included)."""
    return ValueError(f"{what} must hold integer token ids (int64, int32, int16, int8 or uint8), got {dtype}: "
                      "convert them with .long()")


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


def prompt_too_long(T: int, n_ctx: int, where: str = "") -> ValueError:
    """The error for a prompt of T >= n_ctx tokens, `where` before it (e.g. "row 2: ")."""
    if n_ctx < 2:  # no prompt is short enough
        return ValueError(f"{where}the context window is {n_ctx}, too small for a prompt and a new token: use a model "
                          "with a larger window (n_ctx)")
    return ValueError(f"{where}the prompt has {T} tokens but the context window is {n_ctx}: shorten it to at most "
                      f"{n_ctx - 1} tokens so there is room to generate")


def check_prompt(input_ids: torch.Tensor, n_ctx: int, vocab_size: int) -> None:
    """Raises ValueError, saying how to fix it, if `input_ids` cannot be a prompt.

    A prompt is a (B, T) integer tensor with 1 <= T < n_ctx (there must be room
    for at least one new token) and every id in [0, vocab_size).
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a (batch, tokens) tensor, e.g. torch.tensor([[15496, 995]])")
    if input_ids.dtype not in TOKEN_ID_DTYPES:
        raise id_dtype_error("input_ids", input_ids.dtype)
    T = input_ids.size(1)
    if input_ids.size(0) == 0:
        raise ValueError("the batch is empty: give at least one prompt")
    if T == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if T >= n_ctx:
        raise prompt_too_long(T, n_ctx)
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        bad_row = int(((input_ids < 0) | (input_ids >= vocab_size)).any(dim=1).nonzero()[0])
        where = f" (row {bad_row})" if input_ids.size(0) > 1 else ""
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got ids from {lo} to {hi}{where}")


def check_prompts(
    prompts: torch.Tensor | Sequence[Sequence[int]], lengths: torch.Tensor | Sequence[int] | None,
    n_ctx: int, vocab_size: int,
) -> list[torch.Tensor]:
    """The rows of a batch of prompts of any lengths, checked.

    Args:
        prompts: a list of prompts, each a list (or 1-D tensor) of token ids;
            or a (B, T) integer tensor, whose row b is padded on the right
            after its own `lengths[b]` tokens (all T if `lengths` is None).
        lengths: (B,) the length of each row of a padded tensor, or None.
        n_ctx, vocab_size: the model's context window and vocabulary.

    Returns:
        B (T_b,) int64 tensors, 1 <= T_b < n_ctx (room for one new token).

    Raises:
        ValueError: an empty batch, an empty row, a row that is not integer
            ids, an id outside [0, vocab_size), a row too long for the
            context window; the message names the row and how to fix it.
    """
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ValueError("a tensor of prompts must be (batch, tokens), e.g. torch.tensor([[15496, 995]])")
        if prompts.dtype not in TOKEN_ID_DTYPES:
            raise id_dtype_error("prompts", prompts.dtype)
        B, T = prompts.shape
        if lengths is None:
            row_lengths = [T] * B
        else:
            row_lengths = check_lengths(lengths, B, T)
        rows = [prompts[b, : row_lengths[b]] for b in range(B)]
    else:
        if lengths is not None:
            raise ValueError("lengths goes with a padded (batch, tokens) tensor; a list of prompts has its own lengths")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError(
                f"prompts must be a list of token-id lists or a (batch, tokens) tensor, got {type(prompts).__name__}"
            )
        if prompts and all(isinstance(t, int) for t in prompts):
            raise ValueError(f"prompts is one list of token ids, {list(prompts)!r:.40}: a batch is a list of "
                             "such lists ([[15496, 995]]); one prompt can also be a (1, tokens) tensor")
        rows = [prompt_row(row, b) for b, row in enumerate(prompts)]
    if not rows:
        raise ValueError("the batch is empty: give at least one prompt")
    for b, row in enumerate(rows):
        T_b = row.numel()
        if T_b == 0:
            raise ValueError(f"row {b}: the prompt is empty: give every prompt at least one token")
        if T_b >= n_ctx:
            raise prompt_too_long(T_b, n_ctx, f"row {b}: ")
        lo, hi = int(row.min()), int(row.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"row {b}: token ids must lie in [0, {vocab_size}), got ids from {lo} to {hi}")
    return [row.to(torch.int64) for row in rows]


def prompt_row(row, b: int) -> torch.Tensor:
    """Row b of a list of prompts (a list, array or 1-D tensor of token ids)
    as a 1-D integer tensor, possibly empty; or a ValueError naming the row."""
    bad = ValueError(f"row {b} must be a list of integer token ids, got {row!r:.60}")
    if isinstance(row, (str, bytes)) or (isinstance(row, Sequence) and any(isinstance(t, bool) for t in row)):
        raise bad
    try:
        tensor = row if isinstance(row, torch.Tensor) else torch.as_tensor(row)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise bad from None
    if tensor.dim() == 1 and tensor.numel() == 0:
        return tensor.to(torch.int64)  # empty: check_prompts names it
    if tensor.dim() == 1 and tensor.dtype not in TOKEN_ID_DTYPES and not tensor.is_floating_point() \
            and not tensor.is_complex() and tensor.dtype != torch.bool:
        raise id_dtype_error(f"row {b}", tensor.dtype)  # integers of another width (uint16 ...)
    if tensor.dim() != 1 or tensor.dtype not in TOKEN_ID_DTYPES:
        raise bad
    return tensor


def check_lengths(lengths, B: int, T: int) -> list[int]:
    """The B row lengths of a padded (B, T) tensor of prompts as ints in [0, T], or a ValueError."""
    values = lengths.tolist() if hasattr(lengths, "tolist") else lengths  # a tensor or a numpy array
    if not isinstance(values, Sequence) or len(values) != B:
        raise ValueError(f"lengths must give one length per row: {B} integers, got {lengths!r:.60}")
    checked = []
    for b, value in enumerate(values):
        length = check_integer(value, f"lengths[{b}]", 0)
        if length > T:
            raise ValueError(f"row {b}: lengths[{b}] = {length} is longer than the padded tensor's {T} tokens")
        checked.append(length)
    return checked


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


def check_callback(fn, name: str, arguments: tuple[str, ...] | None = None) -> None:
    """Raises ValueError unless `fn` is None or can be called (a callback such as on_step), with the positional
    `arguments` it will get (their names, e.g. ("tokens", "num_accepted")) where its signature can be read."""
    if fn is not None and not callable(fn):
        raise ValueError(f"{name} must be a function (or None), got {type(fn).__name__}")
    if fn is None or arguments is None:
        return
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: its call is its own business
        return
    try:
        signature.bind(*arguments)
    except TypeError:
        raise ValueError(f"{name} is called as {name}({', '.join(arguments)}), but it takes {signature}: give it "
                         "those arguments") from None


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ, or where the shorter one
    ends if it is a prefix of the other; None if they are equal. (Greedy
    speculative output must equal the baseline's: this says where it does not.)"""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # stops at the shorter
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def generate(
    model: GPT2,
    input_ids: torch.Tensor | Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    lengths: torch.Tensor | Sequence[int] | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor | list[list[int]]:
    """Generates up to `max_new_tokens` tokens after each prompt, one per step.

    The prompts are prefilled once into a fresh KV cache (all but each row's
    last token); each step then feeds every unfinished row its newest token.
    A row stops after its own `eos_id`, its budget, or the context window,
    and leaves the batch: it costs nothing in later steps.

    Args:
        model: the GPT-2 to decode with.
        input_ids: the prompts: a (B, T) tensor of token ids (every row T
            long, or padded on the right: see `lengths`), or a list of B
            prompts of any lengths, each a list of token ids.
        max_new_tokens: the most tokens to add to each row.
        lengths: (B,) each row's own length in a padded (B, T) tensor.
        temperature, top_k, top_p: see `SamplingConfig`; temperature 0 is greedy.
        eos_id: a row stops after this token (kept in its output); None: never early.
        generator: randomness for sampling, one draw per unfinished row per
            step, in row order; the same seed reproduces the batch.

    Returns:
        A (B, T) tensor without `lengths` gives what it always gave: a
        (B, T + n) LongTensor, the prompts followed by n <= max_new_tokens new
        tokens, where a row that ends before the others is padded with
        `eos_id` (n is smaller when every row ended, or at the context window).
        A list of prompts, or a tensor with `lengths`, gives a list of B token
        lists: each row's own prompt and new tokens, no padding.

    Raises:
        ValueError: a bad prompt or setting (the message names the row and
            says how to fix it).
    """
    config = SamplingConfig(temperature, top_k, top_p)
    check_model(model)
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    as_tensor = isinstance(input_ids, torch.Tensor) and lengths is None
    if as_tensor:
        check_prompt(input_ids, model.config.n_ctx, model.config.vocab_size)
    prompts = check_prompts(input_ids, lengths, model.config.n_ctx, model.config.vocab_size)
    eos_id = check_eos_id(eos_id, model.config.vocab_size)
    generator = check_generator(generator, config, model.device)
    rows = decode_rows(model, prompts, max_new_tokens, config, eos_id, generator)
    if not as_tensor:
        return rows
    width = max(len(row) for row in rows)  # rows differ only where one ended at eos_id
    return torch.tensor([row + [eos_id] * (width - len(row)) for row in rows], device=input_ids.device)  # (B, T + n)


def decode_rows(
    model: GPT2, prompts: list[torch.Tensor], max_new_tokens: int, config: SamplingConfig,
    eos_id: int | None, generator: torch.Generator | None,
) -> list[list[int]]:
    """The loop of `generate` over checked prompts ((T_b,) tensors): each
    row's prompt and new tokens."""
    n_ctx = model.config.n_ctx
    out = [prompt.tolist() for prompt in prompts]
    max_len = [len(row) + min(max_new_tokens, n_ctx - len(row)) for row in out]  # never past the window
    rows = [b for b in range(len(out)) if max_len[b] > len(out[b])]  # the unfinished rows, in order
    if not rows:
        return out

    cache = model.new_cache(len(rows), capacity=max(max_len[b] for b in rows))
    prefill_rows(model, cache, [prompts[b][:-1] for b in rows])  # every token but each row's last
    pending = torch.tensor([out[b][-1] for b in rows], device=model.device)  # (B,) the next token to feed
    while rows:
        logits = model(pending[:, None], cache)[:, -1]  # (B, 1) -> (B, V)
        pending = next_token(logits, config, generator)  # (B,)
        keep = []
        for i, (b, token) in enumerate(zip(rows, pending.tolist())):
            out[b].append(token)
            if token != eos_id and len(out[b]) < max_len[b]:
                keep.append(i)
        if len(keep) < len(rows):  # finished rows leave the batch
            cache.keep_rows(keep)
            pending = pending[keep]
            rows = [rows[i] for i in keep]
    return out


# What a forward pass costs beyond its positions' arithmetic, in positions: a pass reads every weight once
# (4 bytes each), and in that time a CPU, which does some 4 flops per byte it reads from memory, multiply-adds
# every weight (2 flops) for about 8 positions. Rows therefore share a prefill pass when that saves more than the
# padding it adds.
PASS_POSITIONS = 8


def prefill_rows(model: GPT2, cache: KVCache, prefixes: list[torch.Tensor]) -> None:
    """Caches row b's `prefixes[b]` ((P_b,) token ids, P_b may be 0) into an
    empty cache, computing little padding: rows of similar length share a
    forward pass (`length_groups`), padded on the right to the group's
    longest and then each rewound to its own length (causal attention keeps
    the padding away from a row's own positions, and the rewind forgets it).
    A group that is not the whole batch goes through a cache of its own,
    copied into its rows. A batch of equal lengths is one pass.
    """
    P = [prefix.numel() for prefix in prefixes]
    assert cache.batch_size == len(P) and int(cache.lengths.max()) == 0, "prefill_rows needs an empty cache"
    for group in length_groups(P):
        longest = max(P[b] for b in group)
        if longest == 0:
            continue
        ids = torch.zeros(len(group), longest, dtype=torch.long, device=model.device)  # (G, longest), padded with 0
        for i, b in enumerate(group):
            ids[i, : P[b]] = prefixes[b]
        whole = group == list(range(len(P)))
        part = cache if whole else model.new_cache(len(group), capacity=longest)
        model(ids, part, last_logits_only=True)
        if not whole:  # the group's rows, padding included (a row never reads past its length)
            rows = torch.tensor(group, device=cache.k.device)  # (G,)
            cache.k[:, rows, :, :longest] = part.k  # (L, G, nh, longest, hs)
            cache.v[:, rows, :, :longest] = part.v
        cache.lengths[group] = torch.tensor([P[b] for b in group])  # (G,): each row back to its own length


def length_groups(lengths: list[int]) -> list[list[int]]:
    """The rows (indices into `lengths`) in prefill groups, shortest first,
    chosen to minimise the work of the passes: a group of G rows padded to
    its longest, P, costs PASS_POSITIONS + G * P positions. Sorted by length,
    the best split into runs of neighbours is found exactly by dynamic
    programming: best[j] = min over i of best[i] + cost(rows i..j-1). Rows of
    near lengths share a pass (one read of the weights), and a very short
    row does not compute a long one's padding.
    """
    order = sorted(range(len(lengths)), key=lambda b: lengths[b])
    P = [lengths[b] for b in order]  # ascending
    best = [0] + [None] * len(P)  # best[j]: the least cost of the first j sorted rows
    start = [0] * (len(P) + 1)  # start[j]: where the last group of that best split begins
    for j in range(1, len(P) + 1):
        for i in range(j):  # the last group is rows i..j-1; on a tie the bigger group (fewer passes) stays
            cost = best[i] + (PASS_POSITIONS + (j - i) * P[j - 1] if P[j - 1] else 0)  # empty rows: no pass
            if best[j] is None or cost < best[j]:
                best[j], start[j] = cost, i
    groups, j = [], len(P)
    while j > 0:
        groups.append(sorted(order[start[j] : j]))
        j = start[j]
    return groups[::-1]
