"""Causal self-attention over the KV cache, behind one function.

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


def few_queries_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`causal_attention` on the C kernel (see `runs_on_kernel` for what it takes).

    Args and Returns: as `causal_attention`.
    """
    kernel = c_kernel.load_attention()
    assert kernel is not None, "few_queries_attention needs the C kernel: check runs_on_kernel first"
    B, nh, T, hs = q.shape
    K = k.size(2)
    y = torch.empty(B, T, nh * hs, dtype=q.dtype)  # (B, T, C), every element written by the kernel
    kernel(
        q.data_ptr(), None, None,  # no new keys and values to store first: they are in k and v
        k.data_ptr(), v.data_ptr(), y.data_ptr(),
        B, nh, T, K, hs,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        1.0 / math.sqrt(hs),
    )
    return y
