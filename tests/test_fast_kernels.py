"""The C kernels of gpt2/fast/csrc, called directly, against float64
references: the matrix product with its optional layer norm, GELU and
residual (linear.c, float32 and int8 weights), and attention over a KV cache
with per-row cache lengths and tree masks (attention.c); and their memory:
scratch freed (glibc's count of the heap), no access past a buffer (the
kernel tests again, on a build with AddressSanitizer). Each check is shown
to fail on a plausible mistake.

Tolerances: outputs of unit scale, float32 sums in another order and the
kernels' float32 exp and tanh: 1e-5 * sqrt(in) for products, 2e-5 with the
fused parts, 1e-5 for attention; the softmax's e^x alone, from exact scores,
3e-7 relative.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpt2.fast import build
from gpt2.fast.accelerator import pack_rows
from gpt2.fast.quantize import dequantize_rows, quantize_rows_int8
from helpers import REPO_ROOT, binary_tree_mask

FUSED_ATOL = 2e-5
ATTENTION_ATOL = 1e-5


# ---------------------------------------------------------------------------
# linear.c
# ---------------------------------------------------------------------------


def kernel_linear(kernels, x, w, b=None, *, norm=None, gelu=False, residual=None, int8_scale=None):
    """residual + gelu(norm(x) W^T + b) through few_rows_linear. x: (N, in);
    w: (out, in) float32, or int8 levels with `int8_scale` (out,)."""
    rows, in_features = x.shape
    out_features = w.shape[0]
    packed = pack_rows(w)  # (ceil(out / 4), in / 8, 4, 8)
    y = torch.empty(rows, out_features)  # (N, out)
    kernels.linear(
        x.data_ptr(), packed.data_ptr(), None if int8_scale is None else int8_scale.data_ptr(),
        None if b is None else b.data_ptr(), y.data_ptr(), rows, in_features, out_features,
        None if norm is None else norm.weight.data_ptr(), None if norm is None else norm.bias.data_ptr(),
        0.0 if norm is None else norm.eps, int(gelu), None if residual is None else residual.data_ptr(),
    )
    return y


def linear_reference(x, w, b=None, *, norm=None, gelu=False, residual=None, exact_gelu=False):
    """The same in float64, rounded to float32."""
    h = x.double()
    if norm is not None:
        h = F.layer_norm(h, norm.normalized_shape, norm.weight.double(), norm.bias.double(), norm.eps)
    y = F.linear(h, w.double(), None if b is None else b.double())
    if gelu:
        y = F.gelu(y, approximate="none" if exact_gelu else "tanh")
    if residual is not None:
        y = residual.double() + y
    return y.float()


def test_pack_rows_layout():
    w = torch.arange(5 * 16, dtype=torch.float32).view(5, 16)  # out 5 (not a multiple of 4), in 16
    packed = pack_rows(w)
    assert packed.shape == (2, 2, 4, 8)  # (ceil(5 / 4), 16 / 8, 4, 8)
    assert torch.equal(packed[0, 1, 0], w[0, 8:16])  # group 0, block 1, row o
    assert torch.equal(packed[0, 1, 3], w[3, 8:16])  # group 0, block 1, row o + 3
    assert torch.equal(packed[1, 0, 0], w[4, 0:8])
    assert torch.equal(packed[1, 0, 1:], torch.zeros(3, 8))  # the padding rows


@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 9, 15, 48, 70])
@pytest.mark.parametrize("in_features, out_features", [(8, 1), (24, 7), (32, 101), (1280, 64)])
def test_products_match_the_float64_reference(fast_kernels, rows, in_features, out_features):
    g = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if rows % 2 else None
    torch.testing.assert_close(
        kernel_linear(fast_kernels, x, w, b), linear_reference(x, w, b), rtol=1e-5, atol=1e-5 * in_features**0.5
    )


def test_that_check_fails_on_a_wrong_layout(fast_kernels):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 32, generator=g), torch.randn(6, 32, generator=g)
    y = torch.empty(5, 6)
    wrong = torch.cat([w, torch.zeros(2, 32)])  # (8, 32): the packed size, rows not interleaved in blocks of 8
    fast_kernels.linear(x.data_ptr(), wrong.data_ptr(), None, None, y.data_ptr(), 5, 32, 6, None, None, 0.0, 0, None)
    assert not torch.allclose(y, linear_reference(x, w), rtol=1e-5, atol=1e-4)


def fused_case(rows, in_features, out_features, seed):
    g = torch.Generator().manual_seed(seed)
    x = 3.0 * torch.randn(rows, in_features, generator=g) + 1.0  # off-centre: the norm has work to do
    w = torch.randn(out_features, in_features, generator=g) / in_features**0.5  # outputs of unit scale
    b = torch.randn(out_features, generator=g)
    norm = torch.nn.LayerNorm(in_features, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.5 * torch.randn(in_features, generator=g))
        norm.bias.copy_(0.5 * torch.randn(in_features, generator=g))
    residual = torch.randn(rows, out_features, generator=g)
    return x, w, b, norm, residual


@pytest.mark.parametrize("rows", [1, 5, 9])
@pytest.mark.parametrize("in_features, out_features", [(1280, 5120), (64, 13), (24, 7)])
@pytest.mark.parametrize("parts", ["norm", "norm+gelu", "residual", "norm+gelu+residual"])
def test_norm_gelu_and_residual_match_the_float64_reference(fast_kernels, rows, in_features, out_features, parts):
    x, w, b, norm, residual = fused_case(rows, in_features, out_features, seed=rows + in_features + out_features)
    options = {
        "norm": norm if "norm" in parts else None,
        "gelu": "gelu" in parts,
        "residual": residual if "residual" in parts else None,
    }
    with torch.no_grad():
        y = kernel_linear(fast_kernels, x, w, b, **options)
        assert (y - linear_reference(x, w, b, **options)).abs().max().item() <= FUSED_ATOL


def test_the_fused_check_fails_the_exact_gelu_and_a_missing_norm(fast_kernels):
    """GELU with erf instead of tanh (F.gelu's default) is off by up to ~5e-4,
    and skipping the norm by far more."""
    x, w, b, norm, _ = fused_case(5, 1280, 5120, seed=7)
    with torch.no_grad():
        y = kernel_linear(fast_kernels, x, w, b, norm=norm, gelu=True)
        assert (y - linear_reference(x, w, b, norm=norm, gelu=True)).abs().max().item() <= FUSED_ATOL
        exact = linear_reference(x, w, b, norm=norm, gelu=True, exact_gelu=True)
        assert (y - exact).abs().max().item() > 10 * FUSED_ATOL
        assert (y - linear_reference(x, w, b, gelu=True)).abs().max().item() > 10 * FUSED_ATOL


def test_gelu_of_large_inputs_stays_finite_and_exact(fast_kernels):
    """tanh through e^(-2|u|) never overflows: outputs of +-200 give x and 0."""
    x = torch.eye(16)
    w = torch.diag(torch.tensor([200.0, -200.0, 50.0, -50.0, 1e-4, -1e-4, 0.0, 3.0] * 2))
    y = kernel_linear(fast_kernels, x, w, gelu=True).diagonal()
    assert torch.isfinite(y).all()
    assert (y - F.gelu(w.diagonal().double(), approximate="tanh").float()).abs().max().item() <= 1e-6


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 48])
@pytest.mark.parametrize("in_features, out_features", [(8, 1), (24, 7), (64, 101), (1280, 5120)])
def test_int8_weights_match_the_float64_product(fast_kernels, rows, in_features, out_features):
    g = torch.Generator().manual_seed(rows + in_features)
    x = torch.randn(rows, in_features, generator=g)
    q, scale = quantize_rows_int8(torch.randn(out_features, in_features, generator=g) / in_features**0.5)
    b = torch.randn(out_features, generator=g)
    y = kernel_linear(fast_kernels, x, q, b, int8_scale=scale)
    expected = linear_reference(x, dequantize_rows(q, scale), b)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * in_features**0.5)
    # The check can fail: scales given to the wrong rows.
    wrong = kernel_linear(fast_kernels, x, q, b, int8_scale=scale.roll(1))
    assert out_features == 1 or not torch.allclose(wrong, expected, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("rows, in_features, out_features", [(70, 1280, 100), (50, 5120, 36)])
def test_a_row_gets_the_same_bits_whatever_the_rows_beside_it(fast_kernels, int8, rows, in_features, out_features):
    """Batch invariance of the product: row r of an N-row call is
    bit-identical to the same row computed alone, for every N: past the
    AVX-512 build's 12-row tiles, its two-group tiles from 32 rows (25
    groups: pairs, and a group alone in the last chunk), the AVX2 build's
    3-row tiles from 24 rows, and (in = 5120, from 40 rows) blocks of rows."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g) / 40
    b = torch.randn(out_features, generator=g)
    scale = None
    if int8:
        w, scale = quantize_rows_int8(w)
    alone = torch.cat([kernel_linear(fast_kernels, x[r : r + 1], w, b, int8_scale=scale) for r in range(rows)])
    for n in range(2, rows + 1):
        assert torch.equal(kernel_linear(fast_kernels, x[:n], w, b, int8_scale=scale), alone[:n]), n


