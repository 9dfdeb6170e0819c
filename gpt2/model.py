"""GPT-2 (Radford et al. 2019), written out by hand.

Legend: B = batch, T = new tokens in this forward pass, K = keys attended
over (the cached positions plus the T new ones), C = n_embd, nh = n_head,
hs = head size (C // nh), V = vocab size.

Token + learned position embeddings, n_layer pre-LayerNorm blocks (causal
self-attention, then an MLP with the tanh-approximated GELU), a final
LayerNorm, and an LM head tied to the token embedding. Parameter names are
the checkpoint's (`wte`, `h.N.attn.c_attn`, ...), so loading is a
name-for-name copy (loading.py). Decoding feeds a few new tokens at a time on
top of a KV cache; a `mask` lets them form a token tree (`GPT2.forward`). One
seam lets a faster implementation of the same pass take over:
`GPT2.accelerator` (gpt2/fast puts its C kernels there; None keeps this code).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import GPT2Config
from .kv_cache import KVCache


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config, layer: int) -> None:
        super().__init__()
        self.layer = layer  # which slice of the KV cache is ours
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # x -> q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor, cache: KVCache | None, mask: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C); mask: (B, 1, T, K) bool, True where a query may see a key. -> (B, T, C)"""
        B, T, C = x.size()
        nh, hs = self.n_head, C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)  # (B, T, 3C) -> 3 x (B, T, C)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs): the heads split
        k = k.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        if cache is not None:
            k, v = cache.write(self.layer, k, v)  # (B, nh, K, hs): the cached positions and these T
        # softmax(q k^T / sqrt(hs)) v: (B, nh, T, hs) x (B, nh, hs, K) -> (B, nh, T, K), x (B, nh, K, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): the heads side by side again
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        h = F.gelu(self.c_fc(x), approximate="tanh")  # (B, T, 4C); GPT-2's "gelu_new"
        return self.c_proj(h)


class Block(nn.Module):
    def __init__(self, config: GPT2Config, layer: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: KVCache | None, mask: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C), mask as CausalSelfAttention's. -> (B, T, C)"""
        x = x + self.attn(self.ln_1(x), cache, mask)
        x = x + self.mlp(self.ln_2(x))
        return x


