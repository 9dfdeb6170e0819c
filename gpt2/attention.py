"""Causal self-attention over the KV cache, behind one function
(`causal_attention`), and a GPT-2 block's attention around it
(`self_attention`: split c_attn's output into heads, store the new keys and
values in the cache, attend).

Legend: B = batch, nh = heads, T = new tokens (queries), K = keys (the P cached
positions plus the T new ones), hs = head size, C = nh * hs.

The T queries are the last T positions of the K keys: query t sits at
position K - T + t and may see keys 0 .. K - T + t. That one rule covers
prefill (no cache: K = T, the usual causal mask), a decode step (T = 1: every
key) and a verification pass (T = gamma + 1 on top of the cache).

The readable path is `F.scaled_dot_product_attention` with that rule as a
boolean mask. On an x86-64 CPU with AVX2 in float32 during inference, for at
most KERNEL_MAX_QUERIES queries, `causal_attention` calls the C kernel
few_queries_attention.c instead:

- What it buys: attention reads every cached key and value once, so it
  should cost what reading them costs (gpt2-large at 600 positions: 221 MB,
  ~4.6 ms at 48 GB/s), and a verification pass should not read them once per
  query. PyTorch's CPU SDPA pays per query and more with a mask: on the
  whole gpt2-large forward (torch 2.13, fp32, 2 Zen 4 EPYC cores, medians of
  12 interleaved repeats, `python -m benchmarks.decode_speed
  --plain-attention`), ms:

      context, new tokens       SDPA     few_queries_attention
      100, 1 (decode step)      74.5     73.1
      100, 5 (verify gamma 4)   90.7     87.8
      600, 1                    78.3     80.7   (within the noise)
      600, 5                   110.6     95.4

  and in a second interleaved A/B of the same forward passes: 74.7 / 72.3,
  94.6 / 89.3, 82.2 / 76.9, 112.1 / 97.7. The kernel reads each key and
  value once for all T queries and writes y in the (B, T, C) layout the
  projection wants, so the transpose after SDPA (a copy for T > 1) goes too.
- Results: equal up to floating-point reassociation and the float32 error of
  its exp: max abs difference to a float64 reference 1e-6 to 3.4e-6 on
  unit-scale inputs (tests/test_attention.py allows 1e-5).

With a cache, `self_attention` lets the kernel copy the new keys and values
into the cache itself (it reads them from c_attn's output where q is), which
saves the two cache writes and the views around them: in a decode step these
small ops ran at ~120 us per layer instead of the ~17 us they take in a loop
(the caches are full of weights; see gpt2/block_loop.py).

`plain_attention()` switches this kernel off; `plain_linear()` and
GPT2_PLAIN_LINEAR=1 (gpt2/linear.py) switch it off as well, with the linear
kernel: they give the readable path everywhere.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from gpt2 import c_kernel
from gpt2 import linear as gpt2_linear
from gpt2.kv_cache import KVCache

# The kernel takes decode steps and verification passes; a prompt's prefill
# (more queries, and no cache to read) goes to SDPA.
KERNEL_MAX_QUERIES = 16

_use_kernel = True


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(hs)) v, query t seeing keys 0 .. K - T + t.

    Args:
        q: (B, nh, T, hs) queries of the T new positions.
        k, v: (B, nh, K, hs) keys and values of all K positions, the T new
            ones last (views into the KV cache are fine).

    Returns:
        (B, T, C): the heads side by side, ready for the output projection.
    """
    B, nh, T, hs = q.shape
    K = k.size(2)
    assert k.shape == v.shape == (B, nh, K, hs) and K >= T, (
        f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    )
    if runs_on_kernel(q, k, v):
        return few_queries_attention(q, k, v)
    mask = None  # one query sees every key
    if T > 1:
        key_pos = torch.arange(K, device=q.device)  # (K,)
        query_pos = torch.arange(K - T, K, device=q.device)  # (T,)
        mask = key_pos[None, :] <= query_pos[:, None]  # (T, K), True = may attend
    # (B, nh, T, hs) x (B, nh, hs, K) -> (B, nh, T, K); softmax; x (B, nh, K, hs) -> (B, nh, T, hs)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(hs))
    return y.transpose(1, 2).reshape(B, T, nh * hs)  # (B, nh, T, hs) -> (B, T, C)


