"""Helpers the tests share (the fixtures are in conftest.py):

- reference models: `transformers`' GPT2LMHeadModel with random weights;
- checkpoint folders in the Hub's exact format (`write_checkpoint`);
- tiny random GPT-2s for the decoding tests (`tiny_gpt2`, `perturbed_copy`)
  and a recorder of forward passes (`ForwardRecorder`);
- the lossless tests' exact distribution of the first few sampled tokens
  (`exact_continuation_distribution`) and Pearson's chi-square test
  (`chi_square`, `chi_square_quantile_0999`).

The tiny decoding models are far too small to say anything sensible, but
they are real GPT-2s (the same code path as the 774M target) and run in well
under a millisecond per forward pass. Their weights are drawn with std 0.4
rather than GPT-2's 0.02, so that next-token distributions are peaked (clear
argmaxes, clearly non-uniform probabilities) instead of near-uniform.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import pytest
import torch
from safetensors.torch import save_file

from benchmarks.common import noisy_copy
from gpt2 import GPT2, GPT2Config, init_random_weights, logits_to_probs
from gpt2.loading import CONV1D_SUFFIXES

REPO_ROOT = Path(__file__).resolve().parent.parent
# The real GPT-2 vocabulary, beside the repository (../shared/gpt2-bpe).
GPT2_BPE_DIR = REPO_ROOT.parent / "shared" / "gpt2-bpe"

# ---------------------------------------------------------------------------
# Reference models
# ---------------------------------------------------------------------------

TINY = GPT2Config(n_layer=2, n_head=4, n_embd=32, n_ctx=64, vocab_size=101)


def make_hf_model(config: GPT2Config, *, seed: int = 0):
    """transformers' GPT2LMHeadModel of `config`'s shape with random weights,
    in eval mode (no dropout), using the eager attention as the reference.

    The weights are deliberately not GPT-2's init: random biases and
    LayerNorm gains/shifts of std 0.1, so that every parameter matters and the
    logits are far from all equal (a wrong layout or a missing term shows).
    Weight matrices and embeddings have std 0.1 * sqrt(32 / n_embd): 0.1 for
    the tiny shape, GPT-2's own 0.02 at n_embd = 768 (larger ones make 12
    layers amplify every rounding error into chaos).
    """
    g = torch.Generator().manual_seed(seed)
    state = {}
    matrix_std = 0.1 * (32 / config.n_embd) ** 0.5
    for name, shape in hub_parameter_shapes(config).items():
        is_layer_norm = ".ln_" in name or name.startswith("ln_f")
        base = 1.0 if is_layer_norm and name.endswith("weight") else 0.0
        std = 0.1 if is_layer_norm or name.endswith(".bias") else matrix_std
        state[name] = base + std * torch.randn(shape, generator=g)
    return hf_model_from_hub_state(config, state)


def hub_parameter_shapes(config: GPT2Config) -> dict[str, torch.Size]:
    """Every parameter of a GPT-2 checkpoint in the Hub layout, with its shape."""
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(hf_config_for(config))  # shapes only
    return {name: p.shape for name, p in model.transformer.named_parameters()}


def hf_model_from_hub_state(config: GPT2Config, state: dict[str, torch.Tensor]):
    """transformers' GPT2LMHeadModel holding `state` (Hub layout; the tensors
    are shared, not copied), in eval mode."""
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(hf_config_for(config))  # shapes only: the weights come from `state`
    model.transformer.load_state_dict(state, assign=True)
    model.tie_weights()
    assert model.lm_head.weight is model.transformer.wte.weight, "lm_head must be tied to wte"
    return model.eval()


def hf_config_for(config: GPT2Config):
    """transformers' GPT2Config of the same shape: no dropout, eager attention,
    no special token ids (they would lie outside a tiny vocabulary)."""
    from transformers import GPT2Config as HFGPT2Config

    return HFGPT2Config(**config.to_hf_inference_dict(), attn_implementation="eager")


def hub_state_dict(hf_model) -> dict[str, torch.Tensor]:
    """The model's weights under the Hub files' names (`wte.weight`,
    `h.0.attn.c_attn.weight`, ... with Conv1D weights stored (in, out)),
    without the tied lm_head."""
    return {
        key.removeprefix("transformer."): tensor
        for key, tensor in hf_model.state_dict().items()
        if key != "lm_head.weight"
    }


# ---------------------------------------------------------------------------
# Checkpoint folders
# ---------------------------------------------------------------------------


def hub_layout(model: GPT2) -> dict[str, torch.Tensor]:
    """Our weights under the Hub's names, Conv1D weights back in (in, out): what `write_checkpoint` takes."""
    return {name: (t.t() if name.endswith(CONV1D_SUFFIXES) else t).contiguous()
            for name, t in model.state_dict().items()}


