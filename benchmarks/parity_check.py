"""Parity check: is speculative greedy output identical to plain greedy output, and when it is not, why?

Greedy speculative decoding keeps a draft only if it is the target's argmax (Leviathan et al. 2023, 2.3), so in
exact arithmetic it reproduces greedy decoding; in floating point a near-tie can flip the argmax (docs/parity.md).
For every benchmark prompt and dtype both ways decode, and the first differing token gets its evidence and a
verdict (`explain_divergence`). Exit code 1 if a float32 divergence is a BUG or a run broke the end-of-text rule,
2 for a usage error, else 0.

    python -m benchmarks.parity_check --random-weights --dtypes float32,bfloat16
    python -m benchmarks.parity_check --draft gpt2 --target gpt2-large --gamma 4 --max-gen 32
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import asdict, dataclass, field

import torch

from benchmarks.common import ArgumentParser, pair_names
from benchmarks.common import build_pair, encode_prompts, environment, environment_lines, load_prompt_tokenizer
from benchmarks.common import MAX_SEED, check_range, markdown_table, must, results_dir, run_cli, write_json
from benchmarks.prompts import EARLY_EOS_PROMPTS, PROMPTS
from gpt2 import END_OF_TEXT_ID, GPT2, GPT2Config, KVCache, fast, generate, resolve_device, resolve_dtype
from gpt2.generate import check_integer, first_difference
from spec_decoding import ModelDrafter, speculative_generate

DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEFAULT_TIE_TOLERANCE = 1e-4  # relative to the logit scale: ~100x float32's rounding between the two paths
TIE_EPS_MULTIPLE = 8  # the tolerance is never below 8 eps(dtype) * scale
GPT2_WINDOW = 1024  # GPT-2's n_ctx: a larger --gamma could never be verified


@contextlib.contextmanager
def target_logits(model: GPT2, *, first_position: int, ignore_cache: KVCache | None = None):
    """While open, yields {position: the target's logits row (V,) that scored the token there, float32 on the CPU}
    for positions >= first_position; a later scoring (verification after a rejection) overwrites an earlier one.
    Calls on `ignore_cache` (the drafter's, when the draft is the target itself) are not the target's."""
    rows: dict[int, torch.Tensor] = {}

    def record(module: GPT2, args: tuple, kwargs: dict, logits: torch.Tensor) -> None:
        input_ids = args[0] if args else kwargs["input_ids"]
        cache = args[1] if len(args) > 1 else kwargs.get("cache")
        if cache is not None and cache is ignore_cache:
            return
        must(input_ids.size(0) == 1, "the parity check decodes one sequence at a time")
        end = cache.length if cache is not None else input_ids.size(1)
        start = end - logits.size(1) + 1  # (1, T_out, V): row t scored position start + t
        for t in range(max(first_position - start, 0), logits.size(1)):
            rows[start + t] = logits[0, t].detach().to("cpu", torch.float32, copy=True)  # (V,)

    handle = model.register_forward_hook(record, with_kwargs=True)
    try:
        yield rows
    finally:
        handle.remove()


def tokens_after_eos(tokens: list[int], eos_id: int) -> int:
    """How many tokens follow the first `eos_id` (0 if none): the rule wants 0."""
    return len(tokens) - tokens.index(eos_id) - 1 if eos_id in tokens else 0


def count_differing(a: list[int], b: list[int]) -> int:
    """Positions where `a` and `b` differ; positions only one of them has count too."""
    return sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))


@dataclass(frozen=True)
class ParitySettings:
    """gamma (K) and max_new_tokens per prompt, the end-of-text id both paths stop after, the relative tie tolerance."""

    gamma: int = 4
    max_new_tokens: int = 32
    eos_id: int = END_OF_TEXT_ID
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE

    def __post_init__(self) -> None:
        if check_integer(self.gamma, "--gamma", 1) >= GPT2_WINDOW:  # checked against the models' own once built
            raise ValueError(f"--gamma must be less than {GPT2_WINDOW}, GPT-2's context window, got {self.gamma}")
        check_integer(self.max_new_tokens, "--max-gen", 1)
        if not 0 < self.tie_tolerance <= 1:  # 1: the whole logit scale; past it every parting is called a tie
            raise ValueError(f"--tie-tolerance must lie in (0, 1] (relative to the logit scale), "
                             f"got {self.tie_tolerance!r}")

    def relative_tolerance(self, dtype: torch.dtype, fast_path: bool = False) -> float:
        """The tie tolerance as a fraction of the logit scale, for `dtype`; 0 on the CPU fast path, whose logits
        are bit-exact whatever the pass (a divergence there is a BUG unless the logits tie exactly)."""
        return 0.0 if fast_path else max(self.tie_tolerance, TIE_EPS_MULTIPLE * torch.finfo(dtype).eps)

    def tolerance_for(self, target: GPT2) -> float:
        """`relative_tolerance` for the dtype and path `target` runs."""
        return self.relative_tolerance(target.dtype, fast.status(target).startswith("fast path:"))


@dataclass(frozen=True)
class Evidence:
    """What one run shows at a position: its token (None: it had ended) and text (None without a tokenizer); from
    the logits row it chose with (None: no row) the top-1 minus top-2 gap, the argmax, and the deficit, the top-1
    logit minus the chosen token's (0: it took its argmax)."""

    token: int | None
    text: str | None
    gap: float | None
    top1: int | None
    deficit: float | None

    @classmethod
    def at(cls, tokens: list[int], row: torch.Tensor | None, position: int, tokenizer) -> Evidence:
        token = tokens[position] if position < len(tokens) else None
        text = tokenizer.decode([token]) if tokenizer is not None and token is not None else None
        if row is None:
            return cls(token, text, None, None, None)
        top = torch.topk(row, 2).values  # (V,) -> (2,)
        deficit = float(row.max() - row[token]) if token is not None else None
        return cls(token, text, float(top[0] - top[1]), int(row.argmax()), deficit)


@dataclass(frozen=True)
class Divergence:
    """The first differing new token of a prompt (`position` 0: the first new token), each run's evidence there,
    max |difference| of their two logits rows, max |logit| of both (`scale`), the absolute tie tolerance, and the
    verdict ("near-tie" or "BUG") with one sentence saying why."""

    position: int
    baseline: Evidence
    speculative: Evidence
    logit_delta: float | None
    scale: float | None
    tolerance: float | None
    verdict: str
    reason: str


@dataclass
class PromptResult:
    """Both runs of one prompt in one dtype: their new tokens, the first difference (None: identical), the largest
    logit difference (absolute, and relative to the logit scale) on the prefixes both runs share, the speculative
    run's α and tokens per target call; then tokens after end-of-text in each run (the rule wants 0)."""

    name: str
    prompt_tokens: int
    baseline: list[int]
    speculative: list[int]
    divergence: Divergence | None
    max_logit_delta: float
    max_logit_delta_relative: float
    alpha: float
    tokens_per_target_call: float
    eos_id: int
    identical: bool = field(init=False)
    differing_tokens: int = field(init=False)
    after_eos: dict[str, int] = field(init=False)
    eos_ok: bool = field(init=False)

    def __post_init__(self) -> None:
        self.identical = self.divergence is None
        self.differing_tokens = count_differing(self.baseline, self.speculative)
        self.after_eos = {run: tokens_after_eos(getattr(self, run), self.eos_id) for run in ("baseline", "speculative")}
        self.eos_ok = not any(self.after_eos.values())


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

    def summary(self) -> dict:
        return {
            "dtype": self.dtype, "skipped": self.skipped, "prompts": len(self.prompts),
            "identical": sum(p.identical for p in self.prompts),
            "differing_tokens": sum(p.differing_tokens for p in self.prompts),
            "compared_tokens": sum(max(len(p.baseline), len(p.speculative)) for p in self.prompts),
            "divergences": len(self.divergences), "near_ties": len(self.divergences) - self.bugs, "bugs": self.bugs,
            "eos_violations": sum(not p.eos_ok for p in self.prompts),
            "max_logit_delta": max((p.max_logit_delta for p in self.prompts), default=None),
            "max_logit_delta_relative": max((p.max_logit_delta_relative for p in self.prompts), default=None),
            "relative_tolerance": self.relative_tolerance,
        }


def row_difference(row_b: torch.Tensor, row_s: torch.Tensor) -> tuple[float, float]:
    """(delta, scale) of two logits rows (V,) for one position: max |row_b - row_s| and max |logit| of both."""
    return float((row_b - row_s).abs().max()), float(torch.maximum(row_b.abs().max(), row_s.abs().max()))


def explain_divergence(position: int, baseline: Evidence, speculative: Evidence, row_b: torch.Tensor | None,
                       row_s: torch.Tensor | None, relative_tolerance: float, after_eos: bool = False) -> Divergence:
    """The verdict at the first differing new token, from both runs' evidence and logits rows (V,) there
    (`after_eos`: the token before it, which both share, is end-of-text). "near-tie": each run took its own argmax,
    and both gaps and the rows' difference are within the tie tolerance, `relative_tolerance` (max(--tie-tolerance,
    8 eps(dtype)), 0 on the fast path) x max|logit| (rounding errors scale with the values); "BUG": anything else."""
    delta = scale = tolerance = None
    if row_b is not None and row_s is not None:
        delta, scale = row_difference(row_b, row_s)
        tolerance = relative_tolerance * scale
    verdict = "BUG"
    if baseline.token is None or speculative.token is None:
        went_on = "baseline" if speculative.token is None else "speculative"
        reason = (f"the {went_on} path went on after end-of-text" if after_eos
                  else "one path stopped early without end-of-text while the other went on")
    elif tolerance is None:
        reason = "no target logits were recorded for this position in one run"
    elif baseline.deficit > 0 or speculative.deficit > 0:  # a path did not take its own argmax (a tie is no deficit)
        which, e = ("baseline", baseline) if baseline.deficit > 0 else ("speculative", speculative)
        reason = f"the {which} path chose a token {e.deficit:.3g} below the top-1 of its own target logits"
    elif delta > tolerance:
        reason = f"the two runs' logits differ by {delta:.3g}, more than rounding ({tolerance:.3g})"
    elif baseline.gap <= tolerance and speculative.gap <= tolerance:
        verdict, reason = "near-tie", "both gaps are below the tie tolerance: rounding flipped the argmax"
    else:
        reason = "a clear top-1 (gap above the tie tolerance) differs between the two paths"
    return Divergence(position, baseline, speculative, delta, scale, tolerance, verdict, reason)


def compare_prompt(target: GPT2, draft: GPT2, name: str, prompt_ids: torch.Tensor, settings: ParitySettings,
                   tokenizer=None) -> PromptResult:
    """Decodes `prompt_ids` (1, T) greedily with `generate` and with `speculative_generate` (the draft may be the
    target itself), recording the target's logits, and compares the two runs."""
    T = prompt_ids.size(1)
    with target_logits(target, first_position=T) as base_rows:
        baseline_ids = generate(target, prompt_ids, settings.max_new_tokens, eos_id=settings.eos_id)  # (1, T + n)
    drafter = ModelDrafter(draft)
    with target_logits(target, first_position=T, ignore_cache=drafter.cache) as spec_rows:
        spec_ids, stats = speculative_generate(target, drafter, prompt_ids, gamma=settings.gamma,
                                               max_new_tokens=settings.max_new_tokens, eos_id=settings.eos_id)
    baseline, speculative = baseline_ids[0, T:].tolist(), spec_ids[0, T:].tolist()

    d = first_difference(baseline, speculative)
    divergence = None
    if d is not None:
        row_b, row_s = base_rows.get(T + d), spec_rows.get(T + d)
        divergence = explain_divergence(d, Evidence.at(baseline, row_b, d, tokenizer),
                                        Evidence.at(speculative, row_s, d, tokenizer), row_b, row_s,
                                        settings.tolerance_for(target), d > 0 and baseline[d - 1] == settings.eos_id)
    # The noise between the two paths: (delta, scale) at every position whose prefix both runs share.
    last_shared = T + (d if d is not None else max(len(baseline), len(speculative)) - 1)
    noise = [row_difference(base_rows[t], spec_rows[t]) for t in range(T, last_shared + 1)
             if t in base_rows and t in spec_rows]
    max_delta = max((delta for delta, _ in noise), default=0.0)
    max_relative = max((delta / scale if scale > 0 else 0.0 for delta, scale in noise), default=0.0)
    return PromptResult(name, T, baseline, speculative, divergence, max_delta, max_relative, stats.alpha,
                        stats.tokens_per_target_call, settings.eos_id)


def check_parity(target: GPT2, draft: GPT2, prompts: list[tuple[str, torch.Tensor]], settings: ParitySettings,
                 tokenizer=None, *, progress: bool = False) -> DtypeReport:
    """Runs `compare_prompt` on every (name, (1, T) ids) prompt, in the models' dtype."""
    report = DtypeReport(str(target.dtype).removeprefix("torch."), settings.tolerance_for(target))
    for i, (name, ids) in enumerate(prompts):
        report.prompts.append(result := compare_prompt(target, draft, name, ids, settings, tokenizer))
        if progress:
            d = result.divergence
            status = "identical" if d is None else f"differs at {d.position} ({d.verdict})"
            print(f"  [{report.dtype}] {i + 1}/{len(prompts)} {name}: {status}", file=sys.stderr, flush=True)
    return report


def dtype_unsupported_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why `device` cannot run GPT-2 in `dtype` (None if it can): a tiny model's prefill and one cached step must
    give finite logits."""
    try:
        resolve_dtype(dtype, device)
        model = GPT2(GPT2Config(n_layer=1, n_head=2, n_embd=8, n_ctx=8, vocab_size=16)).to(device, dtype).eval()
        with torch.inference_mode():
            cache, ids = model.new_cache(1), torch.tensor([[1, 2, 3]], device=device)
            logits = torch.cat([model(ids, cache), model(ids[:, :1], cache)], dim=1)  # (1, 4, V)
    except (RuntimeError, NotImplementedError, ValueError) as e:
        return str(e).splitlines()[0][:160]
    return None if bool(torch.isfinite(logits).all()) else f"{dtype} gives non-finite logits on {device}"


def fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.3g}"


def shown_token(e: Evidence) -> str:
    if e.token is None:
        return "(ended)"
    if e.text is None:
        return str(e.token)
    escaped = e.text.replace("\\", "\\\\").replace("\n", "\\n").replace("|", "\\|").replace("`", "'")
    return f"{e.token} `{escaped}`"


def markdown_report(env: dict, s: dict, reports: list[DtypeReport]) -> str:
    lines = ["# Parity check: speculative greedy vs plain greedy decoding", "", *environment_lines(env),
             f"- weights: {s['weights']}{' (the target drafts for itself)' if s['draft_equals_target'] else ''}; "
             f"gamma {s['gamma']}; max_gen {s['max_new_tokens']}; eos_id {s['eos_id']}; tie tolerance "
             f"max({s['tie_tolerance']:g}, {TIE_EPS_MULTIPLE} eps(dtype)) x max|logit|, 0 on the fast path",
             f"- prompts: {', '.join(s['prompts'])} (tokenizer: {s['tokenizer']})", "",
             "Both paths decode greedily with the same target. Gaps are the target's top-1 minus top-2 logit in "
             "each run's own logits row at the first differing position (captured during the run: the baseline's "
             "prefill or one-token cached step, the speculative run's batched verification). abs(Δlogit) is the "
             "largest difference between the two runs' logits on prefixes they share. Differing tokens count the "
             "positions where the outputs differ.", "", "## Summary", ""]
    rows = []
    for r in reports:
        m = r.summary()
        rows.append([r.dtype, f"skipped: {r.skipped}"] + [""] * 7 if r.skipped else [
            r.dtype, str(m["prompts"]), str(m["identical"]), f"{m['differing_tokens']} / {m['compared_tokens']}",
            str(m["near_ties"]), str(m["bugs"]), str(m["eos_violations"]),
            f"{fmt(m['max_logit_delta'])} ({fmt(m['max_logit_delta_relative'])} x scale)",
            fmt(m["relative_tolerance"])])
    lines.append(markdown_table(["dtype", "prompts", "identical", "differing tokens", "near-ties", "BUG",
                                 "EOS violations", "max abs(Δlogit)", "tie tolerance (x scale)"], rows))
    for r in reports:
        if r.divergences:
            lines += ["", f"## Divergences, {r.dtype}", "", markdown_table(
                ["prompt", "position", "baseline token", "speculative token", "gap (baseline)", "gap (speculative)",
                 "abs(Δlogit)", "tolerance", "verdict"],
                [[name, str(d.position), shown_token(d.baseline), shown_token(d.speculative), fmt(d.baseline.gap),
                  fmt(d.speculative.gap), fmt(d.logit_delta), fmt(d.tolerance), d.verdict]
                 for name, d in r.divergences])]
            lines += [f"\n- **BUG** in `{name}` at position {d.position}: {d.reason}."
                      for name, d in r.divergences if d.verdict == "BUG"]
    lines += ["", "## End-of-text rule", ""]
    violations = [(r.dtype, p) for r in reports for p in r.prompts if not p.eos_ok]
    if not violations:
        lines.append("Neither path produced a token after end-of-text, in any prompt or dtype.")
    lines += [f"- **violated** in `{p.name}` ({dtype}): {p.after_eos['baseline']} token(s) after EOS in the "
              f"baseline, {p.after_eos['speculative']} in the speculative run." for dtype, p in violations]
    ended = sorted({p.name for r in reports for p in r.prompts if s["eos_id"] in p.baseline + p.speculative})
    lines.append(f"\nPrompts that produced end-of-text in some run: {', '.join(ended) if ended else 'none'}.")
    return "\n".join(lines) + "\n"


def parse_dtypes(text: str) -> list[torch.dtype]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in DTYPE_NAMES for n in names):
        raise ValueError(f"--dtypes takes a comma-separated list of {', '.join(DTYPE_NAMES)}; got {text!r}")
    return [getattr(torch, n) for n in dict.fromkeys(names)]


def encode_suite(prompts, pair, device: torch.device):
    """The prompts as (name, (1, T) ids), the tokenizer (or None) and its description. With random weights and no
    GPT-2 tokenizer at all, each prompt becomes its UTF-8 bytes as token ids (the report then shows ids)."""
    try:
        tokenizer = load_prompt_tokenizer(pair.tokenizer_folder)
        return encode_prompts(tokenizer, prompts, device), tokenizer, "GPT-2 BPE"
    except FileNotFoundError:
        if pair.weights == "checkpoint":
            raise
    ids = [(name, torch.tensor([list(text.encode("utf-8"))], dtype=torch.long, device=device))  # (1, T)
           for name, text in prompts]
    return ids, None, "none found: prompts as UTF-8 byte ids, tokens shown as ids"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m benchmarks.parity_check", description=__doc__.splitlines()[0])
    p.add_argument("--target", help="Hub id or folder, a preset name with --random-weights (default gpt2-large)")
    p.add_argument("--draft", help="draft model (default gpt2)")
    p.add_argument("--draft-equals-target", action="store_true", help="the target drafts for itself (bonus tokens)")
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--random-weights", action="store_true", help="the presets' shapes, random weights")
    weights.add_argument("--tiny", action="store_true", help="tiny random models (2-layer target, 1-layer draft)")
    p.add_argument("--readable", action="store_true", help="the readable path instead of the CPU fast path")
    p.add_argument("--gamma", type=int, default=4, help="tokens drafted per step (default 4)")
    p.add_argument("--max-gen", type=int, default=32, help="new tokens per prompt (default 32)")
    p.add_argument("--prompts", type=int, help="only the first N benchmark prompts (the early-EOS ones always run)")
    p.add_argument("--dtypes", default=",".join(DTYPE_NAMES), help="comma-separated, default float32,bfloat16,"
                   "float16; unsupported ones are skipped")
    p.add_argument("--tie-tolerance", type=float, default=DEFAULT_TIE_TOLERANCE, help="near-tie threshold x "
                   f"max|logit| (default {DEFAULT_TIE_TOLERANCE:g}, at least {TIE_EPS_MULTIPLE} eps(dtype); 0 on the "
                   "CPU fast path, which is bit-exact)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, mps or auto (default cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--out", help="results folder (default benchmarks/results/parity-<time>)")
    args = p.parse_args(argv)
    pair_names(args, presets=args.tiny or args.random_weights)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = ParitySettings(gamma=args.gamma, max_new_tokens=args.max_gen, tie_tolerance=args.tie_tolerance)
    check_range("--seed", args.seed, -MAX_SEED, MAX_SEED)
    if args.prompts is not None and not 1 <= args.prompts <= len(PROMPTS):
        raise ValueError(f"--prompts must be between 1 and {len(PROMPTS)}, got {args.prompts}")
    device, dtypes = resolve_device(args.device), parse_dtypes(args.dtypes)
    weights = "tiny" if args.tiny else "random" if args.random_weights else "checkpoint"
    suite = list(PROMPTS[: args.prompts]) + list(EARLY_EOS_PROMPTS)

    folder = results_dir(args.out, "parity", create=False)  # made once the work is done: a failure leaves none

    reports, models, encoded, tokenizer, tokenizer_note = [], None, None, None, None
    paths = {}  # dtype name -> the forward pass its target runs (float32 may take the fast path, the others not)
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        reason = dtype_unsupported_reason(dtype, device)
        if reason is not None:
            print(f"[{name}] skipped: {reason}", file=sys.stderr)
            reports.append(DtypeReport(name, settings.relative_tolerance(dtype), skipped=reason))
            continue
        print(f"[{name}] building the models ...", file=sys.stderr, flush=True)
        pair = build_pair(args.target, args.draft, weights=weights, draft_equals_target=args.draft_equals_target,
                          device=device, dtype=dtype, seed=args.seed, accelerate=not args.readable)
        if encoded is None:  # the first dtype that runs
            encoded, tokenizer, tokenizer_note = encode_suite(suite, pair, device)
            models = {"target": pair.target_name, "draft": pair.draft_name}
        paths[name] = fast.status(pair.target)
        reports.append(check_parity(pair.target, pair.draft, encoded, settings, tokenizer, progress=True))
        del pair  # frees this dtype's models before the next are built

    path = (next(iter(paths.values())) if len(set(paths.values())) == 1
            else " | ".join(f"{name}: {p}" for name, p in paths.items()) or "no dtype ran")
    env = environment(device, dtypes[0], models or {"target": args.target, "draft": args.draft}, path)
    env["dtype"] = ", ".join(r.dtype + (" (skipped)" if r.skipped else "") for r in reports)
    settings_dict = {**asdict(settings), "weights": weights, "draft_equals_target": args.draft_equals_target,
                     "readable": args.readable, "prompts": [name for name, _ in suite],
                     "tokenizer": tokenizer_note or "not needed", "tie_eps_multiple": TIE_EPS_MULTIPLE,
                     "logits": "captured during each run by a forward hook on the target"}
    # 1 if a float32 divergence is a BUG or any run broke the end-of-text rule
    code = int(any((r.dtype == "float32" and r.bugs) or not all(p.eos_ok for p in r.prompts) for r in reports))
    dtype_results = [{"summary": r.summary(), "prompts": [asdict(p) for p in r.prompts]} for r in reports]
    folder = results_dir(folder, "parity")  # now made
    write_json(folder / "parity.json", {"environment": env, "settings": settings_dict, "dtypes": dtype_results,
                                        "passed": code == 0})
    report = markdown_report(env, settings_dict, reports)
    (folder / "parity.md").write_text(report, encoding="utf-8")
    print(report)
    print(f"results in {folder}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(run_cli(main))
