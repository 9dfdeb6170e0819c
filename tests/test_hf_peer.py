"""benchmarks/hf_peer.py: transformers' generate on our weights takes our
sampling settings, and assisted generation needs a draft length."""

from __future__ import annotations

import pytest
import torch

from benchmarks.hf_peer import hf_generate, to_transformers
from gpt2 import SamplingConfig, generate
from helpers import TINY, tiny_gpt2

pytest.importorskip("transformers")  # a test dependency (requirements-dev.txt), imported by the peer when used


def test_sampling_with_one_candidate_left_is_greedy_decoding():
    # Near-uniform next-token distributions (weights of std 0.02 over 101 tokens): if top-k or top-p did not reach
    # transformers, its own default (top-k 50) would sample other tokens.
    model = tiny_gpt2(TINY, seed=0, std=0.02)
    hf_model, ids = to_transformers(model), torch.tensor([[1, 2, 3]])
    greedy = generate(model, ids, 10)
    for sampling in (SamplingConfig(1.0, top_k=1), SamplingConfig(1.0, top_p=1e-6)):
        torch.manual_seed(0)
        assert torch.equal(hf_generate(hf_model, ids, 10, sampling), greedy), sampling
    torch.manual_seed(0)
    assert not torch.equal(hf_generate(hf_model, ids, 10, SamplingConfig(1.0)), greedy)  # sampling does sample


def test_assisted_generation_needs_a_draft_length_of_at_least_1():
    hf_model, ids = to_transformers(tiny_gpt2(TINY, seed=0)), torch.tensor([[1, 2, 3]])
    for gamma in (None, 0):
        with pytest.raises(AssertionError, match="assisted generation needs gamma >= 1"):
            hf_generate(hf_model, ids, 4, SamplingConfig(), assistant=hf_model, gamma=gamma)
    assert hf_generate(hf_model, ids, 4, SamplingConfig(), assistant=hf_model, gamma=1).shape == (1, 7)
