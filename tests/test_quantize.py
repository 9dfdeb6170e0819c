"""Weight-only int8 quantisation (gpt2/fast/quantize.py): the rounding itself
(golden values and its error bound), a quantised model that is the same
model on every path (the int8 kernels and the readable path), and
speculative decoding that is lossless with respect to the quantised target.
(The int8 kernel against a float64 product: tests/test_fast_kernels.py.)"""

from __future__ import annotations

import pytest
import torch

from gpt2 import GPT2Config, fast, generate, load_model
from gpt2.fast.accelerator import pack_rows
from gpt2.fast.quantize import dequantize_rows, matrix_weights, quantize_model_int8, quantize_rows_int8
from gpt2.fast.quantize import resolve_quantize
from helpers import TINY, hub_state_dict, make_hf_model, perturbed_copy, tiny_gpt2, write_checkpoint
from spec_decoding import speculative_generate

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
# A quantised model
# ---------------------------------------------------------------------------

CONFIG = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_ctx=64, vocab_size=64)


def quantised(seed: int = 0):
    model = tiny_gpt2(CONFIG, seed=seed)
    quantize_model_int8(model)
    return model


def test_every_weight_matrix_is_its_quantised_value_and_the_kernels_read_int8(fast_kernels):
    original = tiny_gpt2(CONFIG, seed=0)
    model = fast.accelerate(tiny_gpt2(CONFIG, seed=0), int8=True)
    matrices, before = matrix_weights(model), matrix_weights(original)
    assert len(matrices) == 4 * CONFIG.n_layer + 1  # four projections per block, and wte (the LM head)
    for name, weight in matrices.items():
        q, scale = quantize_rows_int8(before[name])
        assert torch.equal(weight, dequantize_rows(q, scale))
        packed = model.accelerator.packed[name]
        assert packed.data.dtype == torch.int8 and torch.equal(packed.data, pack_rows(q))
        assert torch.equal(packed.scale, scale)
    # Layer norms, biases and the position table are left as they were.
    assert torch.equal(model.wpe.weight, original.wpe.weight)
    assert torch.equal(model.h[1].ln_2.weight, original.h[1].ln_2.weight)
    assert torch.equal(model.h[0].mlp.c_fc.bias, original.h[0].mlp.c_fc.bias)


def logits_of(model, prompt, new):
    cache = model.new_cache()
    with torch.inference_mode():
        model(prompt, cache)
        return model(new, cache)  # (1, T, V)


@pytest.mark.parametrize("T", [1, 5])
def test_the_int8_kernels_and_the_readable_path_compute_the_same_quantised_model(fast_kernels, T):
    """One model on two paths: the kernels on int8 weights, and F.linear +
    SDPA on the float32 weights (which hold the quantised values). Equal
    within 1e-4 on logits of scale ~10; the float32 original differs by far more."""
    model = fast.accelerate(tiny_gpt2(CONFIG, seed=0), int8=True)
    g = torch.Generator().manual_seed(4)
    prompt, new = torch.randint(64, (1, 9), generator=g), torch.randint(64, (1, T), generator=g)
    kernels = logits_of(model, prompt, new)
    accelerator, model.accelerator = model.accelerator, None
    readable = logits_of(model, prompt, new)
    model.accelerator = accelerator
    assert (kernels - readable).abs().max().item() <= 1e-4
    original = logits_of(tiny_gpt2(CONFIG, seed=0), prompt, new)
    assert (original - readable).abs().max().item() > 1e-2


def test_a_quantised_weight_changed_later_is_read_as_its_new_float32_values(fast_kernels):
    model = fast.accelerate(tiny_gpt2(CONFIG, seed=0), int8=True)
    with torch.no_grad():
        model.h[0].mlp.c_fc.weight.mul_(1.001)  # off the int8 grid now
    g = torch.Generator().manual_seed(5)
    prompt, new = torch.randint(64, (1, 9), generator=g), torch.randint(64, (1, 3), generator=g)
    kernels = logits_of(model, prompt, new)
    packed = model.accelerator.packed["h.0.mlp.c_fc.weight"]
    assert packed.scale is None and packed.data.dtype == torch.float32
    assert model.accelerator.packed["h.1.mlp.c_fc.weight"].data.dtype == torch.int8  # the others stay int8
    accelerator, model.accelerator = model.accelerator, None
    assert (kernels - logits_of(model, prompt, new)).abs().max().item() <= 1e-4
    model.accelerator = accelerator


def test_only_a_float32_cpu_model_is_quantised():
    with pytest.raises(ValueError, match="int8 weights are for the CPU in float32"):
        quantize_model_int8(tiny_gpt2(CONFIG, seed=0).double())
    with pytest.raises(ValueError, match="int8 weights are for the CPU in float32"):
        fast.accelerate(tiny_gpt2(CONFIG, seed=0).half(), int8=True)
    with pytest.raises(ValueError, match="unknown quantisation 'int4': choose none or int8"):
        resolve_quantize("int4", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="int8 weights are for the CPU in float32, not cuda float16"):
        resolve_quantize("int8", torch.device("cuda"), torch.float16)
    assert resolve_quantize("none", torch.device("cuda"), torch.float16) is None
    assert resolve_quantize(None, torch.device("cpu"), torch.float32) is None


def test_load_model_quantises_when_asked(tmp_path):
    folder = write_checkpoint(tmp_path / "tiny", TINY, hub_state_dict(make_hf_model(TINY, seed=21)))
    plain, int8 = load_model(folder), load_model(folder, quantize="int8")
    for a, b in zip(matrix_weights(plain).values(), matrix_weights(int8).values()):
        assert torch.equal(b, dequantize_rows(*quantize_rows_int8(a)))
    readable = load_model(folder, quantize="int8", accelerate=False)  # quantised, on the readable path
    assert readable.accelerator is None and torch.equal(readable.wte.weight, int8.wte.weight)
    with pytest.raises(ValueError, match="unknown quantisation"):
        load_model(folder, quantize="fp8")


def test_load_model_int8_on_the_fast_path_packs_the_weights_as_int8(tmp_path, fast_kernels):
    folder = write_checkpoint(tmp_path / "tiny", TINY, hub_state_dict(make_hf_model(TINY, seed=21)))
    int8 = load_model(folder, quantize="int8")
    assert int8.accelerator is not None and int8.accelerator.int8, fast.status(int8)
    assert int8.accelerator.packed["wte.weight"].data.dtype == torch.int8


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
    draft = perturbed_copy(tiny_gpt2(CONFIG, seed=0), scale=0.04, seed=2)
    quantize_model_int8(draft)
    prompt = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        expected = generate(target, prompt, 40)
        out, stats = speculative_generate(target, draft, prompt, gamma=gamma, max_new_tokens=40)
    assert torch.equal(out, expected)
    assert 0 < stats.accepted < stats.drafted  # the draft agrees sometimes: rejections were exercised
