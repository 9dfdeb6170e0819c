"""All of GPT-2's blocks for a few new tokens in one C call: the speed trick
of a decode step that is about the work between the matrix products.

Legend: B = batch, T = new tokens, C = n_embd, L = n_layer.

`GPT2.forward` hands its blocks to `block_loop` whenever it can take them:
CPU, float32, no gradient, a KV cache, and few enough new tokens for the
kernels (a decode step, a verification pass). few_rows_blocks.c then computes,
for each block, what `Block.forward` computes, in five kernel calls:

    qkv = ln_1(x) W_attn^T + b_attn          few_rows_linear, layer norm inside
    y   = attention(q, cache + (k, v))       few_queries_attention, writing k, v
    x2  = x + y W_proj^T + b_proj            few_rows_linear, residual inside
    h   = gelu(ln_2(x2) W_fc^T + b_fc)       few_rows_linear, norm and GELU inside
    x   = x2 + h W_mlp_proj^T + b_mlp_proj   few_rows_linear, residual inside

- What it buys: the Python of the Block modules and the ~10 small PyTorch ops
  per block around the kernels (layer norms, GELU, residual additions, the
  cache writes, views). A decode step's kernels stream ~3 GB of weights
  through the caches, so each of those ops runs with cold caches and costs
  5-10x what it costs in a tight loop. Measured on the whole forward pass,
  100 cached positions, fp32, 2 Zen 4 EPYC cores, medians of 12 interleaved
  repeats (`python -m benchmarks.decode_speed --module-blocks`), ms:

                       Block modules   block_loop
      gpt2-large step       97.9          88.6
      gpt2-large t_v(5)    108.7          99.7
      gpt2 step             20.2          17.0
      gpt2 t_v(5)           22.5          17.7

  (at 600 cached positions: 1.12x and 1.09x for gpt2-large): the step from
  83% to 89% of the memory-bandwidth bound.
- What it costs: this second wiring of a block, which tests/test_block_loop.py
  holds equal to `Block.forward` (up to floating-point rounding: the
  kernel's float32 layer norm and GELU, within 4e-6 of a float64 reference
  on unit-scale values, tests/test_linear.py); and a table of data pointers
  to the current parameters (`block_pointers`), rebuilt whenever a parameter
  changes, so that a weight that was changed or moved is never read stale.
  Forward hooks on the blocks are not called on this path; `module_blocks()`
  switches it off, and `plain_linear()` gives the readable path everywhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from gpt2 import attention, c_kernel
from gpt2 import linear as gpt2_linear
from gpt2.kv_cache import KVCache

if TYPE_CHECKING:
    from gpt2.model import GPT2


class BlockPointers(ctypes.Structure):
    """One block's parameters as data pointers, as few_rows_blocks.c reads
    them: layer norms as they are, linear weights pair-packed (float32, or
    int8 with their rows' scales; the scale is NULL for float32)."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "ln_1_weight", "ln_1_bias",
            "c_attn", "c_attn_scale", "c_attn_bias",
            "attn_proj", "attn_proj_scale", "attn_proj_bias",
            "ln_2_weight", "ln_2_bias",
            "c_fc", "c_fc_scale", "c_fc_bias",
            "mlp_proj", "mlp_proj_scale", "mlp_proj_bias",
        )
    ]


_use_loop = True


@contextlib.contextmanager
def module_blocks() -> Iterator[None]:
    """Inside this block the model calls its Block modules one by one (the
    kernels stay on), to measure what the loop buys or to compare the two."""
    global _use_loop
    saved, _use_loop = _use_loop, False
    try:
        yield
    finally:
        _use_loop = saved


def runs_block_loop(model: GPT2, x: torch.Tensor, cache: KVCache | None) -> bool:
    """The block loop can take this forward pass: it is switched on (not in
    `module_blocks()`), both kernels are switched on and built, x is CPU
    float32 with B * T <= KERNEL_MAX_ROWS rows and T <= KERNEL_MAX_QUERIES,
    there is a float32 CPU cache, head size and width are multiples of 8,
    and no gradient is to be recorded. (Each parameter is checked as its
    pointer is taken, in `block_pointers`.)"""
    if not _use_loop or cache is None or not attention.kernel_enabled():
        return False
    B, T, C = x.shape
    if not x.is_cpu or x.dtype != torch.float32 or not cache.k.is_cpu or cache.k.dtype != torch.float32:
        return False  # (checked before the kernels are loaded: a GPU run never builds them)
    if c_kernel.load_blocks() is None:
        return False
    if not (1 <= B * T <= gpt2_linear.KERNEL_MAX_ROWS and T <= attention.KERNEL_MAX_QUERIES):
        return False
    if C % 8 or (C // model.config.n_head) % 8 or not (cache.k.is_contiguous() and cache.v.is_contiguous()):
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in model.parameters())))


