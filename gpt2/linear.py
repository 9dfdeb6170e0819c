"""The linear layers of GPT-2, y = x W^T + b, behind one function.

Legend: N = rows (B * T tokens), in/out = features.

Every matrix product of the model (attention and MLP projections, the LM head)
calls `linear`, so the CPU kernel is chosen in exactly one place.

The readable path is `F.linear`. It is what runs on a GPU, in float16/bfloat16,
for more than KERNEL_MAX_ROWS rows (a prompt's prefill), whenever autograd is
recording, and wherever the C kernel cannot be built. On an x86-64 CPU with
AVX2 in float32 during inference, `linear` calls `few_rows_linear` instead,
the one speed trick of this file:

- What it does: a small C loop (few_rows_linear.c, built on first use by
  c_kernel.py) that reads each weight once and multiplies it into all N rows
  while it sits in a register, from a copy of W "pair-packed" so that each
  thread reads one sequential stream (`pack_pairs`). The path is chosen and
  the packed copies made when a model is loaded (`prepare`, called by
  `load_model` through `GPT2.prepare_linear_layers`), or else on first use;
  a copy is kept until W is freed or changed.
- What it buys: a decode step (N = 1) and a verification pass (N = gamma + 1)
  both read every weight once, so both should cost what reading the weights
  costs. BLAS kernels are tuned for large N: with `F.linear` (MKL sgemm) 5
  rows cost 1.9-2.8x one row, so verifying gamma + 1 drafted tokens costs
  ~2-3x a decode step and speculative decoding loses on a CPU. Measured on
  the whole gpt2-large forward on a 100-token cache, torch 2.13, fp32, 2
  threads, medians of interleaved runs (benchmarks/decode_speed.py
  --plain-linear), ms:

      2 Zen 4 EPYC cores:            step   t_v(5)  r_5 = t_v(5) / step
      F.linear                       216    408     1.89
      few_rows_linear                 80     96     1.20
      transformers                   192    444     2.32

      the project's earlier machine, 2 AVX2-only EPYC cores:
      F.linear                       186    521     2.80
      few_rows_linear                124    142     1.14
      transformers                   183    547     2.98

  and on 16 gpt2-large MLP weights (8 x (1280->5120, 5120->1280), 419 MB,
  earlier machine), N = 1 / 5 / 9 rows: F.linear 24.3 / 64.3 / 70.8 ms,
  oneDNN on packed W 18.9 / 26.6 / 31.2, few_rows_linear 15.1 / 17.5 / 24.1.
  The L2 prefetch in few_rows_linear.c is what keeps r_5 low where memory is
  fast (Zen 4: r_5 1.84 without it).

  Tried before, all slower at N = 5: oneDNN's inner product on packed W
  (r_5 1.31-1.48 on the earlier machine), `addmm` on a second (in, out) copy of W, `mm`
  of the transposed problem W x^T, MKL's packed sgemm, batched products over
  column panels of W; the same C loop on the unpacked W (two streams per
  thread: N = 5 ~20% slower on 1280-wide inputs).
- What it costs: RAM for one packed copy of every weight matrix, i.e. the
  weights twice (gpt2-large: +3.1 GB; gpt2: +0.5 GB). The dense weights stay,
  as parameters, for the embedding lookup, prefill, `state_dict` and autograd.
  A C compiler (`cc`) on first use, about a second; c_kernel.status() says
  why the kernel is not used where it is not.
- Results: equal up to floating-point reassociation (the sums run in another
  order: max abs difference of gpt2-shape logits to `F.linear` ~4e-6).

A weight quantised to int8 (gpt2/quantize.py, an explicit option) is read by
the kernel from an int8 copy with one scale per row (`use_int8_copy`) instead
of a float32 one: a quarter of the bytes.

few_rows_linear.c can also apply a layer norm before the product and GELU
and a residual addition after it, in the same call; only the block loop of
gpt2/block_loop.py uses that (here those are the model's own PyTorch ops).

Set the environment variable GPT2_PLAIN_LINEAR=1 to run `F.linear` everywhere
(or use `with plain_linear():`), for comparison or debugging; attention then
takes its readable path too (gpt2/attention.py).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2 import c_kernel

# GPT2_PLAIN_LINEAR=1 switches the speed trick off: the readable path everywhere.
PLAIN_LINEAR = os.environ.get("GPT2_PLAIN_LINEAR", "0") == "1"

# The kernel is used for 1 ... KERNEL_MAX_ROWS rows; above that (a long
# prompt's prefill) MKL's sgemm is faster. Measured on the gpt2-large MLP
# weights: kernel / F.linear = 0.76 at 32 rows, 0.88 at 48, 1.02 at 64, 1.24
# at 100; a 20-token gpt2-large prefill takes 326 ms instead of 643.
KERNEL_MAX_ROWS = 48

_use_kernel = not PLAIN_LINEAR


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b, through the fastest path for the device (see the module docstring).

    Args:
        x: (..., in) activations.
        weight: (out, in), the `nn.Linear` layout.
        bias: (out,) or None.

    Returns:
        (..., out), in x's dtype, on x's device.
    """
    if runs_on_kernel(x, weight, bias):
        return few_rows_linear(x, weight, bias)
    return F.linear(x, weight, bias)  # (..., in) x (in, out) -> (..., out)


