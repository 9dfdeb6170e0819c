"""Shared test helpers and fixtures.

Sections:
- the real GPT-2 vocabulary (../shared/gpt2-bpe) and tiktoken's offline cache;
- reference models: `transformers`' GPT2LMHeadModel with random weights;
- checkpoint folders in the Hub's exact format (`write_checkpoint`);
- the local Hub server fixtures (`hub`, `no_hub`, from hub_server.py);
- `kernels_or_skip`, for the tests of the C kernels.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gpt2 import GPT2Config, c_kernel
from hub_server import hub, no_hub  # noqa: F401  (fixtures, registered for every test file)

REPO_ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------
# The real GPT-2 vocabulary
# ---------------------------------------------------------------------------

GPT2_BPE_DIR = REPO_ROOT.parent / "shared" / "gpt2-bpe"
# tiktoken names each cached file by the sha1 of the URL it came from.
TIKTOKEN_CACHE_NAMES = {
    "vocab.bpe": "6d1cbeee0f20b3d9449abfede4726ed8212e3aee",
    "encoder.json": "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6",
}


@pytest.fixture(scope="session", autouse=True)
def offline_tiktoken_cache(tmp_path_factory: pytest.TempPathFactory):
    """Seeds a tiktoken cache with ../shared/gpt2-bpe (when present), so that
    `tiktoken.get_encoding("gpt2")` works with no network, for the whole session."""
    if not GPT2_BPE_DIR.is_dir():
        yield None
        return
    cache = tmp_path_factory.mktemp("tiktoken_cache")
    for source, cached_name in TIKTOKEN_CACHE_NAMES.items():
        shutil.copyfile(GPT2_BPE_DIR / source, cache / cached_name)
    before = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    yield cache
    if before is None:
        del os.environ["TIKTOKEN_CACHE_DIR"]
    else:
        os.environ["TIKTOKEN_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def gpt2_bpe_dir() -> Path:
    """../shared/gpt2-bpe (encoder.json, vocab.bpe), or a skip if this clone has none."""
    if not GPT2_BPE_DIR.is_dir():
        pytest.skip(f"the real GPT-2 vocabulary is not at {GPT2_BPE_DIR} (../shared/gpt2-bpe from the repo root)")
    return GPT2_BPE_DIR


# ---------------------------------------------------------------------------
# Reference models
# ---------------------------------------------------------------------------

TINY = GPT2Config(n_layer=2, n_head=4, n_embd=32, n_ctx=64, vocab_size=101)


def make_hf_model(config: GPT2Config, *, seed: int = 0):
    """transformers' GPT2LMHeadModel of `config`'s shape with random weights,
    in eval mode (no dropout), using the eager attention as the reference.

    The weights are deliberately not GPT-2's init: N(0, 0.1) matrices, random
    biases and LayerNorm gains/shifts, so that every parameter matters and
    the logits are far from all equal (a wrong layout or a missing term shows).
    """
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in hub_parameter_shapes(config).items():
        is_layer_norm = ".ln_" in name or name.startswith("ln_f")
        base = 1.0 if is_layer_norm and name.endswith("weight") else 0.0
        state[name] = base + 0.1 * torch.randn(shape, generator=g)
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
# The C kernels
# ---------------------------------------------------------------------------


def kernels_or_skip():
    """The C kernels' library is built: returns the linear kernel
    (`c_kernel.load()`). Skipped only where the kernels truly cannot exist
    (another CPU, no C compiler); a failed build on a machine that has both
    fails."""
    unsupported = c_kernel.cpu_supported()
    if unsupported:
        pytest.skip(unsupported)
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler on this machine")
    assert c_kernel.library() is not None, c_kernel.status()
    return c_kernel.load()
