"""gpt2/attention.py and its C kernel: both paths give causal attention of
the T new positions over the cache (checked against a float64 reference),
and whatever the kernel cannot take goes to SDPA.

Tolerance: max abs difference <= 1e-5 to the float64 reference on inputs of
unit scale (scores up to ~+-30): float32 sums in another order and the
kernel's float32 exp."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import kernels_or_skip
from gpt2 import c_kernel
from gpt2.attention import KERNEL_MAX_QUERIES, causal_attention, few_queries_attention, plain_attention, runs_on_kernel
from gpt2.linear import plain_linear

ATOL = 1e-5


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The rule written out in float64: query t of T is position K - T + t and
    sees keys 0 .. K - T + t. Returns (B, T, C) in float32."""
    B, nh, T, hs = q.shape
    K = k.size(2)
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(hs)  # (B, nh, T, K)
    sees = torch.arange(K)[None, :] <= torch.arange(K - T, K)[:, None]  # (T, K)
    probs = scores.masked_fill(~sees, float("-inf")).softmax(dim=-1)
    return (probs @ v.double()).transpose(1, 2).reshape(B, T, nh * hs).float()


def cached_inputs(B: int, nh: int, T: int, P: int, hs: int, seed: int = 0):
    """q as the model makes it (a strided view of the c_attn output) and k, v
    as views of [0, P + T) of a larger cache buffer, as KVCache.write returns them."""
    g = torch.Generator().manual_seed(seed)
    capacity = P + T + 5
    cache_k = torch.randn(1 + 1, B, nh, capacity, hs, generator=g)  # (L, B, nh, S, hs), two layers
    cache_v = torch.randn(1 + 1, B, nh, capacity, hs, generator=g)
    qkv = 2.0 * torch.randn(B, T, 3 * nh * hs, generator=g)  # (B, T, 3C)
    q = qkv[:, :, : nh * hs].view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs), not contiguous
    return q, cache_k[1, :, :, : P + T], cache_v[1, :, :, : P + T]


SHAPES = [  # B, nh, T, P, hs
    (1, 20, 1, 100, 64),  # a gpt2-large decode step
    (1, 20, 5, 600, 64),  # its verification of gamma = 4 at a long context
    (1, 12, 9, 1014, 64),  # the end of the context window
    (2, 3, 7, 0, 8),  # no cache: a short prefill, plain causal mask
    (1, 2, KERNEL_MAX_QUERIES, 33, 24),
    (3, 4, 3, 13, 72),  # hs not a multiple of 64; P + T not a multiple of 8
    (1, 1, 1, 0, 128),  # one key
]


@pytest.mark.parametrize("B, nh, T, P, hs", SHAPES)
def test_kernel_matches_the_float64_reference(B, nh, T, P, hs):
    kernels_or_skip()
    q, k, v = cached_inputs(B, nh, T, P, hs, seed=T * 100 + P)
    assert runs_on_kernel(q, k, v)
    got = causal_attention(q, k, v)
    assert got.shape == (B, T, nh * hs) and got.is_contiguous()
    assert (got - reference(q, k, v)).abs().max().item() <= ATOL


@pytest.mark.parametrize("B, nh, T, P, hs", SHAPES)
def test_sdpa_path_matches_the_same_reference(B, nh, T, P, hs):
    q, k, v = cached_inputs(B, nh, T, P, hs, seed=T * 100 + P)
    with plain_attention():
        assert not runs_on_kernel(q, k, v)
        got = causal_attention(q, k, v)
    assert (got - reference(q, k, v)).abs().max().item() <= ATOL


def test_reference_check_fails_a_kernel_that_ignores_the_causal_rule():
    """The check above can fail: letting every query see every key (no mask)
    is caught on a verification shape."""
    kernels_or_skip()
    q, k, v = cached_inputs(1, 4, 5, 20, 64)
    unmasked = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, 5, 256)
    assert (unmasked - reference(q, k, v)).abs().max().item() > 100 * ATOL
    # and the kernel, given the same tensors, follows the rule:
    assert (few_queries_attention(q, k, v) - reference(q, k, v)).abs().max().item() <= ATOL


