"""What the benchmark scripts share: the environment header every result carries, the results folder and its file
formats, the (target, draft) pair, the prompts' tokenizer and the command-line error rule.

Timing rules, kept by every benchmark: the clock is read after the device has finished its queued work
(`spec_decoding.stats.clock`); warm-up calls come first and are not counted; several repeats, reported as medians.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import functools
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch

from gpt2 import GPT2, PRESETS, GPT2Config, fast, init_random_weights, load_model, load_tokenizer, preset
from gpt2 import resolve_device, resolve_dtype
from gpt2.fast.quantize import quantize_model_int8, resolve_quantize
from gpt2.hub import resolve_source
from spec_decoding import TokenTree
from spec_decoding.stats import clock

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
SHARED_BPE_DIR = REPO_ROOT.parent / "shared" / "gpt2-bpe"  # OpenAI's GPT-2 vocabulary, for offline use

# Two small random GPT-2s for tests and smoke runs, with GPT-2's vocabulary and context window so that the real
# prompts fit. Benchmarks take them by name: "tiny", "tiny-draft".
TINY_TARGET = GPT2Config(n_layer=2, n_head=2, n_embd=64)
TINY_DRAFT = GPT2Config(n_layer=1, n_head=2, n_embd=64)


def shape(name: str) -> GPT2Config:
    """A preset's config ("gpt2", "gpt2-large", ...) or a tiny one ("tiny", "tiny-draft")."""
    tiny = {"tiny": TINY_TARGET, "tiny-draft": TINY_DRAFT}
    if name in tiny:
        return tiny[name]
    try:
        return preset(name)
    except ValueError:
        raise ValueError(f"no preset named {name!r}: choose one of {', '.join([*PRESETS, *tiny])}") from None


def pair_names(args: argparse.Namespace, *, presets: bool, target: str = "gpt2-large",
               draft: str = "gpt2") -> tuple[str, str]:
    """Sets and returns (args.target, args.draft): "tiny" and "tiny-draft" with --tiny, else the names given,
    `target` and `draft` where none was given (the parser's defaults are None). `presets`: the names are shapes
    for random weights (`shape`), checked here, before any model is built; else Hub ids or folders.

    Raises:
        ValueError: a name that is empty, or not a shape with `presets`, or a test shape without; --tiny with
            --target or --draft, or --draft-equals-target with --draft, which would ignore them.
    """
    given = {f"--{role}": getattr(args, role) for role in ("target", "draft") if getattr(args, role) is not None}
    as_typed = {flag: f"{flag} {shlex.quote(name)}" for flag, name in given.items()}
    if args.tiny and given:
        raise ValueError(f"--tiny builds tiny models of its own: drop {' and '.join(as_typed.values())}, or drop "
                         "--tiny")
    if getattr(args, "draft_equals_target", False) and "--draft" in given:
        raise ValueError(f"--draft-equals-target drafts with the target: drop {as_typed['--draft']}, or drop "
                         "--draft-equals-target")
    for flag, name in given.items():
        if not name.strip():
            raise ValueError(f"{flag} is empty: give a model, or leave it out for the default")
        if presets:
            try:
                shape(name)
            except ValueError as e:
                raise ValueError(f"{flag}: {e}") from None
        elif name in ("tiny", "tiny-draft"):
            raise ValueError(f"{flag} {name} is a test shape, not a checkpoint: pass --tiny for the tiny pair (or "
                             "--random-weights)")
    if args.tiny:
        args.target, args.draft = "tiny", "tiny-draft"
    else:
        args.target = target if args.target is None else args.target
        args.draft = draft if args.draft is None else args.draft
    return args.target, args.draft


