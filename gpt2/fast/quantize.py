"""Weight-only int8 quantisation: every weight matrix W (out, in), the four
projections of each block and wte (also the LM head), rounded to 255 levels
per output row, for the CPU kernel to read a quarter of the bytes:

    scale[o] = max_i |W[o, i]| / 127
    q[o, i]  = round(W[o, i] / scale[o]),  an int8 in [-127, 127]
    W[o, i] <- scale[o] * q[o, i]

The last line keeps this honest: the model's float32 weights become their
quantised values, so the model *is* the quantised model on every path (the
kernels, the readable path, `state_dict`). Biases, layer norms, the position
table and the activations stay float32: the per-row absmax scheme weight
quantisation papers start from (Dettmers et al. 2022, LLM.int8(); Frantar et
al. 2022, GPTQ). Speculative decoding with a quantised target is lossless
with respect to it; quantising only the draft keeps the float32 target's output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

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
            "use the CPU in float32 (device 'cpu', dtype float32: --device cpu --dtype float32), or no int8 "
            "(quantize=None: leave out --quantize); on a GPU, float16 is the fast option"
        )
    return quantize


def matrix_weights(model: GPT2) -> dict[str, torch.Tensor]:
    """Every weight matrix a forward pass multiplies by, by parameter name:
    the four projections of each block and wte, the tied LM head. (out, in) each."""
    # In a block, the 2-D parameters are exactly its four projections (layer norms and biases are 1-D).
    return {name: p for name, p in model.named_parameters()
            if name == "wte.weight" or (name.startswith("h.") and p.dim() == 2)}


def quantize_model_int8(model: GPT2) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Quantises every weight matrix of `model` in place (see the module
    docstring).

    Args:
        model: a GPT2 on the CPU in float32.

    Returns:
        {parameter name: (q, scale)}: the int8 levels (out, in) and the rows'
        scales (out,) of every weight matrix, now equal to scale[:, None] * q.

    Raises:
        ValueError: the model is not on the CPU in float32 (`resolve_quantize`).
    """
    resolve_quantize("int8", model.wte.weight.device, model.wte.weight.dtype)
    levels = {}
    with torch.no_grad():
        for name, weight in matrix_weights(model).items():
            q, scale = quantize_rows_int8(weight)
            weight.copy_(dequantize_rows(q, scale))  # (out, in): the model is now the quantised one
            levels[name] = (q, scale)
    return levels
