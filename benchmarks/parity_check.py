"""Parity check: is speculative greedy output identical to plain greedy output,
and when it is not, why?

Legend: T = prompt tokens, n = new tokens, d = index of the first differing new
token, V = vocab size, K = gamma.

Greedy speculative decoding (Leviathan et al. 2023, section 2.3; Chen et al.
2023) keeps a drafted token only if it is the target's argmax, so in exact
arithmetic its output equals greedy decoding of the target alone. In floating
point the two paths compute the target's logits differently: plain decoding
feeds one token per forward pass (a (1, 1) input against the KV cache),
verification feeds K + 1 tokens at once (a (1, K + 1) input, other matrix
shapes, other kernels and reduction orders). The logits then differ in their
last bits; where the target's top two tokens are nearly tied, that is enough
to pick the other one, and from there on the texts differ.

For every prompt of the benchmark suite (plus the prompts that end early with
end-of-text) and every dtype, this script decodes greedily both ways and, at
the first differing token, shows the evidence:

- the two tokens chosen, and the target's top-1 minus top-2 logit gap at that
  position in each run. The logits are the very rows each run decided with,
  captured during the runs by a forward hook on the target (no recomputation):
  the baseline's from its prefill or one-token cached step, the speculative
  run's from the batched verification pass that committed the token. Both runs
  share the prefix up to that position, so the two rows score the same context;
- |delta logit|: the largest difference between the two rows, the numerical
  noise between the two ways of computing the same thing;
- a verdict. "near-tie": each run chose the top-1 of its own logits and both
  gaps are below the tie tolerance (rounding can explain the flip). "BUG":
  anything else, a clear winner that was not chosen or a path that did not
  follow its own argmax (a broken verifier, a stale cache, a bad rewind).

The tie tolerance at a position is

    tolerance = max(--tie-tolerance, TIE_EPS_MULTIPLE * eps(dtype)) * scale,

with scale = the largest |logit| of the two rows. Rounding errors scale with
the magnitude of the values involved, hence the relative form. Measured here
(random GPT-2 weights of the real shapes, CPU), one-token and batched logits
differ by ~1e-6 * scale in float32 and by ~1-2 eps(dtype) * scale in
bfloat16/float16 (their matmuls accumulate in float32; rounding of stored
activations dominates). So in float32 the default 1e-3 * scale sits three
orders of magnitude above the noise and well below the gap of a real mistake
(a wrong token typically trails the top-1 by a sizeable fraction of the logit
spread); for half precision the floor of 8 eps * scale is a few times the
measured noise.

It also checks the end-of-text rule of both paths: the end-of-text token, if
produced, is the last token; nothing follows it.

Output: parity.md and parity.json in a results folder, with the environment
header of the other benchmarks. The exit code is 1 if a float32 divergence is a
BUG or any path broke the end-of-text rule, so the script can gate CI; 2 for a
usage error; 0 otherwise.

    python -m benchmarks.parity_check --random-weights --dtypes float32,bfloat16
    python -m benchmarks.parity_check --draft gpt2 --target gpt2-large --gamma 4 --max-gen 32
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python benchmarks/parity_check.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    build_pair,
    encode_prompts,
    environment,
    environment_lines,
    load_prompt_tokenizer,
    markdown_table,
    results_dir,
    run_cli,
    write_json,
)
from benchmarks.prompts import EARLY_EOS_PROMPTS, PROMPTS
from gpt2 import END_OF_TEXT_ID, GPT2, GPT2Config, generate, resolve_device, resolve_dtype
from gpt2.kv_cache import KVCache
from spec_decoding import ModelDrafter, speculative_generate

DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEFAULT_TIE_TOLERANCE = 1e-3  # relative to the logit scale; see the module docstring
TIE_EPS_MULTIPLE = 8  # the tolerance is never below 8 eps(dtype) * scale


# ---------------------------------------------------------------------------
# Capturing the logits each run decided with
# ---------------------------------------------------------------------------


class TargetLogitRecorder:
    """Keeps, for each sequence position, the target's logits row that scored
    the token there, during one decoding run.

    A forward hook sees every target call. A call that leaves the cache at
    length L and returns T_out rows scored positions L - T_out + 1 .. L (row t
    of a forward over positions [P, P + T) scores the token at P + t + 1). A
    later call that scores a position again overwrites it: speculative
    decoding re-scores positions after a rejected draft, and the last scoring
    is the one that committed the token, with the committed prefix.

    Attributes:
        rows: position -> (V,) float32 logits on the CPU, positions >= first_position.
    """

    def __init__(self, model: GPT2, *, first_position: int, ignore_cache: KVCache | None = None) -> None:
        self.model = model
        self.first_position = first_position
        self.ignore_cache = ignore_cache  # the drafter's cache, when the draft is the target itself
        self.rows: dict[int, torch.Tensor] = {}
        self._handle = None

    def __enter__(self) -> TargetLogitRecorder:
        self._handle = self.model.register_forward_hook(self._record, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()

    def _record(self, module: GPT2, args: tuple, kwargs: dict, logits: torch.Tensor) -> None:
        input_ids = args[0] if args else kwargs["input_ids"]
        cache = args[1] if len(args) > 1 else kwargs.get("cache")
        if cache is not None and cache is self.ignore_cache:
            return  # a drafting call, not the target's
        assert input_ids.size(0) == 1, "the parity check decodes one sequence at a time"
        end = cache.length if cache is not None else input_ids.size(1)  # last position scored
        T_out = logits.size(1)
        for t in range(T_out):
            position = end - T_out + 1 + t
            if position >= self.first_position:
                self.rows[position] = logits[0, t].detach().to("cpu", torch.float32, copy=True)  # (V,)


# ---------------------------------------------------------------------------
# Comparing two token sequences
# ---------------------------------------------------------------------------


def tokens_after_eos(tokens: list[int], eos_id: int) -> int:
    """How many tokens follow the first `eos_id` in `tokens` (0 if none does,
    or if there is no `eos_id`): the end-of-text rule wants 0."""
    if eos_id not in tokens:
        return 0
    return len(tokens) - tokens.index(eos_id) - 1


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where `a` and `b` differ, counting the end of the
    shorter one as a difference; None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def count_differing(a: list[int], b: list[int]) -> int:
    """Positions where `a` and `b` differ; positions only one of them has count too."""
    return sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))


def top2_gap(row: torch.Tensor) -> float:
    """Top-1 minus top-2 logit of a (V,) row."""
    top = torch.topk(row, 2).values  # (V,) -> (2,)
    return float(top[0] - top[1])


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ParitySettings:
    """What the check runs.

    Attributes:
        gamma: tokens drafted per speculative step (K).
        max_new_tokens: the most tokens each path generates per prompt.
        eos_id: the end-of-text token both paths stop after.
        tie_tolerance: the relative tie tolerance (see the module docstring).
    """

    gamma: int = 4
    max_new_tokens: int = 32
    eos_id: int = END_OF_TEXT_ID
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE

    def __post_init__(self) -> None:
        if not isinstance(self.gamma, int) or self.gamma < 1:
            raise ValueError(f"--gamma must be an integer >= 1, got {self.gamma!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"--max-gen must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.tie_tolerance > 0:
            raise ValueError(f"--tie-tolerance must be > 0 (relative to the logit scale), got {self.tie_tolerance!r}")

    def relative_tolerance(self, dtype: torch.dtype) -> float:
        """The tie tolerance as a fraction of the logit scale, for `dtype`."""
        return max(self.tie_tolerance, TIE_EPS_MULTIPLE * torch.finfo(dtype).eps)


@dataclass(frozen=True)
class Divergence:
    """The first differing token of one prompt, with the evidence.

    Attributes:
        position: index of the token among the new tokens (0 = first new token).
        baseline_token, speculative_token: the ids chosen (None: the run had ended).
        baseline_text, speculative_text: their text (None without a tokenizer).
        baseline_gap, speculative_gap: the target's top-1 minus top-2 logit in
            each run's own logits row at that position (None: no row).
        baseline_top1, speculative_top1: the argmax of each run's row.
        baseline_deficit, speculative_deficit: the top-1 logit minus the logit
            of the token the run chose, in its own row (0 when it chose its argmax).
        logit_delta: max |difference| between the two rows.
        scale: max |logit| of the two rows.
        tolerance: the absolute tie tolerance there (relative tolerance * scale).
        verdict: "near-tie" or "BUG".
        reason: one sentence saying why.
    """

    position: int
    baseline_token: int | None
    speculative_token: int | None
    baseline_text: str | None
    speculative_text: str | None
    baseline_gap: float | None
    speculative_gap: float | None
    baseline_top1: int | None
    speculative_top1: int | None
    baseline_deficit: float | None
    speculative_deficit: float | None
    logit_delta: float | None
    scale: float | None
    tolerance: float | None
    verdict: str
    reason: str


@dataclass
class PromptResult:
    """Both runs of one prompt in one dtype.

    Attributes:
        name: the prompt's name in benchmarks/prompts.py.
        prompt_tokens: T.
        baseline, speculative: the new token ids of each path.
        differing_tokens: positions where they differ (see `count_differing`).
        divergence: the first difference, or None if identical.
        baseline_after_eos, speculative_after_eos: tokens after end-of-text (want 0).
        max_logit_delta: max |difference| between the two runs' logits over the
            positions whose prefix they share (up to and including the first
            difference): the numerical noise between the two paths.
        max_logit_delta_relative: the same, each position's difference divided
            by its logit scale (max |logit| of the two rows).
        acceptance_rate, tokens_per_target_call: of the speculative run.
    """

    name: str
    prompt_tokens: int
    baseline: list[int]
    speculative: list[int]
    differing_tokens: int
    divergence: Divergence | None
    baseline_after_eos: int
    speculative_after_eos: int
    max_logit_delta: float
    max_logit_delta_relative: float
    acceptance_rate: float
    tokens_per_target_call: float

    @property
    def identical(self) -> bool:
        return self.divergence is None

    @property
    def eos_ok(self) -> bool:
        return self.baseline_after_eos == 0 and self.speculative_after_eos == 0


@dataclass
class DtypeReport:
    """Every prompt in one dtype, or why the dtype was skipped."""

    dtype: str
    relative_tolerance: float
    prompts: list[PromptResult] = field(default_factory=list)
    skipped: str | None = None

    @property
    def divergences(self) -> list[tuple[str, Divergence]]:
        return [(p.name, p.divergence) for p in self.prompts if p.divergence is not None]

    @property
    def bugs(self) -> int:
        return sum(d.verdict == "BUG" for _, d in self.divergences)

    @property
    def eos_violations(self) -> int:
        return sum(not p.eos_ok for p in self.prompts)

    def summary(self) -> dict:
        deltas = [p.max_logit_delta for p in self.prompts]
        relative = [p.max_logit_delta_relative for p in self.prompts]
        return {
            "dtype": self.dtype,
            "skipped": self.skipped,
            "prompts": len(self.prompts),
            "identical": sum(p.identical for p in self.prompts),
            "differing_tokens": sum(p.differing_tokens for p in self.prompts),
            "compared_tokens": sum(max(len(p.baseline), len(p.speculative)) for p in self.prompts),
            "divergences": len(self.divergences),
            "near_ties": sum(d.verdict == "near-tie" for _, d in self.divergences),
            "bugs": self.bugs,
            "eos_violations": self.eos_violations,
            "max_logit_delta": max(deltas) if deltas else None,
            "max_logit_delta_relative": max(relative) if relative else None,
            "relative_tolerance": self.relative_tolerance,
        }

    def to_dict(self) -> dict:
        return {
            "summary": self.summary(),
            "prompts": [{**asdict(p), "identical": p.identical, "eos_ok": p.eos_ok} for p in self.prompts],
        }


# ---------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------


def token_text(tokenizer, token: int | None) -> str | None:
    if tokenizer is None or token is None:
        return None
    return tokenizer.decode([token])


def explain_divergence(
    position: int,
    absolute_position: int,
    baseline: list[int],
    speculative: list[int],
    baseline_rows: dict[int, torch.Tensor],
    speculative_rows: dict[int, torch.Tensor],
    relative_tolerance: float,
    tokenizer,
) -> Divergence:
    """Gathers the evidence at the first differing new token and gives the verdict.

    Args:
        position: index d among the new tokens.
        absolute_position: T + d, its index in the whole sequence.
        baseline, speculative: the new tokens of each path.
        baseline_rows, speculative_rows: each run's logits rows by absolute position.
        relative_tolerance: the tie tolerance as a fraction of the logit scale.
        tokenizer: for the tokens' text, or None.
    """
    tok_b = baseline[position] if position < len(baseline) else None
    tok_s = speculative[position] if position < len(speculative) else None
    row_b = baseline_rows.get(absolute_position)  # (V,) or None
    row_s = speculative_rows.get(absolute_position)  # (V,) or None
    gap_b = top2_gap(row_b) if row_b is not None else None
    gap_s = top2_gap(row_s) if row_s is not None else None
    top1_b = int(row_b.argmax()) if row_b is not None else None
    top1_s = int(row_s.argmax()) if row_s is not None else None
    deficit_b = float(row_b.max() - row_b[tok_b]) if row_b is not None and tok_b is not None else None
    deficit_s = float(row_s.max() - row_s[tok_s]) if row_s is not None and tok_s is not None else None
    delta = scale = tolerance = None
    if row_b is not None and row_s is not None:
        delta = float((row_b - row_s).abs().max())
        scale = float(torch.maximum(row_b.abs().max(), row_s.abs().max()))
        tolerance = relative_tolerance * scale

    if tok_b is None or tok_s is None:
        verdict, reason = "BUG", "one path stopped early without end-of-text while the other went on"
    elif row_b is None or row_s is None:
        verdict, reason = "BUG", "no target logits were recorded for this position in one run"
    elif deficit_b > 0 or deficit_s > 0:  # a path did not take its own argmax (an exact tie is no deficit)
        which, deficit = ("baseline", deficit_b) if deficit_b > 0 else ("speculative", deficit_s)
        verdict, reason = "BUG", (
            f"the {which} path chose a token {deficit:.3g} below the top-1 of its own target logits"
        )
    elif gap_b <= tolerance and gap_s <= tolerance:
        verdict, reason = "near-tie", "both gaps are below the tie tolerance: rounding flipped the argmax"
    else:
        verdict, reason = "BUG", "a clear top-1 (gap above the tie tolerance) differs between the two paths"
    return Divergence(
        position=position,
        baseline_token=tok_b,
        speculative_token=tok_s,
        baseline_text=token_text(tokenizer, tok_b),
        speculative_text=token_text(tokenizer, tok_s),
        baseline_gap=gap_b,
        speculative_gap=gap_s,
        baseline_top1=top1_b,
        speculative_top1=top1_s,
        baseline_deficit=deficit_b,
        speculative_deficit=deficit_s,
        logit_delta=delta,
        scale=scale,
        tolerance=tolerance,
        verdict=verdict,
        reason=reason,
    )


def compare_prompt(
    target: GPT2,
    draft: GPT2,
    name: str,
    prompt_ids: torch.Tensor,
    settings: ParitySettings,
    tokenizer=None,
) -> PromptResult:
    """Decodes `prompt_ids` greedily with `generate` and with
    `speculative_generate`, recording the target's logits, and compares.

    Args:
        target, draft: the models (the draft may be the target itself).
        name: the prompt's name, for the report.
        prompt_ids: (1, T) token ids on the target's device.
        settings: gamma, max_new_tokens, eos_id, tie tolerance.
        tokenizer: for the divergent tokens' text, or None.
    """
    T = prompt_ids.size(1)
    with TargetLogitRecorder(target, first_position=T) as base_rec:
        baseline_ids = generate(target, prompt_ids, settings.max_new_tokens, eos_id=settings.eos_id)  # (1, T + n)
    drafter = ModelDrafter(draft)
    with TargetLogitRecorder(target, first_position=T, ignore_cache=drafter.cache) as spec_rec:
        spec_ids, stats = speculative_generate(
            target, drafter, prompt_ids, gamma=settings.gamma,
            max_new_tokens=settings.max_new_tokens, eos_id=settings.eos_id,
        )  # (1, T + n')
    baseline = baseline_ids[0, T:].tolist()
    speculative = spec_ids[0, T:].tolist()

    d = first_difference(baseline, speculative)
    divergence = None
    if d is not None:
        divergence = explain_divergence(
            d, T + d, baseline, speculative, base_rec.rows, spec_rec.rows,
            settings.relative_tolerance(target.dtype), tokenizer,
        )
    # The noise between the two paths: every position whose prefix both runs
    # share, i.e. up to and including the first difference.
    last_shared = T + (d if d is not None else max(len(baseline), len(speculative)) - 1)
    max_delta, max_relative = 0.0, 0.0
    for position in range(T, last_shared + 1):
        row_b, row_s = base_rec.rows.get(position), spec_rec.rows.get(position)
        if row_b is None or row_s is None:
            continue
        delta = float((row_b - row_s).abs().max())
        scale = float(torch.maximum(row_b.abs().max(), row_s.abs().max()))
        max_delta = max(max_delta, delta)
        max_relative = max(max_relative, delta / scale if scale > 0 else 0.0)
    return PromptResult(
        name=name,
        prompt_tokens=T,
        baseline=baseline,
        speculative=speculative,
        differing_tokens=count_differing(baseline, speculative),
        divergence=divergence,
        baseline_after_eos=tokens_after_eos(baseline, settings.eos_id),
        speculative_after_eos=tokens_after_eos(speculative, settings.eos_id),
        max_logit_delta=max_delta,
        max_logit_delta_relative=max_relative,
        acceptance_rate=stats.acceptance_rate,
        tokens_per_target_call=stats.tokens_per_target_call,
    )


def check_parity(
    target: GPT2,
    draft: GPT2,
    prompts: list[tuple[str, torch.Tensor]],
    settings: ParitySettings,
    tokenizer=None,
    *,
    progress: bool = False,
) -> DtypeReport:
    """Runs `compare_prompt` on every (name, (1, T) ids) prompt, in the models' dtype."""
    dtype_name = str(target.dtype).removeprefix("torch.")
    report = DtypeReport(dtype_name, settings.relative_tolerance(target.dtype))
    for i, (name, ids) in enumerate(prompts):
        result = compare_prompt(target, draft, name, ids, settings, tokenizer)
        report.prompts.append(result)
        if progress:
            d = result.divergence
            status = "identical" if d is None else f"differs at {d.position} ({d.verdict})"
            print(f"  [{dtype_name}] {i + 1}/{len(prompts)} {name}: {status}", file=sys.stderr, flush=True)
    return report


