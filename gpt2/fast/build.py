"""Compiles the C kernels of csrc/ into one library, once per machine, and
loads it with ctypes.

The kernels are plain C with AVX2 + FMA intrinsics (and AVX-512's 512-bit
multiply-adds where the CPU has them) and OpenMP: no PyTorch headers, no build
step at install time. They are compiled on first use (`$CC`, else `cc`) into
a cache folder, under a name hashed from the sources, the compile command, its
flags and the platform, so an edited source or another command builds anew;
beside it, its SHA-256: a file that does not match (cut short by a crash or a
partial copy, which would kill the process in the loader) is built again.

Environment:
    CC                 the C compiler, possibly with arguments ("ccache gcc"; default `cc`)
    GPT2_KERNEL_CACHE  where the library goes (default $XDG_CACHE_HOME/gpt2-speculative,
                       else ~/.cache/gpt2-speculative)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("linear.c", "attention.c", "blocks.c"))
HEADERS = (CSRC / "vector_math.h",)  # included by the sources: part of the recipe

# -fopenmp: the loops are split across threads with OpenMP. The library asks for
# libgomp.so.1, which PyTorch has already loaded, so both share one thread pool
# and torch.set_num_threads applies to the kernels too. -ffp-contract=off: a product and a sum
# are never fused into one multiply-add unless the source says so. GCC fuses by default where it
# sees fit, and it saw fit differently in different inlined copies of one line: a row's bits then
# depended on its tile (an int8 output's `scale * sum + bias`).
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
# Where the CPU has AVX-512 (as PyTorch counts it: F, BW, VL, DQ, and as the CPU's own flags say, since
# ATEN_CPU_CAPABILITY changes only what PyTorch reports), the kernels may also use its 32 vector registers and
# 512-bit multiply-adds (linear.c: float32 from 6 rows, int8 at every row count). The flags are part of the
# library's name, so a cache shared with an AVX2-only machine never hands it this build.
AVX512_FLAGS = ("-mavx512f", "-mavx512vl")
LIBRARIES = ("-lm",)
COMPILE_TIMEOUT_S = 120


def cache_dir() -> Path:
    """The folder of built libraries, absolute (ctypes searches the system's library paths for a bare name)."""
    if os.environ.get("GPT2_KERNEL_CACHE"):
        return Path(os.path.abspath(os.environ["GPT2_KERNEL_CACHE"]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.path.abspath(base)) / "gpt2-speculative"


def cpu_unsupported() -> str | None:
    """None if this CPU and OS can run the kernels, else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the C kernels are x86-64 only (this CPU: {platform.machine()})"
    if sys.platform == "win32":
        return "building the C kernels on Windows is not supported"
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", ...
    if capability not in ("AVX2", "AVX512"):
        return f"the C kernels need AVX2 and FMA (PyTorch reports CPU capability {capability})"
    if not cpu_has("avx2", "fma"):
        return "the C kernels need AVX2 and FMA, which this CPU's flags (/proc/cpuinfo) lack"
    return None


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags as Linux lists them in /proc/cpuinfo; None where that cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((frozenset(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), None)


def cpu_has(*features: str) -> bool:
    """Whether the CPU's own flags include every one of `features`; True where its flags cannot be read (PyTorch's
    capability then decides alone)."""
    flags = cpu_flags()
    return flags is None or set(features) <= flags


def compiler() -> list[str] | None:
    """The C compiler's command, its path first (`$CC` may carry arguments,
    as in make), or None."""
    try:
        words = shlex.split(compiler_name())
    except ValueError:  # unbalanced quotes
        return None
    path = shutil.which(words[0]) if words else None
    return None if path is None else [path, *words[1:]]


def compiler_name() -> str:
    """`$CC` as given, else `cc` (an empty CC too)."""
    return os.environ.get("CC", "").strip() or "cc"


def flags() -> tuple[str, ...]:
    """The compiler flags for this CPU: FLAGS, and AVX512_FLAGS where it has AVX-512."""
    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512" and cpu_has("avx512f", "avx512vl")
    return FLAGS + (AVX512_FLAGS if avx512 else ())


def library_path(cc: list[str]) -> Path:
    """Where the library built by `cc` from today's sources is (or will be)."""
    recipe = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    recipe += repr((cc, flags(), LIBRARIES, platform.platform())).encode()
    return cache_dir() / f"gpt2-kernels-{hashlib.sha256(recipe).hexdigest()[:16]}.so"


