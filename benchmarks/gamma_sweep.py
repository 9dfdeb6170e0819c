"""The gamma x max_gen sweep: the measured speedup of speculative decoding
beside the one theory predicts from measured step costs (sweep_report.py).
With --tree, token tree shapes are swept beside the gammas (tree_loop.py).

Each cell (max_gen, gamma, simulated acceptance) is timed against the
baseline `gpt2.generate` on the same prompts, back to back in every repeat
(in reversed order on odd repeats, so drift cancels); speedup is the median
over repeats of baseline / speculative time. The step costs the prediction
needs are timed in rounds between the runs (`ComponentTimer`). End-of-text
is ignored: every run emits max_gen tokens.

    python -m benchmarks.gamma_sweep                       # gpt2 -> gpt2-large, full sweep
    python -m benchmarks.gamma_sweep --random-weights --simulate-acceptance 0.5 0.7 0.9 --quick
    python -m benchmarks.gamma_sweep --random-weights --draft-equals-target --peer transformers --quick
    python -m benchmarks.gamma_sweep --random-weights --simulate-acceptance 0.5 0.8 --tree 2 3,1 "nodes 8 depth 4"

Outputs (--out, default benchmarks/results/gamma_sweep-<UTC time>/): sweep.md, sweep.csv,
sweep.json (columns: sweep_report.COLUMNS), speedup_vs_gamma.png, acceptance_per_position.png.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, field
from statistics import median

import torch
from tqdm import tqdm

from benchmarks import sweep_report
from benchmarks.common import ModelPair, build_pair, encode_prompts, environment, load_prompt_tokenizer
from benchmarks.common import results_dir, run_cli
from benchmarks.tree_speed import parse_shape
from benchmarks.prompts import PROMPTS
from gpt2 import SamplingConfig, fast, generate
from spec_decoding import SimulatedDrafter, SimulatedTreeDrafter, SpecStats, TokenTree, TreeShape
from spec_decoding import speculative_generate
from spec_decoding.stats import clock


@dataclass(frozen=True)
class SweepSettings:
    """What to sweep and how to time it.

    Attributes:
        gammas, max_gens: the grid.
        simulate: acceptance rates for `SimulatedDrafter` (greedy only);
            empty: the real draft proposes.
        sampling: the one sampling filter; greedy by default.
        seed: seeds sampling and the simulation (the same every repeat).
        repeats, warmup: timed repeats after warm-up rounds.
        component_calls: timed calls per repeat of each of t_d, t_t, t_v.
        peer: "transformers" to run its assisted generation beside ours.
        trees: token tree shapes swept beside the gammas ("3,2,1" or
            "nodes 16 depth 5"); a tree cell's gamma is its depth.
        tree_profile: for simulated trees, the probability that the
            target's token is the draft's 2nd, 3rd, ... candidate at a depth
            (the 1st: the simulated acceptance rate).
    """

    gammas: tuple[int, ...] = (1, 2, 4, 8)
    max_gens: tuple[int, ...] = (50, 100, 200, 500)
    simulate: tuple[float, ...] = ()
    sampling: SamplingConfig = SamplingConfig()
    seed: int = 0
    repeats: int = 3
    warmup: int = 1
    component_calls: int = 10
    peer: str | None = None
    trees: tuple[str, ...] = ()
    tree_profile: tuple[float, ...] = (0.15, 0.07)

    def __post_init__(self) -> None:
        for name in ("gammas", "max_gens"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must be positive integers, got {values!r}")
        if any(not 0.0 <= a <= 1.0 for a in self.simulate):
            raise ValueError(f"simulated acceptance rates must lie in [0, 1], got {self.simulate!r}")
        if self.simulate and not self.sampling.greedy:
            raise ValueError("--simulate-acceptance works with greedy decoding only: drop --temperature")
        if self.simulate and self.peer:
            raise ValueError("--peer cannot simulate acceptance (transformers' assistant is a real model): drop "
                             "--simulate-acceptance, or use --draft-equals-target for alpha = 1 on both sides")
        if self.peer not in (None, "transformers"):
            raise ValueError(f"unknown peer {self.peer!r}: the only peer is 'transformers'")
        if self.repeats < 1 or self.warmup < 0 or self.component_calls < 1:
            raise ValueError("repeats and component calls must be >= 1 and warm-up >= 0")
        self.shapes  # each tree shape parses, or a ValueError says how to write it
        if self.trees and self.peer:
            raise ValueError("--peer has no token trees (transformers' assisted generation drafts a chain): "
                             "drop --tree or --peer")
        for a in self.simulate:
            if any(p < 0 for p in self.tree_profile) or (self.trees and a + sum(self.tree_profile) > 1 + 1e-9):
                raise ValueError(f"a simulated tree's profile (alpha_sim {a:g}, then --tree-profile "
                                 f"{' '.join(f'{p:g}' for p in self.tree_profile)}) must be >= 0 and sum to <= 1")

    @property
    def shapes(self) -> dict[str, TreeShape]:
        """The token trees to sweep, by their text."""
        return {text: parse_shape(text) for text in self.trees}

    @property
    def alpha_settings(self) -> tuple[float | None, ...]:
        """The simulated acceptance rates; (None,): the real draft model."""
        return self.simulate or (None,)


@dataclass
class Cell:
    """The measurements of one (max_gen, gamma, simulated alpha) cell; seconds
    per repeat are summed over the prompts."""

    max_gen: int
    gamma: int
    alpha_sim: float | None
    tree: str | None = None  # a token tree's shape (its depth is gamma), or None: a chain
    spec_seconds: list[float] = field(default_factory=list)
    stats: list[SpecStats] = field(default_factory=list)  # repeat 0, one per prompt
    tokens: int = 0  # new tokens of one repeat
    draft_seconds: float = 0.0  # SpecStats' time split, summed over all repeats
    verify_seconds: float = 0.0
    identical: int = 0  # greedy runs whose output equals the baseline's
    compared: int = 0
    hf_spec_seconds: list[float] = field(default_factory=list)
    hf_identical: int = 0


@dataclass
class Baseline:
    """Plain decoding at one max_gen: ours and (with --peer) transformers'."""

    seconds: list[float] = field(default_factory=list)
    tokens: int = 0
    hf_seconds: list[float] = field(default_factory=list)


