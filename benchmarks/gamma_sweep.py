"""The gamma x max_gen sweep: the measured speedup of speculative decoding beside the one theory predicts from
measured step costs (sweep_report.py), with token trees (tree_loop.py) beside the gammas on --tree. On each
prompt the baseline `gpt2.generate` and every cell run in lockstep (benchmarks/lockstep.py: they take turns step
by step, so a swing of the machine's speed lands on all of them alike); speedup is the median over repeats of
baseline / speculative time. The step costs are timed in rounds that take their turns among the runs
(`ComponentTimer`). End-of-text is ignored: every run emits max_gen tokens.

    python -m benchmarks.gamma_sweep                       # gpt2 -> gpt2-large, full sweep
    python -m benchmarks.gamma_sweep --random-weights --simulate-acceptance 0.5 0.7 --tree 2 3,1 "nodes 8 depth 4"
    python -m benchmarks.gamma_sweep --random-weights --draft-equals-target --peer transformers --quick

Outputs (--out, default benchmarks/results/gamma_sweep-<UTC time>/): sweep.md, sweep.csv, sweep.json
(columns: sweep_report.COLUMNS), speedup_vs_gamma.png, acceptance_per_position.png.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from dataclasses import dataclass, field
from statistics import median

import torch
from tqdm import tqdm

from benchmarks import sweep_report
from benchmarks.common import ArgumentParser, ModelPair, build_pair, check_caches_fit, check_passes_fit, encode_prompts
from benchmarks.common import MAX_SEED, check_range, environment, load_prompt_tokenizer, results_dir, run_cli
from benchmarks.common import must, pair_names, set_threads
from benchmarks.lockstep import Method, lockstep, plain_decoding, rotated, stepwise
from benchmarks.prompts import PROMPTS
from benchmarks.tree_speed import parse_shape
from gpt2 import KVCache, SamplingConfig, fast, generate
from spec_decoding import SimulatedDrafter, SimulatedTreeDrafter, SpecStats, TokenTree, TreeShape
from spec_decoding import speculative_generate
from spec_decoding.stats import clock


@dataclass(frozen=True)
class SweepSettings:
    """The grid (gammas x max_gens, and token `trees`, whose gamma is their depth) and how to time it.
    `simulate`: acceptance rates for the simulated drafters (empty: the real draft proposes); `tree_profile`: for
    simulated trees, P(the target's token is the draft's 2nd, 3rd, ... candidate); `seed` seeds sampling and the
    simulation, the same every repeat; `component_calls`: timed calls per repeat of each step cost."""

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
        for name, values in (("gammas", self.gammas), ("max_gens", self.max_gens)):
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must be positive integers, got {values!r}")
        for name, values in (("gammas", self.gammas), ("max_gens", self.max_gens), ("simulate", self.simulate),
                             ("trees", self.trees)):
            if len(set(values)) < len(values):  # the cells are keyed by these values
                raise ValueError(f"{name} must be distinct, got {values!r}")
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
        profile = " ".join(f"{p:g}" for p in self.tree_profile)
        if any(not 0.0 <= p <= 1.0 for p in self.tree_profile):  # NaN too: it compares False
            raise ValueError(f"--tree-profile values are probabilities: each must lie in [0, 1], got {profile}")
        too_likely = [a for a in self.simulate if self.trees and a + sum(self.tree_profile) > 1 + 1e-9]
        if too_likely:
            raise ValueError(f"a simulated tree's profile (alpha_sim {too_likely[0]:g}, then --tree-profile "
                             f"{profile}) must sum to <= 1")

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
    """The measurements of one (max_gen, gamma or tree, simulated alpha) cell; seconds are summed over prompts."""

    max_gen: int
    gamma: int
    alpha_sim: float | None
    tree: str | None = None  # a token tree's shape (its depth is gamma), or None: a chain
    spec_seconds: list[float] = field(default_factory=list)  # one per repeat
    stats: list[SpecStats] = field(default_factory=list)  # repeat 0, one per prompt
    tokens: int = 0  # new tokens of one repeat
    draft_seconds: float = 0.0  # SpecStats' time split, summed over all repeats
    verify_seconds: float = 0.0
    identical: int = 0  # greedy runs whose output equals the baseline's
    hf_spec_seconds: list[float] = field(default_factory=list)
    hf_identical: int = 0


@dataclass
class Group:
    """What the cells of one max_gen are measured against: the baselines' seconds per repeat and the step costs
    in seconds, with `context_len` positions cached: t_verify[gamma] = t_v(gamma + 1), t_verify[tree] = a pass
    over the tree's nodes; t_start_*: a new KV cache and the prefill of a `prompt_len`-token prompt."""

    prompt_len: int
    context_len: int
    base_seconds: list[float] = field(default_factory=list)
    base_tokens: int = 0  # new tokens of one repeat
    hf_base_seconds: list[float] = field(default_factory=list)
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
    groups: dict[int, Group]  # by max_gen