def test_the_avx2_and_avx512_builds_give_the_same_bits(fast_kernels, tmp_path, monkeypatch):
    """The AVX-512 build (512-bit registers from 6 rows, and for int8 weights
    at every N) sums every output in the AVX2 build's order: a cache shared
    by two machines, or a model moved between them, gives the same logits."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("runs both builds: needs a CPU with AVX-512")
    monkeypatch.setenv("GPT2_KERNEL_CACHE", str(tmp_path))
    cc = build.compiler()
    kernels = {}
    for capability in ("AVX2", "AVX512"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        library = build.library_path(cc)
        build.compile_library(cc, library)
        kernels[capability] = build.bind(ctypes.CDLL(str(library)), library)
    g = torch.Generator().manual_seed(10)
    for rows, in_features in ((70, 640), (48, 5120)):  # the second in blocks of rows from 40
        x, w = torch.randn(rows, in_features, generator=g), torch.randn(200, in_features, generator=g) / 25
        b = torch.randn(200, generator=g)
        q, scale = quantize_rows_int8(w)  # int8: 512-bit tiles at every N
        for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 24, 25, 30, 32, 33, 40, 48, 70):
            if n <= rows:
                avx2, avx512 = (kernel_linear(kernels[c], x[:n], w, b) for c in ("AVX2", "AVX512"))
                assert torch.equal(avx2, avx512), (n, in_features)
                avx2, avx512 = (kernel_linear(kernels[c], x[:n], q, b, int8_scale=scale) for c in ("AVX2", "AVX512"))
                assert torch.equal(avx2, avx512), ("int8", n, in_features)


# ---------------------------------------------------------------------------
# attention.c
# ---------------------------------------------------------------------------


def attention_reference(q, k, v, starts, mask):
    """Row b, query t sees keys [0, starts[b] + T - W) and the window keys u
    (at starts[b] + T - W + u) with mask[t, u], in float64. q: (B, nh, T, hs);
    k, v: (B, nh, S, hs) caches already holding the new keys; mask (T, W).
    Returns (B, T, C)."""
    B, nh, T, hs = q.shape
    W = mask.size(1)
    out = []
    for b in range(B):
        P = int(starts[b])
        seen = torch.cat([torch.ones(T, P + T - W, dtype=torch.bool), mask], dim=1)  # (T, P + T)
        K = k[b, :, : P + T].double()  # (nh, P + T, hs)
        scores = q[b].double() @ K.transpose(-1, -2) / math.sqrt(hs)  # (nh, T, P + T)
        probs = scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)
        out.append((probs @ v[b, :, : P + T].double()).transpose(0, 1).reshape(T, nh * hs))  # (T, C)
    return torch.stack(out).float()


def window_mask(T: int, cached: int) -> torch.Tensor:
    """(T, cached + T): the last level of a binary tree fed one level per
    pass: `cached` nodes already in the cache, then T new ones; node i's
    parent is (i - 1) // 2 (so T = cached + 1 for a full level)."""
    tree = binary_tree_mask(cached + T)
    return tree[cached:]