def dtype_unsupported_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why `device` cannot run GPT-2 in `dtype` (None if it can): tries a tiny
    model's prefill and one cached step, and checks the logits are finite."""
    try:
        resolve_dtype(dtype, device)
        config = GPT2Config(n_layer=1, n_head=2, n_embd=8, n_ctx=8, vocab_size=16)
        model = GPT2(config).to(device=device, dtype=dtype).eval()
        with torch.inference_mode():
            cache = model.new_cache(1)
            ids = torch.tensor([[1, 2, 3]], device=device)
            logits = torch.cat([model(ids, cache), model(ids[:, :1], cache)], dim=1)  # (1, 4, V)
        if not bool(torch.isfinite(logits).all()):
            return f"{dtype} gives non-finite logits on {device}"
    except (RuntimeError, NotImplementedError, ValueError) as e:
        return f"{str(e).splitlines()[0][:160]}"
    return None


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def fmt(value: float | None, spec: str = ".3g") -> str:
    return "–" if value is None else format(value, spec)


def shown_token(token: int | None, text: str | None) -> str:
    if token is None:
        return "(ended)"
    if text is None:
        return str(token)
    escaped = text.replace("\\", "\\\\").replace("\n", "\\n").replace("|", "\\|").replace("`", "'")
    return f"{token} `{escaped}`"


