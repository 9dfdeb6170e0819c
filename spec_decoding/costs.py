"""What a step of speculative decoding costs on this machine: t_d and t_v(k).

Legend: K = tokens drafted in a step, k = tokens in one target pass.

A step that drafts K tokens costs K t_d + t_v(K + 1): K draft forward passes
of one token, then one target pass over the pending token and the K drafts
(Leviathan et al. 2023, section 3, with the verification at its measured
cost; on a CPU t_v(k) grows with k). `gamma="auto"` (schedule.py) weighs the
tokens a step is expected to emit against this cost. `calibrate` measures both
once (seconds: five timed rounds of every pass length) and keeps them in a
JSON file under the C kernels' cache folder, keyed by the machine, the models'
shapes, device, dtype and which forward path each model takes (fast or
readable, float32 or int8).
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import platform
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from gpt2 import fast
from gpt2.fast import build
from gpt2.generate import check_integer
from gpt2.model import GPT2

from .stats import clock

CONTEXT = 256  # tokens in the KV caches while timing: a pass's cost grows with it, t_v(k) faster for larger k
ROUNDS = 5  # each kind of pass is timed once per round (see relative_medians)
# Untimed decode steps of each model first: the fast path settles each model's thread count over its first passes
# (gpt2/fast/threads.py), and a draft timed before it has settled can look several times slower on a busy machine.
WARMUP_STEPS = 24
Kind = tuple[str, int]  # a kind of pass: ("target" or "draft", tokens in it)


@dataclass(frozen=True)
class StepCosts:
    """Seconds of the two kinds of work in a speculative step.

    Attributes:
        t_draft: one draft forward pass of one token, on a KV cache (0 for a
            drafter without a model, such as prompt lookup).
        t_verify: t_verify[k - 1] = one target pass over k tokens on a KV
            cache, k = 1 .. len(t_verify); t_verify[0] is a plain decode step.
    """

    t_draft: float
    t_verify: tuple[float, ...]

    def __post_init__(self) -> None:
        times = tuple(self.t_verify) if isinstance(self.t_verify, (tuple, list)) else ()
        numbers_only = all(isinstance(t, numbers.Real) and not isinstance(t, bool) for t in (self.t_draft, *times))
        finite = numbers_only and all(math.isfinite(t) for t in (self.t_draft, *times))
        if not times or not finite or self.t_draft < 0 or min(times) <= 0:
            raise ValueError(f"step costs need a finite t_draft >= 0 and finite positive t_verify times, got {self}")
        object.__setattr__(self, "t_verify", tuple(float(t) for t in self.t_verify))

    @property
    def max_tokens(self) -> int:
        """The largest pass it has a cost for: K + 1 for K = max_tokens - 1."""
        return len(self.t_verify)

    def step_seconds(self, K: int) -> float:
        """K t_d + t_v(K + 1): drafting K tokens and verifying them."""
        if isinstance(K, bool) or not isinstance(K, int) or not 0 <= K < self.max_tokens:  # t_verify[-1] is no cost
            raise ValueError(f"no verification cost for K = {K!r}: K must be an integer in 0..{self.max_tokens - 1}")
        return K * self.t_draft + self.t_verify[K]


def non_decreasing(values: list[float]) -> tuple[float, ...]:
    """Each value raised to the largest before it: a pass over more tokens
    never costs less than one over fewer, so a lower figure is noise."""
    out = list(values)
    for i in range(1, len(out)):
        out[i] = max(out[i], out[i - 1])
    return tuple(out)


@torch.inference_mode()
def measure(target: GPT2, draft: GPT2 | None, max_tokens: int, *, rounds: int = ROUNDS) -> StepCosts:
    """Times t_d and t_v(k), k = 1 .. max_tokens, now: in `rounds` rounds that
    each time one pass of every kind, after WARMUP_STEPS untimed decode steps
    of each model and one untimed round. A
    shared machine's speed swings from one second to the next, and auto's
    choice depends on the costs' ratios, not their level: so each pass is
    taken relative to t_v(1) of its own round (`relative_medians`). Every k
    is timed: t_v(k) is not smooth in k (the kernels work on groups of rows,
    so it rises in steps), and the best K often sits at a step."""
    ks = range(1, max_tokens + 1)
    device = target.device
    models = {"target": target} if draft is None else {"target": target, "draft": draft}
    longest = {"target": max_tokens, "draft": 1}  # the longest pass timed of each
    caches, lengths = {}, {}
    for name, model in models.items():
        if longest[name] > model.config.n_ctx:
            raise ValueError(
                f"the {name}'s context window ({model.config.n_ctx} tokens) is too short to time passes of "
                f"{longest[name]} tokens: ask for a smaller largest gamma"
            )
        lengths[name] = min(CONTEXT, model.config.n_ctx - longest[name])  # room left for the timed passes
        caches[name] = model.new_cache(1)
        context = torch.arange(lengths[name], device=device)[None] % model.config.vocab_size  # (1, length)
        if lengths[name] > 0:
            model(context, caches[name], last_logits_only=True)
        step = torch.zeros((1, 1), dtype=torch.long, device=device)  # (1, 1): token 0, one position after it
        for _ in range(WARMUP_STEPS):
            model(step, caches[name])
            caches[name].rewind(lengths[name])
    passes = [("target", k) for k in ks] + ([("draft", 1)] if draft is not None else [])
    seconds: dict[Kind, list[float]] = {p: [] for p in passes}
    for round_ in range(rounds + 1):
        for name, k in passes:
            tokens = torch.arange(k, device=device)[None] % models[name].config.vocab_size  # (1, k)
            t0 = clock(device)
            models[name](tokens, caches[name])  # every position's logits, as a verification computes them
            t1 = clock(device)
            caches[name].rewind(lengths[name])
            if round_ > 0:  # round 0 warms up
                seconds[(name, k)].append(t1 - t0)
    cost = relative_medians(seconds, ("target", 1))
    t_verify = non_decreasing([cost[("target", k)] for k in ks])
    return StepCosts(t_draft=cost.get(("draft", 1), 0.0), t_verify=t_verify)


def relative_medians(seconds: dict[Kind, list[float]], reference: Kind) -> dict[Kind, float]:
    """Each kind's typical seconds from per-round timings, `seconds[kind][r]`
    for round r: the median over rounds of its ratio to `reference` in the same
    round, times the reference's median. A round in which the whole machine
    ran slower moves no ratio."""
    ref = seconds[reference]
    return {kind: statistics.median(ref) * statistics.median(t / r for t, r in zip(times, ref))
            for kind, times in seconds.items()}


def default_cache_dir() -> Path:
    """Where calibrations are kept: step-costs/ in the C kernels' cache folder
    (GPT2_KERNEL_CACHE, else gpt2-speculative/ in $XDG_CACHE_HOME or ~/.cache)."""
    return build.cache_dir() / "step-costs"


def calibration_key(target: GPT2, draft: GPT2 | None, max_tokens: int) -> dict:
    """Everything a calibration depends on: the machine, the thread count,
    the models' shapes, device and dtype, and the path each forward pass takes."""

    def describe(model: GPT2 | None) -> dict | None:
        if model is None:
            return None
        return {
            "config": asdict(model.config),
            "device": str(model.device),
            "dtype": str(model.dtype).removeprefix("torch."),
            "path": fast.status(model),  # fast or readable, float32 or int8 weights, which kernel build
        }

    return {
        "machine": machine_name(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "target": describe(target),
        "draft": describe(draft),
        "max_tokens": max_tokens,
        "context": CONTEXT,
        "rounds": ROUNDS,
        "warmup_steps": WARMUP_STEPS,  # calibrations stored before the warm-up steps existed are measured again
    }


def machine_name() -> str:
    """The CPU's model name (and the GPU's where CUDA is present)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if torch.cuda.is_available():
        cpu += " + " + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return cpu


def calibrate(
    target: GPT2, draft: GPT2 | None, max_tokens: int, *, cache_dir: str | Path | None = None, refresh: bool = False
) -> StepCosts:
    """t_d and t_v(1 .. max_tokens) for this pair on this machine: read from
    the cache folder if measured before, else measured now (`measure`) and
    stored there (a folder that cannot be written is skipped silently).

    Args:
        target: the target model.
        draft: the draft model, or None for a drafter without one (t_d = 0).
        max_tokens: the largest target pass needed, K + 1 for the largest K.
        cache_dir: default `default_cache_dir()`.
        refresh: measure again even if a calibration is stored.
    """
    max_tokens = check_integer(max_tokens, "max_tokens", 1)
    if not isinstance(target, GPT2) or not (draft is None or isinstance(draft, GPT2)):
        raise ValueError(f"calibrate times loaded GPT2 models (gpt2.load_model), the draft's or None, got "
                         f"{type(target).__name__} and {type(draft).__name__}")
    key = calibration_key(target, draft, max_tokens)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir or default_cache_dir()) / f"step-costs-{digest}.json"
    if not refresh:
        try:
            stored = json.loads(path.read_text())
            costs = StepCosts(t_draft=stored["t_draft"], t_verify=tuple(stored["t_verify"]))
            if costs.max_tokens == max_tokens and costs.t_verify == non_decreasing(costs.t_verify):
                return costs
        except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError):
            pass  # none yet, unreadable, edited or from an older format: measure again
    costs = measure(target, draft, max_tokens)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"key": key, **asdict(costs)}, indent=1))
        partial.replace(path)  # atomic: another process never reads half a file
    except OSError:
        pass
    return costs
