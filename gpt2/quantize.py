"""Weight-only int8 quantisation, an explicit option for CPU decoding: round
every weight matrix to 255 levels per output row (round to nearest), and let
the CPU kernel read the int8 levels instead of float32.

Legend: out, in = a weight matrix's output and input features.

For each weight matrix W (out, in) of the model (the four projections of every
block, and the token embedding wte, which is also the LM head):

    scale[o] = max_i |W[o, i]| / 127
    q[o, i]  = round(W[o, i] / scale[o]),  an int8 in [-127, 127]
    W[o, i] <- scale[o] * q[o, i]

The last line is what keeps this honest: the model's float32 weights are
replaced by their quantised values, so from then on the model *is* the
quantised model on every path (the CPU kernel, `F.linear` in a long prefill,
the embedding lookup, `state_dict`). Biases, layer norms and the position
table stay as they are (0.1% of gpt2-large's bytes), and so do the
activations: only weights are rounded. This is the round-to-nearest,
per-row ("vector-wise") absmax scheme that the weight-quantisation papers
start from (Dettmers et al. 2022, LLM.int8(); Frantar et al. 2022, GPTQ,
whose baseline it is).

- What it buys: a decode step reads every weight once, so on a CPU it costs
  what reading the weights costs; few_rows_linear.c reads q (1 byte) and the
  rows' scales instead of W (4 bytes). Measured: see README.md, "int8
  weights" (`python -m benchmarks.decode_speed --int8`).
- What it costs: each weight moves by up to scale[o] / 2, i.e. by up to
  1/254 of its row's largest weight, and the logits move with them. The
  model's outputs are those of another model, close to the original.
  Speculative decoding with both models quantised is lossless with respect
  to the quantised target (it is just the target), not to the float32 one.
- Memory: the float32 weights stay (for the embedding lookup, prefill and
  `state_dict`); the kernel's int8 copy replaces its float32 copy, so a
  quantised gpt2-large holds 3.1 + 0.8 GB instead of 3.1 + 3.1 GB.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gpt2 import linear

if TYPE_CHECKING:
    from gpt2.model import GPT2

INT8_LEVELS = 127  # q in [-127, 127]: symmetric, so that -W quantises to -q


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest int8 quantisation with one scale per row.

    Args:
        weight: (out, in) float tensor.

    Returns:
        q: (out, in) int8 with |q| <= 127, and scale: (out,) float32, such
        that scale[:, None] * q is the quantised weight. An all-zero row gets
        scale 0 and q 0.
    """
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / INT8_LEVELS  # (out,)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # (out,): a zero row divides by 1
    q = torch.round(w / divisor[:, None]).clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)  # (out, in)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """scale[o] * q[o, i] in float32: (out, in) int8, (out,) -> (out, in)."""
    return q.float() * scale[:, None]


QUANTIZATIONS = ("none", "int8")


def resolve_quantize(quantize: str | None, device: torch.device, dtype: torch.dtype) -> str | None:
    """Checks a weight quantisation choice: None or "none" (the checkpoint's
    weights as they are) or "int8" (this file), which is for the CPU in
    float32. Returns None or "int8".

    Raises:
        ValueError: an unknown choice, or int8 on another device or dtype.
    """
    if quantize in (None, "none"):
        return None
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"unknown quantisation '{quantize}': choose none or int8")
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(
            f"int8 weights are for the CPU in float32, not {device.type} {str(dtype).removeprefix('torch.')}: "
            "use --device cpu --dtype float32, or leave out --quantize (on a GPU, float16 is the fast option)"
        )
    return quantize


def quantize_model_int8(model: GPT2) -> GPT2:
    """Quantises every weight matrix of `model` in place (see the module
    docstring) and gives the CPU kernel their int8 copies.

    Args:
        model: a GPT2 on the CPU in float32.

    Returns:
        The same model, now the quantised model.

    Raises:
        ValueError: the model is not on the CPU in float32 (`resolve_quantize`).
    """
    resolve_quantize("int8", model.device, model.dtype)
    with torch.no_grad():
        for weight in model.matrix_weights():
            q, scale = quantize_rows_int8(weight)
            weight.copy_(dequantize_rows(q, scale))  # (out, in): the model is now the quantised one
            linear.use_int8_copy(weight, q, scale)
    return model
