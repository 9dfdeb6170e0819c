"""Compile and load the C kernel `few_rows_linear.c`, once per machine.

`gpt2/linear.py` uses the kernel for the products of a decode step and of a
verification pass on x86-64 CPUs with AVX2 and FMA. It is built on first use
with the system C compiler (`$CC`, else `cc`) into a cache folder, and called
through `ctypes`, so it needs no build step at install time and no PyTorch
headers (compiling takes about a second).

If anything is missing (another CPU, no compiler, a failed build), `load()`
returns None and says why in `status()`; the model then uses `F.linear`,
with the same results and lower speed. Nothing here raises.

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

SOURCE = Path(__file__).with_name("few_rows_linear.c")

# -fopenmp: the loop is split across threads with OpenMP. The library asks for
# libgomp.so.1, which PyTorch has already loaded, so both share one thread pool
# and torch.set_num_threads applies to the kernel too.
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")

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
    """Compile SOURCE into `folder`, named by a hash of everything that goes
    into it, and return the library's path (already there: no compile).

    Raises:
        RuntimeError: the compiler failed; the message has its last line.
    """
    recipe = SOURCE.read_bytes() + repr((compiler, FLAGS, platform.platform())).encode()
    library = folder / f"few_rows_linear-{hashlib.sha256(recipe).hexdigest()[:16]}.so"
    if library.exists():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    # Compile to a temporary name, then rename: a second process building at
    # the same time never loads a half-written file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", partial],
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
def load() -> ctypes._CFuncPtr | None:
    """The kernel's C function `few_rows_linear`, or None (see `status()`).

    Its arguments: x, packed W, bias (or None), y as data pointers, then
    N, IN, OUT; see few_rows_linear.c for the layouts.
    """
    unsupported = cpu_supported()
    if unsupported:
        _set_status(f"F.linear ({unsupported})")
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        _set_status(f"F.linear (no C compiler: `{os.environ.get('CC', 'cc')}` not found; install gcc or set CC)")
        return None
    try:
        library = ctypes.CDLL(str(build(compiler, cache_dir())))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        _set_status(f"F.linear (building few_rows_linear.c failed: {err})")
        return None
    kernel = library.few_rows_linear
    kernel.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    kernel.restype = None
    _set_status(f"few_rows_linear.c (AVX2, built with {compiler})")
    return kernel
