"""GPT-2 (Radford et al. 2019), written out by hand.

Legend: B = batch, T = tokens in this forward pass, P = positions already in the
KV cache, C = n_embd, nh = n_head, hs = head size (C // nh), V = vocab size.

The architecture is GPT-2's: token + learned position embeddings, n_layer
pre-LayerNorm blocks (causal self-attention, then an MLP with the
tanh-approximated GELU), a final LayerNorm, and an LM head tied to the token
embedding. Parameter names are the checkpoint's (`wte`, `wpe`, `h.N.ln_1`,
`h.N.attn.c_attn`, ...), so loading is a name-for-name copy (see loading.py).

Weight layout: every linear layer stores its weight as (out_features,
in_features), like `nn.Linear`. The checkpoint's Conv1D weights are stored
(in, out); loading.py transposes them once. All products go through
`linear.linear` and all attention through `attention.causal_attention`: the
two places where a faster CPU path is chosen. On a CPU, a decode step or a
verification pass may run all blocks in one C call instead of the loop over
the Block modules (`block_loop.block_loop`, the one speed trick of
`GPT2.forward`); that loop is the definition.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import causal_attention
from .block_loop import block_loop
from .config import GPT2Config
from .kv_cache import KVCache
from .linear import Linear, linear, prepare


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head = config.n_head
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd)  # x -> q, k, v
        self.c_proj = Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor, cache: KVCache | None, start: int) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        B, T, C = x.size()
        nh, hs = self.n_head, C // self.n_head
        qkv = self.c_attn(x).view(B, T, 3, nh, hs)  # (B, T, 3C) -> (B, T, 3, nh, hs)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, nh, T, hs)
        if cache is not None:
            # Attend over everything cached so far plus the T new positions.
            k, v = cache.write(self.layer, start, k, v)  # (B, nh, P + T, hs)
        # softmax(q k^T / sqrt(hs)) v, each new token seeing the keys up to its own position
        y = causal_attention(q, k, v)  # (B, nh, T, hs), (B, nh, P + T, hs) x 2 -> (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd)

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

    def forward(self, x: torch.Tensor, cache: KVCache | None, start: int) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        x = x + self.attn(self.ln_1(x), cache, start)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT2(nn.Module):
    """GPT-2 language model with an optional preallocated KV cache."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding, (V, C)
        self.wpe = nn.Embedding(config.n_ctx, config.n_embd)  # position embedding, (n_ctx, C)
        self.h = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        # The LM head has no weight of its own: it is wte (tied), see forward.
        init_random_weights(self)

    @property
    def device(self) -> torch.device:
        return self.wte.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.wte.weight.dtype

    def prepare_linear_layers(self) -> str:
        """Chooses the path of every matrix product now, when the model is
        loaded (gpt2/linear.py `prepare`): on a CPU in float32, packs the
        kernel's copy of each linear weight and of the tied LM head (a model
        moved or converted later is packed on first use instead). Returns
        the one-line description of the chosen path."""
        return prepare(self.matrix_weights())

    def matrix_weights(self) -> list[torch.Tensor]:
        """Every weight matrix a forward pass multiplies by: the four
        projections of each block and wte, the tied LM head. (out, in) each."""
        return [*(m.weight for m in self.modules() if isinstance(m, Linear)), self.wte.weight]

    def new_cache(self, batch_size: int = 1) -> KVCache:
        """An empty KV cache sized for this model (n_ctx positions)."""
        return KVCache(self.config, batch_size, device=self.device, dtype=self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        *,
        last_logits_only: bool = False,
    ) -> torch.Tensor:
        """Runs the model on `input_ids`, continuing from `cache` if given.

        Args:
            input_ids: (B, T) LongTensor of token ids.
            cache: a KVCache holding P earlier positions; the new tokens take
                positions [P, P + T) and the cache grows by T. Without a cache
                the tokens take positions [0, T).
            last_logits_only: compute the LM head for the last position only
                (prefill needs nothing else); the output is then (B, 1, V).

        Returns:
            (B, T, V) logits, one row per position given: row t scores the token
            that follows input_ids[:, t].

        Raises:
            ValueError: the positions would run past the context window n_ctx.
        """
        B, T = input_ids.size()
        P = 0 if cache is None else cache.length
        if P + T > self.config.n_ctx:
            raise ValueError(
                f"{P + T} tokens do not fit GPT-2's context window of {self.config.n_ctx}: "
                "use a shorter prompt or fewer new tokens"
            )
        if cache is not None:
            assert cache.batch_size == B, f"cache batch {cache.batch_size} != input batch {B}"

        pos = torch.arange(P, P + T, device=input_ids.device)  # (T,)
        x = self.wte(input_ids) + self.wpe(pos)  # (B, T, C) + (T, C) -> (B, T, C)

        # A decode step or verification pass on a CPU runs the blocks in one C
        # call (gpt2/block_loop.py); the loop over the Block modules is the
        # definition, and the path everything else takes.
        looped = block_loop(self, x, cache, P)  # (B, T, C), or None: it cannot take this pass
        if looped is not None:
            x = looped
        else:
            for block in self.h:
                x = block(x, cache, P)  # (B, T, C)
        if cache is not None:
            cache.length = P + T

        x = self.ln_f(x)  # (B, T, C)
        if last_logits_only:
            x = x[:, -1:, :]  # (B, 1, C)
        return linear(x, self.wte.weight)  # (B, T, C) x (C, V) -> (B, T, V)


def init_random_weights(model: GPT2, *, std: float = 0.02, generator: torch.Generator | None = None) -> GPT2:
    """Fills `model` with random weights as GPT-2 was initialised: N(0, std)
    for embeddings and linear weights, zero biases, unit LayerNorms.

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
