"""`transformers`' GPT-2 with the same weights, as a peer: its plain `generate`
and its assisted generation (`assistant_model=draft`, Leviathan et al. 2023's
rejection sampling when sampling). Only the benchmarks import it, only when
asked: `transformers` is a test/benchmark dependency."""

from __future__ import annotations

import torch

from benchmarks.common import must
from gpt2 import GPT2, SamplingConfig
from gpt2.loading import CONV1D_SUFFIXES  # the four projections transformers stores (in, out)


def to_transformers(model: GPT2):
    """transformers' GPT2LMHeadModel with a copy of `model`'s weights, on its device and dtype, in eval mode
    (the library's default attention, SDPA). Raises a ValueError saying how to install transformers."""
    try:
        import transformers
    except ImportError:
        raise ValueError("--peer transformers needs the transformers library: "
                         "pip install -r requirements-dev.txt") from None
    transformers.logging.set_verbosity_error()  # no per-call advice about generation settings in the output
    state = {f"transformer.{name}": (w.t() if name.endswith(CONV1D_SUFFIXES) else w).contiguous().clone()
             for name, w in model.state_dict().items()}  # its own copy, Conv1D weights as (in, out)
    with torch.device("meta"):  # shapes only; the weights come from `state`
        hf_model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**model.config.to_hf_inference_dict()))
    missing, unexpected = hf_model.load_state_dict(state, strict=False, assign=True)
    must(not unexpected and set(missing) <= {"lm_head.weight"}, f"unknown {unexpected}, left unset {missing}")
    hf_model.tie_weights()  # lm_head = wte, as in GPT-2
    must(hf_model.lm_head.weight.data_ptr() == hf_model.transformer.wte.weight.data_ptr(), "lm_head must be tied")
    return hf_model.to(device=model.device, dtype=model.dtype).eval()


def keeping_rng(pause, device: torch.device):
    """`pause` for a run that samples from torch's global generator beside others that draw from it too (in
    lockstep): the run's generator state is put back when its turn comes again, so it draws what it would alone."""
    def pause_keeping_rng(tokens: int) -> None:
        cpu, gpu = torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        pause(tokens)
        torch.set_rng_state(cpu)
        if gpu is not None:
            torch.cuda.set_rng_state(gpu, device)
    return pause_keeping_rng


class PausingStreamer:
    """A transformers streamer that makes `generate` a lockstep method (benchmarks/lockstep.py): it calls
    `pause(new tokens so far)` each time tokens arrive; the first call brings the prompt."""

    def __init__(self, pause) -> None:
        self.pause, self.tokens = pause, None

    def put(self, value: torch.Tensor) -> None:
        self.tokens = 0 if self.tokens is None else self.tokens + value.numel()
        self.pause(self.tokens)

    def end(self) -> None:
        pass


@torch.inference_mode()
def hf_generate(hf_target, input_ids: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig, *,
                assistant=None, gamma: int | None = None, streamer: PausingStreamer | None = None) -> torch.Tensor:
    """transformers' plain generate (`assistant` None) or assisted generation, `assistant` drafting exactly
    `gamma` tokens a step: (1, T) `input_ids` -> (1, T + max_new_tokens) LongTensor, with no end-of-text, as
    ours. Models from `to_transformers`; transformers samples from torch's global generator (seed it)."""
    kwargs = {"max_new_tokens": max_new_tokens, "min_new_tokens": max_new_tokens, "eos_token_id": None,
              "pad_token_id": None, "do_sample": not sampling.greedy}
    if not sampling.greedy:  # top_k 0: no top-k (its default is 50)
        kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p or 1.0)
    if assistant is not None:  # like ours (transformers 5.x, generation/candidate_generator.py):
        must(gamma is not None and gamma >= 1, "assisted generation needs gamma >= 1")
        config = assistant.generation_config  # a constant gamma (the default "heuristic" schedule changes it) ...
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = gamma, "constant"
        config.assistant_confidence_threshold = 0.0  # ... and no early stop (None means its default 0.4)
        kwargs["assistant_model"] = assistant
    return hf_target.generate(input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer,
                              **kwargs)  # one unpadded row