def kernel_attention(kernels, q, k_new, v_new, cache_k, cache_v, starts, mask, scale=None):
    """few_queries_attention: copies the new keys into the caches at `starts`, then attends; the scores are scaled
    by `scale` (default 1 / sqrt(hs))."""
    B, nh, T, hs = q.shape
    y = torch.empty(B, T, nh * hs)
    starts = starts.to(torch.int64).contiguous()
    mask_bytes = None if mask is None else mask.to(torch.uint8).contiguous()
    kernels.attention(
        q.data_ptr(), k_new.data_ptr(), v_new.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(), y.data_ptr(),
        B, nh, T, starts.data_ptr(), None if mask_bytes is None else mask_bytes.data_ptr(),
        T if mask is None else mask.size(1), hs, q.stride(0), q.stride(1), q.stride(2), cache_k.stride(0),
        cache_k.stride(1), 1.0 / math.sqrt(hs) if scale is None else scale,
    )
    return y


ATTENTION_CASES = {  # B, nh, T, starts, hs, mask
    "gpt2-large decode step": (1, 20, 1, [100], 64, None),
    "verification at a long context": (1, 20, 5, [600], 64, None),
    "end of the context window": (1, 12, 9, [1015], 64, None),
    "prefill, no cache": (2, 3, 7, [0, 0], 8, None),
    "rows of different lengths": (3, 4, 3, [13, 0, 40], 72, None),
    "a token tree": (1, 4, 15, [21], 16, "tree"),
    "a tree over a batch": (2, 2, 32, [5, 70], 64, "tree"),
    "a tree level on cached levels": (2, 4, 8, [30, 19], 16, "window"),
    "64 new tokens": (1, 2, 64, [9], 24, None),
}


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_matches_the_float64_reference(fast_kernels, case):
    B, nh, T, starts, hs, mask_kind = ATTENTION_CASES[case]
    g = torch.Generator().manual_seed(T * 100 + starts[0])
    starts = torch.tensor(starts)
    S = int(starts.max()) + T + 3
    cache_k, cache_v = torch.randn(B, nh, S, hs, generator=g), torch.randn(B, nh, S, hs, generator=g)
    qkv = 2.0 * torch.randn(B, T, 3, nh, hs, generator=g)
    q, k_new, v_new = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, nh, T, hs), strided views
    mask = {"tree": binary_tree_mask(T), "window": window_mask(T, cached=7), None: None}[mask_kind]
    before_k = cache_k.clone()
    y = kernel_attention(fast_kernels, q, k_new, v_new, cache_k, cache_v, starts, mask)
    for b in range(B):  # the new keys went in at their row's start, and nothing else moved
        P = int(starts[b])
        assert torch.equal(cache_k[b, :, P : P + T], k_new[b]) and torch.equal(cache_v[b, :, P : P + T], v_new[b])
        assert torch.equal(cache_k[b, :, :P], before_k[b, :, :P])
        assert torch.equal(cache_k[b, :, P + T :], before_k[b, :, P + T :])
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    expected = attention_reference(q, cache_k, cache_v, starts, causal if mask is None else mask)
    assert (y - expected).abs().max().item() <= ATTENTION_ATOL