def markdown_report(env: dict, settings_dict: dict, reports: list[DtypeReport]) -> str:
    lines = ["# Parity check: speculative greedy vs plain greedy decoding", ""]
    lines += environment_lines(env)
    s = settings_dict
    settings_line = (
        f"- weights: {s['weights']}{' (the target drafts for itself)' if s['draft_equals_target'] else ''}; "
        f"gamma {s['gamma']}; max_gen {s['max_new_tokens']}; eos_id {s['eos_id']}; "
        f"tie tolerance max({s['tie_tolerance']:g}, {TIE_EPS_MULTIPLE} eps(dtype)) x max|logit|"
    )
    how_to_read = (
        "Both paths decode greedily with the same target. Gaps are the target's top-1 minus top-2 "
        "logit in each run's own logits row at the first differing position (captured during the "
        "run: the baseline's prefill or one-token cached step, the speculative run's batched "
        "verification). abs(Δlogit) is the largest difference between the two runs' logits on "
        "prefixes they share. Differing tokens count the positions where the outputs differ."
    )
    lines += [
        settings_line,
        f"- prompts: {', '.join(s['prompts'])} (tokenizer: {s['tokenizer']})",
        "",
        how_to_read,
        "",
        "## Summary",
        "",
    ]
    rows = []
    for r in reports:
        m = r.summary()
        if r.skipped:
            rows.append([r.dtype, f"skipped: {r.skipped}"] + [""] * 7)
            continue
        rows.append([
            r.dtype, str(m["prompts"]), str(m["identical"]),
            f"{m['differing_tokens']} / {m['compared_tokens']}",
            str(m["near_ties"]), str(m["bugs"]), str(m["eos_violations"]),
            f"{fmt(m['max_logit_delta'])} ({fmt(m['max_logit_delta_relative'])} x scale)",
            fmt(m["relative_tolerance"]),
        ])
    lines.append(markdown_table(
        ["dtype", "prompts", "identical", "differing tokens", "near-ties", "BUG", "EOS violations",
         "max abs(Δlogit)", "tie tolerance (x scale)"],
        rows,
    ))
    for r in reports:
        if r.skipped or not r.divergences:
            continue
        lines += ["", f"## Divergences, {r.dtype}", ""]
        rows = []
        for name, d in r.divergences:
            rows.append([
                name, str(d.position),
                shown_token(d.baseline_token, d.baseline_text), shown_token(d.speculative_token, d.speculative_text),
                fmt(d.baseline_gap), fmt(d.speculative_gap), fmt(d.logit_delta), fmt(d.tolerance), d.verdict,
            ])
        lines.append(markdown_table(
            ["prompt", "position", "baseline token", "speculative token", "gap (baseline)",
             "gap (speculative)", "abs(Δlogit)", "tolerance", "verdict"],
            rows,
        ))
        for name, d in r.divergences:
            if d.verdict == "BUG":
                lines.append(f"\n- **BUG** in `{name}` at position {d.position}: {d.reason}.")
    lines += ["", "## End-of-text rule", ""]
    violations = [(r.dtype, p) for r in reports for p in r.prompts if not p.eos_ok]
    if not violations:
        lines.append("Neither path produced a token after end-of-text, in any prompt or dtype.")
    for dtype, p in violations:
        lines.append(
            f"- **violated** in `{p.name}` ({dtype}): {p.baseline_after_eos} token(s) after EOS in the baseline, "
            f"{p.speculative_after_eos} in the speculative run."
        )
    ended = sorted({p.name for r in reports for p in r.prompts if s["eos_id"] in p.baseline + p.speculative})
    lines.append(f"\nPrompts that produced end-of-text in some run: {', '.join(ended) if ended else 'none'}.")
    return "\n".join(lines) + "\n"