def write_checkpoint(
    folder: Path,
    config: GPT2Config,
    state: dict[str, torch.Tensor],
    *,
    layout: str = "hub",
    with_tokenizer: bool = False,
) -> Path:
    """Writes a model folder as found in the wild and returns it.

    Args:
        folder: created if needed.
        config: written as config.json (GPT2Config.to_hf_dict()).
        state: weights in the Hub layout (see `hub_state_dict`).
        layout: "hub" writes model.safetensors as the Hub's GPT-2 repos hold
            it: bare names plus the `h.N.attn.bias` (1, 1, n_ctx, n_ctx)
            causal masks and `h.N.attn.masked_bias` scalars. "save_pretrained"
            lets transformers' own `GPT2LMHeadModel.save_pretrained` write
            the folder: `transformer.` prefixes, no lm_head, its own config.json.
        with_tokenizer: also copy the real vocab.json + merges.txt
            (skips the test if ../shared/gpt2-bpe is absent).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if layout == "hub":
        tensors = {name: t.contiguous() for name, t in state.items()}
        causal = torch.tril(torch.ones(config.n_ctx, config.n_ctx)).view(1, 1, config.n_ctx, config.n_ctx)
        for i in range(config.n_layer):
            tensors[f"h.{i}.attn.bias"] = causal.clone()  # safetensors refuses shared memory
            tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    elif layout == "save_pretrained":
        hf_model_from_hub_state(config, state).save_pretrained(folder)
    else:
        raise AssertionError(f"unknown layout {layout!r}")
    if with_tokenizer:
        if not GPT2_BPE_DIR.is_dir():
            pytest.skip(f"the real GPT-2 vocabulary is not at {GPT2_BPE_DIR}")
        shutil.copyfile(GPT2_BPE_DIR / "encoder.json", folder / "vocab.json")
        shutil.copyfile(GPT2_BPE_DIR / "vocab.bpe", folder / "merges.txt")
    return folder


# ---------------------------------------------------------------------------
# Tiny models for the decoding tests
# ---------------------------------------------------------------------------

PEAKED_STD = 0.4


def tiny_gpt2(config: GPT2Config, *, seed: int, std: float = PEAKED_STD) -> GPT2:
    """A GPT-2 of `config`'s shape with N(0, std) weights drawn from `seed`, in eval mode."""
    model = GPT2(config)
    init_random_weights(model, std=std, generator=torch.Generator().manual_seed(seed))
    return model.eval()


def perturbed_copy(model: GPT2, *, scale: float, seed: int) -> GPT2:
    """A copy of `model` with N(0, scale) noise added to every matrix and embedding
    (LayerNorms and biases untouched): a stand-in for a draft that mostly,
    but not always, agrees with the target (`benchmarks.common.noisy_copy`)."""
    return noisy_copy(model, scale=scale, seed=seed)


# The drafts of the greedy-equality tests (test_speculative.py, test_batch.py, test_drafting.py).
# PERTURBATION puts alpha around 0.35-0.8 for gamma 1..8 on their tiny targets (0.02 accepts
# nearly everything, 0.1 nearly nothing).
UNRELATED_DRAFT = GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=64, vocab_size=64)
PERTURBATION = 0.04


def three_drafts(target: GPT2) -> dict[str, GPT2]:
    """The target itself (alpha 1), an unrelated model (alpha ~ 0) and a noisy copy of the target."""
    return {
        "self": target,
        "unrelated": tiny_gpt2(UNRELATED_DRAFT, seed=1),
        "perturbed": perturbed_copy(target, scale=PERTURBATION, seed=2),
    }


def binary_tree_mask(T: int) -> torch.Tensor:
    """(T, T) bool: node t's parent is (t - 1) // 2, a binary tree; each node sees its ancestors and itself."""
    mask = torch.eye(T, dtype=torch.bool)
    for t in range(1, T):
        mask[t] |= mask[(t - 1) // 2]
    return mask


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


# ---------------------------------------------------------------------------
# Chi-square test (the lossless tests)
# ---------------------------------------------------------------------------

Z_0999 = 3.090232  # the 0.999 quantile of the standard normal


@torch.inference_mode()
def exact_continuation_distribution(target: GPT2, prompt: torch.Tensor, n: int, sampling) -> torch.Tensor:
    """(V^n,) float64: P(first n new tokens = x) for every x after `prompt`
    (1, T), in the order of `torch.cartesian_prod` (x1 * V^(n-1) + ... + xn),
    from the target alone with the `SamplingConfig` filter. One batched pass."""
    V, T = target.config.vocab_size, prompt.size(1)
    continuations = torch.cartesian_prod(*[torch.arange(V)] * n)  # (V^n, n)
    ids = torch.cat([prompt.expand(len(continuations), T), continuations], dim=1)  # (V^n, T + n)
    probs = logits_to_probs(target(ids), sampling).double()  # (V^n, T + n, V)
    # Row T - 1 + j predicts new token j: gather p(x_j | prompt, x_<j) and multiply.
    per_token = probs[:, T - 1 : T - 1 + n].gather(-1, continuations[..., None])  # (V^n, n, 1)
    return per_token.squeeze(-1).prod(dim=-1)  # (V^n,)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `probs`, and its degrees of freedom.

    Cells expected fewer than 5 times are pooled into one (the usual validity
    condition of the chi-square approximation); with k cells left the statistic
    has k - 1 degrees of freedom, and the lossless tests fail above
    `chi_square_quantile_0999(k - 1)`. An outcome the target cannot produce
    (probability 0, observed > 0) makes the statistic infinite, before any
    pooling: pooled, a few percent of impossible outcomes went unnoticed."""
    if counts[probs == 0].sum() > 0:
        return math.inf, int((probs * counts.sum() >= 5).sum())
    N = counts.sum()
    expected = probs * N
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    if expected[-1] == 0:  # nothing pooled: drop the empty cell, unless something impossible was seen
        if observed[-1] > 0:
            return math.inf, len(observed) - 1
        observed, expected = observed[:-1], expected[:-1]
    statistic = float(((observed - expected) ** 2 / expected).sum())
    return statistic, len(observed) - 1


def chi_square_quantile_0999(df: int) -> float:
    """Wilson-Hilferty: (chi2_df / df)^(1/3) is close to normal with mean
    1 - 2/(9 df) and variance 2/(9 df). No scipy needed; above the exact
    quantile by 1.7% at 3 degrees of freedom, under 1% from 7 on and under
    0.3% from 26 on (the lossless tests see 3 to 282)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + Z_0999 * math.sqrt(h)) ** 3
