"""A preallocated key/value cache for GPT-2 decoding.

Legend: L = layers, B = batch, nh = heads, S = cache capacity (n_ctx),
hs = head size, T = tokens written by one forward pass.

Keys and values of every layer live in two buffers allocated once,
(L, B, nh, S, hs). A forward pass writes its T new positions at
[length, length + T) and attends over [0, length + T). Rewinding is one integer
assignment: the slots past the new length are never read again (attention only
looks at [0, length)) and the next write overwrites them. That is what makes
rejecting drafted tokens free in speculative decoding (the idea as in gpt-fast).
"""

from __future__ import annotations

import torch

from .config import GPT2Config


class KVCache:
    """Keys and values of the tokens a model has already processed.

    Attributes:
        k, v: (L, B, nh, S, hs) buffers; only positions [0, length) are valid.
        length: number of valid positions; the next token goes at `length`.
        capacity: S, the most positions the cache can hold (= n_ctx).
    """

    def __init__(
        self,
        config: GPT2Config,
        batch_size: int = 1,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (config.n_layer, batch_size, config.n_head, config.n_ctx, config.head_size)
        # torch.empty, not zeros: a slot is always written before it is read
        # (attention reads [0, length + T) only), and zero-filling gpt2-large's
        # 377 MB of buffers cost ~380 ms per new cache, i.e. three decode steps
        # of start-up for every generation (untouched pages cost nothing).
        self.k = torch.empty(shape, device=device, dtype=dtype)  # (L, B, nh, S, hs)
        self.v = torch.empty(shape, device=device, dtype=dtype)  # (L, B, nh, S, hs)
        self.capacity = config.n_ctx
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self.k.size(1)

    def check_room(self, num_new: int) -> None:
        """Raises ValueError if `num_new` more positions do not fit."""
        if self.length + num_new > self.capacity:
            raise ValueError(
                f"the sequence would reach {self.length + num_new} tokens but the model's context "
                f"window is {self.capacity}: use a shorter prompt or fewer new tokens"
            )

    def write(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores the new keys and values of `layer` at [start, start + T).

        Args:
            layer: the block index.
            start: the first position written; the model passes `length`.
            k, v: (B, nh, T, hs) keys and values of the new tokens.

        Returns:
            Keys and values of positions [0, start + T): two (B, nh, start + T, hs)
            views into the buffers (no copy).
        """
        T = k.size(2)
        end = start + T
        assert end <= self.capacity, f"cache write [{start}, {end}) past capacity {self.capacity}"
        self.k[layer, :, :, start:end] = k  # (B, nh, T, hs) into (B, nh, S, hs)
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # (B, nh, start + T, hs)

    def rewind(self, length: int) -> None:
        """Forgets every position from `length` on, in O(1): no copy, no recompute."""
        assert 0 <= length <= self.length, f"cannot rewind a cache of length {self.length} to {length}"
        self.length = length