def exit_code(reports: list[DtypeReport]) -> int:
    """1 if a float32 divergence is a BUG or any run broke the end-of-text rule, else 0."""
    failed = any(r.bugs for r in reports if r.dtype == "float32") or any(r.eos_violations for r in reports)
    return 1 if failed else 0


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def parse_dtypes(text: str) -> list[torch.dtype]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in DTYPE_NAMES]
    if not names or unknown:
        raise ValueError(f"--dtypes takes a comma-separated list of {', '.join(DTYPE_NAMES)}; got {text!r}")
    return [getattr(torch, n) for n in dict.fromkeys(names)]


def encode_suite(prompts, pair, device: torch.device):
    """The prompts as (name, (1, T) ids), the tokenizer (or None) and its description.

    Without any GPT-2 tokenizer (no model folder, no ../shared/gpt2-bpe, no
    network) and random weights, each prompt becomes its UTF-8 bytes as token
    ids: a fixed, valid input, but the report then shows ids only."""
    try:
        tokenizer = load_prompt_tokenizer(pair.tokenizer_folder)
        return encode_prompts(tokenizer, prompts, device), tokenizer, "GPT-2 BPE"
    except FileNotFoundError:
        if pair.weights == "checkpoint":
            raise
    ids = [
        (name, torch.tensor([list(text.encode("utf-8"))], dtype=torch.long, device=device))  # (1, T)
        for name, text in prompts
    ]
    return ids, None, "none found: prompts as UTF-8 byte ids, tokens shown as ids"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.parity_check",
        description="Is speculative greedy output identical to plain greedy output? Where not, why.",
    )
    p.add_argument("--target", default="gpt2-large",
                   help="target: Hub id or local folder; a preset name with --random-weights (default gpt2-large)")
    p.add_argument("--draft", default="gpt2", help="draft model (default gpt2)")
    p.add_argument("--draft-equals-target", action="store_true",
                   help="draft with the target itself (every draft accepted, bonus tokens exercised)")
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--random-weights", action="store_true",
                         help="the presets' real shapes with random weights: no download")
    weights.add_argument("--tiny", action="store_true",
                         help="tiny random models (2-layer target, 1-layer draft): a smoke run")
    p.add_argument("--gamma", type=int, default=4, help="tokens drafted per step (default 4)")
    p.add_argument("--max-gen", type=int, default=32, help="new tokens per prompt (default 32)")
    p.add_argument("--prompts", type=int, default=None,
                   help="use only the first N benchmark prompts (the early-EOS ones always run)")
    p.add_argument("--dtypes", default=",".join(DTYPE_NAMES),
                   help="comma-separated, default float32,bfloat16,float16; unsupported ones are skipped "
                   "(on a CPU half precision is slow: bfloat16 ~10x float32)")
    p.add_argument("--tie-tolerance", type=float, default=DEFAULT_TIE_TOLERANCE,
                   help=f"near-tie threshold relative to max|logit| (default {DEFAULT_TIE_TOLERANCE:g}; "
                   f"never below {TIE_EPS_MULTIPLE} eps of the dtype)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, mps or auto (default cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/parity-<time>)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = ParitySettings(gamma=args.gamma, max_new_tokens=args.max_gen, tie_tolerance=args.tie_tolerance)
    if args.prompts is not None and not 1 <= args.prompts <= len(PROMPTS):
        raise ValueError(f"--prompts must be between 1 and {len(PROMPTS)}, got {args.prompts}")
    device = resolve_device(args.device)
    dtypes = parse_dtypes(args.dtypes)
    weights = "tiny" if args.tiny else "random" if args.random_weights else "checkpoint"
    suite = list(PROMPTS[: args.prompts]) + list(EARLY_EOS_PROMPTS)
    folder = results_dir(args.out, "parity")

    reports, env_models, tokenizer_note = [], None, None
    encoded = tokenizer = None
    for dtype in dtypes:
        dtype_name = str(dtype).removeprefix("torch.")
        reason = dtype_unsupported_reason(dtype, device)
        if reason is not None:
            print(f"[{dtype_name}] skipped: {reason}", file=sys.stderr)
            reports.append(DtypeReport(dtype_name, settings.relative_tolerance(dtype), skipped=reason))
            continue
        print(f"[{dtype_name}] building the models ...", file=sys.stderr, flush=True)
        pair = build_pair(
            args.target, args.draft, weights=weights, draft_equals_target=args.draft_equals_target,
            device=device, dtype=dtype, seed=args.seed,
        )
        if encoded is None:
            encoded, tokenizer, tokenizer_note = encode_suite(suite, pair, device)
            env_models = {"target": pair.target_name, "draft": pair.draft_name}
        reports.append(check_parity(pair.target, pair.draft, encoded, settings, tokenizer, progress=True))
        del pair

    env = environment(device, dtypes[0], env_models or {"target": args.target, "draft": args.draft})
    env["dtype"] = ", ".join(r.dtype + (" (skipped)" if r.skipped else "") for r in reports)
    settings_dict = {
        **asdict(settings),
        "weights": weights,
        "draft_equals_target": args.draft_equals_target,
        "prompts": [name for name, _ in suite],
        "tokenizer": tokenizer_note or "not needed",
        "tie_eps_multiple": TIE_EPS_MULTIPLE,
        "logits": "captured during each run by a forward hook on the target",
    }
    code = exit_code(reports)
    write_json(folder / "parity.json", {
        "environment": env,
        "settings": settings_dict,
        "dtypes": [r.to_dict() for r in reports],
        "passed": code == 0,
    })
    report = markdown_report(env, settings_dict, reports)
    (folder / "parity.md").write_text(report, encoding="utf-8")
    print(report)
    print(f"results in {folder}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(run_cli(main))
