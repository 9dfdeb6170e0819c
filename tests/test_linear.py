"""gpt2/linear.py and its C kernel: the fast path gives F.linear's results
(up to floating-point reassociation), everything it cannot take goes to
F.linear itself, and the kernel's optional layer norm, GELU and residual
(used by gpt2/block_loop.py) match a float64 reference."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import kernels_or_skip
from gpt2 import c_kernel
from gpt2 import linear as gpt2_linear
from gpt2.linear import KERNEL_MAX_ROWS, Linear, linear, pack_pairs, plain_linear, runs_on_kernel

REPO = Path(__file__).resolve().parent.parent


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b in float64, rounded to float32."""
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


def test_pack_pairs_layout():
    w = torch.arange(3 * 16, dtype=torch.float32).view(3, 16)  # out 3 (odd), in 16
    packed = pack_pairs(w)
    assert packed.shape == (2, 2, 2, 8)  # (ceil(3 / 2), 16 / 8, 2, 8)
    assert torch.equal(packed[0, 1, 0], w[0, 8:16])  # pair 0, block 1, row o
    assert torch.equal(packed[0, 1, 1], w[1, 8:16])  # pair 0, block 1, row o + 1
    assert torch.equal(packed[1, 0, 0], w[2, 0:8])
    assert torch.equal(packed[1, 0, 1], torch.zeros(8))  # the padding row


@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 9, 14, 15, KERNEL_MAX_ROWS])
@pytest.mark.parametrize("in_features, out_features", [(8, 1), (24, 7), (32, 101), (1280, 64)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_kernel_matches_float64_reference(rows, in_features, out_features, with_bias):
    kernels_or_skip()
    g = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if with_bias else None
    with torch.inference_mode():
        assert runs_on_kernel(x, w, b)
        y = linear(x, w, b)
    # float32 sums of `in` products of magnitude ~1: error ~ sqrt(in) * 6e-8 * |terms|
    torch.testing.assert_close(y, reference(x, w, b), rtol=1e-5, atol=1e-5 * in_features**0.5)


def test_kernel_fails_this_check_on_a_wrong_layout():
    """The reference comparison above catches a kernel fed a wrongly packed W."""
    kernel = kernels_or_skip()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 32, generator=g), torch.randn(6, 32, generator=g)
    wrong = w.reshape(3, 2, 4, 8).contiguous()  # pairs not interleaved by 8-float blocks
    y = torch.empty(5, 6)
    kernel(x.data_ptr(), wrong.data_ptr(), None, None, y.data_ptr(), 5, 32, 6, None, None, 0.0, 0, None)  # float32, no extras
    assert not torch.allclose(y, reference(x, w, None), rtol=1e-5, atol=1e-4)


def fused_kernel(x, w, b, norm, gelu, residual):
    """residual + gelu(norm(x) W^T + b) through the C function few_rows_linear
    with its optional parts, as gpt2/block_loop.py's C loop calls it.
    x: (N, in); w: (out, in); norm: a LayerNorm over in, or None."""
    kernel = kernels_or_skip()
    rows, in_features = x.shape
    out_features = w.shape[0]
    packed = pack_pairs(w)  # (ceil(out / 2), in / 8, 2, 8)
    y = torch.empty(rows, out_features)  # (N, out)
    kernel(
        x.data_ptr(), packed.data_ptr(), None, None if b is None else b.data_ptr(), y.data_ptr(),
        rows, in_features, out_features,
        None if norm is None else norm.weight.data_ptr(), None if norm is None else norm.bias.data_ptr(),
        0.0 if norm is None else norm.eps,
        1 if gelu else 0, None if residual is None else residual.data_ptr(),
    )
    return y


def fused_reference(x, w, b, norm, gelu, residual, exact_gelu=False):
    """residual + gelu(norm(x) W^T + b) in float64, rounded to float32."""
    h = x.double()
    if norm is not None:
        h = F.layer_norm(h, norm.normalized_shape, norm.weight.double(), norm.bias.double(), norm.eps)
    y = F.linear(h, w.double(), None if b is None else b.double())
    if gelu:
        y = F.gelu(y, approximate="none" if exact_gelu else "tanh")
    if residual is not None:
        y = residual.double() + y
    return y.float()


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


# Tolerance 2e-5 on outputs of unit scale: float32 sums in another order, the
# kernel's float32 layer norm statistics, and its tanh (absolute error ~1e-7).
FUSED_ATOL = 2e-5


@pytest.mark.parametrize("rows", [1, 5, 9])
@pytest.mark.parametrize("in_features, out_features", [(1280, 5120), (64, 13), (24, 7)])
@pytest.mark.parametrize("parts", ["norm", "norm+gelu", "residual", "norm+gelu+residual"])
def test_norm_gelu_and_residual_in_the_kernel_match_the_float64_reference(rows, in_features, out_features, parts):
    x, w, b, norm, residual = fused_case(rows, in_features, out_features, seed=rows + in_features + out_features)
    norm = norm if "norm" in parts else None
    gelu = "gelu" in parts
    residual = residual if "residual" in parts else None
    with torch.no_grad():
        y = fused_kernel(x, w, b, norm, gelu, residual)
    expected = fused_reference(x, w, b, norm, gelu, residual)
    assert (y - expected).abs().max().item() <= FUSED_ATOL


def test_the_fused_check_fails_the_exact_gelu_and_a_missing_norm():
    """The comparison above can fail: GELU with erf instead of tanh (what
    F.gelu does by default) is off by up to ~5e-4, and skipping the norm by far more."""
    x, w, b, norm, residual = fused_case(5, 1280, 5120, seed=7)
    with torch.no_grad():
        y = fused_kernel(x, w, b, norm, True, None)
    assert (y - fused_reference(x, w, b, norm, True, None)).abs().max().item() <= FUSED_ATOL
    assert (y - fused_reference(x, w, b, norm, True, None, exact_gelu=True)).abs().max().item() > 10 * FUSED_ATOL
    assert (y - fused_reference(x, w, b, None, True, None)).abs().max().item() > 10 * FUSED_ATOL


def test_gelu_of_large_inputs_stays_finite_and_exact():
    """tanh through e^(-2|u|) never overflows: outputs of +-200 give x and 0."""
    x = torch.eye(16)
    w = torch.diag(torch.tensor([200.0, -200.0, 50.0, -50.0, 1e-4, -1e-4, 0.0, 3.0] * 2))
    y = fused_kernel(x, w, None, None, True, None).diagonal()
    expected = F.gelu(w.diagonal().double(), approximate="tanh").float()
    assert torch.isfinite(y).all()
    assert (y - expected).abs().max().item() <= 1e-6


def test_batched_and_strided_input_keep_their_shape():
    kernels_or_skip()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 48, 3, generator=g).transpose(1, 2)  # (B=2, T=3, C=48), not contiguous
    w, b = torch.randn(40, 48, generator=g), torch.randn(40, generator=g)
    with torch.inference_mode():
        assert runs_on_kernel(x, w, b)
        y = linear(x, w, b)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y, reference(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "case",
    ["too many rows", "float64", "in not a multiple of 8", "gradient", "no rows"],
)
def test_what_the_kernel_cannot_take_is_exactly_f_linear(case):
    g = torch.Generator().manual_seed(2)
    rows, in_features, dtype = 3, 32, torch.float32
    if case == "too many rows":
        rows = KERNEL_MAX_ROWS + 1
    if case == "float64":
        dtype = torch.float64
    if case == "in not a multiple of 8":
        in_features = 30
    if case == "no rows":
        rows = 0
    x = torch.randn(rows, in_features, generator=g, dtype=dtype)
    w = torch.randn(16, in_features, generator=g, dtype=dtype, requires_grad=(case == "gradient"))
    b = torch.randn(16, generator=g, dtype=dtype)
    assert not runs_on_kernel(x, w, b)
    y = linear(x, w, b)
    assert torch.equal(y, F.linear(x, w, b))
    if case == "gradient":
        y.sum().backward()
        torch.testing.assert_close(w.grad, x.sum(0).expand(16, in_features))


