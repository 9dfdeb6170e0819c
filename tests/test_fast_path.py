"""gpt2/fast on whole models: the C forward pass computes what the readable
path computes (logits and KV cache), position by position bit-identical
however many rows share a pass (batch invariance, and with it exact greedy
parity at near-ties), never reads a stale weight copy, and hands every pass
it cannot take to the readable path. `status` says which path runs and why.

Tolerance against the readable path: 1e-4 on logits of scale ~5 (measured
1e-6 to 2e-5: float32 sums in another order, the kernels' layer norm, GELU
and exp); a block wired wrong is off by more than 1e-2.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.utils.parametrize
import torch.nn.utils.prune

from gpt2 import GPT2, PRESETS, GPT2Config, fast, generate, init_random_weights
from gpt2.fast import build
from gpt2.fast.accelerator import MAX_NEW_TOKENS
from helpers import REPO_ROOT, binary_tree_mask, tiny_gpt2
from spec_decoding import speculative_generate

ATOL = 1e-4
CONFIG = GPT2Config(n_layer=3, n_head=4, n_embd=64, vocab_size=101, n_ctx=160)  # hs = 16


def new_model(seed: int = 0, config: GPT2Config = CONFIG) -> GPT2:
    """Random weights with non-trivial layer norms and biases, so that swapping any two shows."""
    model = GPT2(config).eval()
    init_random_weights(model, std=0.2, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def ids(B: int, T: int, seed: int, vocab: int = CONFIG.vocab_size) -> torch.Tensor:
    return torch.randint(vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def run(model: GPT2, *pieces: torch.Tensor, readable: bool = False, mask: torch.Tensor | None = None):
    """Feeds `pieces` one after another into a fresh cache; the last one with
    `mask`. Returns (logits of each piece, cache)."""
    saved = model.accelerator
    if readable:
        model.accelerator = None
    try:
        cache = model.new_cache(pieces[0].size(0))
        out = [model(p, cache, mask=mask if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
    finally:
        model.accelerator = saved
    return out, cache


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---------------------------------------------------------------------------
# The same computation as the readable path
# ---------------------------------------------------------------------------


PASSES = {  # B, prompt length, new tokens, mask
    "decode step": (1, 9, 1, None),
    "verification": (1, 9, 5, None),
    "16 new tokens": (1, 9, 16, None),
    "a batch": (2, 9, 3, None),
    "a token tree": (1, 9, 15, "tree"),
    "a token tree in chunks": (1, 9, MAX_NEW_TOKENS + 36, "tree"),
    "a long prefill in chunks": (1, 2 * MAX_NEW_TOKENS + 22, 1, None),  # 150 tokens: three calls of 50
}


@pytest.mark.parametrize("case", PASSES)
def test_the_fast_path_gives_the_readable_logits_and_cache(fast_kernels, case):
    B, P, T, mask_kind = PASSES[case]
    model = fast.accelerate(new_model())
    mask = binary_tree_mask(T) if mask_kind == "tree" else None
    prompt, new = ids(B, P, 1), ids(B, T, 2)
    (fast_prefill, fast_logits), fast_cache = run(model, prompt, new, mask=mask)
    (slow_prefill, slow_logits), slow_cache = run(model, prompt, new, readable=True, mask=mask)
    assert max_diff(fast_prefill, slow_prefill) <= ATOL and max_diff(fast_logits, slow_logits) <= ATOL
    assert torch.equal(fast_cache.lengths, slow_cache.lengths)
    K = P + T
    assert max_diff(fast_cache.k[:, :, :, :K], slow_cache.k[:, :, :, :K]) <= ATOL
    assert max_diff(fast_cache.v[:, :, :, :K], slow_cache.v[:, :, :, :K]) <= ATOL
    assert slow_logits.std() > 0.5  # the weights are not trivial


def test_that_check_fails_a_block_wired_wrong(fast_kernels):
    """The comparison above can fail: a pointer table with ln_1 and ln_2 swapped in the second block."""
    model = fast.accelerate(new_model())
    prompt, new = ids(1, 9, 1), ids(1, 2, 2)
    (_, right), _ = run(model, prompt, new)
    table = model.accelerator.block_table(model)
    table[1].ln_1_weight, table[1].ln_2_weight = table[1].ln_2_weight, table[1].ln_1_weight
    (_, wrong), _ = run(model, prompt, new)
    assert max_diff(wrong, right) > 1e-2


# ---------------------------------------------------------------------------
# Batch invariance: a position's logits do not depend on the rows beside it
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["tiny", "gpt2", "gpt2 int8"])
def test_a_position_has_the_same_bits_in_a_step_a_verification_and_a_batch(fast_kernels, shape):
    config = CONFIG if shape == "tiny" else PRESETS["gpt2"]
    model = fast.accelerate(new_model(config=config), int8=shape.endswith("int8"))
    V = config.vocab_size
    prompt, new = ids(1, 20, 3, V), ids(1, 16, 4, V)
    (_, *steps), _ = run(model, prompt, *new.split(1, dim=1))  # 16 one-token steps
    one_by_one = torch.cat(steps, dim=1)  # (1, 16, V)
    for k in range(2, 17):  # a k-token pass gives the bits of k one-token steps
        (_, together), _ = run(model, prompt, new[:, :k])
        assert torch.equal(together, one_by_one[:, :k]), k
    (whole,), _ = run(model, torch.cat([prompt, new], dim=1))  # and so does the prefill of all of it
    assert torch.equal(whole[:, 20:], one_by_one)
    # A batch of 3 rows of different lengths: each row's bits are its own. The
    # rows are prefilled padded to 20 tokens at the end, then each is rewound
    # to its own length (its real positions never saw the padding).
    rows = [ids(1, n, 10 + n, V) for n in (5, 20, 12)]
    padded = torch.cat([torch.cat([r, torch.zeros(1, 20 - r.size(1), dtype=torch.long)], dim=1) for r in rows])
    next_tokens = ids(3, 4, 20, V)
    with torch.inference_mode():
        batched = model.new_cache(3)
        model(padded, batched)
        batched.rewind(torch.tensor([r.size(1) for r in rows]))
        together = model(next_tokens, batched)  # (3, 4, V)
    for b, row in enumerate(rows):
        (_, alone), _ = run(model, row, next_tokens[b : b + 1])
        assert torch.equal(together[b : b + 1], alone), b


def test_a_tree_larger_than_one_kernel_call_keeps_the_bits_of_its_paths(fast_kernels):
    # 100 nodes go in two kernel calls: each node's logits are the bits of its path from the root fed as a chain.
    model = fast.accelerate(new_model())
    T = 100
    assert T > MAX_NEW_TOKENS
    prompt, new = ids(1, 9, 1), ids(1, T, 2)
    (_, tree_logits), _ = run(model, prompt, new, mask=binary_tree_mask(T))  # node i's parent: (i - 1) // 2
    for node in (T - 1, MAX_NEW_TOKENS, MAX_NEW_TOKENS - 1, 40):
        path = [node]
        while path[-1] > 0:
            path.append((path[-1] - 1) // 2)
        (_, chain), _ = run(model, prompt, new[:, path[::-1]])
        assert torch.equal(tree_logits[0, node], chain[0, -1]), node


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_the_thread_count_changes_no_bit(fast_kernels, int8):
    """Every kernel output is summed by one thread, so the count the thread
    chooser picks (gpt2/fast/threads.py) cannot change a result."""
    model = fast.accelerate(new_model(config=PRESETS["gpt2"]), int8=int8, adapt_threads=False)
    prompt, new = ids(2, 30, 3, 50257), ids(2, 7, 4, 50257)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            (first, second), cache = run(model, prompt, new)
            results.append((first, second, cache.k[:, :, :, :37].clone()))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


class FakeLoad:
    """Passes on a fake clock: pass i run with t threads takes cost(t, i) seconds. `used` lists each pass's
    thread count."""

    def __init__(self, cost) -> None:
        self.cost, self.now, self.used = cost, 0.0, []

    def clock(self) -> float:
        return self.now

    def work(self) -> None:
        threads = torch.get_num_threads()
        self.now += self.cost(threads, len(self.used))
        self.used.append(threads)

    def run(self, chooser, passes: int, threads: int) -> list[int]:
        """`passes` more passes through `chooser` with `threads` threads there; the thread count of each."""
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            start = len(self.used)
            for _ in range(passes):
                chooser.run(1, self.work)
                assert torch.get_num_threads() == threads  # restored after every pass
            return self.used[start:]
        finally:
            torch.set_num_threads(before)


def probe_schedule(first: int, cap: int, start: int, end: int) -> list[int]:
    """The passes in [start, end) that probe when every probe loses: the first after `first` passes, then at
    intervals doubling up to `cap`."""
    at, interval, out = start + first - 1, first, []
    while at < end:
        out.append(at)
        interval = min(2 * interval, cap)
        at += interval
    return out


def test_the_thread_chooser_follows_the_faster_count():
    """A pass that is slow with 2 threads (as when another process shares a
    core) moves the chooser to 1 thread; when 2 threads become the faster
    count again, it comes back."""
    from gpt2.fast.threads import LAST_PROBE_BELOW, ThreadChooser

    cost = {1: 0.002, 2: 0.008}  # seconds per pass: 2 threads slowed down
    load = FakeLoad(lambda t, i: cost[t])
    chooser = ThreadChooser(clock=load.clock)
    used = load.run(chooser, 40, threads=2)
    assert chooser.count == 1 and used[-16:].count(1) >= 14, used  # now and then a probe of 2
    cost.update({1: 0.008, 2: 0.002})  # the other process has gone
    used = load.run(chooser, 2 * LAST_PROBE_BELOW + 10, threads=2)
    assert chooser.count == 2 and used[-16:].count(2) >= 14, used


@pytest.mark.parametrize("drift", [0.0, 0.005], ids=["steady", "slowly-drifting"])
def test_losing_probes_grow_rare_and_a_slow_drift_is_not_a_change_of_load(drift):
    """While probes lose, they come at intervals doubling from FIRST_PROBE up to LAST_PROBE at all threads, and
    up to LAST_PROBE_BELOW below them. A load that drifts slowly (0.5% per pass, 400x over the run) is followed
    by the running mean, not taken for a change: no extra probe."""
    from gpt2.fast.threads import FIRST_PROBE, LAST_PROBE, LAST_PROBE_BELOW, ThreadChooser

    best_all = FakeLoad(lambda t, i: (1.0 if t == 2 else 2.0) * (1 + drift) ** i)
    used = best_all.run(ThreadChooser(clock=best_all.clock), 1200, threads=2)
    assert [i for i, t in enumerate(used) if t != 2] == probe_schedule(FIRST_PROBE, LAST_PROBE, 0, 1200)

    best_one = FakeLoad(lambda t, i: (1.0 if t == 1 else 2.0) * (1 + drift) ** i)
    used = best_one.run(ThreadChooser(clock=best_one.clock), 400, threads=2)
    assert used[: FIRST_PROBE] == [2] * (FIRST_PROBE - 1) + [1]  # the first probe wins: 1 thread from then on
    probes = probe_schedule(FIRST_PROBE, LAST_PROBE_BELOW, FIRST_PROBE, 400)
    assert [i for i, t in enumerate(used) if t == 2 and i >= FIRST_PROBE] == probes


def test_a_change_of_load_is_probed_at_once_and_a_few_slow_passes_are_not():
    """With probes 256 passes apart, a pass time that jumps and stays (3 passes in a row) is probed on the next
    pass, whichever way it jumped; slow passes that are not 3 in a row probe nothing."""
    from gpt2.fast.threads import FIRST_PROBE, LAST_PROBE_BELOW, ThreadChooser

    cost = {1: 2.0, 2: 1.0}
    slow = {300, 320, 322, 324, 340, 341}  # alone, every other pass, two in a row: 3x slower
    load = FakeLoad(lambda t, i: cost[t] * (3.0 if i in slow and t == 2 else 1.0))
    chooser = ThreadChooser(clock=load.clock)
    used = load.run(chooser, 400, threads=2)
    assert used[248:] == [2] * 152  # the last scheduled probe was pass 247, the next is due at 503

    cost[2] = 3.0  # another process now shares a core: 2 threads are slower than 1
    used = load.run(chooser, 100, threads=2)
    assert used[:10] == [2, 2, 2] + [1] * 7  # three slow passes, then a probe of 1 thread, which wins
    assert [i for i, t in enumerate(used) if t == 2 and i > 3] == probe_schedule(FIRST_PROBE, LAST_PROBE_BELOW, 4, 100)

    cost[1] = 0.6  # and back down, 23 passes before the next scheduled probe: 1 thread got faster, 2 faster still
    cost[2] = 0.3
    used = load.run(chooser, 10, threads=2)
    assert used == [1, 1, 1] + [2] * 7


def test_between_all_threads_and_one_the_probes_try_both_sides():
    """With 4 threads and 2 the fastest count, the chooser walks down from 4 to 2 and then probes 1 and 3 in
    turn."""
    from gpt2.fast.threads import ThreadChooser

    cost = {1: 4.0, 2: 2.0, 3: 2.5, 4: 3.0}
    load = FakeLoad(lambda t, i: cost[t])
    used = load.run(ThreadChooser(clock=load.clock), 600, threads=4)
    assert used[:8] == [4] * 7 + [3] and used[8:15] == [3] * 7  # the probe of 3 won
    settled = used[used.index(2) + 1 :]
    probes = [t for t in settled if t != 2]
    assert len(probes) >= 10 and probes[::2] == [3] * len(probes[::2]) and probes[1::2] == [1] * len(probes[1::2])


def near_tie_target() -> GPT2:
    """A target whose two best candidates are often nearly tied: token 3's
    embedding (= LM head row) is token 4's plus 1e-8 noise, and 4 is this
    model's most frequent token, so whenever it leads, 3 trails (or leads) by
    rounding noise."""
    model = tiny_gpt2(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_ctx=64, vocab_size=8), seed=5)
    with torch.no_grad():
        model.wte.weight[3] = model.wte.weight[4] + 1e-8 * torch.randn(32, generator=torch.Generator().manual_seed(0))
    return model


@pytest.mark.usefixtures("single_thread")
def test_greedy_speculation_equals_greedy_decoding_at_near_ties(fast_kernels):
    """On the fast path, 120 greedy runs, gamma 1..8, with a draft that often
    disagrees: every one is identical to plain greedy decoding. (On the
    kernels before batch invariance only 2 of the 120 were; on the readable
    path a few, 2 to 6 by machine.)"""
    target = fast.accelerate(near_tie_target())
    draft = fast.accelerate(tiny_gpt2(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=64, vocab_size=8), seed=6))
    ties = identical = 0
    for run_index in range(120):
        prompt = ids(1, 1 + run_index % 5, 100 + run_index, 8)
        baseline = generate(target, prompt, 40)
        ties += int(((baseline[0, prompt.size(1) :] == 3) | (baseline[0, prompt.size(1) :] == 4)).sum())
        out, _ = speculative_generate(target, draft, prompt, gamma=1 + run_index % 8, max_new_tokens=40)
        identical += int(torch.equal(out, baseline))
    assert ties > 500, "the runs must pass through the near-tied tokens often"
    assert identical == 120


# ---------------------------------------------------------------------------
# Copies never go stale
# ---------------------------------------------------------------------------


def readable_and_fast(model: GPT2, prompt: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    (_, slow), _ = run(model, prompt, new, readable=True)
    (_, quick), _ = run(model, prompt, new)
    return slow, quick


EDITS = {
    "written in place": lambda m: m.h[0].mlp.c_fc.weight.mul_(1.5),
    "given new storage": lambda m: setattr(m.h[1].attn.c_attn.weight, "data", m.h[1].attn.c_attn.weight.data * -1),
    "replaced by a new parameter": lambda m: setattr(
        m.h[2].mlp, "c_proj", torch.nn.Linear(4 * CONFIG.n_embd, CONFIG.n_embd)
    ),
    "the tied head written in place": lambda m: m.wte.weight.add_(0.1),
    # The first new storage is freed by the second, which may take the packed weight's address back at the same
    # version: the packed copy holds its source's storage, so that address stays taken.
    "given new storage twice": lambda m: [setattr(w, "data", torch.randn_like(w))
                                          for w in [m.h[0].mlp.c_fc.weight] * 2],
    "a layer norm written in place": lambda m: m.h[0].ln_2.weight.mul_(-1),
}


@pytest.mark.parametrize("edit", EDITS)
@pytest.mark.parametrize("int8", [False, True])
def test_an_edited_weight_is_used_at_the_next_pass(fast_kernels, edit, int8):
    model = fast.accelerate(new_model(), int8=int8)
    prompt, new = ids(1, 9, 1), ids(1, 3, 2)
    slow, quick = readable_and_fast(model, prompt, new)
    assert max_diff(slow, quick) <= ATOL
    with torch.no_grad():
        EDITS[edit](model)
    slow_after, quick_after = readable_and_fast(model, prompt, new)
    assert max_diff(slow_after, slow) > 1e-2, "the edit must change the model"
    assert max_diff(quick_after, slow_after) <= ATOL


def test_a_model_made_under_inference_mode_is_watched_too(fast_kernels):
    """Tensors made under torch.inference_mode() have no version counter;
    accelerate swaps them for ordinary ones, so an in-place edit is seen."""
    with torch.inference_mode():
        model = new_model()
    assert model.h[0].attn.c_attn.weight.is_inference()
    fast.accelerate(model)
    prompt, new = ids(1, 9, 1), ids(1, 3, 2)
    slow, _ = readable_and_fast(model, prompt, new)
    with torch.inference_mode():
        model.h[0].attn.c_attn.weight.mul_(2.0)
    slow_after, quick_after = readable_and_fast(model, prompt, new)
    assert max_diff(slow_after, slow) > 1e-2
    assert max_diff(quick_after, slow_after) <= ATOL


@pytest.mark.parametrize("int8", [False, True])
def test_weights_made_under_inference_mode_after_accelerating_go_to_the_readable_code(fast_kernels, int8):
    """Weights loaded under inference mode (no version counter) after `accelerate` cannot be watched: those
    passes take the readable path, and accelerating such a model (int8 too) makes them ordinary first."""
    prompt, new = ids(1, 9, 1), ids(1, 3, 2)
    model = fast.accelerate(new_model(), int8=int8)
    with torch.inference_mode():
        model.load_state_dict(new_model(seed=5).state_dict(), assign=True)
    slow, quick = readable_and_fast(model, prompt, new)
    assert torch.equal(quick, slow)
    with torch.inference_mode():
        made_inside = new_model(seed=5)
    fast.accelerate(made_inside, int8=int8)
    slow_int8, quick_int8 = readable_and_fast(made_inside, prompt, new)
    assert max_diff(quick_int8, slow_int8) <= ATOL and (int8 or torch.equal(slow_int8, slow))


def test_under_autocast_the_readable_code_runs(fast_kernels):
    model = fast.accelerate(new_model())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        slow, quick = readable_and_fast(model, ids(1, 9, 1), ids(1, 3, 2))
    assert quick.dtype == slow.dtype == torch.bfloat16 and torch.equal(quick, slow)


def test_an_edit_through_data_is_seen_once_accelerate_runs_again(fast_kernels):
    """`.data` has a version counter of its own, so the kernels' copy cannot
    notice this edit (accelerate's docstring says so); accelerate again packs anew."""
    model = fast.accelerate(new_model())
    prompt, new = ids(1, 9, 1), ids(1, 3, 2)
    slow, _ = readable_and_fast(model, prompt, new)
    model.h[0].mlp.c_fc.weight.data.mul_(-1)
    fast.accelerate(model)
    slow_after, quick_after = readable_and_fast(model, prompt, new)
    assert max_diff(slow_after, slow) > 1e-2
    assert max_diff(quick_after, slow_after) <= ATOL


# ---------------------------------------------------------------------------
# What it cannot take goes to the readable path; status says why
# ---------------------------------------------------------------------------


class Doubled(torch.nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


class Adapter(torch.nn.Linear):
    """A LoRA-style layer: a Linear subclass with a forward of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 1.5 * super().forward(x)


def with_adapter(m: GPT2) -> None:
    old = m.h[0].attn.c_proj
    m.h[0].attn.c_proj = Adapter(old.in_features, old.out_features)
    m.h[0].attn.c_proj.load_state_dict(old.state_dict())


def with_wider_mlp(m: GPT2) -> None:
    # Stock Linear modules, but 8C wide where the config (and blocks.c) says 4C.
    g = torch.Generator().manual_seed(3)
    C, mlp = m.config.n_embd, m.h[0].mlp
    mlp.c_fc, mlp.c_proj = torch.nn.Linear(C, 8 * C), torch.nn.Linear(8 * C, C)
    with torch.no_grad():
        for p in (*mlp.c_fc.parameters(), *mlp.c_proj.parameters()):
            p.copy_(0.2 * torch.randn(p.shape, generator=g))


CHANGED_MODULES = {
    "a forward hook on a block": lambda m: m.h[1].register_forward_hook(lambda mod, args, out: out * 0.5),
    "a pre-hook on an MLP": lambda m: m.h[0].mlp.register_forward_pre_hook(lambda mod, args: (args[0] + 1.0,)),
    "a hook on the final layer norm": lambda m: m.ln_f.register_forward_hook(lambda mod, args, out: -out),
    "a global forward hook": lambda m: torch.nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: out * 0.5 if isinstance(mod, torch.nn.LayerNorm) else None),
    "pruning": lambda m: torch.nn.utils.prune.l1_unstructured(m.h[0].mlp.c_fc, "weight", amount=0.5),
    "a parametrization": lambda m: torch.nn.utils.parametrize.register_parametrization(
        m.h[0].attn.c_proj, "weight", Doubled()),
    "a Linear subclass": with_adapter,
    "a forward of its own": lambda m: setattr(m.h[1].mlp, "forward", lambda x: torch.zeros_like(x)),
    "a wider MLP": with_wider_mlp,
    "a layer norm epsilon of its own": lambda m: setattr(m.h[0].ln_1, "eps", 0.5),
    "a Linear without a bias": lambda m: setattr(m.h[0].mlp, "c_fc", torch.nn.Linear(CONFIG.n_embd, 4 * CONFIG.n_embd,
                                                                                    bias=False)),
    "a layer norm without a bias": lambda m: setattr(m, "ln_f", torch.nn.LayerNorm(CONFIG.n_embd, bias=False)),
}


@pytest.mark.parametrize("change", CHANGED_MODULES)
def test_hooks_and_changed_modules_are_run_by_the_readable_code(fast_kernels, change):
    """The kernels stand in for the stock modules only: what a hook, a parametrization or a subclass adds would
    be skipped, so such a pass goes to the readable path."""
    model = fast.accelerate(new_model())
    prompt, new = ids(1, 9, 1), ids(1, 3, 2)
    slow, _ = readable_and_fast(model, prompt, new)
    handle = CHANGED_MODULES[change](model)
    try:
        slow_after, quick_after = readable_and_fast(model, prompt, new)
    finally:
        if hasattr(handle, "remove"):
            handle.remove()  # a global hook would reach every later test
    assert max_diff(slow_after, slow) > 1e-2, "the change must change the model"
    assert torch.equal(quick_after, slow_after)


def test_an_embedding_of_another_vocabulary_is_run_by_the_readable_code(fast_kernels):
    # The kernels' LM head is as wide as the config's vocabulary: 7 more rows would be cut off (or, fewer, read past).
    model = fast.accelerate(new_model())
    V, C = CONFIG.vocab_size, CONFIG.n_embd
    model.wte = torch.nn.Embedding(V + 7, C)
    slow, quick = readable_and_fast(model, ids(1, 9, 1), ids(1, 3, 2))
    assert quick.shape == slow.shape == (1, 3, V + 7) and torch.equal(quick, slow)


def test_a_model_with_blocks_taken_out_is_run_by_the_readable_code(fast_kernels):
    model = new_model()
    model.h = model.h[:2]  # of the config's 3
    fast.accelerate(model)
    slow, quick = readable_and_fast(model, ids(1, 9, 1), ids(1, 3, 2))
    assert torch.equal(quick, slow)


def test_a_mask_where_a_token_sees_a_later_one_gives_the_readable_logits_past_one_kernel_call(fast_kernels):
    # A pass longer than one kernel call goes in chunks, each seeing only what came before its end.
    model = fast.accelerate(new_model())
    for T in (MAX_NEW_TOKENS, MAX_NEW_TOKENS + 1, 2 * MAX_NEW_TOKENS + 3):
        mask = torch.eye(T, dtype=torch.bool)
        mask[0, T - 1] = True  # the first token sees the last
        (_, quick), _ = run(model, ids(1, 9, 1), ids(1, T, 2), mask=mask)
        (_, slow), _ = run(model, ids(1, 9, 1), ids(1, T, 2), mask=mask, readable=True)
        assert max_diff(quick, slow) < ATOL, T


def test_passes_it_cannot_take_run_the_readable_code(fast_kernels):
    model = fast.accelerate(new_model())
    prompt = ids(1, 9, 1)
    with torch.inference_mode():
        x = model.wte(prompt)
        cache = model.new_cache()
        assert model.accelerator.takes(model, x, cache, None)
        assert model.accelerator.takes(model, x, None, None)  # no KV cache: a scratch one
        assert model.accelerator.takes(model, model.wte(ids(1, 70, 1)), cache, binary_tree_mask(70))  # in chunks
        assert not model.accelerator.takes(model, x, cache, binary_tree_mask(9).to("meta"))  # a mask off the CPU
    model.requires_grad_(True)
    x = model.wte(prompt)
    assert not model.accelerator.takes(model, x, model.new_cache(), None)  # gradients are recorded
    logits = model(prompt)  # and run through the readable code
    logits.sum().backward()
    assert model.h[0].attn.c_attn.weight.grad is not None
    odd = fast.accelerate(new_model(config=GPT2Config(n_layer=1, n_head=3, n_embd=36, vocab_size=50, n_ctx=16)))
    assert odd.accelerator is None and "multiples of 8, this model has 36 and 12" in fast.status(odd)
    (fast_out,), _ = run(odd, ids(1, 5, 1, 50))  # width 36: not a multiple of 8
    (slow_out,), _ = run(odd, ids(1, 5, 1, 50), readable=True)
    assert torch.equal(fast_out, slow_out)


def test_a_pass_of_no_tokens_is_refused_on_both_paths(fast_kernels):
    model = fast.accelerate(new_model())
    with torch.inference_mode():
        cache = model.new_cache()
        model(ids(1, 4, 1), cache)
        for accelerator in (model.accelerator, None):
            model.accelerator = accelerator
            for cached in (None, cache):
                with pytest.raises(ValueError, match=r"input_ids of shape \(1, 0\) holds no tokens"):
                    model(torch.zeros(1, 0, dtype=torch.long), cached)
            with pytest.raises(ValueError, match=r"input_ids of shape \(0, 3\) holds no tokens"):
                model(torch.zeros(0, 3, dtype=torch.long))  # no rows
        assert cache.length == 4


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: fast.accelerate(None), "expected a GPT2 model .* got NoneType"),
        (lambda: fast.accelerate(torch.nn.Linear(2, 2)), "expected a GPT2 model .* got Linear"),
        (lambda: fast.accelerate(new_model(), int8="no"), "int8 must be True or False, got 'no'"),
        (lambda: fast.accelerate(new_model(), adapt_threads="x"), "adapt_threads must be True or False, got 'x'"),
        (lambda: fast.status("gpt2"), "expected a GPT2 model .* got str"),
    ],
)
def test_accelerate_and_status_refuse_what_is_not_a_model(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_accelerate_and_status_on_models_the_kernels_do_not_serve(monkeypatch):
    def no_build():
        raise AssertionError("nothing may be compiled for a model the kernels cannot serve")

    monkeypatch.setattr(build, "load", no_build)
    half = fast.accelerate(new_model().half())
    assert half.accelerator is None
    assert "CPU float32 models, this one is cpu float16" in fast.status(half)
    monkeypatch.setenv(fast.READABLE_ENV, "1")
    model = fast.accelerate(new_model())
    assert model.accelerator is None and "GPT2_PLAIN_LINEAR=1" in fast.status(model)


def test_status_names_the_path(fast_kernels):
    model = new_model()
    assert fast.status(model).startswith("readable path") and "not accelerated" in fast.status(model)
    fast.accelerate(model)
    assert fast.status(model).startswith("fast path") and "float32 weights" in fast.status(model)
    assert "int8 weights" in fast.status(fast.accelerate(new_model(), int8=True))
    model.accelerator = None  # the switch
    assert fast.status(model).startswith("readable path")
    cast = fast.accelerate(new_model()).half()  # its accelerator stands aside for a float16 model
    assert fast.status(cast).startswith("readable path") and "this one is cpu float16" in fast.status(cast)


@pytest.mark.parametrize("int8", [False, True])
def test_a_deep_copy_is_accelerated_on_its_own_weights_and_a_pickle_drops_the_accelerator(fast_kernels, int8):
    import copy
    import pickle

    model = fast.accelerate(new_model(), int8=int8)
    prompt, new = ids(1, 9, 1), ids(1, 3, 2)
    _, before = readable_and_fast(model, prompt, new)
    twin = copy.deepcopy(model)
    assert twin.accelerator is not None and twin.accelerator.model() is twin
    with torch.no_grad():
        twin.h[0].mlp.c_fc.weight.add_(0.05)  # the copy's own weights, not the original's (off the int8 grid)
    slow, quick = readable_and_fast(twin, prompt, new)
    assert max_diff(slow, before) > 1e-2 and max_diff(quick, slow) <= ATOL
    assert torch.equal(readable_and_fast(model, prompt, new)[1], before)
    weights = "int8 and float32" if int8 else "float32"  # the edited matrix is no int8 rounding any more
    assert f"fast path: C kernels ({model.accelerator.kernels.path.name}), {weights} weights" in fast.status(twin)
    unpickled = pickle.loads(pickle.dumps(model))
    assert unpickled.accelerator is None and torch.equal(readable_and_fast(unpickled, prompt, new)[0],
                                                         readable_and_fast(model, prompt, new)[0])


def test_status_says_which_weights_the_kernels_read_now(fast_kernels):
    model = fast.accelerate(new_model(), int8=True)
    quantised = {name: p.clone() for name, p in model.state_dict().items()}
    model.load_state_dict(new_model(seed=3).state_dict())  # float weights: packed as float32 at the next pass
    run(model, ids(1, 3, 1))
    assert "float32 weights" in fast.status(model)
    model.load_state_dict(quantised)  # int8 roundings again: packed as int8
    run(model, ids(1, 3, 1))
    assert "int8 weights" in fast.status(model)


def test_status_of_a_kernel_cache_the_file_system_refuses(fast_kernels, monkeypatch):
    monkeypatch.setenv("GPT2_KERNEL_CACHE", "/" + "x" * 300)  # a name too long to look up
    assert "the kernel cache folder" in fast.status() and "cannot be read (File name too long)" in fast.status()


def run_python(code: str, tmp_path, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "GPT2_KERNEL_CACHE": str(tmp_path / "cache"), **env}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=300
    )


def test_status_before_any_build_says_the_kernels_will_be_compiled_and_builds_nothing(fast_kernels, tmp_path):
    result = run_python("from gpt2 import fast; print(fast.status())", tmp_path)  # a fresh process, an empty cache
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("fast path available: C kernels to be compiled with ")
    assert result.stdout.rstrip().endswith(" on first use") and not (tmp_path / "cache").exists()


FALLBACK = """
import torch
from gpt2 import GPT2, GPT2Config, fast
model = fast.accelerate(GPT2(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_ctx=8)).eval())
assert model.accelerator is None
with torch.inference_mode():
    model(torch.tensor([[1, 2, 3]]), model.new_cache())
print(fast.status(model))
"""


@pytest.mark.parametrize(
    "compiler, expected",
    [("no-such-compiler-here", "no C compiler"), ("false", "building the C kernels failed"),
     ("true", "true` exited 0 but wrote no library")],
)
def test_without_a_working_compiler_it_falls_back_and_says_why(tmp_path, compiler, expected):
    if build.cpu_unsupported():
        pytest.skip(build.cpu_unsupported())
    done = run_python(FALLBACK, tmp_path, CC=compiler)
    assert done.returncode == 0, done.stderr
    assert expected in done.stdout and "readable path" in done.stdout


@pytest.mark.parametrize("stream", ["stderr", "stdout"])
def test_a_failed_build_says_the_compilers_last_line(tmp_path, stream):
    """Why the compiler failed is its last line: on stderr, as compilers write it, or on stdout where only that
    has output. Nothing is left in the cache folder."""
    to = " >&2" if stream == "stderr" else ""
    script = f"echo 'In file included from linear.c:1:'{to}; echo 'linear.c:9: error: no such intrinsic'{to}; exit 3"
    cc = [shutil.which("sh"), "-c", script, "sh"]  # the flags and sources come after, as $1, $2, ...
    with pytest.raises(RuntimeError, match=r"failed \(exit 3\): linear.c:9: error: no such intrinsic$"):
        build.compile_library(cc, tmp_path / "kernels.so")
    assert list(tmp_path.iterdir()) == []


ACCELERATED = """
import torch
from gpt2 import GPT2, GPT2Config, fast
model = fast.accelerate(GPT2(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_ctx=8)).eval())
with torch.inference_mode():
    model(torch.tensor([[1, 2, 3]]), model.new_cache())
