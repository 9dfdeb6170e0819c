"""A preallocated key/value cache for GPT-2 decoding, with a length per row.

Legend: L = layers, B = rows (batch), nh = heads, S = capacity (positions),
hs = head size, T = new tokens per row in one forward pass.

Keys and values of every layer live in two buffers allocated once,
(L, B, nh, S, hs). Row b holds `lengths[b]` positions, [0, lengths[b]); a
forward pass writes its T new positions at [lengths[b], lengths[b] + T) and
then moves the length on. Rewinding is setting a length back: the slots past
it are never attended to again (masked) and the next write overwrites them. That is what makes
rejecting drafted tokens free in speculative decoding (the idea as in
gpt-fast). Rows may have different lengths (a batch of prompts of different
lengths, each accepting its own number of drafted tokens); attention masks the
slots a row does not have (gpt2/model.py `visible_keys`). A row that has
finished leaves the batch (`keep_rows`), so it costs nothing in later passes.
"""

from __future__ import annotations

import torch

from .config import GPT2Config


class KVCache:
    """Keys and values of the tokens a model has already processed.

    Attributes:
        k, v: (L, B, nh, S, hs) buffers; row b's valid positions are [0, lengths[b]).
        lengths: (B,) int64 on the CPU, the positions each row holds; the
            next token of row b goes at lengths[b].
        capacity: S, the most positions a row can hold.
    """

    def __init__(
        self,
        config: GPT2Config,
        batch_size: int = 1,
        *,
        capacity: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        capacity = config.n_ctx if capacity is None else capacity
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= config.n_ctx:
            raise ValueError(f"capacity must be an integer in 1..{config.n_ctx} (the context window), got {capacity!r}")
        shape = (config.n_layer, batch_size, config.n_head, capacity, config.head_size)
        # One row reads only slots it has written, so its buffers can start as
        # they are (zero-filling gpt2-large's 377 MB costs ~0.4 s). Rows of a
        # batch also see (masked) slots up to the longest row's length, and a
        # masked score still multiplies its value: 0 x NaN would be NaN, so
        # those buffers start at zero.
        allocate = torch.empty if batch_size == 1 else torch.zeros
        self.k = allocate(shape, device=device, dtype=dtype)  # (L, B, nh, S, hs)
        self.v = allocate(shape, device=device, dtype=dtype)  # (L, B, nh, S, hs)
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device="cpu")  # (B,), whatever the default device
        self.capacity = capacity

    @staticmethod
    def nbytes(config: GPT2Config, batch_size: int = 1, capacity: int | None = None,
               dtype: torch.dtype = torch.float32) -> int:
        """Bytes of the two buffers of a KVCache(config, batch_size, capacity=capacity, dtype=dtype), before
        allocating them: what a caller checks against the memory it has."""
        capacity = config.n_ctx if capacity is None else capacity
        return 2 * config.n_layer * batch_size * config.n_head * capacity * config.head_size * dtype.itemsize

    @property
    def batch_size(self) -> int:
        return self.k.size(1)

    @property
    def length(self) -> int:
        """The positions held, when every row holds the same number (one sequence)."""
        if self.batch_size == 0:
            raise ValueError("the cache holds no rows (keep_rows kept none): it has no length")
        first = int(self.lengths[0])
        if not bool((self.lengths == first).all()):
            raise ValueError(f"rows hold different lengths {self.lengths.tolist()}: read cache.lengths instead")
        return first

    def check_room(self, num_new: int) -> None:
        """Raises ValueError if `num_new` more positions do not fit in every row."""
        longest = int(self.lengths.max())
        if longest + num_new > self.capacity:
            raise ValueError(
                f"the sequence would reach {longest + num_new} tokens but this cache holds {self.capacity} "
                "positions (the model's context window, or less): use a shorter prompt or fewer new tokens"
            )

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores the new keys and values of `layer` at each row's length.

        Args:
            layer: the block index.
            k, v: (B, nh, T, hs) keys and values of the new tokens.

        Returns:
            Keys and values of positions [0, max(lengths) + T): two
            (B, nh, max(lengths) + T, hs) views into the buffers (no copy).
            Row b's slots [lengths[b] + T, ...) in them are not its own.
        """
        T = k.size(2)
        starts = self.lengths.tolist()
        for b, start in enumerate(starts):
            self.k[layer, b, :, start : start + T] = k[b]  # (nh, T, hs) into (nh, S, hs)
            self.v[layer, b, :, start : start + T] = v[b]
        end = max(starts) + T
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # (B, nh, end, hs)

    def advance(self, num_new: int) -> None:
        """Every row now also holds the `num_new` positions just written."""
        self.lengths += num_new

    def rewind(self, length: int | torch.Tensor) -> None:
        """Forgets every position from `length` on (one int for all rows, or a
        (B,) tensor), in O(1): no copy, no recompute.

        Raises:
            ValueError: `length` would add positions (past a row's length, or
                below 0), or is not one length or one per row.
        """
        given, ok = length, False
        if not isinstance(length, torch.Tensor) and hasattr(length, "__array__"):  # numpy: checked as a tensor
            try:
                length = torch.as_tensor(length)
            except (TypeError, ValueError, RuntimeError):
                length = None  # an array torch cannot hold (strings, objects)
        if isinstance(length, torch.Tensor):
            integral = not (length.is_floating_point() or length.is_complex() or length.dtype == torch.bool)
            ok = integral and length.dim() <= 1 and length.numel() in (1, self.batch_size)
        elif length is not None:
            ok = not isinstance(length, bool) and hasattr(type(length), "__index__")  # int, ...
        if not ok:
            raise ValueError(f"rewind takes one integer length or {self.batch_size} (one per row), got {given!r:.60}")
        lengths = torch.as_tensor(length, dtype=torch.int64, device=self.lengths.device).expand(self.batch_size)
        if not bool((lengths >= 0).all() and (lengths <= self.lengths).all()):
            raise ValueError(f"cannot rewind lengths {self.lengths.tolist()} to {lengths.tolist()}: rewinding only "
                             "forgets positions, to a length from 0 to each row's own")
        self.lengths = lengths.clone()

    def keep(self, row: int, start: int, positions: torch.Tensor) -> None:
        """Moves the keys and values of `positions` of `row` to the contiguous
        slots [start, start + n), in order, and sets the row's length to
        start + n: what is left of a verified token tree, its accepted path.

        Args:
            row: the row.
            start: the first slot of the tree (the row's length before it).
            positions: (n,) slot indices >= start, increasing.
        """
        slots = positions.tolist()
        held = int(self.lengths[row]) if 0 <= row < self.batch_size else -1
        if not (0 <= start <= held and all(a < b for a, b in zip([start - 1] + slots, slots + [held]))):
            raise ValueError(f"keep takes a row in [0, {self.batch_size}) and slots of it, held, increasing from "
                             f"start {start}; got row {row}, slots {slots!r:.60}")
        # One slice copy per kept position (an accepted path is a few tokens),
        # in order: slot start + i <= slots[i] < slots[i + 1], so no copy
        # overwrites a position still to be moved. A gather with an index
        # tensor, k[:, row, :, index], measured slower in the tree loop, more
        # so on a loaded machine (docs/performance.md).
        for i, slot in enumerate(slots):
            if slot != start + i:
                self.k[:, row, :, start + i] = self.k[:, row, :, slot]  # (L, nh, hs)
                self.v[:, row, :, start + i] = self.v[:, row, :, slot]
        self.lengths[row] = start + len(slots)

    def keep_rows(self, rows: list[int]) -> None:
        """Keeps only `rows`, in that order, as rows 0..n-1: the batch shrinks
        to n = len(rows), so finished rows cost nothing in later passes.

        In place: each kept row's [0, length) slots move to the front (no new
        buffers); k and v become views of the first n rows.

        Args:
            rows: row indices, strictly increasing.
        """
        if not (all(a < b for a, b in zip(rows, rows[1:])) and all(0 <= r < self.batch_size for r in rows)):
            raise ValueError(f"rows must be increasing indices in [0, {self.batch_size}), got {rows!r:.60}")
        # Row `new` <= `old`: every row a move overwrites was dropped or has already moved.
        for new, old in enumerate(rows):
            n = int(self.lengths[old])
            if new != old and n:
                self.k[:, new, :, :n] = self.k[:, old, :, :n]  # (L, nh, n, hs)
                self.v[:, new, :, :n] = self.v[:, old, :, :n]
        self.k = self.k[:, : len(rows)]  # (L, n, nh, S, hs): a view of the same buffer
        self.v = self.v[:, : len(rows)]
        self.lengths = self.lengths[list(rows)].clone()  # (n,)