@dataclass
class Components:
    """Seconds of the costs the prediction is built from, at one max_gen:
    t_draft, t_target, t_verify[gamma] (= t_v(gamma + 1)) and t_verify[tree]
    (a pass over the tree's nodes with its mask) with `context_len` positions
    cached; t_start_*: a new KV cache and the prefill of a
    `prompt_len`-token prompt."""

    prompt_len: int
    context_len: int
    t_draft: list[float] = field(default_factory=list)
    t_target: list[float] = field(default_factory=list)
    t_verify: dict[int | str, list[float]] = field(default_factory=dict)
    t_start_target: list[float] = field(default_factory=list)
    t_start_draft: list[float] = field(default_factory=list)


@dataclass
class SweepResult:
    settings: SweepSettings
    prompts: list[tuple[str, int]]  # (name, prompt tokens)
    cells: list[Cell]
    baselines: dict[int, Baseline]
    components: dict[int, Components]


class ComponentTimer:
    """Times one round of the costs at one max_gen: a draft step, a target
    step and a target pass over gamma + 1 tokens, each on a KV cache of
    `comp.context_len` positions (rewound after the call), and each model's
    start-up. The sweep spreads its rounds between the decoding runs: on a
    shared machine whose speed drifts, costs timed in one block before the
    runs describe another machine than the one the runs saw."""

    @torch.inference_mode()
    def __init__(self, pair: ModelPair, comp: Components, gammas: tuple[int, ...], seed: int,
                 trees: dict[str, TreeShape] | None = None) -> None:
        self.device = pair.device
        masks = {text: largest_tree(shape).ancestor_mask() for text, shape in (trees or {}).items()}  # (N, N) each
        length = max(comp.context_len + max([g + 1 for g in gammas] + [m.size(0) for m in masks.values()]),
                     comp.prompt_len)
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(pair.target.config.vocab_size, (1, length), generator=g).to(self.device)  # (1, length)
        P = comp.context_len
        caches = {model: model.new_cache(1) for model in (pair.target, pair.draft)}
        for model, cache in caches.items():
            model(ids[:, :P], cache, last_logits_only=True)

        def step(model, n: int, mask: torch.Tensor | None = None):
            def call():
                caches[model].rewind(P)
                model(ids[:, P : P + n], caches[model], mask=mask)  # (1, n) new tokens
            return call

        def start(model):
            return lambda: model(ids[:, : comp.prompt_len], model.new_cache(1), last_logits_only=True)

        self.timed = [(comp.t_target, step(pair.target, 1)), (comp.t_draft, step(pair.draft, 1)),
                      *((comp.t_verify.setdefault(gamma, []), step(pair.target, gamma + 1)) for gamma in gammas),
                      *((comp.t_verify.setdefault(text, []), step(pair.target, mask.size(0), mask))
                        for text, mask in masks.items()),
                      (comp.t_start_target, start(pair.target)), (comp.t_start_draft, start(pair.draft))]
        for _, call in self.timed:  # warm-up
            call()

    @torch.inference_mode()
    def round(self) -> None:
        for samples, call in self.timed:
            t0 = clock(self.device)
            call()
            samples.append(clock(self.device) - t0)


