"""Optional speed for decoding on a CPU (on by default in `load_model`): the model's forward pass in C.

A decode step reads every weight once, so on a CPU it should cost what
reading the weights costs, and verifying a few drafted tokens in one pass
barely more. This subpackage streams each weight once for all rows
(csrc/linear.c), reads each cached key once for all queries (csrc/attention.c)
and runs every block of a pass in one C call (csrc/blocks.c). A position's
logits do not depend on how many rows share its pass, so greedy speculative
decoding reproduces greedy decoding bit for bit. Measured: docs/performance.md.

    from gpt2 import fast
    fast.accelerate(model)              # load_model does this by default on a CPU
    fast.accelerate(model, int8=True)   # and rounds the weights to int8 first
    print(fast.status(model))           # which path runs, and why
    model.accelerator = None            # back to the readable path (GPT2_PLAIN_LINEAR=1: every model loaded)
"""

from __future__ import annotations

import os
import shlex
from typing import TYPE_CHECKING

import torch

from . import build
from .accelerator import FastGPT2, own_ordinary_tensors
from .quantize import quantize_model_int8

if TYPE_CHECKING:
    from gpt2.model import GPT2

READABLE_ENV = "GPT2_PLAIN_LINEAR"  # =1: models loaded or accelerated after it is set keep the readable path

__all__ = ["READABLE_ENV", "accelerate", "status"]


def accelerate(model: GPT2, *, int8: bool = False, adapt_threads: bool = True) -> GPT2:
    """Puts the C forward pass at `model`'s seam, where it can run: an x86-64
    CPU with AVX2 and FMA, not Windows, a C compiler, a CPU float32 model whose
    n_embd and head size are multiples of 8, and GPT2_PLAIN_LINEAR not set to
    1. Elsewhere the model keeps its readable path (`status` says why) and
    nothing is compiled.

    Args:
        model: a GPT2.
        int8: first round every weight matrix to int8 with one scale per row
            (gpt2/fast/quantize.py; CPU float32 only). The model is then the
            quantised model on every path, and the kernels read a quarter of
            the bytes.
        adapt_threads: time the passes and run them with fewer threads
            while that is faster, as when another process keeps a core busy
            (gpt2/fast/threads.py; the results do not change). False: always
            `torch.get_num_threads()`.

    The kernels read packed copies of the weight matrices, packed again
    whenever a parameter changes as PyTorch counts changes: in-place ops on
    the parameter (under `torch.no_grad()`), `load_state_dict`, or `p.data =
    new`; and all of them after a step of an optimizer of the model's
    parameters (a fused one does not count its writes). An edit through
    `p.data.mul_(...)` or a NumPy view is not counted (`.data` has a version
    counter of its own): call `accelerate` again after one. Passes that torch.compile or torch.jit.trace record take
    the readable path (the recording is of tensor operations).

    Returns:
        The same model.

    Raises:
        ValueError: `model` is not a GPT2, `int8` or `adapt_threads` not a
            bool; int8 for a model that is not on the CPU in float32.
    """
    check_gpt2(model)
    for name, value in (("int8", int8), ("adapt_threads", adapt_threads)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    own_ordinary_tensors(model)  # first: quantising writes the weights in place
    levels = quantize_model_int8(model) if int8 else None
    reason = unavailable(model)
    kernels = build.load() if reason is None else None  # compiles on first use
    usable = isinstance(kernels, build.Kernels)
    model.accelerator = FastGPT2(model, kernels, levels, adapt_threads) if usable else None
    return model


def check_gpt2(model) -> None:
    """Raises ValueError unless `model` is a GPT2 (gpt2/model.py)."""
    from gpt2.model import GPT2  # here: gpt2.model must not import this package, and need not

    if not isinstance(model, GPT2):
        raise ValueError(f"expected a GPT2 model (gpt2.load_model('gpt2')), got {type(model).__name__}")


def why_not_cpu_float32(model: GPT2) -> str | None:
    """Why the kernels cannot serve `model`'s device and dtype; None on a CPU in float32."""
    weight = model.wte.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        dtype = str(weight.dtype).removeprefix("torch.")
        return f"the C kernels are for CPU float32 models, this one is {weight.device.type} {dtype}"
    return None


def why_not_widths(model: GPT2) -> str | None:
    """Why the kernels cannot serve `model`'s widths (they read 8 floats at a time); None if they can."""
    C, hs = model.config.n_embd, model.config.head_size
    if C % 8 or hs % 8:
        return f"the C kernels need n_embd and the head size to be multiples of 8, this model has {C} and {hs}"
    return None


def unavailable(model: GPT2 | None) -> str | None:
    """Why the fast path cannot run for `model` (or on this machine), found
    without compiling anything; None if nothing stands in its way."""
    if os.environ.get(READABLE_ENV, "0") == "1":
        return f"{READABLE_ENV}=1"
    if model is not None and (reason := why_not_cpu_float32(model) or why_not_widths(model)):
        return reason
    unsupported = build.cpu_unsupported()
    if unsupported:
        return unsupported
    if build.compiler() is None:
        return f"no C compiler: `{build.compiler_name()}` not found; install gcc or set CC"
    return None


def status(model: GPT2 | None = None) -> str:
    """One line: which path runs (for `model`, or on this machine), and why.
    It compiles and loads nothing."""
    if model is not None:
        check_gpt2(model)
    readable = "readable path (F.linear + SDPA, the Block modules)"
    fast = getattr(model, "accelerator", None)
    if isinstance(fast, FastGPT2) and why_not_cpu_float32(model) is None:  # moved or cast since: it stands aside
        if (reason := fast.why_not(model)) is not None:
            return f"{readable}: {reason}"
        threads = "threads chosen by timing" if fast.threads is not None else "torch.get_num_threads() threads"
        return (f"fast path: C kernels ({fast.kernels.path.name}), {fast.weights} weights, {threads}; passes "
                f"that record gradients, run under hooks or autocast take the {readable}")
    reason = unavailable(model)
    if reason is None and build.load.cache_info().currsize:  # loaded or tried in this process
        loaded = build.load()
        reason = None if isinstance(loaded, build.Kernels) else loaded
    if reason is not None:
        return f"{readable}: {reason}"
    if model is not None:
        return f"{readable}: not accelerated (gpt2.fast.accelerate(model) would use the C kernels)"
    cc = build.compiler()
    try:
        library = build.library_path(cc)
        built = library.exists() and build.intact(library)
    except OSError as e:  # a GPT2_KERNEL_CACHE the file system refuses to look into
        return f"{readable}: the kernel cache folder {build.cache_dir()} cannot be read ({e.strerror})"
    compile_with = f"to be compiled with {shlex.join(cc)} on first use"
    return "fast path available: C kernels " + ("built" if built else compile_with)
