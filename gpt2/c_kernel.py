"""Compile and load the C kernels, once per machine.

The kernels, for x86-64 CPUs with AVX2 and FMA, make a decode step and a
verification pass cost about what reading the model from memory costs:
`few_rows_linear.c` (used by `gpt2/linear.py`: the matrix products, float32
or int8 weights), `few_queries_attention.c` (used by `gpt2/attention.py`:
attention over the KV cache) and `few_rows_blocks.c` (used by
`gpt2/block_loop.py`: all blocks of a step in one C call of the other two,
which then also do the layer norms, GELU, residuals and cache writes), with
the vector helpers of `vector_math.h`. They are
built into one library on first use with the system C compiler (`$CC`, else
`cc`) into a cache folder, and called through `ctypes`, so they need no build
step at install time and no PyTorch headers (compiling takes about a second).

If anything is missing (another CPU, no compiler, a failed build), `load()`,
`load_attention()` and `load_blocks()` return None and `status()` says why;
the model then uses `F.linear`, `F.scaled_dot_product_attention` and its
Block modules, with the same results and lower speed. Nothing here raises.

Environment:
    CC                 the C compiler (default `cc`)
    GPT2_KERNEL_CACHE  where the built library goes (default
                       $XDG_CACHE_HOME/gpt2-speculative, else ~/.cache/gpt2-speculative)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("few_rows_linear.c", "few_queries_attention.c", "few_rows_blocks.c")
)
HEADERS = (Path(__file__).with_name("vector_math.h"),)  # included by the sources: part of the recipe

# -fopenmp: the loops are split across threads with OpenMP. The library asks for
# libgomp.so.1, which PyTorch has already loaded, so both share one thread pool
# and torch.set_num_threads applies to the kernel too.
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
LIBRARIES = ("-lm",)

COMPILE_TIMEOUT_S = 120

_status = "not loaded yet"


def status() -> str:
    """One line: whether the kernel is in use, and if not, why not."""
    return _status


def _set_status(text: str) -> None:
    global _status
    _status = text


def cache_dir() -> Path:
    if os.environ.get("GPT2_KERNEL_CACHE"):
        return Path(os.environ["GPT2_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpt2-speculative"


def cpu_supported() -> str | None:
    """None if this CPU can run the kernel, else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernel is x86-64 only (this CPU: {platform.machine()})"
    if sys.platform == "win32":
        return "building the kernel on Windows is not supported"
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", ...
    if capability not in ("AVX2", "AVX512"):
        return f"the kernel needs AVX2 and FMA (PyTorch reports CPU capability {capability})"
    return None


def build(compiler: str, folder: Path) -> Path:
    """Compile SOURCES into one library in `folder`, named by a hash of
    everything that goes into it, and return the library's path (already
    there: no compile).

    Raises:
        RuntimeError: the compiler failed; the message has its last line.
    """
    recipe = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    recipe += repr((compiler, FLAGS, LIBRARIES, platform.platform())).encode()
    library = folder / f"gpt2-kernels-{hashlib.sha256(recipe).hexdigest()[:16]}.so"
    if library.exists():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    # Compile to a temporary name, then rename: a second process building at
    # the same time never loads a half-written file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, *map(str, SOURCES), "-o", partial, *LIBRARIES],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
            raise RuntimeError(f"`{compiler}` failed (exit {done.returncode}): {lines[-1]}")
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return library


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library of both kernels, or None (see `status()`)."""
    unsupported = cpu_supported()
    if unsupported:
        _set_status(f"F.linear + SDPA ({unsupported})")
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        cc = os.environ.get("CC", "cc")
        _set_status(f"F.linear + SDPA (no C compiler: `{cc}` not found; install gcc or set CC)")
        return None
    try:
        built = ctypes.CDLL(str(build(compiler, cache_dir())))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        _set_status(f"F.linear + SDPA (building the C kernels failed: {err})")
        return None
    _set_status(f"few_rows_linear.c + few_queries_attention.c + few_rows_blocks.c (AVX2, built with {compiler})")
    return built


@functools.cache
def load() -> ctypes._CFuncPtr | None:
    """The C function `few_rows_linear`, or None (see `status()`).

    Its arguments: x, packed W (float32 or int8), the rows' scales (int8
    W; None for float32), bias (or None), y as data pointers; N, IN, OUT;
    the layer norm's weight and bias (or None) and eps; gelu (0 or 1);
    residual (or None). See few_rows_linear.c for the layouts.
    """
    built = library()
    if built is None:
        return None
    kernel = built.few_rows_linear
    kernel.argtypes = (
        [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    )
    kernel.restype = None
    return kernel


@functools.cache
def load_attention() -> ctypes._CFuncPtr | None:
    """The C function `few_queries_attention`, or None (see `status()`).

    Its arguments: q, k_new, v_new (or None), k, v, y as data pointers, then
    B, nh, T, K, hs, the strides q_b, q_h, q_t, kv_b, kv_h, and the scale; see
    few_queries_attention.c for the layouts.
    """
    built = library()
    if built is None:
        return None
    kernel = built.few_queries_attention
    kernel.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 10 + [ctypes.c_float]
    kernel.restype = None
    return kernel


@functools.cache
def load_blocks() -> ctypes._CFuncPtr | None:
    """The C function `few_rows_blocks`, or None (see `status()`).

    Its arguments: the array of BlockPointers, n_layer, x, scratch, B, T, C,
    nh, eps, k_cache, v_cache, the cache strides layer, b, h, and start; see
    few_rows_blocks.c.
    """
    built = library()
    if built is None:
        return None
    kernel = built.few_rows_blocks
    kernel.argtypes = (
        [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        + [ctypes.c_int64] * 4
        + [ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
        + [ctypes.c_int64] * 4
    )
    kernel.restype = None
    return kernel
