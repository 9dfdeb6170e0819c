"""The hand-written GPT-2 against transformers' GPT2LMHeadModel, on both of
its paths (the readable one and the C fast path of gpt2/fast), and the
properties of its KV cache.

Both models get the same random weights through the real file path: the
reference's weights are written as model.safetensors in both key layouts and
read back by `gpt2.load_model`. Tolerance: max |logit difference| <= 1e-4 in
float32 (the two compute the same sums in a different order).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gpt2 import GPT2, PRESETS, GPT2Config, KVCache, fast, load_model, preset
from gpt2.fast.accelerator import FastGPT2
from helpers import TINY, hub_state_dict, make_hf_model, write_checkpoint

ATOL = 1e-4
LAYOUTS = ("hub", "save_pretrained")
# tiny-eps: a LayerNorm epsilon other than GPT-2's 1e-5, which the checkpoint's config.json carries to every path.
SHAPES = {"tiny": TINY, "tiny-eps": dataclasses.replace(TINY, layer_norm_epsilon=1e-2),
          "distilgpt2": PRESETS["distilgpt2"], "gpt2": PRESETS["gpt2"]}


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    return (a - b).abs().max().item()


def random_ids(config: GPT2Config, B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request, tmp_path_factory):
    """(config, transformers reference, {layout: our model loaded from that layout's files})."""
    config = SHAPES[request.param]
    hf = make_hf_model(config, seed=1)
    state = hub_state_dict(hf)
    root = tmp_path_factory.mktemp(f"ckpt_{request.param}")
    ours = {layout: load_model(write_checkpoint(root / layout, config, state, layout=layout)) for layout in LAYOUTS}
    return config, hf, ours


@torch.no_grad()
@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_sequence_logits_match_transformers(pair, layout):
    config, hf, ours = pair
    ids = random_ids(config, B=2, T=8)
    expected = hf(ids).logits  # (2, 8, V)
    got = ours[layout](ids)
    assert got.shape == (2, 8, config.vocab_size)
    assert got.dtype == torch.float32
    assert max_diff(got, expected) <= ATOL
    # The weights are not trivial: the logits of different tokens really differ.
    assert expected.std().item() > 0.3


@torch.no_grad()
def test_cached_decoding_matches_transformers(pair):
    """Prefill 4 tokens, then feed one token at a time through our KV cache:
    the rows match transformers' uncached forward over the whole sequence
    (and, on the first steps, its own cached decoding)."""
    config, hf, ours = pair
    model = ours["hub"]
    ids = random_ids(config, B=1, T=8, seed=2)

    cache = model.new_cache(batch_size=1)
    rows = [model(ids[:, :4], cache)]  # (1, 4, V)
    for t in range(4, ids.size(1)):
        rows.append(model(ids[:, t : t + 1], cache))  # (1, 1, V)
    assert cache.length == ids.size(1)
    assert max_diff(torch.cat(rows, dim=1), hf(ids).logits) <= ATOL

    hf_out = hf(ids[:, :4], use_cache=True)
    hf_out = hf(ids[:, 4:5], hf_out.past_key_values, use_cache=True)  # the cache by position (5.x renamed it)
    assert max_diff(rows[1], hf_out.logits) <= ATOL


@torch.inference_mode()
@pytest.mark.parametrize("path", ["readable", "fast"])
@pytest.mark.parametrize("new_tokens", [1, 5, 60])
@pytest.mark.parametrize("cached", [True, False], ids=["cache", "no cache"])
def test_both_paths_match_transformers(pair, fast_kernels, path, new_tokens, cached):
    """The readable path and the fast path, with and without a KV cache, for
    1, 5 and 60 new tokens (with a cache: after a 7-token prefill)."""
    config, hf, ours = pair
    model = ours["hub"]
    assert isinstance(model.accelerator, FastGPT2), "load_model accelerates on a CPU"
    prefix = min(7, config.n_ctx - new_tokens) if cached else 0
    ids = random_ids(config, B=1, T=prefix + new_tokens, seed=new_tokens)
    expected = hf(ids).logits[:, prefix:]  # (1, new_tokens, V)
    saved = model.accelerator
    if path == "readable":
        model.accelerator = None
    try:
        if cached:
            cache = model.new_cache()
            model(ids[:, :prefix], cache)
            got = model(ids[:, prefix:], cache)
        else:
            got = model(ids)
    finally:
        model.accelerator = saved
    assert max_diff(got, expected) <= ATOL


# ---------------------------------------------------------------------------
# KV cache properties, on the tiny shape
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> GPT2:
    """A tiny GPT-2 with random weights (no file needed for cache properties)."""
    from gpt2 import init_random_weights

    model = GPT2(TINY).eval()
    return init_random_weights(model, std=0.2, generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def test_cached_decoding_equals_uncached_forward(tiny):
    """Chunks of any size, including several tokens on top of a filled cache
    (what speculative decoding's verification pass does), give the rows of
    one uncached forward."""
    ids = random_ids(TINY, B=2, T=20, seed=4)
    full = tiny(ids)  # (2, 20, V)
    cache = tiny.new_cache(batch_size=2)
    pieces, start = [], 0
    for size in (3, 1, 5, 1, 1, 7, 2):
        pieces.append(tiny(ids[:, start : start + size], cache))
        start += size
        assert cache.length == start
    assert start == ids.size(1)
    assert max_diff(torch.cat(pieces, dim=1), full) <= 1e-5


@torch.no_grad()
def test_rewind_then_append_equals_fresh_run(tiny):
    prefix = random_ids(TINY, B=1, T=6, seed=5)
    rejected = random_ids(TINY, B=1, T=4, seed=6)
    accepted = random_ids(TINY, B=1, T=3, seed=7)

    cache = tiny.new_cache()
    tiny(torch.cat([prefix, rejected], dim=1), cache)
    k_buffer = cache.k.data_ptr()
    cache.rewind(6)  # drop the 4 rejected tokens
    assert cache.length == 6
    assert cache.k.data_ptr() == k_buffer, "rewinding must not reallocate the buffers"
    got = tiny(accepted, cache)  # (1, 3, V)

    fresh = tiny(torch.cat([prefix, accepted], dim=1))[:, 6:]  # (1, 3, V)
    assert cache.length == 9
    assert max_diff(got, fresh) <= 1e-5


@torch.no_grad()
def test_cache_buffers_are_preallocated_for_the_whole_context(tiny):
    cache = tiny.new_cache(batch_size=3)
    C = TINY
    assert cache.k.shape == (C.n_layer, 3, C.n_head, C.n_ctx, C.n_embd // C.n_head)
    assert cache.v.shape == cache.k.shape
    assert cache.length == 0 and cache.capacity == C.n_ctx


@torch.no_grad()
def test_the_whole_context_window_fits(tiny):
    ids = random_ids(TINY, B=1, T=TINY.n_ctx, seed=8)
    cache = tiny.new_cache()
    tiny(ids[:, :-1], cache)
    last = tiny(ids[:, -1:], cache)
    assert cache.length == TINY.n_ctx
    assert max_diff(last, tiny(ids)[:, -1:]) <= 1e-5


@torch.no_grad()
@pytest.mark.parametrize("batch_size, capacity, dtype", [(1, None, torch.float32), (3, 17, torch.bfloat16)])
def test_a_caches_size_is_known_before_it_is_allocated(batch_size, capacity, dtype):
    config = GPT2Config(n_layer=3, n_head=2, n_embd=16, n_ctx=40, vocab_size=50)
    cache = KVCache(config, batch_size, capacity=capacity, dtype=dtype)
    assert KVCache.nbytes(config, batch_size, capacity, dtype) == cache.k.nbytes + cache.v.nbytes
    assert KVCache.nbytes(PRESETS["gpt2-large"]) == 2 * 36 * 1024 * 1280 * 4  # 377 MB: one row of the whole window


@pytest.mark.parametrize("batch_size, capacity, message", [
    (0, None, "batch_size must be an integer >= 1, got 0"), (-1, None, "batch_size must be an integer >= 1"),
    (2.5, None, "batch_size must be"), (1, 0, r"capacity must be an integer in 1\.\.64 \(the context window\)"),
    (1, 65, "capacity must be an integer in 1..64"), (1, "8", "capacity must be"),
])
def test_a_bad_cache_size_raises_value_error(tiny, batch_size, capacity, message):
    with pytest.raises(ValueError, match=message):
        tiny.new_cache(batch_size, capacity)


@torch.no_grad()
def test_rewinding_past_a_rows_length_raises_value_error(tiny):
    cache = tiny.new_cache(batch_size=2)
    tiny(random_ids(TINY, B=2, T=5), cache)
    for bad in (6, -1, torch.tensor([3, 6])):
        with pytest.raises(ValueError, match=r"cannot rewind lengths \[5, 5\] to .*only forgets positions"):
            cache.rewind(bad)
    for bad in (torch.tensor([1, 2, 3]), torch.tensor([2.0, 3.0]), torch.tensor(True), 2.5, True, "3", None,
                np.array([2.9, 1.7]), np.array([True, False]), np.array(["2", "3"]), np.float64(2.0)):
        with pytest.raises(ValueError, match="rewind takes one integer length or 2 \\(one per row\\)"):
            cache.rewind(bad)
    assert cache.lengths.tolist() == [5, 5]  # nothing forgotten by a refused rewind
    cache.rewind(np.array([4, 5]))
    assert cache.lengths.tolist() == [4, 5]
    cache.rewind(torch.tensor([2, 5]))
    assert cache.lengths.tolist() == [2, 5]
    empty = tiny.new_cache(batch_size=2)
    empty.keep_rows([])
    with pytest.raises(ValueError, match="the cache holds no rows"):
        empty.length


@torch.no_grad()
@pytest.mark.parametrize("accelerated", [False, True])
def test_a_forward_pass_it_cannot_run_raises_value_error(request, tiny, accelerated):
    model = GPT2(TINY).eval()
    model.load_state_dict(tiny.state_dict())
    if accelerated:  # the checks come before the seam: both paths refuse alike
        request.getfixturevalue("fast_kernels")
        fast.accelerate(model)
        assert isinstance(model.accelerator, FastGPT2)
    ids, cache = random_ids(TINY, B=2, T=3), model.new_cache(2)
    model(ids, cache)
    bad = {
        "input_ids must be a \\(batch, tokens\\) tensor of token ids, got \\(3,\\)": (ids[0], None, None),
        "got list": ([[1, 2]], None, None),
        "the cache holds 2 rows but input_ids has 1: use model.new_cache\\(1\\)": (ids[:1], cache, None),
        "mask must be a \\(3, W >= 3\\) bool tensor, got \\(3, 2\\)": (ids, cache, torch.ones(3, 2, dtype=torch.bool)),
        "bool tensor, got \\(3, 3\\) torch.float32": (ids, cache, torch.ones(3, 3)),
        "bool tensor, got list": (ids, cache, [[True] * 3] * 3),
        # A draft's cache given to the target: the kernels would write past its buffers.
        "the cache is another model's \\(2 layers, 2 heads of 16; this model has 2, 4 of 8\\)": (
            ids, KVCache(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_ctx=64, vocab_size=101), 2), None),
        "the cache holds torch.float16 on cpu, the model is torch.float32 on cpu: use model.new_cache": (
            ids, KVCache(TINY, 2, dtype=torch.float16), None),
        "input_ids are on meta, the model on cpu: pass input_ids.to\\(model.device\\)": (
            ids.to("meta"), None, None),
        "the mask's window reaches 4 cached positions back, but a row of the cache holds 3":
            (ids, cache, torch.ones(3, 7, dtype=torch.bool)),
        "input_ids must hold integer token ids \\(torch.long\\), got torch.float32": (ids.float(), cache, None),
        f"input_ids holds token id {TINY.vocab_size}, outside this model's vocabulary 0..{TINY.vocab_size - 1}": (
            torch.full_like(ids, TINY.vocab_size), cache, None),
        "input_ids holds token id -1, outside": (torch.full_like(ids, -1), cache, None),
        # The smallest id is 0: the message names the one outside, the largest.
        f"input_ids holds token id {TINY.vocab_size}, outside": (torch.tensor([[0, 1, TINY.vocab_size]] * 2), cache,
                                                                 None),
        # Without a cache no position is cached: a window one wider than the new tokens reaches before the first.
        "the mask's window reaches 1 cached positions back, but a row of the cache holds 0": (
            ids, None, torch.ones(3, 4, dtype=torch.bool)),
        "cache must be a KVCache \\(model.new_cache\\(\\)\\) or None, got bool": (ids, True, None),  # was 'bool'.k
        # Row 1 sees only token 0: run as if it were token 0's position, silently, before the check.
        "the mask's diagonal over the new tokens must be True": (
            ids, cache, torch.tensor([[1, 0, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)),
    }
    for message, (input_ids, c, mask) in bad.items():
        with pytest.raises(ValueError, match=message):
            model(input_ids, c, mask=mask)
    assert cache.lengths.tolist() == [3, 3]  # a refused pass writes nothing


# The published checkpoints' parameter counts (the LM head is the tied wte): the benchmarks' random-weight
# models have the real shapes only if the presets do.
PUBLISHED_PARAMETERS = {"openai-community/gpt2": 124_439_808, "openai-community/gpt2-medium": 354_823_168,
                        "openai-community/gpt2-large": 774_030_080, "openai-community/gpt2-xl": 1_557_611_200,
                        "distilbert/distilgpt2": 81_912_576}


def test_each_preset_has_its_published_checkpoints_shape():
    for name, expected in PUBLISHED_PARAMETERS.items():
        config = preset(name)  # by its Hub id
        with torch.device("meta"):  # shapes only, no memory
            model = GPT2(config)
        assert sum(p.numel() for p in model.parameters()) == expected, name
        assert (config.vocab_size, config.n_ctx, config.head_size) == (50257, 1024, 64), name
    assert GPT2Config() == preset("gpt2")  # the default config is the smallest GPT-2


def test_a_model_and_a_preset_by_a_wrong_kind_of_name_say_what_to_give():
    with pytest.raises(ValueError, match=r"GPT2 takes a GPT2Config \(preset\('gpt2'\) for a shape\), got 'gpt2'; "
                       r"for the weights, load_model\('gpt2'\)"):
        GPT2("gpt2")  # an AttributeError on 'str'.vocab_size
    with pytest.raises(ValueError, match="no preset named 'None'"):
        preset(None)


def test_a_cached_pass_while_autograd_records_is_refused_and_an_uncached_one_has_gradients(tiny):
    """The cache is written in place: with two layers or more, backward through a cached pass failed inside
    autograd, and a decode loop without no_grad kept every earlier pass alive through the cache."""
    model = GPT2(TINY).eval()
    model.load_state_dict(tiny.state_dict())
    ids, cache = random_ids(TINY, B=1, T=4), model.new_cache(1)
    with pytest.raises(ValueError, match="a pass with a KV cache is for inference .* torch.no_grad\\(\\)"):
        model(ids, cache)
    assert cache.lengths.tolist() == [0]
    with torch.no_grad():
        model(ids, cache)  # fine without autograd
    model(ids)[0, -1].logsumexp(-1).backward()  # the uncached pass: gradients reach every layer
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.h[0].parameters())


def test_the_caches_own_checks_are_value_errors(tiny):
    """They were asserts: gone under python -O, where keep_rows([1, 0]) copied row 1 into both rows."""
    cache = tiny.new_cache(3)
    with torch.no_grad():
        tiny(random_ids(TINY, B=3, T=4), cache)
    cache.rewind(torch.tensor([4, 2, 4]))
    with pytest.raises(ValueError, match=r"rows hold different lengths \[4, 2, 4\]: read cache.lengths"):
        cache.length
    for rows in ([2, 0], [0, 3], [-1, 0], [1, 1]):
        with pytest.raises(ValueError, match="rows must be increasing indices in \\[0, 3\\)"):
            cache.keep_rows(rows)
    for row, start, slots in ((0, 2, [1]), (0, 1, [3, 2]), (3, 1, [2]), (-1, 1, [2]), (1, 1, [2]), (0, 1, [4]),
                              (0, 5, [])):  # the last would have claimed a position the row does not hold
        with pytest.raises(ValueError, match="keep takes a row in \\[0, 3\\) and slots of it"):
            cache.keep(row, start, torch.tensor(slots))
    assert cache.lengths.tolist() == [4, 2, 4]  # nothing moved by a refused call
    cache.keep(0, 1, torch.tensor([2, 3]))
    assert cache.lengths.tolist() == [3, 2, 4]


def test_a_batchs_cache_starts_at_zero_whatever_fresh_memory_holds(tiny, monkeypatch):
    # Rows of a batch see masked slots up to the longest row, and a masked score still multiplies its value:
    # 0 x NaN is NaN. Fresh memory is made to hold NaN here.
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: empty(*args, **kwargs).fill_(float("nan")))
    for B in (2, 3):
        cache = tiny.new_cache(B)
        assert not cache.k.isnan().any() and not cache.v.isnan().any(), B
    assert tiny.new_cache(1).k.isnan().all()  # one row reads only slots it wrote: left as allocated


def test_a_pass_past_the_caches_capacity_is_refused_before_it_writes(tiny):
    cache = tiny.new_cache(1, capacity=6)
    with torch.no_grad():
        tiny(random_ids(TINY, B=1, T=4), cache)
        with pytest.raises(ValueError, match=r"the sequence would reach 7 tokens but this cache holds 6 positions"):
            tiny(random_ids(TINY, B=1, T=3), cache)
        assert cache.length == 4  # nothing written
        tiny(random_ids(TINY, B=1, T=2), cache)  # exactly full
    assert cache.length == 6


def test_uncached_forward_past_the_context_window_raises_value_error(tiny):
    ids = random_ids(TINY, B=1, T=TINY.n_ctx + 1)
    with pytest.raises(ValueError, match=rf"{TINY.n_ctx + 1} tokens .*context window of {TINY.n_ctx}"):
        tiny(ids)


@torch.no_grad()
def test_cached_forward_past_the_context_window_raises_value_error(tiny):
    cache = tiny.new_cache()
    tiny(random_ids(TINY, B=1, T=TINY.n_ctx - 2), cache)
    with pytest.raises(ValueError, match=rf"{TINY.n_ctx + 1} tokens .*context window of {TINY.n_ctx}"):
        tiny(random_ids(TINY, B=1, T=3), cache)  # would take positions n_ctx-2 .. n_ctx
    # Nothing was written: the cache is still usable.
    assert cache.length == TINY.n_ctx - 2
    tiny(random_ids(TINY, B=1, T=2), cache)
    assert cache.length == TINY.n_ctx
    with pytest.raises(ValueError, match="context window"):
        tiny(random_ids(TINY, B=1, T=1), cache)


@torch.no_grad()
def test_last_logits_only_returns_the_last_row(tiny):
    ids = random_ids(TINY, B=2, T=9, seed=9)
    full = tiny(ids)
    last = tiny(ids, last_logits_only=True)
    assert last.shape == (2, 1, TINY.vocab_size)
    assert max_diff(last, full[:, -1:]) <= 1e-6

    cache = tiny.new_cache(batch_size=2)
    last_cached = tiny(ids, cache, last_logits_only=True)
    assert cache.length == 9, "the cache holds every position even when only the last row is scored"
    assert max_diff(last_cached, full[:, -1:]) <= 1e-5


@torch.no_grad()
def test_rows_of_a_batch_are_independent(tiny):
    ids = random_ids(TINY, B=3, T=7, seed=10)
    batched = tiny(ids)
    for b in range(3):
        assert max_diff(batched[b : b + 1], tiny(ids[b : b + 1])) <= 1e-5


def test_parameter_names_follow_the_checkpoint(tiny):
    names = {name for name, _ in tiny.named_parameters()}
    expected_block = {
        f"h.1.{suffix}"
        for suffix in (
            "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
            "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
            "mlp.c_proj.weight", "mlp.c_proj.bias",
        )
    }  # fmt: skip
    assert {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"} | expected_block <= names
    assert len(names) == 4 + 12 * TINY.n_layer, "no lm_head of its own: it is tied to wte"