print(fast.status(model))
"""


def test_a_library_damaged_in_the_cache_is_built_again(fast_kernels, tmp_path):
    # A library cut short (a crash during its build, a partial copy of the cache) killed every later process
    # in the system loader (SIGBUS): its digest no longer matches, so it is compiled again.
    first = run_python(ACCELERATED, tmp_path)
    assert first.returncode == 0 and "fast path" in first.stdout, first.stderr
    (library,) = (tmp_path / "cache").glob("*.so")
    library.write_bytes(library.read_bytes()[: library.stat().st_size * 2 // 5])
    again = run_python(ACCELERATED, tmp_path)
    assert again.returncode == 0 and "fast path" in again.stdout, (again.returncode, again.stderr)
    assert build.intact(library)


def test_cc_may_carry_arguments(fast_kernels, tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "cc -std=gnu11")  # as make takes it (ccache gcc, gcc -m64, ...)
    assert build.compiler() == [shutil.which("cc"), "-std=gnu11"]
    monkeypatch.setenv("CC", "")
    assert build.compiler() == [shutil.which("cc")]
    done = run_python(ACCELERATED, tmp_path, CC="cc -std=gnu11")
    assert done.returncode == 0 and "fast path" in done.stdout, done.stderr


def test_the_build_is_cached_by_its_recipe(fast_kernels, tmp_path, monkeypatch):
    monkeypatch.setenv("GPT2_KERNEL_CACHE", str(tmp_path))
    cc = build.compiler()
    library = build.library_path(cc)
    assert library.parent == tmp_path and not library.exists()
    build.compile_library(cc, library)
    stamp = library.stat().st_mtime_ns
    assert build.library_path(cc) == library  # the same recipe, the same file: not compiled again
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([library.name, build.digest_path(library).name])
    assert build.intact(library)  # and no temporary file left
    assert library.stat().st_mtime_ns == stamp
    umask = os.umask(0o022)
    os.umask(umask)
    assert library.stat().st_mode & 0o777 == 0o755 & ~umask  # other users of a shared cache can load it too
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPT2_KERNEL_CACHE", ".")
    assert build.cache_dir() == tmp_path and build.library_path(cc) == library  # absolute: ctypes needs a path


def test_avx512_builds_its_own_library_and_avx2_cpus_never_get_it(monkeypatch):
    """The AVX-512 flags (512-bit tiles in linear.c) go only to a CPU PyTorch
    counts as AVX512 and whose own flags have AVX-512, and they are part of the library's name: a kernel cache
    shared with an AVX2-only machine cannot hand it the AVX-512 build."""
    paths = {}
    avx512_cpu = frozenset({"avx2", "fma", "avx512f", "avx512vl"})
    for capability in ("AVX2", "AVX512"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        monkeypatch.setattr(build, "cpu_flags", lambda: avx512_cpu)
        assert (set(build.AVX512_FLAGS) <= set(build.flags())) == (capability == "AVX512")
        assert set(build.FLAGS) <= set(build.flags())
        paths[capability] = build.library_path(["cc"])
    assert paths["AVX2"] != paths["AVX512"]
    # ATEN_CPU_CAPABILITY=avx512 makes PyTorch report AVX512 on any CPU: the CPU's own flags decide.
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert not set(build.AVX512_FLAGS) & set(build.flags()) and build.cpu_unsupported() is None
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"sse4_2"}))
    assert "lack" in build.cpu_unsupported()


def test_a_capability_forced_past_the_cpu_builds_kernels_the_cpu_runs(fast_kernels, tmp_path):
    # With ATEN_CPU_CAPABILITY=avx512 on an AVX2-only CPU, the AVX-512 build died of an illegal instruction.
    done = run_python(ACCELERATED, tmp_path, ATEN_CPU_CAPABILITY="avx512", GPT2_KERNEL_CACHE=str(build.cache_dir()))
    assert done.returncode == 0 and "fast path" in done.stdout, (done.returncode, done.stderr[-1500:])


ODD_INPUTS = """
import torch
from gpt2 import GPT2, GPT2Config, fast, init_random_weights
model = GPT2(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50, n_ctx=16)).eval()
init_random_weights(model, std=0.2, generator=torch.Generator().manual_seed(0))
x = torch.randint(50, (1, 9), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    readable = model(x)
    {change}
    fast.accelerate(model)
    with {context}:
        quick = model(x, model.new_cache(1))
print(fast.status(model).split(":")[0], float((quick - readable).abs().max()))
"""


@pytest.mark.parametrize("change, context, path", [
    # torch.set_default_device("cuda") for a GPU target beside a CPU draft: the kernels' buffers and a cache's
    # lengths went to the default device, and the kernels got a device (here: meta, 0) pointer: SIGSEGV.
    ("pass", 'torch.device("meta")', "fast path"),
    # A tensor subclass wrapping its data (a quantised weight) has no storage: its data pointer is 0. As c_fc's
    # weight: SIGSEGV; as ln_1's: the kernels took it for "no layer norm", logits off by 0.3.
    ("model.h[0].mlp.c_fc.weight = torch.nn.Parameter(TwoTensor(*[model.h[0].mlp.c_fc.weight.clone()] * 2))",
     "torch.no_grad()", "readable path"),
    ("model.h[0].ln_1.weight = torch.nn.Parameter(TwoTensor(*[model.h[0].ln_1.weight.clone()] * 2))",
     "torch.no_grad()", "readable path"),
    ("x = TwoTensor(x, x)", "torch.no_grad()", "fast path"),  # its activations too: that pass takes the readable path
])
def test_a_default_device_and_wrapped_parameters_leave_the_results_alone(fast_kernels, tmp_path, change, context,
                                                                         path):
    code = "from torch.testing._internal.two_tensor import TwoTensor\n" + ODD_INPUTS.format(change=change,
                                                                                             context=context)
    done = run_python(code, tmp_path, GPT2_KERNEL_CACHE=str(build.cache_dir()))  # the kernels built already
    assert done.returncode == 0, (done.returncode, done.stderr[-1500:])
    status, error = done.stdout.rsplit(" ", 1)
    assert status.startswith(path) and float(error) < (ATOL if path == "fast path" else 1e-12), done.stdout


RECORDED = """
import torch
from gpt2 import GPT2, GPT2Config, fast, init_random_weights
torch.set_default_dtype(torch.{default})
model = GPT2(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50, n_ctx=16)).to(torch.float32).eval()
init_random_weights(model, std=0.2, generator=torch.Generator().manual_seed(0))
fast.accelerate(model)
assert fast.status(model).startswith("fast path"), fast.status(model)
x = torch.randint(50, (2, 9), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    fast_logits = model(x)
    recorded = {recording}
    accelerator, model.accelerator = model.accelerator, None
    readable = model(x)
print(fast_logits.dtype, float((fast_logits - readable).abs().max()), float((recorded - readable).abs().max()))
"""


@pytest.mark.parametrize("default, recording", [
    ("float32", 'torch.compile(model, backend="eager")(x)'),  # dynamo froze the kernels' pointers: SIGSEGV
    ("float32", "torch.jit.trace(model, (x,))(x)"),  # failed: 'batch_size must be an integer >= 1, got tensor(2)'
    ("bfloat16", "model(x)"),  # the kernels' buffers took the default dtype: half their size, a heap overflow
    ("float64", "model(x)"),  # float64 buffers, float32 writes: logits off by 1.7, silently
])
def test_a_recorded_pass_and_the_default_dtype_leave_the_results_alone(fast_kernels, tmp_path, default, recording):
    done = run_python(RECORDED.format(default=default, recording=recording), tmp_path)
    assert done.returncode == 0, done.stderr[-1500:]
    dtype, fast_error, recorded_error = done.stdout.split()
    assert dtype == "torch.float32" and float(fast_error) < ATOL and float(recorded_error) < ATOL


@pytest.mark.parametrize("fused", [True, False])
def test_an_optimizers_step_is_seen_by_the_packed_weights(fast_kernels, fused):
    """A fused optimizer writes the weights without moving their version counters: the kernels read the old
    matrices beside the new biases (logits 7.4 off, 4% of argmaxes right) until the weights were packed again."""
    model = fast.accelerate(new_model(seed=11))
    x = ids(2, 12, seed=12)
    run(model, x)  # packed once
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    for _ in range(3):  # training passes record gradients: the readable path
        optimizer.zero_grad()
        model(x)[:, :-1].log_softmax(-1).gather(-1, x[:, 1:, None]).sum().neg().backward()
        optimizer.step()
    (fast_logits,), _ = run(model, x)
    (readable,), _ = run(model, x, readable=True)
    assert (fast_logits - readable).abs().max() < ATOL


def test_another_models_optimizer_leaves_the_packed_weights_alone(fast_kernels):
    """Any optimizer's step repacked every accelerated model (a frozen teacher beside a draft in training paid a
    full repack per pass)."""
    model, student = fast.accelerate(new_model(seed=17)), torch.nn.Linear(4, 4)
    x = ids(1, 6, seed=18)
    run(model, x)
    packed = dict(model.accelerator.packed)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    student(torch.ones(4)).sum().backward()
    optimizer.step()
    run(model, x)
    assert all(model.accelerator.packed[name] is p for name, p in packed.items())


def test_status_says_readable_when_the_parameters_send_every_pass_there(fast_kernels):
    """It said 'fast path' while the accelerator handed every pass to the readable path."""
    model = fast.accelerate(new_model(seed=13))
    views = {k: (v.t().contiguous().t() if v.dim() == 2 and k.startswith("h.") else v)  # transposed layouts
             for k, v in model.state_dict().items()}
    model.load_state_dict(views, assign=True)
    assert fast.status(model) == ("readable path (F.linear + SDPA, the Block modules): a parameter is not a "
                                  "plain contiguous CPU float32 tensor")
    model = fast.accelerate(new_model(seed=13))
    with torch.inference_mode():
        model.load_state_dict(new_model(seed=14).state_dict(), assign=True)
    assert "made under torch.inference_mode() (accelerate again)" in fast.status(model)
    fast.accelerate(model)
    assert fast.status(model).startswith("fast path")
    model.h[0].attn.c_attn = torch.nn.Linear(CONFIG.n_embd, 3 * CONFIG.n_embd)
    model.h[0].attn.c_attn.register_forward_hook(lambda *args: None)
    assert "a module the kernels stand in for was replaced, hooked" in fast.status(model)


# torch's make_dual loads its forward-AD decompositions through torch.jit.script, which warns in torch 2.10+.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_forward_mode_ad_is_left_to_the_readable_path(fast_kernels):
    """The kernels dropped a dual input's tangent: the output came back with none, silently."""
    import torch.autograd.forward_ad as fwAD

    model = fast.accelerate(new_model(seed=15)).requires_grad_(False)
    x = ids(1, 5, seed=16)
    for name in ("wpe.weight", "h.1.mlp.c_fc.weight"):  # a tangent on the input, or on a weight the kernels read
        weight = model.get_parameter(name)
        with fwAD.dual_level():
            dual = fwAD.make_dual(weight, torch.ones_like(weight))
            try:
                out = torch.func.functional_call(model, {name: dual}, (x,))
            except NotImplementedError:  # the readable path's attention has no forward AD in this torch
                continue
            assert fwAD.unpack_dual(out).tangent is not None, name
