"""Helpers for the speculative decoding tests: tiny random GPT-2s and a
recorder of forward passes.

The models are far too small to say anything sensible, but they are real
GPT-2s (same code path as the 774M target) and run in well under a
millisecond per forward pass. Their weights are drawn with std 0.4 rather than
GPT-2's 0.02, so that next-token distributions are peaked (clear argmaxes,
clearly non-uniform probabilities) instead of near-uniform.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Self

import pytest
import torch

from gpt2 import GPT2, GPT2Config, init_random_weights

PEAKED_STD = 0.4


def tiny_gpt2(config: GPT2Config, *, seed: int, std: float = PEAKED_STD) -> GPT2:
    """A GPT-2 of `config`'s shape with N(0, std) weights drawn from `seed`, in eval mode."""
    model = GPT2(config)
    init_random_weights(model, std=std, generator=torch.Generator().manual_seed(seed))
    return model.eval()


def perturbed_copy(model: GPT2, *, scale: float, seed: int) -> GPT2:
    """A copy of `model` with N(0, scale) noise added to every matrix and embedding
    (LayerNorms and biases untouched): a stand-in for a draft that mostly,
    but not always, agrees with the target."""
    copy = GPT2(model.config)
    copy.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in copy.named_parameters():
            if name.endswith("weight") and ".ln_" not in name and not name.startswith("ln_"):
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return copy.eval()


@dataclass
class ForwardCall:
    """One forward pass: how many tokens it was fed and how many positions its
    KV cache held before (None when called without a cache)."""

    tokens: int
    cached: int | None


@dataclass
class ForwardRecorder:
    """Records every forward pass of a model (through a pre-hook, so the model's
    code runs untouched). Use as a context manager."""

    model: GPT2
    calls: list[ForwardCall] = field(default_factory=list)

    def __enter__(self) -> Self:
        def hook(module, args):
            input_ids, cache = args[0], (args[1] if len(args) > 1 else None)
            self.calls.append(ForwardCall(tokens=input_ids.size(1), cached=None if cache is None else cache.length))

        self.handle = self.model.register_forward_pre_hook(hook)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


@pytest.fixture(scope="module")
def single_thread():
    """Runs a module's tests on one CPU thread, then restores the setting.

    These models are so small that a forward pass is Python overhead plus
    microsecond kernels; a thread pool only adds synchronisation, and on a
    shared machine an oversubscribed pool made the tests ~20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