def test_plain_linear_switches_the_kernel_off():
    kernels_or_skip()
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    assert runs_on_kernel(x, w, None)
    with plain_linear():
        assert not runs_on_kernel(x, w, None)
        assert "F.linear" in gpt2_linear.describe()
    assert runs_on_kernel(x, w, None)


def test_a_changed_weight_is_packed_again():
    kernels_or_skip()
    layer = Linear(16, 8)
    torch.nn.init.normal_(layer.weight, generator=torch.Generator().manual_seed(3))
    torch.nn.init.zeros_(layer.bias)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2)  # in place: the version counter moves
        torch.testing.assert_close(layer(x), 2 * before)
        layer.weight.data = -layer.weight.data  # new storage
        torch.testing.assert_close(layer(x), -2 * before)


def test_prepare_packs_at_load_time_exactly_the_weights_the_kernel_takes():
    kernels_or_skip()
    from gpt2 import GPT2, GPT2Config

    model = GPT2(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_ctx=8)).eval()
    matrices = [m.weight for m in model.modules() if isinstance(m, Linear)] + [model.wte.weight]
    assert not any(id(w) in gpt2_linear._packed_weights for w in matrices)  # a new model: nothing packed
    assert "few_rows_linear.c" in model.prepare_linear_layers()
    for w in matrices:
        assert torch.equal(gpt2_linear._packed_weights[id(w)][2].data, pack_pairs(w))
    odd = torch.randn(4, 12)  # in = 12 is no multiple of 8: the kernel cannot take it
    gpt2_linear.prepare([odd])
    assert id(odd) not in gpt2_linear._packed_weights
    with plain_linear():  # the kernel switched off: nothing is packed
        fresh = torch.randn(4, 16)
        assert "F.linear" in gpt2_linear.prepare([fresh])
        assert id(fresh) not in gpt2_linear._packed_weights


def run_python(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "GPT2_KERNEL_CACHE": str(tmp_path / "cache"), **env}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=environment, capture_output=True, text=True, timeout=300
    )


FALLBACK_CHECK = """
import torch, torch.nn.functional as F
from gpt2 import linear as L
x, w = torch.randn(3, 16), torch.randn(8, 16)
assert not L.runs_on_kernel(x, w, None)
assert torch.equal(L.linear(x, w), F.linear(x, w))
print(L.describe())
"""


@pytest.mark.parametrize(
    "compiler, expected",
    [("no-such-compiler-here", "no C compiler"), ("false", "building the C kernels failed")],
)
def test_without_a_working_compiler_it_falls_back_and_says_why(tmp_path, compiler, expected):
    if c_kernel.cpu_supported():
        pytest.skip(c_kernel.cpu_supported())
    done = run_python(FALLBACK_CHECK, tmp_path, CC=compiler)
    assert done.returncode == 0, done.stderr
    assert expected in done.stdout
    assert "F.linear" in done.stdout


def test_the_build_is_cached_by_its_recipe(tmp_path):
    kernels_or_skip()
    compiler = shutil.which(os.environ.get("CC", "cc"))
    first = c_kernel.build(compiler, tmp_path)
    stamp = first.stat().st_mtime_ns
    second = c_kernel.build(compiler, tmp_path)
    assert second == first and second.stat().st_mtime_ns == stamp  # not compiled again
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left