class Runner:
    """The decoding runs of the sweep, each timed between synchronised clocks."""

    def __init__(self, pair: ModelPair, settings: SweepSettings) -> None:
        self.pair, self.settings = pair, settings
        self.hf_target = self.hf_draft = None
        if settings.peer == "transformers":
            from benchmarks.hf_peer import to_transformers  # transformers only when asked for

            self.hf_target = to_transformers(pair.target)
            self.hf_draft = self.hf_target if pair.draft_is_target else to_transformers(pair.draft)

    def timed(self, fn, *args, **kwargs):
        """(fn's result, seconds)."""
        t0 = clock(self.pair.device)
        out = fn(*args, **kwargs)
        return out, clock(self.pair.device) - t0

    def generator(self, prompt_index: int) -> torch.Generator:
        """The same seed for a prompt in every run: repeats do identical work."""
        return torch.Generator(device=self.pair.device).manual_seed(self.settings.seed + 1000 * prompt_index)

    def baseline(self, ids: torch.Tensor, n: int, p: int) -> tuple[torch.Tensor, float]:
        s = self.settings.sampling
        return self.timed(generate, self.pair.target, ids, n, temperature=s.temperature, top_k=s.top_k,
                          top_p=s.top_p, generator=self.generator(p))

    def speculative(self, ids: torch.Tensor, n: int, p: int, gamma: int, alpha_sim: float | None,
                    reference: torch.Tensor | None, tree: str | None = None
                    ) -> tuple[tuple[torch.Tensor, SpecStats], float]:
        """One run, of a chain of `gamma` or of the token tree `tree`; with
        `alpha_sim` the drafter copies `reference` (the baseline's greedy
        output) with that probability (a tree: as its first candidate, its
        2nd, 3rd, ... with --tree-profile's), built inside the timed region
        as the loop builds a ModelDrafter."""
        s = self.settings.sampling
        shape = None if tree is None else self.settings.shapes[tree]

        def run():
            draft = self.pair.draft
            if alpha_sim is not None and shape is None:
                draft = SimulatedDrafter(draft, reference, alpha_sim, seed=self.settings.seed + p)
            elif alpha_sim is not None:
                profile = (alpha_sim, *self.settings.tree_profile)
                draft = SimulatedTreeDrafter(draft, reference, profile, seed=self.settings.seed + p)
            how = {"gamma": gamma} if shape is None else {"tree": shape}
            return speculative_generate(self.pair.target, draft, ids, max_new_tokens=n, temperature=s.temperature,
                                        top_k=s.top_k, top_p=s.top_p, generator=self.generator(p), **how)

        return self.timed(run)

    def hf(self, ids: torch.Tensor, n: int, p: int, gamma: int | None) -> tuple[torch.Tensor, float]:
        """transformers' plain generate (gamma None) or assisted generation."""
        from benchmarks.hf_peer import hf_generate

        torch.manual_seed(self.settings.seed + 1000 * p)  # transformers samples from the global generator
        assistant = None if gamma is None else self.hf_draft
        return self.timed(hf_generate, self.hf_target, ids, n, self.settings.sampling, assistant=assistant,
                          gamma=gamma)