def largest_tree(shape: TreeShape) -> TokenTree:
    """The largest tree `shape` can grow (a dynamic one: levels of `width` nodes hanging from the first node of
    the level above), with dummy tokens: only what a verification pass over it costs matters."""
    if shape.is_static:
        sizes = [math.prod(shape.branching[: d + 1]) for d in range(len(shape.branching))]  # nodes at depth 1, 2, ...
    else:
        sizes = [n for n in (min(shape.width, shape.nodes - shape.width * d) for d in range(shape.depth)) if n > 0]
    parents, first, above = [-1], 0, 1  # the level above: its first node's index and its size
    for size in sizes:
        branch = size // above if shape.is_static else size  # children per node above (dynamic: all on the first)
        parents += [first + i // branch for i in range(size)]
        first, above = first + above, size
    return TokenTree((0,) * len(parents), tuple(parents))


class ComponentTimer:
    """Times rounds of one max_gen's step costs into its `group`, each pass on a KV cache rewound to
    `group.context_len` positions after the call. The rounds take turns with the decoding runs (`during`): on a
    shared machine whose speed drifts, costs timed in one block describe another machine than the runs saw."""

    @torch.inference_mode()
    def __init__(self, pair: ModelPair, group: Group, settings: SweepSettings, seed: int) -> None:
        self.device = pair.device
        masks = {text: largest_tree(shape).ancestor_mask() for text, shape in settings.shapes.items()}  # (N, N) each
        P = group.context_len
        length = max(P + max([g + 1 for g in settings.gammas] + [m.size(0) for m in masks.values()]), group.prompt_len)
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(pair.target.config.vocab_size, (1, length), generator=g).to(self.device)  # (1, length)
        caches = {model: model.new_cache(1) for model in (pair.target, pair.draft)}
        for model, cache in caches.items():
            model(ids[:, :P], cache, last_logits_only=True)

        def step(model, n: int, mask: torch.Tensor | None = None):
            def call():
                caches[model].rewind(P)
                model(ids[:, P : P + n], caches[model], mask=mask)  # (1, n) new tokens
            return call

        def start(model):
            return lambda: model(ids[:, : group.prompt_len], model.new_cache(1), last_logits_only=True)

        self.timed = [(group.t_target, step(pair.target, 1)), (group.t_draft, step(pair.draft, 1)),
                      *((group.t_verify.setdefault(gamma, []), step(pair.target, gamma + 1))
                        for gamma in settings.gammas),
                      *((group.t_verify.setdefault(text, []), step(pair.target, mask.size(0), mask))
                        for text, mask in masks.items()),
                      (group.t_start_target, start(pair.target)), (group.t_start_draft, start(pair.draft))]
        for _, call in self.timed:  # warm-up
            call()

    @torch.inference_mode()
    def round(self) -> None:
        for samples, call in self.timed:
            t0 = clock(self.device)
            call()
            samples.append(clock(self.device) - t0)

    def during(self, rounds: int, n: int) -> Method:
        """`rounds` rounds as a lockstep method beside runs of `n` tokens: round i once the runs are
        (i + 1/2) n / rounds tokens in, so that the step costs meet the memory phases the runs meet."""

        def run(pause):
            for i in range(rounds):
                pause((2 * i + 1) * n // (2 * rounds))
                self.round()

        return run


def jobs_of(settings: SweepSettings, cells: list[Cell], group: Group) -> list[tuple[str, Cell | None, list[float]]]:
    """The runs for one prompt at one max_gen: (kind, its cell or None, the list its seconds per repeat go to)."""
    jobs = [("baseline", None, group.base_seconds)] + [("speculative", c, c.spec_seconds) for c in cells]
    if settings.peer:  # no simulation with a peer: one cell per gamma
        jobs += [("hf baseline", None, group.hf_base_seconds)] + [("hf assisted", c, c.hf_spec_seconds) for c in cells]
    return jobs


class Runner:
    """The decoding runs of the sweep, as lockstep methods (benchmarks/lockstep.py)."""

    def __init__(self, pair: ModelPair, settings: SweepSettings) -> None:
        self.pair, self.settings = pair, settings
        self.hf_target = self.hf_draft = None
        if settings.peer == "transformers":
            from benchmarks.hf_peer import to_transformers  # transformers only when asked for

            self.hf_target = to_transformers(pair.target)
            self.hf_draft = self.hf_target if pair.draft_is_target else to_transformers(pair.draft)

    def method(self, kind: str, cell: Cell | None, ids: torch.Tensor, n: int, p: int,
               reference: torch.Tensor | None) -> Method:
        """One run of `kind` (see `jobs_of`) on prompt number `p`, (1, T) `ids`, returning (output ids, SpecStats
        of a speculative run or None). A simulated drafter copies `reference`, the baseline's greedy output; it is
        built inside the timed run, as the loop builds a ModelDrafter."""
        s, q = self.settings, self.settings.sampling
        seed = s.seed + 1000 * p  # the same for a prompt in every run: repeats do identical work
        if kind == "baseline":
            plain = plain_decoding(self.pair.target, ids, n, q, seed)
            return lambda pause: (plain(pause), None)
        if kind == "speculative":
            shape = s.shapes.get(cell.tree)  # None: a chain of gamma tokens

            def speculative(on_step):
                draft = self.pair.draft
                if cell.alpha_sim is not None and shape is None:
                    draft = SimulatedDrafter(draft, reference, cell.alpha_sim, seed=s.seed + p)
                elif cell.alpha_sim is not None:
                    draft = SimulatedTreeDrafter(draft, reference, (cell.alpha_sim, *s.tree_profile),
                                                 seed=s.seed + p)
                generator = torch.Generator(self.pair.device).manual_seed(seed)
                return speculative_generate(self.pair.target, draft, ids, gamma=None if shape else cell.gamma,
                                            tree=shape, max_new_tokens=n, temperature=q.temperature, top_k=q.top_k,
                                            top_p=q.top_p, generator=generator, on_step=on_step)
            return stepwise(speculative)
        from benchmarks.hf_peer import PausingStreamer, hf_generate, keeping_rng

        assisted = kind == "hf assisted"  # else transformers' plain generate

        def peer(pause):
            torch.manual_seed(seed)  # transformers samples from the global generator, which the other runs share
            pause = pause if q.greedy else keeping_rng(pause, self.pair.device)
            return hf_generate(self.hf_target, ids, n, q, assistant=self.hf_draft if assisted else None,
                               gamma=cell.gamma if assisted else None, streamer=PausingStreamer(pause)), None
        return peer


def check_fits(pair: ModelPair, prompts: list[tuple[str, torch.Tensor]], settings: SweepSettings) -> None:
    """Raises a ValueError unless the longest prompt, the longest max_gen and a verification pass of the largest
    gamma + 1 or tree nodes + 1 fit both models' context window, and the runs of one prompt, in lockstep, fit the
    machine's memory with each a target and a draft cache of the full window."""
    n_ctx = min(pair.target.config.n_ctx, pair.draft.config.n_ctx)
    longest, max_gen = max(ids.size(1) for _, ids in prompts), max(settings.max_gens)
    if longest + max_gen > n_ctx:
        raise ValueError(f"a prompt of {longest} tokens plus max_gen {max_gen} exceeds the context "
                         f"window of {n_ctx}: use a smaller --max-gen")
    passes = {f"--gamma {g}": g + 1 for g in settings.gammas}
    passes |= {f"--tree {text!r}": shape.max_nodes + 1 for text, shape in settings.shapes.items()}
    check_passes_fit(n_ctx, longest + max_gen, f"the longest prompt ({longest} tokens) and --max-gen {max_gen}",
                     passes)
    runs = (1 + bool(settings.peer)) * (1 + len(settings.alpha_settings) * (len(settings.gammas) + len(settings.trees)))
    per_run = sum(KVCache.nbytes(m.config, dtype=pair.dtype) for m in (pair.target, pair.draft))
    check_caches_fit(runs * per_run, "give fewer --gamma, --tree or --simulate-acceptance values, one sweep each")


def warmup_runs(device: torch.device, prompts: list[tuple[str, torch.Tensor]],
                max_gens: tuple[int, ...]) -> tuple[int, int]:
    """How many of the prompts, from the first, the warm-up runs, and for how many new tokens: on a CPU the first
    for 32 tokens (every code path once); on a GPU every prompt for the longest max_gen, since a GPU pays a
    first-use cost that a short warm-up, or one on another prompt, leaves to the first timed repeat."""
    return (1, min(min(max_gens), 32)) if device.type == "cpu" else (len(prompts), max(max_gens))


def run_sweep(pair: ModelPair, prompts: list[tuple[str, torch.Tensor]], settings: SweepSettings, *,
              progress: bool = True) -> SweepResult:
    """Runs the whole sweep (the protocol is in the module docstring) on `prompts`, (name, (1, T) token ids on
    the pair's device)."""
    check_fits(pair, prompts, settings)
    runner = Runner(pair, settings)
    cells = {n: [cell for a in settings.alpha_settings
                 for cell in [*(Cell(n, g, a) for g in settings.gammas),
                              *(Cell(n, shape.max_depth, a, text) for text, shape in settings.shapes.items())]]
             for n in settings.max_gens}
    prompt_len = int(median([ids.size(1) for _, ids in prompts]))
    groups = {n: Group(prompt_len, prompt_len + n // 2) for n in settings.max_gens}  # any pass fits after: check_fits
    first = settings.max_gens[0]
    jobs = jobs_of(settings, cells[first], groups[first])  # the same runs at every max_gen
    bar = tqdm(total=settings.repeats * len(settings.max_gens) * len(prompts) * len(jobs), desc="gamma sweep",
               unit="run", file=sys.stderr, disable=not progress, dynamic_ncols=True)

    warm_prompts, warm_gen = warmup_runs(pair.device, prompts, settings.max_gens)  # not counted
    for _ in range(settings.warmup):
        bar.set_postfix_str("warm-up")
        for p, (_, ids) in enumerate(prompts[:warm_prompts]):  # each as its timed runs will draw
            reference = generate(pair.target, ids, warm_gen) if settings.simulate else None
            run_together(runner, jobs, ids, warm_gen, p, reference, 0)

    references: dict[tuple[int, int], torch.Tensor] = {}  # (prompt, max_gen) -> baseline output
    if settings.simulate:  # the simulated drafters copy the baseline's output, which lockstep makes alongside them
        bar.set_postfix_str("the baselines' outputs for the simulated drafters")
        references = {(p, n): generate(pair.target, ids, n) for p, (_, ids) in enumerate(prompts)
                      for n in settings.max_gens}
    for r in range(settings.repeats):
        for n in settings.max_gens:
            bar.set_postfix_str(f"repeat {r + 1}, max_gen {n}: preparing the step-cost timer")
            timer = ComponentTimer(pair, groups[n], settings, settings.seed + r)  # caches for one group
            run_group(runner, r, n, prompts, cells[n], groups[n], references, bar, timer)
    bar.close()
    all_cells = [c for n in settings.max_gens for c in cells[n]]
    return SweepResult(settings, [(name, ids.size(1)) for name, ids in prompts], all_cells, groups)


def run_together(runner: Runner, jobs: list, ids: torch.Tensor, n: int, p: int, reference: torch.Tensor | None,
                 shift: int, beside: Method | None = None) -> list[tuple[float, torch.Tensor, SpecStats | None]]:
    """Every one of `jobs` on prompt number `p` in lockstep, the first to move rotated by `shift`, and `beside`
    (untimed) with them: (seconds, output ids, SpecStats or None) of each job, in the order of `jobs`."""
    methods = rotated({j: runner.method(kind, cell, ids, n, p, reference) for j, (kind, cell, _) in enumerate(jobs)},
                      shift)
    timed = lockstep(methods | ({"beside": beside} if beside else {}), lambda: clock(runner.pair.device))
    return [(t, out, stats) for t, (out, stats) in (timed[j] for j in range(len(jobs)))]


def run_group(runner: Runner, r: int, n: int, prompts: list[tuple[str, torch.Tensor]], cells: list[Cell],
              group: Group, references: dict[tuple[int, int], torch.Tensor], bar: tqdm,
              timer: ComponentTimer) -> None:
    """Repeat `r` at max_gen `n`: for each prompt, the baseline and every one of `cells` in lockstep (who moves
    first rotates with the repeat and the prompt), with the `timer`'s rounds among them, spread evenly over the
    prompts and over each run."""
    greedy, calls = runner.settings.sampling.greedy, runner.settings.component_calls
    jobs = jobs_of(runner.settings, cells, group)
    seconds = [0.0] * len(jobs)  # this repeat's, summed over the prompts
    for p, (name, ids) in enumerate(prompts):
        rounds = timer.during(calls * (p + 1) // len(prompts) - calls * p // len(prompts), n)  # spread evenly
        bar.set_postfix_str(f"repeat {r + 1}, max_gen {n}, {name}: {len(jobs)} runs and the step costs in lockstep")
        runs = run_together(runner, jobs, ids, n, p, references.get((p, n)), r + p, rounds)
        for j, ((kind, c, _), (t, out, stats)) in enumerate(zip(jobs, runs)):
            seconds[j] += t
            if kind == "baseline":  # jobs[0]: the reference of the runs after it
                must(not greedy or torch.equal(out, references.get((p, n), out)), "greedy must be deterministic")
                references.setdefault((p, n), out)
                if r == 0:
                    group.base_tokens += out.size(1) - ids.size(1)
            elif kind == "speculative":
                c.draft_seconds += stats.draft_seconds
                c.verify_seconds += stats.verify_seconds
                if r == 0:
                    c.stats.append(stats)
                    c.tokens += out.size(1) - ids.size(1)
                c.identical += int(greedy and torch.equal(out, references[(p, n)]))
            elif kind == "hf assisted" and greedy:
                c.hf_identical += int(torch.equal(out.to(ids.device), references[(p, n)]))
        bar.update(len(jobs))
    for (_, _, samples), t in zip(jobs, seconds):
        samples.append(t)


# The full sweep, and --quick: a short run of the same grid of gammas.
FULL = {"prompts": len(PROMPTS), "max_gen": [50, 100, 200, 500], "repeats": 3, "component_calls": 10}
QUICK = {"prompts": 2, "max_gen": [50, 100], "repeats": 2, "component_calls": 5}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m benchmarks.gamma_sweep", description=(
        "Speculative decoding speedup over gamma x max_gen, measured and predicted."))
    models = ap.add_argument_group("models")
    for role, default in (("target", "gpt2-large"), ("draft", "gpt2")):
        models.add_argument(f"--{role}",
                            help=f"Hub id or folder; a preset name with --random-weights (default {default})")
    models.add_argument("--random-weights", action="store_true",
                        help="the presets' real shapes with random weights: no download (acceptance meaningless)")
    models.add_argument("--tiny", action="store_true", help="a 2-layer target and a 1-layer draft, random weights")
    models.add_argument("--draft-equals-target", action="store_true",
                        help="the target drafts for itself (alpha = 1 when greedy)")
    models.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto (default cpu)")
    models.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    models.add_argument("--quantize", default="none", choices=["none", "int8"],
                        help="int8: both models' weights quantised (CPU, float32), the baseline too (default none)")
    models.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")

    grid = ap.add_argument_group("sweep")
    grid.add_argument("--gamma", type=int, nargs="+", default=[1, 2, 4, 8], help="draft lengths (default 1 2 4 8)")
    grid.add_argument("--max-gen", type=int, nargs="+", help="new tokens per run (default 50 100 200 500)")
    grid.add_argument("--prompts", type=int, help=f"the first N of the {len(PROMPTS)} benchmark prompts (default all)")
    grid.add_argument("--simulate-acceptance", type=float, nargs="+", metavar="ALPHA",
                      help="replace the draft's proposals to get acceptance ALPHA; real costs (greedy only)")
    grid.add_argument("--peer", choices=["transformers"], help="also run transformers' assisted and plain generate")
    grid.add_argument("--tree", nargs="+", default=[], metavar="SHAPE",
                      help='token trees beside the gammas: children per depth ("3,2,1") or "nodes 16 depth 5"')
    grid.add_argument("--tree-profile", type=float, nargs="+", default=[0.15, 0.07], metavar="A",
                      help="simulated trees: P(the target's token is the draft's 2nd, 3rd, ... candidate)")

    sampling = ap.add_argument_group("decoding (greedy by default)")
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--seed", type=int, default=0, help="seeds sampling, random weights, the simulation")

    timing = ap.add_argument_group("timing")
    timing.add_argument("--repeats", type=int, help="timed repeats (default 3)")
    timing.add_argument("--warmup", type=int, default=1, help="warm-up rounds (default 1)")
    timing.add_argument("--component-calls", type=int, help="timed calls per repeat of each step cost (default 10)")
    timing.add_argument("--quick", action="store_true",
                        help="2 prompts, max_gen 50 100, 2 repeats, 5 component calls (explicit options win)")
    ap.add_argument("--out", help="results folder (default benchmarks/results/gamma_sweep-<UTC time>)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    for name in ("gamma", "max_gen", "simulate_acceptance", "tree"):  # a value given twice is run once
        setattr(args, name, None if getattr(args, name) is None else list(dict.fromkeys(getattr(args, name))))
    for name in ("gamma", "max_gen"):  # in order, for the tables and the plot's lines
        setattr(args, name, None if getattr(args, name) is None else sorted(getattr(args, name)))

    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.tiny and args.random_weights:
        raise ValueError("--tiny and --random-weights are alternatives: pick one")
    pair_names(args, presets=args.tiny or args.random_weights)
    if not 1 <= args.prompts <= len(PROMPTS):
        raise ValueError(f"--prompts must be between 1 and {len(PROMPTS)}, got {args.prompts}")
    check_range("--seed", args.seed, -MAX_SEED, MAX_SEED)
    args.settings = SweepSettings(  # its checks, here: a documented command that parses would also run
        gammas=tuple(args.gamma), max_gens=tuple(args.max_gen), simulate=tuple(args.simulate_acceptance or ()),
        sampling=SamplingConfig(args.temperature, args.top_k, args.top_p), seed=args.seed, repeats=args.repeats,
        warmup=args.warmup, component_calls=args.component_calls, peer=args.peer, trees=tuple(args.tree),
        tree_profile=tuple(args.tree_profile),
    )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    settings = args.settings
    folder = results_dir(args.out, "gamma_sweep", create=False)  # checked before the models load or download
    weights = "tiny" if args.tiny else "random" if args.random_weights else "checkpoint"
    pair = build_pair(args.target, args.draft, weights=weights, draft_equals_target=args.draft_equals_target,
                      device=args.device, dtype=args.dtype, quantize=args.quantize, seed=args.seed)
    prompts = encode_prompts(load_prompt_tokenizer(pair.tokenizer_folder), PROMPTS[: args.prompts], pair.device)
    check_fits(pair, prompts, settings)  # before the results folder is made: a bad setting leaves none behind
    folder = results_dir(folder, "gamma_sweep")

    result = run_sweep(pair, prompts, settings, progress=not args.no_progress)

    env = environment(pair.device, pair.dtype, {"target": pair.target_name, "draft": pair.draft_name},
                      fast.status(pair.target), None if args.quantize == "none" else args.quantize)
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