def test_the_attention_check_fails_a_kernel_that_ignores_the_mask(fast_kernels):
    B, nh, T, hs = 1, 2, 7, 16
    g = torch.Generator().manual_seed(1)
    cache_k, cache_v = torch.randn(B, nh, 20 + T, hs, generator=g), torch.randn(B, nh, 20 + T, hs, generator=g)
    q, k_new, v_new = torch.randn(3, B, nh, T, hs, generator=g).unbind(0)
    starts = torch.tensor([20])
    y = kernel_attention(fast_kernels, q, k_new, v_new, cache_k, cache_v, starts, binary_tree_mask(T))
    assert (y - attention_reference(q, cache_k, cache_v, starts, binary_tree_mask(T))).abs().max() <= ATTENTION_ATOL
    causal = attention_reference(q, cache_k, cache_v, starts, torch.ones(T, T, dtype=torch.bool).tril())
    assert (y - causal).abs().max() > 100 * ATTENTION_ATOL


def test_large_scores_do_not_overflow(fast_kernels):
    """Scores of +-1000 give the one-hot softmax, not inf or nan."""
    B, nh, T, hs = 1, 2, 3, 8
    g = torch.Generator().manual_seed(2)
    cache_k, cache_v = torch.randn(B, nh, 16, hs, generator=g), torch.randn(B, nh, 16, hs, generator=g)
    q, k_new, v_new = torch.randn(3, B, nh, T, hs, generator=g).unbind(0)
    q = 300.0 * q
    starts = torch.tensor([10])
    y = kernel_attention(fast_kernels, q, k_new, v_new, cache_k, cache_v, starts, None)
    assert torch.isfinite(y).all()
    expected = attention_reference(q, cache_k, cache_v, starts, torch.ones(T, T, dtype=torch.bool).tril())
    assert (y - expected).abs().max().item() <= 1e-4  # float32 scores of ~1000 carry errors of ~1e-4 themselves