def run_sweep(pair: ModelPair, prompts: list[tuple[str, torch.Tensor]], settings: SweepSettings, *,
              progress: bool = True) -> SweepResult:
    """Runs the whole sweep (the protocol is in the module docstring) on
    `prompts`, (name, (1, T) token ids on the pair's device)."""
    n_ctx = min(pair.target.config.n_ctx, pair.draft.config.n_ctx)
    longest = max(ids.size(1) for _, ids in prompts)
    if longest + max(settings.max_gens) > n_ctx:
        raise ValueError(f"a prompt of {longest} tokens plus max_gen {max(settings.max_gens)} exceeds the context "
                         f"window of {n_ctx}: use a smaller --max-gen")
    runner = Runner(pair, settings)
    cells = [cell for n in settings.max_gens for a in settings.alpha_settings
             for cell in [*(Cell(n, g, a) for g in settings.gammas),
                          *(Cell(n, shape.max_depth, a, text) for text, shape in settings.shapes.items())]]
    baselines = {n: Baseline() for n in settings.max_gens}
    prompt_len = int(median([ids.size(1) for _, ids in prompts]))
    verify_tokens = [g + 1 for g in settings.gammas] + [s.max_nodes + 1 for s in settings.shapes.values()]
    room = pair.target.config.n_ctx - max(verify_tokens)
    components = {n: Components(prompt_len, min(prompt_len + n // 2, room)) for n in settings.max_gens}
    per_prompt = len(jobs_of(settings, cells[: len(cells) // len(settings.max_gens)]))
    bar = tqdm(total=settings.repeats * len(settings.max_gens) * len(prompts) * per_prompt, desc="gamma sweep",
               unit="run", file=sys.stderr, disable=not progress, dynamic_ncols=True)

    _, ids0 = prompts[0]  # warm-up: every code path once on the first prompt, not counted
    n0 = min(min(settings.max_gens), 32)
    for _ in range(settings.warmup):
        bar.set_postfix_str("warm-up")
        reference, _ = runner.baseline(ids0, n0, 0)
        for gamma in settings.gammas:
            for alpha in settings.alpha_settings:
                runner.speculative(ids0, n0, 0, gamma, alpha, reference)
            if settings.peer:
                runner.hf(ids0, n0, 0, gamma)
        for text, shape in settings.shapes.items():
            for alpha in settings.alpha_settings:
                runner.speculative(ids0, n0, 0, shape.max_depth, alpha, reference, text)
        if settings.peer:
            runner.hf(ids0, n0, 0, None)

    references: dict[tuple[int, int], torch.Tensor] = {}  # (prompt, max_gen) -> baseline output
    for r in range(settings.repeats):
        for n in settings.max_gens:
            bar.set_postfix_str(f"repeat {r + 1}, max_gen {n}: preparing the step-cost timer")
            timer = ComponentTimer(pair, components[n], settings.gammas, settings.seed + r,
                                   settings.shapes)  # caches for one group
            group = [c for c in cells if c.max_gen == n]
            run_group(runner, r, n, prompts, group, baselines[n], references, bar, timer)
    bar.close()
    return SweepResult(settings, [(name, ids.size(1)) for name, ids in prompts], cells, baselines, components)


def largest_tree(shape: TreeShape) -> TokenTree:
    """The largest tree `shape` can grow (a dynamic one: levels of `width`
    nodes hanging from the first node of the level above), with dummy
    tokens: what a verification pass over it costs is what matters."""
    if shape.is_static:
        levels = [1]
        for b in shape.branching:
            levels.append(levels[-1] * b)
    else:
        levels = [1] + [min(shape.width, shape.nodes - shape.width * d) for d in range(shape.depth)]
        levels = [n for n in levels if n > 0]
    parents, first = [-1], 0  # `first`: the index of the level above's first node
    for d, size in enumerate(levels[1:], start=1):
        above = levels[d - 1]
        branch = size // above if shape.is_static else size
        parents += [first + (i // branch if shape.is_static else 0) for i in range(size)]
        first += above
    return TokenTree(tuple(0 for _ in parents), tuple(parents))


def jobs_of(settings: SweepSettings, group: list[Cell]) -> list[tuple[str, int | None]]:
    """The runs for one prompt at one max_gen: (kind, index of the cell in `group` or None)."""
    jobs = [("baseline", None)] + [("speculative", i) for i in range(len(group))]
    if settings.peer:  # no simulation with a peer: one cell per gamma
        jobs += [("hf baseline", None)] + [("hf assisted", i) for i in range(len(group))]
    return jobs


def run_group(runner: Runner, r: int, n: int, prompts: list[tuple[str, torch.Tensor]], group: list[Cell],
              base: Baseline, references: dict[tuple[int, int], torch.Tensor], bar: tqdm,
              timer: ComponentTimer) -> None:
    """Repeat `r` at max_gen `n`: for each prompt, the baseline and every cell
    of `group` back to back (the baseline first on even repeats, where it also
    gives the simulated drafter its reference, last on odd ones), with the
    `timer`'s rounds spread evenly between the runs."""
    settings = runner.settings
    greedy = settings.sampling.greedy
    jobs = jobs_of(settings, group)
    seconds = dict.fromkeys(jobs, 0.0)
    num_runs = len(prompts) * len(jobs)
    rounds_before = [0] * num_runs  # timer rounds to run before run k
    for j in range(settings.component_calls):
        rounds_before[j * num_runs // settings.component_calls] += 1
    k = 0
    for p, (name, ids) in enumerate(prompts):
        for kind, i in reversed(jobs) if r % 2 else jobs:
            for _ in range(rounds_before[k]):
                bar.set_postfix_str(f"repeat {r + 1}, max_gen {n}: step costs")
                timer.round()
            k += 1
            label = "" if i is None else f" tree {group[i].tree}" if group[i].tree else f" γ={group[i].gamma}"
            bar.set_postfix_str(f"repeat {r + 1}, max_gen {n}, {name}: {kind}{label}")
            if kind == "baseline":
                out, t = runner.baseline(ids, n, p)
                assert not greedy or torch.equal(out, references.get((p, n), out)), "greedy must be deterministic"
                references.setdefault((p, n), out)
                if r == 0:
                    base.tokens += out.size(1) - ids.size(1)
            elif kind == "speculative":
                c = group[i]
                (out, stats), t = runner.speculative(ids, n, p, c.gamma, c.alpha_sim, references.get((p, n)), c.tree)
                c.draft_seconds += stats.draft_seconds
                c.verify_seconds += stats.verify_seconds
                if r == 0:
                    c.stats.append(stats)
                    c.tokens += out.size(1) - ids.size(1)
                c.compared += greedy
                c.identical += int(greedy and torch.equal(out, references[(p, n)]))
            else:  # transformers: plain generate, or assisted generation
                out, t = runner.hf(ids, n, p, None if kind == "hf baseline" else group[i].gamma)
                if kind == "hf assisted" and greedy:
                    group[i].hf_identical += int(torch.equal(out.to(ids.device), references[(p, n)]))
            seconds[(kind, i)] += t
            bar.update(1)

    base.seconds.append(seconds[("baseline", None)])
    base.hf_seconds += [seconds[("hf baseline", None)]] if settings.peer else []
    for i, c in enumerate(group):
        c.spec_seconds.append(seconds[("speculative", i)])
        c.hf_spec_seconds += [seconds[("hf assisted", i)]] if settings.peer else []


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

# The full sweep, and --quick: a short run of the same grid of gammas.
FULL = {"prompts": len(PROMPTS), "max_gen": [50, 100, 200, 500], "repeats": 3, "component_calls": 10}
QUICK = {"prompts": 2, "max_gen": [50, 100], "repeats": 2, "component_calls": 5}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gamma_sweep", description=(
        "Speculative decoding speedup over gamma x max_gen, measured and predicted."))
    models = ap.add_argument_group("models")
    models.add_argument("--target", default="gpt2-large",
                        help="Hub id or folder; a preset name with --random-weights (default gpt2-large)")
    models.add_argument("--draft", default="gpt2",
                        help="Hub id or folder; a preset name with --random-weights (default gpt2)")
    models.add_argument("--random-weights", action="store_true",
                        help="the presets' real shapes with random weights: no download (acceptance meaningless)")
    models.add_argument("--tiny", action="store_true",
                        help="a 2-layer target and a 1-layer draft with random weights (tests, smoke runs)")
    models.add_argument("--draft-equals-target", action="store_true",
                        help="the target drafts for itself (alpha = 1 when greedy)")
    models.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto (default cpu)")
    models.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    models.add_argument("--quantize", default="none", choices=["none", "int8"],
                        help="int8: both models' weight matrices quantised (gpt2/fast/quantize.py; CPU, float32); "
                        "the baseline is then the int8 target (default none)")
    models.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")

    grid = ap.add_argument_group("sweep")
    grid.add_argument("--gamma", type=int, nargs="+", default=[1, 2, 4, 8], help="draft lengths (default 1 2 4 8)")
    grid.add_argument("--max-gen", type=int, nargs="+", default=None,
                      help="new tokens per run (default 50 100 200 500)")
    grid.add_argument("--prompts", type=int, default=None,
                      help=f"use the first N of the {len(PROMPTS)} prompts of benchmarks/prompts.py (default all)")
    grid.add_argument("--simulate-acceptance", type=float, nargs="+", default=None, metavar="ALPHA",
                      help="replace the draft's proposals to get acceptance ALPHA; real costs (greedy only)")
    grid.add_argument("--peer", choices=["transformers"], default=None,
                      help="also run transformers' assisted generation and plain generate")
    grid.add_argument("--tree", nargs="+", default=[], metavar="SHAPE",
                      help='token trees swept beside the gammas: children per depth ("3,2,1") or a dynamic tree '
                      '("nodes 16 depth 5")')
    grid.add_argument("--tree-profile", type=float, nargs="+", default=[0.15, 0.07], metavar="A",
                      help="simulated trees: the probability that the target's token is the draft's 2nd, 3rd, ... "
                      "candidate (the 1st: --simulate-acceptance; default 0.15 0.07)")

    sampling = ap.add_argument_group("decoding (greedy by default)")
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--seed", type=int, default=0, help="seeds sampling, random weights, the simulation")

    timing = ap.add_argument_group("timing")
    timing.add_argument("--repeats", type=int, default=None, help="timed repeats (default 3)")
    timing.add_argument("--warmup", type=int, default=1, help="warm-up rounds (default 1)")
    timing.add_argument("--component-calls", type=int, default=None,
                        help="timed calls per repeat for each step cost, spread between the runs (default 10)")
    timing.add_argument("--quick", action="store_true", help="a short run: the first 2 prompts, max_gen 50 100, "
                        "2 repeats, 5 component calls (options given explicitly win)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results/gamma_sweep-<UTC time>)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)

    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.tiny and args.random_weights:
        ap.error("--tiny and --random-weights are alternatives: pick one")
    if not 1 <= args.prompts <= len(PROMPTS):
        ap.error(f"--prompts must be between 1 and {len(PROMPTS)}, got {args.prompts}")
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    settings = SweepSettings(
        gammas=tuple(args.gamma), max_gens=tuple(args.max_gen), simulate=tuple(args.simulate_acceptance or ()),
        sampling=SamplingConfig(args.temperature, args.top_k, args.top_p), seed=args.seed, repeats=args.repeats,
        warmup=args.warmup, component_calls=args.component_calls, peer=args.peer, trees=tuple(args.tree),
        tree_profile=tuple(args.tree_profile),
    )
    weights = "tiny" if args.tiny else "random" if args.random_weights else "checkpoint"
    pair = build_pair(args.target, args.draft, weights=weights, draft_equals_target=args.draft_equals_target,
                      device=args.device, dtype=args.dtype, quantize=args.quantize, seed=args.seed)
    prompts = encode_prompts(load_prompt_tokenizer(pair.tokenizer_folder), PROMPTS[: args.prompts], pair.device)
    folder = results_dir(args.out, "gamma_sweep")

    result = run_sweep(pair, prompts, settings, progress=not args.no_progress)

    quantize = None if args.quantize == "none" else args.quantize
    env = environment(pair.device, pair.dtype, {"target": pair.target_name, "draft": pair.draft_name},
                      fast.status(pair.target), quantize)
    env.update(weights=weights, draft_is_target=pair.draft_is_target)
    if settings.peer == "transformers":
        import transformers

        env["transformers"] = transformers.__version__
    command = "python -m benchmarks.gamma_sweep " + shlex.join(sys.argv[1:] if argv is None else argv)
    paths = sweep_report.write_all(result, folder, env, command)
    print((folder / "sweep.md").read_text(encoding="utf-8"))
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