def runs_on_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The kernel takes `weight` (`kernel_takes`), x is CPU float32 with 1 to
    KERNEL_MAX_ROWS rows, and no gradient is to be recorded (the kernel has no
    backward)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.shape[-1] != weight.shape[-1]:
        return False
    if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"):
        return False
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return False
    rows = x.numel() // weight.shape[1]
    return 1 <= rows <= KERNEL_MAX_ROWS and kernel_takes(weight)


def kernel_takes(weight: torch.Tensor) -> bool:
    """Products with this (out, in) weight can run on the kernel: it is CPU
    float32 with `in` a multiple of 8, the kernel is switched on and built."""
    if not _use_kernel or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return False
    return weight.dim() == 2 and weight.shape[1] % 8 == 0 and c_kernel.load() is not None


def prepare(weights: Iterable[torch.Tensor]) -> str:
    """Chooses the path of every product with these weights once, when a model
    is loaded, instead of at its first forward pass: where the kernel takes a
    weight, its pair-packed copy is made now (gpt2-large: ~1 s and +3.1 GB),
    so that the first generation is not the slower one.

    Returns:
        `describe()`, the one line that says which path was chosen.
    """
    for weight in weights:
        if kernel_takes(weight):
            packed_weight(weight)
    return describe()


@contextlib.contextmanager
def plain_linear() -> Iterator[None]:
    """Inside this block `linear` is plain `F.linear` everywhere (the readable
    path), e.g. to measure what the kernel buys in one interleaved run."""
    global _use_kernel
    saved, _use_kernel = _use_kernel, False
    try:
        yield
    finally:
        _use_kernel = saved


def kernels_enabled() -> bool:
    """False inside `plain_linear()` or with GPT2_PLAIN_LINEAR=1: then the
    attention kernel (gpt2/attention.py) is off too."""
    return _use_kernel