def test_the_kernel_writes_the_new_keys_and_values_into_the_cache_first():
    """Given k_new and v_new (as gpt2/block_loop.py's C loop passes them,
    views of c_attn's output), the kernel stores them at the last T positions
    of the cache and then attends: the same as writing them first."""
    kernels_or_skip()
    B, nh, T, P, hs = 2, 4, 5, 30, 64
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(B, T, 3 * nh * hs, generator=g)  # (B, T, 3C)
    q, k_new, v_new = qkv.view(B, T, 3, nh, hs).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, nh, T, hs)
    cache_k, cache_v = torch.randn(B, nh, P + T + 4, hs, generator=g), torch.randn(B, nh, P + T + 4, hs, generator=g)
    before_k, before_v = cache_k.clone(), cache_v.clone()
    k, v = cache_k[:, :, : P + T], cache_v[:, :, : P + T]  # (B, nh, P + T, hs), new positions still stale
    got = torch.empty(B, T, nh * hs)  # (B, T, C)
    c_kernel.load_attention()(
        q.data_ptr(), k_new.data_ptr(), v_new.data_ptr(), k.data_ptr(), v.data_ptr(), got.data_ptr(),
        B, nh, T, P + T, hs, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), 1.0 / math.sqrt(hs),
    )
    assert torch.equal(cache_k[:, :, P : P + T], k_new) and torch.equal(cache_v[:, :, P : P + T], v_new)
    assert torch.equal(cache_k[:, :, :P], before_k[:, :, :P]) and torch.equal(cache_k[:, :, P + T :], before_k[:, :, P + T :])
    assert torch.equal(cache_v[:, :, :P], before_v[:, :, :P]) and torch.equal(cache_v[:, :, P + T :], before_v[:, :, P + T :])
    assert (got - reference(q, k, v)).abs().max().item() <= ATOL


def test_large_scores_do_not_overflow():
    """Scores of +-1000 (far outside exp's float32 range before the max is
    subtracted) give the one-hot softmax, not inf or nan."""
    kernels_or_skip()
    q, k, v = cached_inputs(1, 2, 3, 10, 8)
    q = q * 300.0
    got = causal_attention(q, k, v)
    assert torch.isfinite(got).all()
    # 1e-4: float32 scores of ~1000 carry rounding errors of ~1e-4 themselves
    assert (got - reference(q, k, v)).abs().max().item() <= 1e-4


def with_grad(q, k, v):
    return q.clone().requires_grad_(), k, v


CANNOT_TAKE = {
    "too many queries": lambda: cached_inputs(1, 4, KERNEL_MAX_QUERIES + 1, 40, 64),
    "float64": lambda: tuple(t.double() for t in cached_inputs(1, 4, 5, 40, 64)),
    "head size not a multiple of 8": lambda: cached_inputs(1, 4, 5, 40, 60),
    "recording gradients": lambda: with_grad(*cached_inputs(1, 4, 5, 40, 64)),
}


@pytest.mark.parametrize("case", list(CANNOT_TAKE))
def test_what_the_kernel_cannot_take_goes_to_sdpa_with_the_same_result(case):
    q, k, v = CANNOT_TAKE[case]()
    assert not runs_on_kernel(q, k, v)
    got = causal_attention(q, k, v)
    assert (got.detach().float() - reference(q.detach(), k, v)).abs().max().item() <= ATOL


def test_plain_linear_switches_the_attention_kernel_off_too():
    kernels_or_skip()
    q, k, v = cached_inputs(1, 4, 2, 10, 64)
    assert runs_on_kernel(q, k, v)
    with plain_linear():
        assert not runs_on_kernel(q, k, v)
    with plain_attention():
        assert not runs_on_kernel(q, k, v)
    assert runs_on_kernel(q, k, v)