def test_the_softmax_exp_is_as_accurate_as_float32(fast_kernels):
    """The kernels' e^x (exp8, vector_math.h) within 3e-7 relative over the range a softmax meets, x in [-80, 0]. One
    query e_0 over 512 keys s_i e_0 (scale 1: exact scores) with one-hot values e_i, so y_i / y_last = e^(s_i - 0),
    the new key's score 0 the maximum, up to the exp and one float32 rounding (6e-8; y_last is 1 / sum exactly).
    Its polynomial with one coefficient doubled (that of r^6) is 3.4e-6 off: inside the attention tolerance, outside
    this one."""
    nh, n = 8, 512  # n keys per head, the last one new; head size n, for the one-hot values
    s = -torch.linspace(0, 80, nh * n).view(1, nh, n)  # (B, nh, S): each key's score
    s[..., -1] = 0.0
    cache_k, cache_v = torch.zeros(1, nh, n, n), torch.eye(n).expand(1, nh, n, n).contiguous()  # (B, nh, S, hs)
    cache_k[..., 0] = s
    q = torch.zeros(1, nh, 1, n)  # (B, nh, T, hs)
    q[..., 0] = 1.0
    k_new, v_new = cache_k[:, :, -1:].clone(), cache_v[:, :, -1:].clone()  # (B, nh, T, hs): the last key, new
    y = kernel_attention(fast_kernels, q, k_new, v_new, cache_k, cache_v, torch.tensor([n - 1]), None, scale=1.0)
    y = y.view(nh, n).double()  # (B, T, nh * hs) -> (nh, n): y[h, i] = p_i
    relative = (y / y[:, -1:] / s[0].double().exp() - 1).abs()
    assert relative.max().item() <= 3e-7


def test_the_kernels_are_not_skipped_where_this_machine_can_run_them():
    # The fast_kernels fixture skips on gpt2/fast/build.py's own word. Where Linux lists AVX2 and FMA for an x86-64
    # CPU and a C compiler is on PATH, that word must be yes, or every fast-path test would skip unseen.
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(next((line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                      if line.startswith("flags")), [])) if cpuinfo.is_file() else set()
    if platform.machine().lower() not in ("x86_64", "amd64") or not {"avx2", "fma"} <= flags:
        pytest.skip("not an x86-64 CPU with AVX2 and FMA under Linux: the kernels cannot run here")
    if shutil.which(os.environ.get("CC", "").split()[0] if os.environ.get("CC", "").strip() else "cc") is None:
        pytest.skip("no C compiler on PATH")
    assert build.cpu_unsupported() is None and build.compiler() is not None


# ---------------------------------------------------------------------------
# Memory: the kernels free their scratch and stay inside their buffers
# ---------------------------------------------------------------------------


