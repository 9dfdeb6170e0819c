"""Helpers shared by the benchmark scripts: honest timing, the environment
header every result carries, the results folder, and the (target, draft) pair.

Timing rules, kept by every benchmark:
- the device is synchronised before each clock reading (CUDA and MPS queue
  work asynchronously, so an unsynchronised clock measures the launch only);
- warm-up calls come first and are not counted (allocations, lazy kernels);
- several repeats, reported as median, min and max, never a single run.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2 import (
    GPT2,
    GPT2Config,
    init_random_weights,
    load_model,
    load_tokenizer,
    preset,
    quantize_model_int8,
    resolve_device,
    resolve_dtype,
)
from gpt2 import linear as gpt2_linear
from gpt2.loading import resolve_quantize, resolve_source

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# OpenAI's GPT-2 vocabulary files, kept beside the repository for offline use.
SHARED_BPE_DIR = REPO_ROOT.parent / "shared" / "gpt2-bpe"

# --tiny: two random GPT-2s of a few layers, for tests and smoke runs. They keep
# GPT-2's vocabulary and context window so that the real prompts fit.
TINY_TARGET = GPT2Config(n_layer=2, n_head=2, n_embd=64)
TINY_DRAFT = GPT2Config(n_layer=1, n_head=2, n_embd=64)


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    """Waits until `device` has finished all queued work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def clock(device: torch.device) -> float:
    """Wall time in seconds, read after `device` has finished its queued work."""
    synchronize(device)
    return time.perf_counter()


@dataclass(frozen=True)
class Timing:
    """Seconds of several repeats of the same work."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def to_dict(self) -> dict:
        return {"median": self.median, "min": self.min, "max": self.max, "samples": list(self.samples)}


def median(values: Sequence[float]) -> float:
    """The median (the mean of the two middle values for an even count)."""
    if not values:
        raise ValueError("median of no values")
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def time_call(fn: Callable[[], object], *, device: torch.device, warmup: int = 1, repeats: int = 3) -> Timing:
    """Times `fn()`: `warmup` uncounted calls, then `repeats` timed ones, each
    between two synchronised clock readings."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = clock(device)
        fn()
        samples.append(clock(device) - t0)
    return Timing(tuple(samples))