def compile_library(cc: list[str], library: Path) -> None:
    """Compiles SOURCES into `library` (to a temporary name first, then
    renamed), then writes its digest beside it (`digest_path`).

    Raises:
        RuntimeError: the compiler failed (the message has its last line) or wrote nothing;
        subprocess.TimeoutExpired, OSError: it ran too long or could not run (`load` catches all three).
    """
    library.parent.mkdir(parents=True, exist_ok=True)
    umask = os.umask(0)
    os.umask(umask)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [*cc, *flags(), *map(str, SOURCES), "-o", partial, *LIBRARIES],
            capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S,
        )
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
            raise RuntimeError(f"`{shlex.join(cc)}` failed (exit {done.returncode}): {lines[-1]}")
        with open(partial, "rb") as f:
            built = f.read()
            os.fsync(f.fileno())  # on disk before it takes the library's name
        if not built:
            raise RuntimeError(f"`{shlex.join(cc)}` exited 0 but wrote no library")
        os.chmod(partial, 0o755 & ~umask)  # mkstemp made it 0600: other users of a shared cache could not load it
        os.replace(partial, library)
        partial = f"{library}.{os.getpid()}.tmp"
        Path(partial).write_text(hashlib.sha256(built).hexdigest())
        os.chmod(partial, 0o644 & ~umask)
        os.replace(partial, digest_path(library))  # last: a library without its digest is built again
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def digest_path(library: Path) -> Path:
    """Where the SHA-256 of `library`, as its build wrote it, is kept."""
    return library.with_suffix(".sha256")


def intact(library: Path) -> bool:
    """Whether `library` is what its build wrote (its digest matches)."""
    try:
        return digest_path(library).read_text().strip() == hashlib.sha256(library.read_bytes()).hexdigest()
    except (OSError, UnicodeDecodeError):
        return False


@dataclass(frozen=True)
class Kernels:
    """The three C functions (see csrc/ for their arguments and layouts)."""

    linear: ctypes._CFuncPtr  # few_rows_linear: y = residual + gelu(layer_norm(x) W^T + b)
    attention: ctypes._CFuncPtr  # few_queries_attention: T queries per row over the KV cache
    blocks: ctypes._CFuncPtr  # few_rows_blocks: every block of a pass in one call
    path: Path


def bind(library: ctypes.CDLL, path: Path) -> Kernels:
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    linear = library.few_rows_linear
    linear.argtypes = [ptr] * 5 + [i64] * 3 + [ptr, ptr, f32, ctypes.c_int, ptr]
    attention = library.few_queries_attention
    attention.argtypes = [ptr] * 6 + [i64] * 3 + [ptr, ptr] + [i64] * 7 + [f32]
    blocks = library.few_rows_blocks
    blocks.argtypes = [ptr, i64, ptr, ptr] + [i64] * 4 + [f32, ptr, ptr] + [i64] * 3 + [ptr, ptr, i64]
    for function in (linear, attention, blocks):
        function.restype = None
    return Kernels(linear, attention, blocks, path)


@functools.cache
def load() -> Kernels | str:
    """The kernels, compiled first if needed; or, where they cannot be had,
    the one-line reason (another CPU, no compiler, a failed build). Never
    raises. Cached: a process compiles and loads at most once."""
    unsupported = cpu_unsupported()
    if unsupported:
        return unsupported
    cc = compiler()
    if cc is None:
        return f"no C compiler: `{compiler_name()}` not found; install gcc or set CC"
    try:
        library = library_path(cc)
        if not intact(library):  # not built yet, or damaged since
            compile_library(cc, library)
        return bind(ctypes.CDLL(str(library)), library)
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as err:  # AttributeError: a symbol
        return f"building the C kernels failed: {err}"