class Mallinfo2(ctypes.Structure):
    """glibc's `struct mallinfo2`: the heap's counters, in bytes."""

    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_bytes_in_use() -> int:
    """Bytes the C heap has handed out and not had back, over every thread's arena: glibc's mallinfo2, its chunks
    (uordblks) plus the large blocks it maps alone (hblkhd)."""
    mallinfo2 = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if mallinfo2 is None:
        pytest.skip("counting the C heap needs glibc's mallinfo2 (glibc 2.33 or later)")
    mallinfo2.restype = Mallinfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def test_the_kernels_free_their_scratch(fast_kernels):
    """100 more calls leave the C heap where one call left it. The scratch: the layer norm's rows (linear.c, float32
    and int8 weights, each freed on its own path) and, per thread, the scores and the seen window keys (attention.c;
    rows whose caches grow, so a thread's scores buffer is replaced mid-call). Each leaks 50 KB or more over the 100
    calls, a freed one 0 to a few hundred bytes (Python's own)."""
    x, w, b, norm, residual = fused_case(8, 768, 300, seed=3)  # x (N, in), w (out, in), residual (N, out)
    q8, scale = quantize_rows_int8(w)  # (out, in) int8 levels, (out,) scales
    B, nh, T, hs = 3, 4, 64, 64
    g = torch.Generator().manual_seed(4)
    S = 1024  # cached positions each row has room for
    cache_k, cache_v = torch.randn(B, nh, S, hs, generator=g), torch.randn(B, nh, S, hs, generator=g)  # (B, nh, S, hs)
    q, k_new, v_new = torch.randn(3, B, nh, T, hs, generator=g).unbind(0)  # 3 x (B, nh, T, hs)
    starts = torch.tensor([10, 500, 900])  # rising: each thread's later rows need more room for their scores
    calls = {
        "linear": lambda: kernel_linear(fast_kernels, x, w, b, norm=norm, gelu=True, residual=residual),
        "linear, int8": lambda: kernel_linear(fast_kernels, x, q8, b, norm=norm, int8_scale=scale),
        "attention": lambda: kernel_attention(fast_kernels, q, k_new, v_new, cache_k, cache_v, starts, None),
    }
    with torch.no_grad():
        for name, call in calls.items():
            call()
            before = heap_bytes_in_use()
            for _ in range(100):
                call()
            assert heap_bytes_in_use() - before <= 4096, name


def test_the_kernels_stay_inside_their_buffers_under_address_sanitizer(fast_kernels, tmp_path):
    """The kernel tests of this file and three of test_fast_path.py (the fused block loop against the readable path)
    in a child process whose kernels are built with AddressSanitizer (`CC` with -fsanitize=address, its runtime
    preloaded into Python): a read or a write past a buffer that changes no result (a padded lane read past a row, a
    stray store past the scratch) stops it with a report, which the failure shows. libstdc++ is preloaded too: the
    runtime must find its exception entry point, which PyTorch throws through."""
    cc = build.compiler()  # the fixture has built the kernels with it
    runtimes = [subprocess.run([*cc, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
                for name in ("libasan.so", "libstdc++.so.6")]
    if not os.path.isabs(runtimes[0]):
        pytest.skip(f"`{shlex.join(cc)}` has no AddressSanitizer runtime (libasan.so)")
    env = dict(os.environ, CC=shlex.join([*cc, "-fsanitize=address", "-fno-omit-frame-pointer"]),
               GPT2_KERNEL_CACHE=str(tmp_path / "kernels"), LD_PRELOAD=" ".join(filter(os.path.isabs, runtimes)),
               ASAN_OPTIONS=f"detect_leaks=0:log_path={tmp_path / 'asan'}")  # Python itself leaks at exit
    started = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True)
    if started.returncode != 0:  # the runtime itself (some Linux address-space layouts defeat it), before any kernel
        pytest.skip(f"AddressSanitizer cannot start Python with PyTorch here: {started.stderr.strip()[-300:]}")
    tests = [f"tests/{Path(__file__).name}", *(f"tests/test_fast_path.py::{name}" for name in (
        "test_the_fast_path_gives_the_readable_logits_and_cache",
        "test_a_position_has_the_same_bits_in_a_step_a_verification_and_a_batch",
        "test_a_tree_larger_than_one_kernel_call_keeps_the_bits_of_its_paths"))]
    child = subprocess.run(  # less the two builds compared (slow here) and the two memory tests
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, "-k",
         "not avx2_and_avx512 and not free_their_scratch and not address_sanitizer"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    reports = "".join(path.read_text() for path in tmp_path.glob("asan*"))
    summary = (child.stdout.strip().splitlines() or ["no output"])[-1]
    assert child.returncode == 0 and not reports, f"{summary}\n{reports[:3000]}{child.stderr[-1000:]}"
    assert " passed" in summary and "skipped" not in summary and "deselected" in summary, summary
    libraries = list((tmp_path / "kernels").glob("gpt2-kernels-*.so"))
    assert libraries and all(b"__asan_report" in library.read_bytes() for library in libraries)