@contextlib.contextmanager
def plain_attention() -> Iterator[None]:
    """Inside this block `causal_attention` is plain SDPA everywhere (the
    linear layers keep their path), to measure what the kernel buys."""
    global _use_kernel
    saved, _use_kernel = _use_kernel, False
    try:
        yield
    finally:
        _use_kernel = saved


def kernel_enabled() -> bool:
    """The attention kernel is switched on: not inside `plain_attention()`,
    `plain_linear()` or with GPT2_PLAIN_LINEAR=1. (Whether it is built is
    c_kernel's business.)"""
    return _use_kernel and gpt2_linear.kernels_enabled()


def runs_on_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The kernel is switched on and built, q, k and v are CPU float32 with
    1 to KERNEL_MAX_QUERIES queries, hs a multiple of 8 and contiguous, k and
    v laid out alike, and no gradient is to be recorded."""
    if not kernel_enabled() or q.size(2) > KERNEL_MAX_QUERIES:
        return False
    for t in (q, k, v):
        if not t.is_cpu or t.dtype != torch.float32 or t.stride(3) != 1:
            return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    hs = q.size(3)
    return (
        hs % 8 == 0
        and k.stride() == v.stride()
        and k.stride(2) == hs
        and c_kernel.load_attention() is not None
    )


def few_queries_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """`causal_attention` on the C kernel (see `runs_on_kernel` for what it takes).

    Args:
        q, k, v: as `causal_attention`.
        k_new, v_new: (B, nh, T, hs) keys and values of the T new positions,
            laid out like q, which the kernel first copies into the last T
            positions of k and v (views into the KV cache); or None where
            they are already there.

    Returns: as `causal_attention`.
    """
    kernel = c_kernel.load_attention()
    assert kernel is not None, "few_queries_attention needs the C kernel: check runs_on_kernel first"
    B, nh, T, hs = q.shape
    K = k.size(2)
    if k_new is not None:
        assert v_new is not None and k_new.shape == v_new.shape == q.shape, "k_new and v_new come with q's shape"
        assert k_new.stride() == v_new.stride() == q.stride(), "k_new and v_new are laid out like q"
    y = torch.empty(B, T, nh * hs, dtype=q.dtype)  # (B, T, C), every element written by the kernel
    kernel(
        q.data_ptr(),
        None if k_new is None else k_new.data_ptr(),
        None if v_new is None else v_new.data_ptr(),
        k.data_ptr(), v.data_ptr(), y.data_ptr(),
        B, nh, T, K, hs,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        1.0 / math.sqrt(hs),
    )
    return y


def self_attention(
    qkv: torch.Tensor, n_head: int, cache: KVCache | None, layer: int, start: int
) -> torch.Tensor:
    """The attention of a GPT-2 block: splits `c_attn`'s output into heads,
    stores the new keys and values in `cache` at [start, start + T) (if
    given), and attends causally over everything cached so far.

    On the kernel path the keys and values are copied into the cache by the
    attention kernel itself (one C call instead of three PyTorch ops); the
    readable path is the `cache.write` and `causal_attention` below.

    Args:
        qkv: (B, T, 3C), the queries, keys and values of the T new positions.
        n_head: nh.
        cache: the model's KVCache holding `start` positions, or None (then
            the T positions are the whole sequence).
        layer: the block index, i.e. which of the cache's layers.
        start: the position of the first new token, the cache's length.

    Returns:
        (B, T, C): the heads side by side, ready for the output projection.
    """
    B, T, C3 = qkv.shape
    hs = C3 // (3 * n_head)
    q, k, v = qkv.view(B, T, 3, n_head, hs).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, nh, T, hs)
    if cache is None:
        return causal_attention(q, k, v)
    k_cache, v_cache = cache.layer(layer, start + T)  # (B, nh, start + T, hs) x 2
    if runs_on_kernel(q, k_cache, v_cache):  # k and v are views of qkv like q: laid out alike
        return few_queries_attention(q, k_cache, v_cache, k_new=k, v_new=v)
    k, v = cache.write(layer, start, k, v)  # (B, nh, start + T, hs)
    return causal_attention(q, k, v)