def describe() -> str:
    """One line for reports: which path `linear` takes on a CPU in float32."""
    if not _use_kernel:
        return "F.linear + SDPA (GPT2_PLAIN_LINEAR=1 or plain_linear())"
    c_kernel.load()
    return c_kernel.status()


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b with the C kernel on the pair-packed copy of W (CPU,
    float32, inference, at most KERNEL_MAX_ROWS rows; see `runs_on_kernel`),
    or on its int8 copy where the weight was quantised (gpt2/quantize.py).

    Args and Returns: as `linear`.
    """
    kernel = c_kernel.load()
    out_features, in_features = weight.shape
    assert kernel is not None, "few_rows_linear needs the C kernel: check runs_on_kernel first"
    assert bias is None or bias.shape == (out_features,), f"bias {tuple(bias.shape)} for {out_features} outputs"
    rows = x.numel() // in_features
    x2 = x.reshape(rows, in_features).contiguous()  # (N, in)
    packed = packed_weight(weight)  # (ceil(out / 2), in / 8, 2, 8), float32 or int8 with its scales
    b = None if bias is None else bias.contiguous()
    y = torch.empty(rows, out_features, dtype=x.dtype)  # (N, out), every element written by the kernel
    kernel(
        x2.data_ptr(),
        packed.data.data_ptr(),
        None if packed.scale is None else packed.scale.data_ptr(),
        None if b is None else b.data_ptr(),
        y.data_ptr(),
        rows,
        in_features,
        out_features,
        None, None, 0.0,  # no layer norm before,
        0, None,  # no GELU or residual after (gpt2/block_loop.py uses them)
    )
    return y.view(*x.shape[:-1], out_features)  # (..., out)


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """W (out, in) in the kernel's layout: rows o and o + 1 interleaved in
    blocks of 8 values, out padded to even with a zero row. Any dtype (the
    kernel takes float32 and int8).

    Returns:
        (ceil(out / 2), in / 8, 2, 8), contiguous, in W's dtype.
    """
    out_features, in_features = weight.shape
    w = weight.detach()
    if out_features % 2:
        w = torch.cat([w, w.new_zeros(1, in_features)])  # (out + 1, in)
    pairs = w.reshape(-1, 2, in_features // 8, 8)  # (out / 2, 2, in / 8, 8)
    return pairs.transpose(1, 2).contiguous()  # (out / 2, in / 8, 2, 8)


@dataclass(frozen=True)
class PackedWeight:
    """The kernel's copy of a weight W (out, in), pair-packed (`pack_pairs`):
    W itself in float32, or, for a weight quantised to int8 (gpt2/quantize.py),
    the int8 levels q with W = scale[:, None] * q."""

    data: torch.Tensor  # (ceil(out / 2), in / 8, 2, 8), float32 or int8
    scale: torch.Tensor | None = None  # (out,) float32 with int8 data, else None


# id(weight) -> (its version counter when packed, a view of the storage it
# was packed from, the packed copy). Holding that storage keeps its address
# from being reused, so a weight given new storage never matches a stale entry.
# An entry is removed when its weight is freed (weakref.finalize below).
_packed_weights: dict[int, tuple[int | None, torch.Tensor, PackedWeight]] = {}


def packed_weight(weight: torch.Tensor) -> PackedWeight:
    """The kernel's copy of `weight`: its int8 copy if `use_int8_copy` gave
    one, else the float32 pair-packed copy (`pack_pairs`), made on first use.

    It is made again (in float32) when `weight` has changed since: written in
    place (its version counter moved: `copy_`, `normal_`, an optimiser step)
    or given new storage (`module.half().float()` swaps `.data`). Writes into
    the same storage through `weight.data` bypass the counter and are not
    noticed.
    """
    key = id(weight)
    entry = _packed_weights.get(key)
    if entry is not None and entry[0] == _version(weight) and entry[1].data_ptr() == weight.data_ptr():
        return entry[2]
    with torch.no_grad():
        packed = PackedWeight(pack_pairs(weight))
    _remember(weight, packed)
    return packed


def use_int8_copy(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """From now on the kernel reads `weight` as the int8 levels `q` and the
    rows' `scale` (a quarter of the bytes), until `weight` changes. The
    caller guarantees weight == scale[:, None] * q (gpt2/quantize.py writes
    it so). Nothing is kept where the kernel cannot take `weight`.

    Args:
        weight: (out, in) float32, the quantised weight.
        q: (out, in) int8.
        scale: (out,) float32.
    """
    assert q.dtype == torch.int8 and q.shape == weight.shape, f"q {q.dtype} {tuple(q.shape)}"
    assert scale.dtype == torch.float32 and scale.shape == weight.shape[:1], f"scale {tuple(scale.shape)}"
    if kernel_takes(weight):
        _remember(weight, PackedWeight(pack_pairs(q), scale.contiguous()))


def _version(weight: torch.Tensor) -> int | None:
    return None if weight.is_inference() else weight._version  # inference tensors have no counter


def _remember(weight: torch.Tensor, packed: PackedWeight) -> None:
    key = id(weight)
    if key not in _packed_weights:
        weakref.finalize(weight, _packed_weights.pop, key, None)
    _packed_weights[key] = (_version(weight), weight.detach(), packed)  # detach: shares weight's storage


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
