"""gpt2/block_loop.py: all blocks in one C call give what the Block modules
give (logits and cache, up to float32 rounding), see the parameters as they
are now, and whatever the loop cannot take goes through the modules.

Tolerance: max abs difference 1e-4 on logits and cached keys and values of
scale ~5 (measured: 2e-6 to 4e-6, the kernels' float32 layer norm and GELU
against PyTorch's); a block wired wrong is off by more than 1e-2."""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import kernels_or_skip
from gpt2 import GPT2, GPT2Config, block_loop, init_random_weights
from gpt2.attention import KERNEL_MAX_QUERIES, plain_attention
from gpt2.block_loop import block_pointers, module_blocks, runs_block_loop
from gpt2.linear import plain_linear

# hs = 16 (a multiple of 8, as the kernels need), 3 blocks.
ATOL = 1e-4
CONFIG = GPT2Config(n_layer=3, n_head=4, n_embd=64, vocab_size=101, n_ctx=64)


def new_model(seed: int = 0) -> GPT2:
    model = GPT2(CONFIG).eval()
    init_random_weights(model, std=0.2, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # non-trivial layer norms and biases, so that swapping any two is seen
        for name, p in model.named_parameters():
            if ".ln_" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def ids(B: int, T: int, seed: int) -> torch.Tensor:
    return torch.randint(CONFIG.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() <= ATOL


def step_both_ways(model: GPT2, prompt: torch.Tensor, new: torch.Tensor):
    """(logits, cache) of `new` after `prompt`, through the loop and through
    the modules, each from its own prefilled cache."""
    out = []
    for switch in (contextlib.nullcontext, module_blocks):
        cache = model.new_cache(batch_size=prompt.size(0))
        with torch.inference_mode(), switch():
            model(prompt, cache)
            x = model.wte(new)  # any (B, T, C) input tells whether the loop takes it
            assert runs_block_loop(model, x, cache) == (switch is contextlib.nullcontext)
            logits = model(new, cache)
        out.append((logits, cache))
    return out


@pytest.mark.parametrize("B, T", [(1, 1), (1, 5), (2, 3), (1, KERNEL_MAX_QUERIES)])
def test_the_loop_gives_the_modules_logits_and_cache(B, T):
    kernels_or_skip()
    model = new_model()
    (loop_logits, loop_cache), (module_logits, module_cache) = step_both_ways(model, ids(B, 9, 1), ids(B, T, 2))
    assert close(loop_logits, module_logits)
    assert loop_cache.length == module_cache.length == 9 + T
    assert close(loop_cache.k[:, :, :, : 9 + T], module_cache.k[:, :, :, : 9 + T])
    assert close(loop_cache.v[:, :, :, : 9 + T], module_cache.v[:, :, :, : 9 + T])


def test_that_check_fails_a_loop_wired_wrong():
    """The comparison above can fail: a table with ln_1 and ln_2 swapped in the
    second block gives other logits."""
    kernels_or_skip()
    model = new_model()
    (right, _), _ = step_both_ways(model, ids(1, 9, 1), ids(1, 2, 2))
    table = block_pointers(model)
    entry = table[1]
    entry.ln_1_weight, entry.ln_2_weight = entry.ln_2_weight, entry.ln_1_weight
    entry.ln_1_bias, entry.ln_2_bias = entry.ln_2_bias, entry.ln_1_bias
    (wrong, _), (modules, _) = step_both_ways(model, ids(1, 9, 1), ids(1, 2, 2))  # the kept table: still swapped
    assert close(modules, right)
    assert (wrong - right).abs().max().item() > 1e-2
    block_loop._tables.clear()


def test_a_weight_changed_in_place_replaced_or_given_new_storage_is_used_at_the_next_step():
    kernels_or_skip()
    model = new_model()
    prompt, new = ids(1, 9, 1), ids(1, 2, 2)
    (before, _), _ = step_both_ways(model, prompt, new)
    changes = [
        lambda: model.h[0].mlp.c_fc.weight.mul_(1.5),  # in place: the version counter moves
        lambda: setattr(model.h[1].attn.c_attn.weight, "data", model.h[1].attn.c_attn.weight.data * 0.5),  # new storage
        lambda: setattr(model.h[2].ln_2, "weight", torch.nn.Parameter(model.h[2].ln_2.weight.detach() + 1.0)),  # replaced
        lambda: model.h[2].attn.c_proj.bias.add_(torch.linspace(-1, 1, 64)),  # read by the kernel itself: no stamp
    ]
    for change in changes:
        with torch.no_grad():
            change()
        (loop, _), (modules, _) = step_both_ways(model, prompt, new)
        assert close(loop, modules)
        assert (loop - before).abs().max().item() > 1e-3
        before = loop


def test_a_kept_table_is_reused_until_something_changes():
    kernels_or_skip()
    model = new_model()
    first = block_pointers(model)
    assert block_pointers(model) is first
    with torch.no_grad():
        model.h[0].attn.c_proj.weight.mul_(2.0)
    assert block_pointers(model) is not first


def with_grad(model: GPT2) -> GPT2:
    model.requires_grad_(True)
    return model


CANNOT_TAKE = {
    "no cache": lambda m: (m, None, ids(1, 3, 2)),
    "more tokens than the attention kernel takes": lambda m: (m, m.new_cache(), ids(1, KERNEL_MAX_QUERIES + 1, 2)),
    "float64": lambda m: (m.double(), m.new_cache(), ids(1, 3, 2)),
}


@pytest.mark.parametrize("case", list(CANNOT_TAKE))
def test_what_the_loop_cannot_take_goes_through_the_modules(case):
    kernels_or_skip()
    model, cache, new = CANNOT_TAKE[case](new_model())
    with torch.inference_mode():
        assert not runs_block_loop(model, model.wte(new), cache)
        got = model(new, cache)
        with module_blocks():
            expected = model(new, None if cache is None else model.new_cache())
    assert torch.equal(got, expected)


def test_a_parameter_the_kernels_cannot_read_sends_the_pass_through_the_modules():
    """A weight that is not contiguous (here a transposed copy's view) has no
    pointer the loop could pass: block_loop declines and the modules run."""
    kernels_or_skip()
    model = new_model()
    fc = model.h[1].mlp.c_fc
    fc.weight = torch.nn.Parameter(fc.weight.detach().t().contiguous().t(), requires_grad=False)  # same values
    assert not fc.weight.is_contiguous()
    cache = model.new_cache()
    with torch.inference_mode():
        x = model.wte(ids(1, 2, 2))
        assert runs_block_loop(model, x, cache) and block_pointers(model) is None
        assert block_loop.block_loop(model, x, cache, 0) is None
        got = model(ids(1, 2, 2), cache)
        with module_blocks():
            expected = model(ids(1, 2, 2), model.new_cache())
    assert torch.equal(got, expected)


def test_recording_gradients_goes_through_the_modules():
    kernels_or_skip()
    model = new_model()
    prompt, new = ids(1, 9, 1), ids(1, 2, 2)
    (loop, _), _ = step_both_ways(model, prompt, new)
    with_grad(model)
    cache = model.new_cache()
    model(prompt, cache)
    assert not runs_block_loop(model, model.wte(new), cache)
    recorded = model(new, cache)
    assert recorded.requires_grad  # F.linear and SDPA (the kernels have no backward): equal up to rounding
    assert (recorded.detach() - loop).abs().max().item() <= 1e-4


def test_the_switches_turn_the_loop_off():
    kernels_or_skip()
    model = new_model()
    cache = model.new_cache()
    with torch.inference_mode():
        x = model.wte(ids(1, 2, 2))
        assert runs_block_loop(model, x, cache)
        for switch in (module_blocks, plain_attention, plain_linear):
            with switch():
                assert not runs_block_loop(model, x, cache)
        assert runs_block_loop(model, x, cache)
