"""Weight-only int8 quantisation (gpt2/quantize.py) and the kernel's int8
path: the rounding itself (golden values and its error bound), the kernel
on int8 weights against a float64 product with the dequantised weights, a
quantised model that is the same model on every path, and speculative
decoding that is lossless with respect to the quantised target."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from helpers import TINY, hub_state_dict, kernels_or_skip, make_hf_model, write_checkpoint
from gpt2 import GPT2Config, generate, load_model
from gpt2 import linear as gpt2_linear
from gpt2.block_loop import module_blocks, runs_block_loop
from gpt2.linear import pack_pairs, packed_weight, plain_linear
from gpt2.loading import resolve_quantize
from gpt2.quantize import dequantize_rows, quantize_model_int8, quantize_rows_int8
from spec_decoding import speculative_generate
from helpers import perturbed_copy, tiny_gpt2

# ---------------------------------------------------------------------------
# The rounding
# ---------------------------------------------------------------------------


def test_rows_are_rounded_to_127_levels_of_their_largest_weight():
    w = torch.tensor([
        [1.0, -0.5, 0.25, 0.0],  # scale 1/127: 127, -63.5 -> -64 (half to even), 31.75 -> 32, 0
        [0.0, 0.0, 0.0, 0.0],  # an all-zero row: scale 0, q 0
        [-2.0, 1.0, 0.02, 0.5],  # scale 2/127: -127, 63.5 -> 64, 1.27 -> 1, 31.75 -> 32
    ])  # fmt: skip
    q, scale = quantize_rows_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q.tolist() == [[127, -64, 32, 0], [0, 0, 0, 0], [-127, 64, 1, 32]]
    assert torch.allclose(scale, torch.tensor([1 / 127, 0.0, 2 / 127]))
    assert torch.equal(dequantize_rows(q, scale)[1], torch.zeros(4))


def test_the_rounding_error_is_at_most_half_a_level():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 640, generator=g) * torch.rand(300, 1, generator=g)  # rows of different scales
    q, scale = quantize_rows_int8(w)
    assert q.abs().max().item() == 127 and (q.abs().amax(dim=1) == 127).all()  # each row's largest is +-127
    error = (dequantize_rows(q, scale) - w).abs()  # (out, in)
    assert (error <= scale[:, None] / 2 * (1 + 1e-5)).all()
    assert error.max().item() > 0.4 * scale.max().item()  # and the rounding does move weights


# ---------------------------------------------------------------------------
# The kernel on int8 weights
# ---------------------------------------------------------------------------


def int8_kernel(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x (N, in) times the int8 weights q (out, in) with their rows' scales,
    through the C function few_rows_linear."""
    kernel = kernels_or_skip()
    rows, in_features = x.shape
    out_features = q.shape[0]
    packed = pack_pairs(q)  # (ceil(out / 2), in / 8, 2, 8) int8
    y = torch.empty(rows, out_features)  # (N, out)
    kernel(
        x.data_ptr(), packed.data_ptr(), scale.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
        rows, in_features, out_features, None, None, 0.0, 0, None,
    )  # fmt: skip
    return y


def int8_case(rows: int, in_features: int, out_features: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g) / in_features**0.5  # outputs of unit scale
    q, scale = quantize_rows_int8(w)
    return x, q, scale, torch.randn(out_features, generator=g)


def reference(x, q, scale, b):
    """x (scale q)^T + b in float64, rounded to float32."""
    return F.linear(x.double(), dequantize_rows(q, scale).double(), b.double()).float()


# float32 sums of `in` products in another order: the tolerance of test_linear.py.
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 9, 48])
@pytest.mark.parametrize("in_features, out_features", [(8, 1), (24, 7), (64, 101), (1280, 5120)])
def test_the_kernel_on_int8_weights_matches_the_float64_product(rows, in_features, out_features):
    x, q, scale, b = int8_case(rows, in_features, out_features, seed=rows + in_features)
    y = int8_kernel(x, q, scale, b)
    torch.testing.assert_close(y, reference(x, q, scale, b), rtol=1e-5, atol=1e-5 * in_features**0.5)


def test_that_check_fails_scales_given_to_the_wrong_rows():
    x, q, scale, b = int8_case(5, 64, 101, seed=3)
    y = int8_kernel(x, q, scale.roll(1), b)
    assert not torch.allclose(y, reference(x, q, scale, b), rtol=1e-5, atol=1e-3)


# ---------------------------------------------------------------------------
# A quantised model
# ---------------------------------------------------------------------------

CONFIG = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_ctx=64, vocab_size=64)


def quantised(seed: int = 0):
    return quantize_model_int8(tiny_gpt2(CONFIG, seed=seed))