# model -> (the stamp of its block tensors when the table was built, views of
# their storage, the table). Holding the storage keeps its address from being
# reused, so a tensor given new storage never matches a stale stamp.
_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def block_tensors(model: GPT2) -> list[torch.Tensor | None]:
    """The 12 parameters of every block, in BlockPointers order (each linear
    layer's weight unpacked). Looked up through the modules' own dicts:
    attribute access on an nn.Module costs ~0.6 us, 20x a dict lookup, and
    this runs at every step."""
    tensors = []
    for block in model.h:
        parts, attn, mlp = block._modules, block._modules["attn"]._modules, block._modules["mlp"]._modules
        for module in (parts["ln_1"], attn["c_attn"], attn["c_proj"], parts["ln_2"], mlp["c_fc"], mlp["c_proj"]):
            tensors += (module._parameters["weight"], module._parameters["bias"])
    return tensors


def stamps(tensors: list[torch.Tensor | None]) -> list[int | None]:
    """What identifies the tensors' current contents: every tensor's storage
    address, and for the linear weights (which the kernel reads through a
    packed copy) their version counter too, moved by every in-place write
    (inference tensors have none). Values written in place into a layer norm
    or bias need no stamp: the kernel reads those tensors themselves."""
    addresses = [None if t is None else t.data_ptr() for t in tensors]
    matrices = tensors[2::12] + tensors[4::12] + tensors[8::12] + tensors[10::12]  # c_attn, c_proj, c_fc, c_proj
    versions = [None if w is None or w.is_inference() else w._version for w in matrices]
    return addresses + versions


def packed_pointers(weight: torch.Tensor) -> tuple[int, int | None]:
    """The kernel's copy of `weight` (`linear.packed_weight`) as pointers:
    (packed data, scales or None)."""
    packed = gpt2_linear.packed_weight(weight)
    return packed.data.data_ptr(), None if packed.scale is None else packed.scale.data_ptr()


def block_pointers(model: GPT2) -> ctypes.Array | None:
    """The pointer table of every block, from the parameters as they are now;
    None if a parameter is not CPU float32 and contiguous.

    The table is kept and used again while every block parameter is the same
    tensor with the same storage and version; otherwise it is built again
    (linear weights through `linear.packed_weight`, which packs a changed
    weight again). Building it takes ~1 ms for gpt2-large, checking it ~0.2 ms.

    Returns:
        (BlockPointers * L), the table few_rows_blocks.c reads.
    """
    tensors = block_tensors(model)
    now = stamps(tensors)
    kept = _tables.get(model)
    if kept is not None and kept[0] == now:
        return kept[2]
    if not all(t is not None and t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
        return None
    table = (BlockPointers * len(model.h))()
    per_block = zip(*[iter(tensors)] * 12)  # the tensors 12 at a time
    for entry, (ln_1_w, ln_1_b, attn_w, attn_b, proj_w, proj_b, ln_2_w, ln_2_b, fc_w, fc_b, mlp_w, mlp_b) in zip(
        table, per_block
    ):
        if not all(gpt2_linear.kernel_takes(w) for w in (attn_w, proj_w, fc_w, mlp_w)):
            return None
        entry.ln_1_weight, entry.ln_1_bias = ln_1_w.data_ptr(), ln_1_b.data_ptr()
        entry.c_attn, entry.c_attn_scale = packed_pointers(attn_w)
        entry.attn_proj, entry.attn_proj_scale = packed_pointers(proj_w)
        entry.ln_2_weight, entry.ln_2_bias = ln_2_w.data_ptr(), ln_2_b.data_ptr()
        entry.c_fc, entry.c_fc_scale = packed_pointers(fc_w)
        entry.mlp_proj, entry.mlp_proj_scale = packed_pointers(mlp_w)
        entry.c_attn_bias, entry.attn_proj_bias = attn_b.data_ptr(), proj_b.data_ptr()
        entry.c_fc_bias, entry.mlp_proj_bias = fc_b.data_ptr(), mlp_b.data_ptr()
    _tables[model] = (now, [t.detach() for t in tensors], table)
    return table


def block_loop(model: GPT2, x: torch.Tensor, cache: KVCache | None, start: int) -> torch.Tensor | None:
    """`for block in model.h: x = block(x, cache, start)` in one C call, if
    it can take this pass (`runs_block_loop`, and every parameter readable
    by the kernels: `block_pointers`); otherwise None, and nothing is done.
    The T new keys and values go into `cache` at [start, start + T), as the
    blocks would put them.

    Args:
        x: (B, T, C), the blocks' input (embeddings).
        cache: the model's KVCache holding `start` positions, or None.
        start: the position of the first new token.

    Returns:
        (B, T, C), the last block's output, or None.
    """
    if not runs_block_loop(model, x, cache):
        return None
    table = block_pointers(model)
    if table is None:
        return None
    B, T, C = x.shape
    assert start + T <= cache.capacity, f"positions [{start}, {start + T}) past the cache's {cache.capacity}"
    out = x.contiguous().clone()  # (B, T, C): the kernel updates it in place, block after block
    scratch = torch.empty(9 * B * T * C, dtype=x.dtype)  # qkv (3C), y (C), x2 (C), h (4C) per row
    k, v = cache.k, cache.v  # (L, B, nh, S, hs) x 2
    kernel = c_kernel.load_blocks()
    kernel(
        table, len(model.h), out.data_ptr(), scratch.data_ptr(),
        B, T, C, model.config.n_head, model.config.layer_norm_epsilon,
        k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
        start,
    )
    return out
