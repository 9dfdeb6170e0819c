"""The linear layers of GPT-2, y = x W^T + b, behind one function.

Legend: N = rows (B * T tokens), in/out = features.

Every matrix product of the model (attention and MLP projections, the LM head)
calls `linear`, so the CPU kernel is chosen in exactly one place.

The readable path is `F.linear`. It is what runs on a GPU, in float16/bfloat16,
and whenever autograd is recording. On a CPU in float32 during inference
(`torch.no_grad` / `torch.inference_mode`), `linear` calls `onednn_linear`
instead, the one speed trick of this file:

- What it does: oneDNN's inner product (the op `torch.compile` itself emits
  for float32 CPU linears with frozen weights) on a copy of W reordered once ("packed") into oneDNN's
  blocked layout, for every number of rows N. The packed copy is made on first
  use and kept until W is freed or changed.
- What it buys: with plain `F.linear` (MKL sgemm) a product of 2-9 rows costs
  2-3x one of 1 row although it reads the same weights, so verifying gamma + 1
  drafted tokens costs ~2.4x a decode step and speculative decoding loses on
  a CPU. Packed oneDNN is faster for every N, most for N >= 2. Measured on 2 AMD EPYC cores (AVX2), torch
  2.13, fp32, 2 threads, medians of interleaved runs, ms:

      16 gpt2-large MLP weights (8 x (1280->5120, 5120->1280), 419 MB, read
      from memory each time):        N=1    N=2    N=5    N=9
      F.linear                       23.0   54.7   72.4   79.1
      onednn_linear (packed W)       16.5   19.7   26.4   29.1
      (N=1: 25 GB/s, ~85% of the 29.5 GB/s a plain sum read at the time)

      whole gpt2-large forward on a 100-token cache (benchmarks/decode_speed.py --plain-linear):
                                     step   t_v(5)  r_5 = t_v(5) / step
      F.linear                       178    423     2.37
      onednn_linear                  123    172     1.39
      transformers                   168    419     2.50
      (two more runs on this shared machine: step 127 and 144, r_5 1.48 and 1.31)

  Tried, all slower than packed oneDNN: `addmm` on a second (in, out) copy of W
  (N=1 on the LM head 10.7 vs 10.3 ms, N=5 39 vs 12.5), `mm` of the
  transposed problem W x^T (N=1 1.4x, N=5 1.5x), oneDNN on the unpacked
  W (N=1 1.1x, N=5 1.4x), MKL's packed sgemm (`torch.ops.mkl._mkl_linear`),
  batched products over column panels of W. Not taken: `torch.compile`'s C++
  GEMM template (max-autotune, frozen weights) was ~20% faster at N=1 and
  equal at N=5, but needs a C++ compiler and a compile per shape.
- What it costs: RAM for one packed copy of every weight matrix, i.e. the
  weights twice (gpt2-large: +3.1 GB; gpt2: +0.5 GB). The dense weights stay,
  as parameters, for the embedding lookup, `state_dict` and autograd. A
  second dense (in, out) copy would cost as much and is slower.
- Results: equal up to floating-point reassociation (max abs difference of
  gpt2-shape logits to `F.linear` ~5e-6 at logits of magnitude ~3).

Set the environment variable GPT2_PLAIN_LINEAR=1 to run `F.linear` everywhere
(or use `with plain_linear():`), for comparison or debugging.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

# GPT2_PLAIN_LINEAR=1 switches the speed trick off: the readable path everywhere.
PLAIN_LINEAR = os.environ.get("GPT2_PLAIN_LINEAR", "0") == "1"

# oneDNN packs a weight for an expected number of rows. With hint 5 (gamma + 1
# for gamma = 4) the layout beats unpacked W at every N = 1 ... 9 (table
# above); hints 1, 8 and 16 measured the same or slower.
ONEDNN_PACKING_ROWS = 5


def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN and the two ops `onednn_linear` uses."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


# Chosen once, at import: the fast CPU path exists in this build and is not switched off.
USE_ONEDNN = not PLAIN_LINEAR and onednn_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b, through the fastest path for the device (see the module docstring).

    Args:
        x: (..., in) activations.
        weight: (out, in), the `nn.Linear` layout.
        bias: (out,) or None.

    Returns:
        (..., out), in x's dtype, on x's device.
    """
    if USE_ONEDNN and runs_on_onednn(x, weight, bias):
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)  # (..., in) x (in, out) -> (..., out)


def runs_on_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """CPU, float32, and no gradient to record (the oneDNN op has no backward)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if bias is not None and bias.dtype != torch.float32:
        return False
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return False
    return x.numel() > 0


@contextlib.contextmanager
def plain_linear() -> Iterator[None]:
    """Inside this block `linear` is plain `F.linear` everywhere (the readable
    path), e.g. to measure what `onednn_linear` buys in one interleaved run."""
    global USE_ONEDNN
    saved, USE_ONEDNN = USE_ONEDNN, False
    try:
        yield
    finally:
        USE_ONEDNN = saved


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b with oneDNN on the packed copy of W (CPU, float32, inference).

    Args and Returns: as `linear`.
    """
    packed = packed_weight(weight)  # (out, in), in oneDNN's blocked layout
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # (..., in) -> (..., out)


# id(weight) -> (its version counter when packed, a view of the storage it
# was packed from, the packed copy). Holding that storage keeps its address
# from being reused, so a weight given new storage never matches a stale entry.
# An entry is removed when its weight is freed (weakref.finalize below).
_packed_weights: dict[int, tuple[int | None, torch.Tensor, torch.Tensor]] = {}


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed copy of `weight`, made on first use.

    It is made again when `weight` has changed since: written in place (its
    version counter moved: `copy_`, `normal_`, an optimiser step) or given new
    storage (`module.half().float()` swaps `.data`). Writes into the same
    storage through `weight.data` bypass the counter and are not noticed.
    """
    version = None if weight.is_inference() else weight._version  # inference tensors have no counter
    key = id(weight)
    entry = _packed_weights.get(key)
    if entry is not None and entry[0] == version and entry[1].data_ptr() == weight.data_ptr():
        return entry[2]
    if entry is None:
        weakref.finalize(weight, _packed_weights.pop, key, None)
    with torch.no_grad():
        source = weight.detach()  # shares weight's storage
        packed = torch.ops.mkldnn._reorder_linear_weight(source.contiguous(), ONEDNN_PACKING_ROWS)
    _packed_weights[key] = (version, source, packed)
    return packed


class Linear(nn.Module):
    """A linear layer whose weight is (out, in) and whose product is `linear`.

    The GPT-2 checkpoint calls these Conv1D and stores them (in, out);
    loading.py transposes them into this layout.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # (out, in)
        self.bias = nn.Parameter(torch.empty(out_features))  # (out,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return linear(x, self.weight, self.bias)
