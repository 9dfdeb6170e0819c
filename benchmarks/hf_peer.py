"""`transformers`' GPT-2 with the same weights, as a peer: its plain
`generate` and its assisted generation (`assistant_model=draft`, Leviathan et
al. 2023's rejection sampling when sampling). Only the benchmarks import it,
only when asked: `transformers` is a test/benchmark dependency.

Like-for-like settings (transformers 5.x, generation/candidate_generator.py):
the assistant drafts a constant gamma tokens (`num_assistant_tokens_schedule
= "constant"`; the default "heuristic" changes it every step), with no
confidence-based early stop (`assistant_confidence_threshold = 0`: None means
its default 0.4); no end-of-text and `min_new_tokens = max_new_tokens`, so
every run produces exactly the requested number of tokens, as ours do.
"""

from __future__ import annotations

import torch

from gpt2 import GPT2, SamplingConfig
from gpt2.loading import CONV1D_SUFFIXES  # the four projections transformers stores (in, out)


def to_transformers(model: GPT2):
    """transformers' GPT2LMHeadModel with a copy of `model`'s weights, on its
    device and dtype, in eval mode (the library's default attention, SDPA).

    Raises:
        ValueError: transformers is not installed (the message says how to get it).
    """
    try:
        from transformers import GPT2Config as HFGPT2Config
        from transformers import GPT2LMHeadModel
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise ValueError(
            "--peer transformers needs the transformers library: pip install -r requirements-dev.txt"
        ) from None
    hf_logging.set_verbosity_error()  # no per-call advice about generation settings in the output

    hf_config = HFGPT2Config(**model.config.to_hf_inference_dict())
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(CONV1D_SUFFIXES):
            tensor = tensor.t()  # our (out, in) -> Conv1D's (in, out)
        state[f"transformer.{name}"] = tensor.contiguous().clone()  # its own copy, in its own layout
    with torch.device("meta"):
        hf_model = GPT2LMHeadModel(hf_config)  # shapes only; the weights come from `state`
    missing, unexpected = hf_model.load_state_dict(state, strict=False, assign=True)
    assert not unexpected, f"transformers' GPT-2 has no parameters {unexpected}"
    assert set(missing) <= {"lm_head.weight"}, f"weights left unset: {missing}"
    hf_model.tie_weights()  # lm_head = wte, as in GPT-2
    assert hf_model.lm_head.weight.data_ptr() == hf_model.transformer.wte.weight.data_ptr(), "lm_head must be tied"
    return hf_model.to(device=model.device, dtype=model.dtype).eval()


@torch.inference_mode()
def hf_generate(hf_target, input_ids: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig, *,
                assistant=None, gamma: int | None = None) -> torch.Tensor:
    """transformers' plain generate (assistant None) or assisted generation
    with `assistant` drafting exactly `gamma` tokens per step, no early stop:
    (1, T) `input_ids` -> (1, T + max_new_tokens) LongTensor. `hf_target` and
    `assistant` come from `to_transformers`; `sampling` is mapped onto
    transformers' arguments, which sample from torch's global generator (seed it)."""
    kwargs = {"max_new_tokens": max_new_tokens, "min_new_tokens": max_new_tokens, "eos_token_id": None,
              "pad_token_id": None, "do_sample": not sampling.greedy}
    if not sampling.greedy:
        kwargs.update(temperature=sampling.temperature,
                      top_k=sampling.top_k if sampling.top_k is not None else 0,  # 0: no top-k (its default is 50)
                      top_p=sampling.top_p if sampling.top_p is not None else 1.0)
    if assistant is not None:
        assert gamma is not None and gamma >= 1, "assisted generation needs gamma >= 1"
        config = assistant.generation_config
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = gamma, "constant"
        config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = assistant
    return hf_target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)  # one unpadded sequence