@functools.cache
def binary_tree_mask(k: int) -> torch.Tensor:
    """(k, k) bool ancestor mask of a binary token tree in breadth-first order (node i's parent is (i - 1) // 2):
    mask[i, j] = j is i or an ancestor of i. What a verification pass over k tree nodes takes."""
    return TokenTree((0,) * k, tuple((i - 1) // 2 for i in range(k))).ancestor_mask()  # the root's parent: -1


def device_name(device: torch.device) -> str:
    """A human name for the device: the GPU model or the CPU model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple GPU (mps), {platform.machine()}"
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    """The repository's short HEAD commit, with '+dirty' if tracked files have changes; None outside git."""
    try:  # --exclude=*: no tag names, the commit hash itself
        done = subprocess.run(["git", "describe", "--always", "--dirty=+dirty", "--exclude=*"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def environment(device: torch.device, dtype: torch.dtype, models: dict[str, str], path: str,
                quantize: str | None = None) -> dict:
    """The header stored with every result: where and how it was measured; `path` is `gpt2.fast.status(model)`,
    `quantize` "int8" for int8 weights."""
    return {
        "device": str(device), "device_name": device_name(device), "dtype": str(dtype).removeprefix("torch."),
        "quantize": quantize, "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "models": dict(models), "path": path, "git_commit": git_commit(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def environment_lines(env: dict) -> list[str]:
    """The header as Markdown bullet lines."""
    models = ", ".join(f"{role}: {name}" for role, name in env["models"].items())
    weights = f", {env['quantize']} weights (gpt2/fast/quantize.py)" if env.get("quantize") else ""
    return [
        f"- device: {env['device']} ({env['device_name']}), {env['threads']} torch threads, "
        f"{env['cpu_count']} logical CPUs",
        f"- dtype: {env['dtype']}{weights}; torch {env['torch']}; Python {env['python']}; {env['platform']}",
        f"- models: {models}",
        f"- forward pass: {env['path']}",
        f"- commit: {env['git_commit']}; date: {env['date']}",
    ]


def results_dir(out: str | Path | None, prefix: str, *, create: bool = True) -> Path:
    """The folder results go to: `out`, or benchmarks/results/<prefix>-<UTC time>. Created, unless `create` is
    False: then only checked, for a run that makes it once its work is done (call again with the folder).

    Raises:
        ValueError: `out` is empty, a file, names no home folder (~user), or a folder that cannot be created or
            written to.
    """
    if out is None:
        out = RESULTS_DIR / f"{prefix}-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%d-%H%M%S')}"
    if not str(out).strip():
        raise ValueError("--out is empty: give a folder for the results, or leave --out out for "
                         f"benchmarks/results/{prefix}-<UTC time>")
    try:
        folder = Path(out).expanduser()  # --out=~/results: no shell expands a ~ after "="
    except RuntimeError:  # pathlib's "Could not determine home directory"
        raise ValueError(f"--out {out}: '{str(out).split('/', 1)[0]}' names no home folder on this machine: "
                         "give a folder for the results") from None
    try:
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"--out {folder} is a file: give a folder for the results")
        existing = next(p for p in [folder, *folder.parents] if p.exists())  # the root always exists
    except OSError as e:  # a name too long, ...: pathlib's exists() passes on only a few errors
        raise ValueError(f"--out {folder} cannot be used ({e.strerror or e}): give a folder you can write to") from None
    if not create:
        if not can_write_in(existing):
            raise ValueError(f"--out {folder} cannot be created ({existing} is not a folder you can write to): "
                             "give a folder you can write to")
        return folder
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a parent that is a file, no permission, a read-only file system, ...
        raise ValueError(f"--out {folder} cannot be created ({e.strerror}): give a folder you can write to") from None
    if not can_write_in(folder):
        raise ValueError(f"--out {folder} is not writable: give a folder you can write to")
    return folder


def can_write_in(folder: Path) -> bool:
    """Whether an entry can be made in `folder`, tried by making and removing an empty folder there: os.access
    answers yes to root even where the file system says no (/sys)."""
    try:
        os.rmdir(tempfile.mkdtemp(dir=folder))
    except OSError:  # not a folder, no permission, a read-only file system, ...
        return False
    return True


def write_json(path: Path, payload: dict) -> None:
    """`payload` as indented JSON, NaN and infinities written as null (JSON has no NaN)."""
    finite = json.loads(json.dumps(payload), parse_constant=lambda _: None)  # NaN, Infinity, -Infinity -> None
    path.write_text(json.dumps(finite, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def write_csv(path: Path, columns: Sequence[str], rows: Sequence[dict]) -> None:
    """One line per row; missing values are left empty, floats written in full."""
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")  # None and missing: empty
        writer.writeheader()
        writer.writerows(rows)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub Markdown table; numbers are right-aligned."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


@dataclass
class ModelPair:
    """`target` and `draft` in eval mode on one device and dtype (the same object when the target drafts for
    itself), the names the report gives them, their `weights` ("checkpoint", "random": real shapes with random
    weights, or "tiny") and the target's tokenizer folder."""

    target: GPT2
    draft: GPT2
    target_name: str
    draft_name: str
    weights: str
    tokenizer_folder: Path | None = None

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def dtype(self) -> torch.dtype:
        return self.target.dtype

    @property
    def draft_is_target(self) -> bool:
        return self.draft is self.target


def random_model(config: GPT2Config, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0, quantize: str | None = None, accelerate: bool = True) -> GPT2:
    """A GPT-2 of `config`'s shape with GPT-2's random init from `seed`, set up as `load_model` sets up a checkpoint:
    accelerated on a CPU in float32 (unless `accelerate` is False), weight matrices int8 if `quantize` is "int8"."""
    with torch.device("meta"):
        model = GPT2(config)  # shapes only: the seeded init below fills them once
    model = init_random_weights(model.to_empty(device="cpu"), generator=torch.Generator().manual_seed(seed))
    model = model.to(device=device, dtype=dtype).eval()
    int8 = resolve_quantize(quantize, model.device, model.dtype) == "int8"
    if accelerate and model.device.type == "cpu" and model.dtype == torch.float32:
        fast.accelerate(model, int8=int8)
    elif int8:
        quantize_model_int8(model)
    return model


def noisy_copy(model: GPT2, *, scale: float, seed: int, relative: bool = False) -> GPT2:
    """A copy of `model`, on the readable path in eval mode, with N(0, scale) noise (N(0, scale * std(W)) if
    `relative`) added to every weight matrix and embedding W, not to layer norms and biases: a draft that partly
    agrees with the target."""
    copy = GPT2(model.config)
    copy.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in copy.named_parameters():
            if name.endswith("weight") and ".ln_" not in name and not name.startswith("ln_"):
                p.add_(torch.randn(p.shape, generator=g) * scale * (p.std() if relative else 1.0))
    return copy.eval()


def build_pair(target: str, draft: str, *, weights: str = "checkpoint", draft_equals_target: bool = False,
               device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
               quantize: str | None = None, seed: int = 0, accelerate: bool = True) -> ModelPair:
    """Loads or builds the (target, draft) pair. `target`, `draft`: Hub ids or folders (weights="checkpoint"),
    preset names such as "gpt2-large" (weights="random"), ignored for "tiny". `draft_equals_target`: the target
    drafts for itself. `quantize` (None or "int8") applies to both; `accelerate`: False keeps the readable path;
    `seed` seeds random weights (target: seed, draft: seed + 1).

    Raises:
        ValueError, FileNotFoundError: unknown names or a failed load, saying how to fix it.
    """
    if weights not in ("checkpoint", "random", "tiny"):
        raise ValueError(f"weights must be 'checkpoint', 'random' or 'tiny', got {weights!r}")
    dev = resolve_device(device)
    dt_ = resolve_dtype(dtype, dev)
    quantize = resolve_quantize(quantize, dev, dt_)
    if weights == "tiny":
        target, draft = "tiny", "tiny-draft"

    def build(name: str, model_seed: int) -> GPT2:
        if weights == "checkpoint":
            return load_model(name, device=dev, dtype=dt_, quantize=quantize, accelerate=accelerate)
        return random_model(shape(name), device=dev, dtype=dt_, seed=model_seed, quantize=quantize,
                            accelerate=accelerate)

    target_model = build(target, seed)
    draft_model = target_model if draft_equals_target else build(draft, seed + 1)
    folder = resolve_source(target) if weights == "checkpoint" else None  # downloaded by load_model already
    return ModelPair(target_model, draft_model, target, target if draft_equals_target else draft, weights, folder)


def load_prompt_tokenizer(model_folder: Path | None = None):
    """The GPT-2 tokenizer for the benchmark prompts: from the model folder's vocab.json/merges.txt, else
    ../shared/gpt2-bpe (OpenAI's encoder.json and vocab.bpe, the same files), else tiktoken's own "gpt2" download;
    a FileNotFoundError if none of them is available."""
    if model_folder is not None and (Path(model_folder) / "vocab.json").is_file():
        return load_tokenizer(model_folder)
    if SHARED_BPE_DIR.is_dir():
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copyfile(SHARED_BPE_DIR / "encoder.json", Path(tmp) / "vocab.json")
            shutil.copyfile(SHARED_BPE_DIR / "vocab.bpe", Path(tmp) / "merges.txt")
            return load_tokenizer(tmp)
    try:
        return load_tokenizer(None)
    except Exception as e:  # tiktoken's download failed: no network and no cache
        raise FileNotFoundError(
            f"the benchmark prompts need the GPT-2 tokenizer, which could not be loaded ({type(e).__name__}): "
            f"connect to the internet once, or put OpenAI's encoder.json and vocab.bpe into {SHARED_BPE_DIR}"
        ) from None


def encode_prompts(tokenizer, prompts: Sequence[tuple[str, str]], device: torch.device
                   ) -> list[tuple[str, torch.Tensor]]:
    """(name, text) -> (name, (1, T) LongTensor of token ids on `device`)."""
    return [(name, torch.tensor([tokenizer.encode(text)], dtype=torch.long, device=device)) for name, text in prompts]


def say(message: str) -> None:
    """A progress line on stderr (stdout carries the report)."""
    print(message, file=sys.stderr, flush=True)


def timed(fn: Callable, *args, device: torch.device = torch.device("cpu")) -> float:
    """Seconds that `fn(*args)` takes, the clock read after `device` has finished its queued work."""
    t0 = clock(device)
    fn(*args)
    return clock(device) - t0


def must(condition: bool, message: str) -> None:
    """A check of the benchmark's own correctness (an output that must equal greedy decoding): an AssertionError
    if it fails, which `python -O` cannot strip as it strips `assert`."""
    if not condition:
        raise AssertionError(message)


def check_range(option: str, value: int | float, low: int | float, high: int | float, why: str = "") -> None:
    """Raises a ValueError naming the command-line `option` unless `value` lies in low..high (NaN never does);
    `why` says where `high` comes from, e.g. " (this machine's logical CPUs)"."""
    if not low <= value <= high:
        raise ValueError(f"{option} must lie in {low}..{high}{why}, got {value}")


# --seed: torch takes 64-bit seeds, and the benchmarks add small offsets to it (per prompt, repeat or model).
MAX_SEED = 2**62


def logical_cpus() -> int:
    """The machine's logical CPUs: the most --threads or --busy may ask for."""
    return os.cpu_count() or 1


def set_threads(threads: int | None) -> None:
    """Gives torch `threads` CPU threads (None: torch's own choice); more than the logical CPUs is a ValueError
    (they only oversubscribe the cores, and a huge count crashes torch)."""
    if threads is not None:
        check_range("--threads", threads, 1, logical_cpus(), " (this machine's logical CPUs)")
        torch.set_num_threads(threads)


def check_passes_fit(n_ctx: int, used: int, what_uses: str, passes: dict[str, int]) -> None:
    """Raises a ValueError unless every verification pass of `passes` ({the option asking for it, e.g. "--gamma 8":
    its tokens, gamma + 1 or a tree's nodes + 1}) fits the context window of `n_ctx` positions after the `used`
    positions that `what_uses` names (a prompt and the tokens generated after it)."""
    room = n_ctx - used  # the longest pass that still fits
    for option, tokens in passes.items():
        if tokens > room:
            fix = (f"give gammas of at most {room - 1} and trees of at most {room - 1} nodes" if room > 1
                   else "shorten the prompt or the run")
            raise ValueError(f"{option} verifies {tokens} tokens in one pass, but after {what_uses} ({used} "
                             f"positions) the context window of {n_ctx} has room for {max(room, 0)}: {fix}")


def machine_memory() -> int:
    """Bytes of this machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_caches_fit(nbytes: int, fix: str, holder: str = "the runs timed together in lockstep") -> None:
    """Raises a ValueError if `nbytes` of KV caches, alive at once in `holder` (by default while the runs of a
    lockstep call, benchmarks/lockstep.py, take turns), exceed half of this machine's memory; `fix` says what to
    give less of."""
    memory = machine_memory()
    if nbytes > memory / 2:
        raise ValueError(f"{holder} would hold {nbytes / 2**30:.1f} GiB of KV caches at once, more than half of "
                         f"this machine's {memory / 2**30:.0f} GiB: {fix}")


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors (a value it cannot parse, an unknown option) are one line, which `run_cli`
    prints with exit code 2, instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"{message} (see --help)")


def writable(stream) -> bool:
    """Whether `stream`'s file takes writes: a launcher that leaves a process's fd 2 open for reading only (a
    shell wrapper of `python` under 2>&-) hands it a stderr whose first write fails."""
    try:
        os.write(stream.fileno(), b"")  # Linux checks the file's mode before the count
    except (AttributeError, ValueError):  # no file behind it (a capture; io.UnsupportedOperation): it takes writes
        return True
    except OSError:
        return False
    return True


def run_cli(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Runs `main(argv)`; a user mistake (ValueError, FileNotFoundError) becomes one line on stderr and exit code 2,
    never a traceback; Ctrl-C exit code 130; a reader that closed stdout early (`| head`) exit code 141, as a
    SIGPIPE; characters stdout cannot encode (γ, α on a cp1252 console) are written as '?'."""
    if sys.stderr is None or not writable(sys.stderr):  # 2>&-: print would send progress and errors to stdout
        sys.stderr = open(os.devnull, "w", encoding="utf-8")
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    try:
        code = main(argv)
        if sys.stdout is not None:
            sys.stdout.flush()  # here, where a reader that left is caught, not as Python exits
        return code
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if sys.stdout is not None:  # what is left in its buffer goes nowhere as Python exits, not to an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:  # a result file that cannot be written (a folder in its place, a full disk)
        print(f"error: {e}", file=sys.stderr)
        return 1