# ---------------------------------------------------------------------------
# Environment header
# ---------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    """A human name for the device: the GPU model or the CPU model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple GPU (mps), {platform.machine()}"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    """The repository's HEAD commit, with '+dirty' if the tree has changes; None outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=5,
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment(
    device: torch.device, dtype: torch.dtype, models: dict[str, str], quantize: str | None = None
) -> dict:
    """The header stored with every result: where and how it was measured
    (`quantize`: "int8" where the models' weights were quantised)."""
    return {
        "device": str(device),
        "device_name": device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "quantize": quantize,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "models": dict(models),
        "cpu_linear": gpt2_linear.describe(),  # the kernel behind every CPU float32 product
        "git_commit": git_commit(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def environment_lines(env: dict) -> list[str]:
    """The header as Markdown bullet lines."""
    models = ", ".join(f"{role}: {name}" for role, name in env["models"].items())
    weights = f", {env['quantize']} weights (gpt2/quantize.py)" if env.get("quantize") else ""
    return [
        f"- device: {env['device']} ({env['device_name']}), {env['threads']} torch threads, "
        f"{env['cpu_count']} logical CPUs",
        f"- dtype: {env['dtype']}{weights}; torch {env['torch']}; Python {env['python']}; {env['platform']}",
        f"- models: {models}",
        f"- CPU float32 linear layers: {env.get('cpu_linear', 'not recorded')}",
        f"- commit: {env['git_commit']}; date: {env['date']}",
    ]


# ---------------------------------------------------------------------------
# Results folder
# ---------------------------------------------------------------------------


def results_dir(out: str | Path | None, prefix: str) -> Path:
    """The folder results go to: `out`, or benchmarks/results/<prefix>-<UTC time>. Created."""
    if out is None:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
        out = RESULTS_DIR / f"{prefix}-{stamp}"
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out {folder} is a file: give a folder for the results")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def json_ready(value):
    """`value` with NaN and infinities turned into None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(json_ready(payload), indent=2, allow_nan=False) + "\n", encoding="utf-8")


def write_csv(path: Path, columns: Sequence[str], rows: Sequence[dict]) -> None:
    """One line per row; missing values are left empty, floats written in full."""
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in columns})


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub Markdown table; numbers are right-aligned."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# The model pair
# ---------------------------------------------------------------------------


@dataclass
class ModelPair:
    """The models a benchmark decodes with.

    Attributes:
        target, draft: the models, in eval mode on one device and dtype; the
            same object when the draft is the target.
        target_name, draft_name: what the report calls them.
        weights: "checkpoint", "random" (real GPT-2 shapes, random weights)
            or "tiny" (small random models for tests).
        tokenizer_folder: where the target's vocab.json/merges.txt are, if any.
    """

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


def random_model(
    config: GPT2Config, *, device: torch.device, dtype: torch.dtype, seed: int, quantize: str | None = None
) -> GPT2:
    """A GPT-2 of `config`'s shape with GPT-2's random init, reproducible from
    `seed`; its weight matrices quantised if `quantize` is "int8" (as
    `load_model(quantize=...)` does it)."""
    with torch.device("meta"):
        model = GPT2(config)  # shapes only: the seeded init below fills them once
    model = model.to_empty(device="cpu")
    init_random_weights(model, generator=torch.Generator().manual_seed(seed))
    model = model.to(device=device, dtype=dtype).eval()
    if resolve_quantize(quantize, model.device, model.dtype) == "int8":
        quantize_model_int8(model)
    model.prepare_linear_layers()  # as load_model does: packing is not timed in the first run
    return model


def build_pair(
    target: str,
    draft: str,
    *,
    weights: str = "checkpoint",
    draft_equals_target: bool = False,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    quantize: str | None = None,
    seed: int = 0,
) -> ModelPair:
    """Loads or builds the (target, draft) pair.

    Args:
        target, draft: Hub ids or local folders (weights="checkpoint"), or
            preset names such as "gpt2-large" (weights="random").
        weights: "checkpoint" loads them; "random" builds the presets' shapes
            with random weights (no download); "tiny" ignores the names and
            builds a 2-layer target and a 1-layer draft.
        draft_equals_target: use the target as its own draft (acceptance 1 when
            greedy): the draft is then the very same object, no second copy.
        device, dtype: where and in what precision the models run.
        quantize: None, or "int8": both models' weight matrices quantised
            (gpt2/quantize.py), so the baseline is the int8 target.
        seed: seeds the random weights (target: seed, draft: seed + 1).

    Raises:
        ValueError, FileNotFoundError: unknown names or a failed load, with a
            message that says how to fix it.
    """
    dev = resolve_device(device)
    dt_ = resolve_dtype(dtype, dev)
    quantize = resolve_quantize(quantize, dev, dt_)
    folder = None
    if weights == "checkpoint":
        target_model = load_model(target, device=dev, dtype=dt_, quantize=quantize)
        draft_model = target_model
        if not draft_equals_target:
            draft_model = load_model(draft, device=dev, dtype=dt_, quantize=quantize)
        folder = resolve_source(target)  # already downloaded by load_model: no network
    elif weights in ("random", "tiny"):
        if weights == "tiny":
            target, draft = "tiny-target (2 layers, C=64)", "tiny-draft (1 layer, C=64)"
            target_config, draft_config = TINY_TARGET, TINY_DRAFT
        else:
            target_config, draft_config = preset(target), preset(draft)
        target_model = random_model(target_config, device=dev, dtype=dt_, seed=seed, quantize=quantize)
        draft_model = target_model
        if not draft_equals_target:
            draft_model = random_model(draft_config, device=dev, dtype=dt_, seed=seed + 1, quantize=quantize)
    else:
        raise ValueError(f"weights must be 'checkpoint', 'random' or 'tiny', got {weights!r}")
    if draft_equals_target:
        draft = target
    return ModelPair(target_model, draft_model, target, draft, weights, folder)


def load_prompt_tokenizer(model_folder: Path | None = None):
    """The GPT-2 tokenizer for encoding the benchmark prompts.

    Taken from the model folder's vocab.json/merges.txt, else from
    ../shared/gpt2-bpe (OpenAI's encoder.json/vocab.bpe are the same files
    under other names), else from tiktoken's own "gpt2" download.

    Raises:
        FileNotFoundError: none of them is available.
    """
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
            f"the GPT-2 tokenizer is needed to encode the benchmark prompts and could not be loaded "
            f"({type(e).__name__}): connect to the internet once, or put OpenAI's encoder.json and "
            f"vocab.bpe into {SHARED_BPE_DIR}"
        ) from None


def encode_prompts(
    tokenizer, prompts: Sequence[tuple[str, str]], device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """(name, text) -> (name, (1, T) LongTensor of token ids on `device`)."""
    return [
        (name, torch.tensor([tokenizer.encode(text)], dtype=torch.long, device=device)) for name, text in prompts
    ]


# ---------------------------------------------------------------------------
# Command-line entry points
# ---------------------------------------------------------------------------


def run_cli(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Runs `main(argv)`; a user mistake (ValueError, FileNotFoundError) becomes
    one line on stderr and exit code 2, never a traceback."""
    try:
        return main(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