def test_every_weight_matrix_is_its_quantised_value_and_the_kernel_reads_int8():
    kernels_or_skip()
    original = tiny_gpt2(CONFIG, seed=0)
    model = quantised(seed=0)
    matrices = model.matrix_weights()
    assert len(matrices) == 4 * CONFIG.n_layer + 1  # four projections per block, and wte (the LM head)
    for weight, before in zip(matrices, original.matrix_weights()):
        q, scale = quantize_rows_int8(before)
        assert torch.equal(weight, dequantize_rows(q, scale))
        packed = packed_weight(weight)
        assert packed.data.dtype == torch.int8 and torch.equal(packed.data, pack_pairs(q))
        assert torch.equal(packed.scale, scale)
    # Layer norms, biases and the position table are left as they were.
    assert torch.equal(model.wpe.weight, original.wpe.weight)
    assert torch.equal(model.h[1].ln_2.weight, original.h[1].ln_2.weight)
    assert torch.equal(model.h[0].mlp.c_fc.bias, original.h[0].mlp.c_fc.bias)


def logits_of(model, prompt, new, switch=contextlib.nullcontext):
    cache = model.new_cache()
    with torch.inference_mode(), switch():
        model(prompt, cache)
        return model(new, cache)  # (1, T, V)


@pytest.mark.parametrize("T", [1, 5])
def test_the_int8_kernel_block_loop_and_modules_compute_the_same_quantised_model(T):
    """One model on three paths: the block loop on int8 weights, the Block
    modules on int8 weights, and F.linear + SDPA on the float32 weights
    (which hold the quantised values). Equal within 1e-4 on logits of scale
    ~10 (float32 rounding); the float32 original differs by far more."""
    kernels_or_skip()
    model = quantised()
    g = torch.Generator().manual_seed(4)
    prompt, new = torch.randint(64, (1, 9), generator=g), torch.randint(64, (1, T), generator=g)
    with torch.inference_mode():
        assert runs_block_loop(model, model.wte(new), model.new_cache())
    loop = logits_of(model, prompt, new)
    modules = logits_of(model, prompt, new, module_blocks)
    readable = logits_of(model, prompt, new, plain_linear)
    assert (loop - readable).abs().max().item() <= 1e-4
    assert (modules - readable).abs().max().item() <= 1e-4
    original = logits_of(tiny_gpt2(CONFIG, seed=0), prompt, new)
    assert (original - readable).abs().max().item() > 1e-2


def test_a_quantised_weight_changed_later_is_read_as_its_new_float32_values():
    kernels_or_skip()
    model = quantised()
    weight = model.h[0].mlp.c_fc.weight
    with torch.no_grad():
        weight.mul_(1.001)  # off the int8 grid now
    assert packed_weight(weight).scale is None and packed_weight(weight).data.dtype == torch.float32
    g = torch.Generator().manual_seed(5)
    prompt, new = torch.randint(64, (1, 9), generator=g), torch.randint(64, (1, 3), generator=g)
    assert (logits_of(model, prompt, new) - logits_of(model, prompt, new, plain_linear)).abs().max().item() <= 1e-4


def test_only_a_float32_cpu_model_is_quantised():
    with pytest.raises(ValueError, match="int8 weights are for the CPU in float32"):
        quantize_model_int8(tiny_gpt2(CONFIG, seed=0).double())
    with pytest.raises(ValueError, match="unknown quantisation 'int4': choose none or int8"):
        resolve_quantize("int4", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="int8 weights are for the CPU in float32, not cuda float16"):
        resolve_quantize("int8", torch.device("cuda"), torch.float16)
    assert resolve_quantize("none", torch.device("cuda"), torch.float16) is None
    assert resolve_quantize(None, torch.device("cpu"), torch.float32) is None


def test_load_model_quantises_when_asked(tmp_path):
    folder = write_checkpoint(tmp_path / "tiny", TINY, hub_state_dict(make_hf_model(TINY, seed=21)))
    plain, int8 = load_model(folder), load_model(folder, quantize="int8")
    for a, b in zip(plain.matrix_weights(), int8.matrix_weights()):
        assert torch.equal(b, dequantize_rows(*quantize_rows_int8(a)))
    if gpt2_linear.kernel_takes(int8.wte.weight):
        assert packed_weight(int8.wte.weight).data.dtype == torch.int8
    with pytest.raises(ValueError, match="unknown quantisation"):
        load_model(folder, quantize="fp8")


# ---------------------------------------------------------------------------
# Speculative decoding with both models quantised
# ---------------------------------------------------------------------------


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_speculative_output_is_the_quantised_targets(gamma):
    """Lossless with respect to the quantised target: the int8 target alone
    and the int8 pair emit the same tokens. (The float32 target's tokens are
    another model's and may differ.)"""
    target = quantised(seed=0)
    draft = quantize_model_int8(perturbed_copy(tiny_gpt2(CONFIG, seed=0), scale=0.04, seed=2))
    prompt = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        expected = generate(target, prompt, 40)
        out, stats = speculative_generate(target, draft, prompt, gamma=gamma, max_new_tokens=40)
    assert torch.equal(out, expected)
    assert 0 < stats.accepted < stats.drafted  # the draft agrees sometimes: rejections were exercised