def visible_keys(lengths: torch.Tensor, mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Which keys each new token may attend to, as SDPA wants it.

    Row b's keys are its lengths[b] cached positions, then its T new tokens
    at [lengths[b], lengths[b] + T). The mask's window is the last W of them,
    [lengths[b] + T - W, lengths[b] + T): visible as `mask` says. The cached
    positions before the window are all visible; the slots past the new tokens
    (another row's, or stale) are not.

    Args:
        lengths: (B,) int64, the positions each row has cached.
        mask: (T, W) bool, W >= T, mask[t, u]: new token t sees window token u
            (the W - T last cached positions, then the T new tokens).

    Returns:
        (B, 1, T, K) bool with K = max(lengths) + T.
    """
    T, W = mask.shape
    lengths = lengths.to(device)
    K = int(lengths.max()) + T
    window_start = lengths + T - W  # (B,): where each row's window begins
    window_index = torch.arange(K, device=device)[None, :] - window_start[:, None]  # (B, K): key j's index in it
    in_window = (window_index >= 0) & (window_index < W)  # (B, K)
    seen = mask[:, window_index.clamp(0, W - 1)].permute(1, 0, 2) & in_window[:, None, :]  # (T, B, K) -> (B, T, K)
    return ((window_index < 0)[:, None, :] | seen)[:, None]  # (B, 1, T, K): keys before the window, and those it sees


class GPT2(nn.Module):
    """GPT-2 language model with an optional preallocated KV cache."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        if not isinstance(config, GPT2Config):
            raise ValueError(f"GPT2 takes a GPT2Config (preset('gpt2') for a shape), got {config!r}; for the "
                             "weights, load_model('gpt2')")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding, (V, C)
        self.wpe = nn.Embedding(config.n_ctx, config.n_embd)  # position embedding, (n_ctx, C)
        self.h = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        # The LM head has no weight of its own: it is wte (tied), see forward.
        # The seam: an object that computes the blocks, ln_f and the LM head of
        # a pass faster (gpt2/fast), or None.
        self.accelerator = None
        init_random_weights(self)

    @property
    def device(self) -> torch.device:
        return self.wte.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.wte.weight.dtype

    def new_cache(self, batch_size: int = 1, capacity: int | None = None) -> KVCache:
        """An empty KV cache for this model: `capacity` positions per row (default n_ctx)."""
        return KVCache(self.config, batch_size, capacity=capacity, device=self.device, dtype=self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        *,
        mask: torch.Tensor | None = None,
        last_logits_only: bool = False,
    ) -> torch.Tensor:
        """Runs the model on `input_ids`, continuing from `cache` if given.

        Args:
            input_ids: (B, T) LongTensor of token ids.
            cache: a KVCache whose row b holds lengths[b] earlier positions; the
                new tokens are written after them and the lengths grow by T.
                Without a cache the tokens are a sequence of their own.
            mask: (T, T) bool, mask[t, u] = new token t sees new token u (its
                diagonal must be True). None: causal, t sees u <= t. A token's
                position is its row's length plus mask[t].sum() - 1, so a tree
                node sits at its depth. Or (T, W) with W > T: a window over the
                W - T last cached positions and then the T new tokens (new token
                t is window token W - T + t); the cached positions before the
                window are all seen, and a token's position is the window's
                start plus mask[t].sum() - 1.
            last_logits_only: compute the LM head for the last position only
                (prefill needs nothing else); the output is then (B, 1, V).

        Returns:
            (B, T, V) logits, one row per token given: row t scores the token
            that follows input_ids[:, t].

        Raises:
            ValueError: input_ids not (B, T >= 1) int64 or int32 ids or on another
                device, a cache of another batch size, dtype or device or
                another model's, a cache while autograd records (a cached
                pass is for inference: use torch.no_grad()), a mask of
                another shape or reaching back past the cache, or positions
                that would run past the context window n_ctx (or past the
                cache's capacity). On a CPU also ids outside the vocabulary
                and a mask whose diagonal is not True (on a GPU these checks
                would wait for the device at every pass).
        """
        check_pass(self, input_ids, cache, mask)
        B, T = input_ids.size()
        if mask is None:
            seen = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()  # (T, T): causal
        else:
            seen = mask.to(input_ids.device)
        lengths = torch.zeros(B, dtype=torch.int64, device="cpu") if cache is None else cache.lengths  # (B,)
        window_cached = seen.size(1) - T  # cached positions inside the mask's window

        depth = seen.sum(dim=1) - 1  # (T,): how many earlier window tokens each one sees
        positions = lengths.to(input_ids.device)[:, None] - window_cached + depth[None, :]  # (B, T)
        x = self.wte(input_ids) + self.wpe(positions)  # (B, T, C)

        logits = None
        if self.accelerator is not None:  # the seam: the same computation, faster, or None
            logits = self.accelerator(x, cache, mask, last_logits_only)
        if logits is None:
            attn_mask = visible_keys(lengths, seen, x.device)  # (B, 1, T, K)
            for block in self.h:
                x = block(x, cache, attn_mask)  # (B, T, C)
            x = self.ln_f(x)  # (B, T, C)
            if last_logits_only:
                x = x[:, -1:, :]  # (B, 1, C)
            logits = F.linear(x, self.wte.weight)  # (B, T, C) x (C, V) -> (B, T, V): the head is wte, tied
        if cache is not None:
            cache.advance(T)
        return logits


def check_pass(model: GPT2, input_ids: torch.Tensor, cache: KVCache | None, mask: torch.Tensor | None) -> None:
    """Raises a ValueError, saying what to give instead, unless `GPT2.forward` can run on these arguments."""
    config = model.config
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a (batch, tokens) tensor of token ids, got {got}")
    if input_ids.device != model.device:
        raise ValueError(f"input_ids are on {input_ids.device}, the model on {model.device}: pass "
                         "input_ids.to(model.device)")
    B, T = input_ids.size()
    if B == 0 or T == 0:
        raise ValueError(f"input_ids of shape {(B, T)} holds no tokens: a forward pass needs at least one row of one")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must hold integer token ids (torch.long), got {input_ids.dtype}")
    if input_ids.device.type == "cpu":  # on a GPU this would wait for the device at every pass
        low, high = (int(v) for v in input_ids.aminmax())  # (B, T) -> two scalars
        if low < 0 or high >= config.vocab_size:
            raise ValueError(f"input_ids holds token id {low if low < 0 else high}, outside this model's "
                             f"vocabulary 0..{config.vocab_size - 1}")
    if cache is not None and torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters()):
        raise ValueError("a pass with a KV cache is for inference (the cache is written in place, which autograd "
                         "cannot undo): run it under torch.no_grad(), or call the model without a cache for "
                         "gradients")
    if cache is not None and not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a KVCache (model.new_cache()) or None, got {type(cache).__name__}")
    if cache is not None:
        L, rows, nh, _, hs = cache.k.shape  # (L, B, nh, S, hs)
        if (cache.k.dtype, cache.k.device) != (model.dtype, model.device):
            raise ValueError(f"the cache holds {cache.k.dtype} on {cache.k.device}, the model is {model.dtype} on "
                             f"{model.device}: use model.new_cache()")
        if rows != B:
            raise ValueError(f"the cache holds {rows} rows but input_ids has {B}: use model.new_cache({B})")
        if (L, nh, hs) != (config.n_layer, config.n_head, config.head_size):
            raise ValueError(f"the cache is another model's ({L} layers, {nh} heads of {hs}; this model has "
                             f"{config.n_layer}, {config.n_head} of {config.head_size}): use this model's "
                             "new_cache()")
    if mask is not None:
        if not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.size(0) == T and mask.size(1) >= T
                and mask.dtype == torch.bool):
            got = f"{tuple(mask.shape)} {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"mask must be a ({T}, W >= {T}) bool tensor, got {got}")
        if mask.device.type == "cpu" and not mask[:, mask.size(1) - T:].diagonal().all():  # (T, T) -> (T,)
            raise ValueError("the mask's diagonal over the new tokens must be True: each token sees itself")
        shortest = 0 if cache is None else int(cache.lengths.min())
        if mask.size(1) - T > shortest:
            raise ValueError(f"the mask's window reaches {mask.size(1) - T} cached positions back, but a row of the "
                             f"cache holds {shortest}")
    longest = 0 if cache is None else int(cache.lengths.max())
    if longest + T > config.n_ctx:
        raise ValueError(f"{longest + T} tokens do not fit GPT-2's context window of {config.n_ctx}: "
                         "use a shorter prompt or fewer new tokens")
    if cache is not None:
        cache.check_room(T)


def init_random_weights(model: GPT2, *, std: float = 0.02, generator: torch.Generator | None = None) -> GPT2:
    """Fills `model` with random weights much as GPT-2 was initialised:
    N(0, std) for embeddings and every linear weight (GPT-2 also scales its
    residual projections' std by 1/sqrt(2 n_layer); not done here), zero
    biases, unit LayerNorms.

    For tests and benchmarks that need a model of a real shape without a
    download. Returns the model.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or name.startswith("ln_"):
                p.fill_(1.0 if name.endswith("weight") else 0.0)  # LayerNorm: unit gain, zero shift
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=generator)
    return model
