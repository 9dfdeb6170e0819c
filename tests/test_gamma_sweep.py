"""The gamma sweep benchmark (benchmarks/gamma_sweep.py, sweep_report.py):
a tiny sweep writes all five outputs with the documented columns and the
theory of spec_decoding/stats.py, the start-up prediction on known values,
pooled statistics, the simulated drafter's α, and greedy output under
simulation. Speed itself is never asserted here."""

from __future__ import annotations

import csv
import dataclasses
import importlib
import json
import math
import os
import shlex
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from benchmarks import common, gamma_sweep, sweep_report
from benchmarks.common import run_cli
from benchmarks.gamma_sweep import ComponentTimer, SweepSettings, main
from benchmarks.lockstep import lockstep
from benchmarks.sweep_report import COLUMNS, PEER_COLUMNS, pooled, predicted_speedup_with_start
from benchmarks.tree_speed import parse_shape
from gpt2 import GPT2, GPT2Config, SamplingConfig, generate, init_random_weights
from spec_decoding import SimulatedDrafter, SpecStats, expected_tokens_per_step, predicted_speedup
from spec_decoding import speculative_generate

REPO_ROOT = Path(__file__).resolve().parent.parent
OUTPUTS = ("sweep.md", "sweep.csv", "sweep.json", "speedup_vs_gamma.png", "acceptance_per_position.png")
# The smallest sweep that still has two gammas and two lengths.
TINY_SWEEP = ["--tiny", "--gamma", "1", "3", "--max-gen", "6", "10", "--prompts", "2", "--repeats", "2",
              "--component-calls", "2", "--no-progress"]
# A one-run sweep: the base of the bad settings below, so that a missing check costs seconds, not minutes.
ONE_RUN = ["--tiny", "--gamma", "1", "--max-gen", "4", "--prompts", "1", "--repeats", "1", "--component-calls", "1",
           "--warmup", "0", "--no-progress"]


@pytest.fixture(scope="module", autouse=True)
def one_thread(single_thread):
    """The tiny models here are latency-bound: one thread (conftest's `single_thread`)."""


def read_csv(path: Path) -> tuple[list[str], list[dict]]:
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames), list(reader)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


# ---------------------------------------------------------------------------
# The theory the report uses
# ---------------------------------------------------------------------------


def test_prediction_with_start_up_costs():
    # E = 2 tokens per step of 1 + 10 (alpha 1, gamma 1); 10 tokens = 5 steps.
    # Baseline 20 + 10 * 10 = 120, speculative 20 + 5 + 5 * 11 = 80.
    args = dict(E=2.0, gamma=1, n=10, t_draft=1.0, t_target=10.0, t_verify=10.0)
    assert predicted_speedup_with_start(**args, t_start_target=20.0, t_start_draft=5.0) == pytest.approx(1.5)
    # Without start-up costs it is the per-step prediction.
    assert predicted_speedup_with_start(**args, t_start_target=0.0, t_start_draft=0.0) == pytest.approx(
        predicted_speedup(1.0, 1, t_draft=1.0, t_target=10.0, t_verify=10.0)
    )


def hand_made_cell() -> tuple[gamma_sweep.SweepResult, gamma_sweep.Cell]:
    """A cell measured by hand, every number distinct, so that a ratio of medians, an inverted ratio, a swapped
    argument or accepted / drafted for α each gives another figure. 3 repeats, 2 prompts, max_gen 10, γ 2."""
    stats = SpecStats(2)
    stats.record_step(2, 0, target_token=True)  # judged 1 (rejected)
    stats.record_step(2, 2, target_token=True)  # judged 2: α = 2 / 3, accepted per drafted 2 / 4
    group = gamma_sweep.Group(prompt_len=5, context_len=10, base_seconds=[1.0, 2.0, 4.0], base_tokens=30,
                              hf_base_seconds=[3.0, 5.0, 4.0], t_draft=[0.1, 0.2, 0.3], t_target=[1.0, 1.2, 1.1],
                              t_verify={2: [1.5, 1.6, 1.4]}, t_start_target=[2.0, 3.0, 2.5],
                              t_start_draft=[0.5, 0.7, 0.6])
    cell = gamma_sweep.Cell(10, 2, None, spec_seconds=[0.25, 1.6, 1.25], stats=[stats], tokens=30, draft_seconds=0.6,
                            verify_seconds=1.8, identical=5, hf_spec_seconds=[2.0, 2.5, 5.0], hf_identical=4)
    settings = SweepSettings(gammas=(2,), max_gens=(10,), repeats=3, peer="transformers")
    return gamma_sweep.SweepResult(settings, [("a", 5), ("b", 5)], [cell], {10: group}), cell


def test_each_column_of_a_row_is_what_its_parts_say():
    row = sweep_report.cell_row(*hand_made_cell())
    E = 1 + 2 / 3 + 4 / 9  # eq. 1 at α = 2/3, γ = 2
    speedup = 3.2  # the median of 1 / 0.25, 2 / 1.6 and 4 / 1.25; the medians' ratio would say 1.6
    predicted = E * 1.1 / (2 * 0.2 + 1.5)
    with_start = (2.5 + 10 * 1.1) / (2.5 + 0.6 + 10 / E * (2 * 0.2 + 1.5))
    expected = {
        "speedup": speedup, "speedup_min": 1.25, "speedup_max": 4.0, "spec_tok_s": 24.0, "base_tok_s": 15.0,
        "alpha": 2 / 3, "accepted_per_drafted": 0.5, "tokens_per_call": 2.0, "t_draft_ms": 200.0,
        "t_target_ms": 1100.0, "t_verify_ms": 1500.0, "c": 0.2 / 1.1, "verify_ratio": 1.5 / 1.1,
        "expected_tokens": E, "predicted_speedup": predicted, "efficiency": speedup / predicted,
        "start_target_ms": 2500.0, "start_draft_ms": 600.0, "predicted_with_start": with_start,
        "efficiency_with_start": speedup / with_start, "draft_share": 0.6 / 3.1, "verify_share": 1.8 / 3.1,
        "spec_seconds": 1.25, "base_seconds": 2.0, "identical_runs": 5, "compared_runs": 6,
        "hf_speedup": 1.5, "hf_speedup_min": 0.8, "hf_speedup_max": 2.0, "hf_spec_tok_s": 12.0,
        "hf_base_tok_s": 7.5, "ours_over_hf": 2.0, "hf_identical_runs": 4,
    }
    assert {name: row[name] for name in expected} == pytest.approx(expected, rel=1e-12)
    result, cell = hand_made_cell()
    result.settings = dataclasses.replace(result.settings, sampling=SamplingConfig(temperature=1.0))
    assert sweep_report.cell_row(result, cell)["compared_runs"] == 0  # sampled runs are not compared


PLOT_ENV = {"models": {"target": "t", "draft": "d"}, "device_name": "cpu", "dtype": "float32"}  # what plot() reads


def test_the_plot_draws_each_measured_speedup_down_to_its_slowest_repeat_and_up_to_its_fastest(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    drawn, errorbar = [], Axes.errorbar

    def recorded(self, x, y, *args, yerr=None, **kwargs):
        drawn.append((list(x), list(y), yerr))
        return errorbar(self, x, y, *args, yerr=yerr, **kwargs)

    monkeypatch.setattr(Axes, "errorbar", recorded)
    result, cell = hand_made_cell()
    sweep_report.plot(result, [sweep_report.cell_row(result, cell)], PLOT_ENV, tmp_path / "s.png",
                      tmp_path / "a.png")
    assert drawn == [([2], [3.2], [[3.2 - 1.25], [4.0 - 3.2]])]  # speedups 4, 1.25, 3.2


def steps(*accepted: int) -> SpecStats:
    """The stats of steps drafting 2 tokens each, of which `accepted` were accepted."""
    stats = SpecStats(2)
    for a in accepted:
        stats.record_step(2, a, target_token=True)
    return stats


def test_the_acceptance_plot_draws_each_simulated_alpha_from_its_own_chains(tmp_path, monkeypatch):
    """One line per simulated α: the per-position acceptance of that α's chain cells pooled, leaving out the other
    α's cells and a tree of the same α (its depths are not a chain's draft positions)."""
    from matplotlib.axes import Axes

    drawn, plot = {}, Axes.plot

    def recorded(self, x, y, *args, label="", **kwargs):
        if label.startswith("simulated") and "," not in label:  # not "..., predicted": the acceptance lines
            drawn[label] = (list(x), list(y))
        return plot(self, x, y, *args, label=label, **kwargs)

    monkeypatch.setattr(Axes, "plot", recorded)
    result, cell = hand_made_cell()
    cells = [dataclasses.replace(cell, alpha_sim=0.5, stats=[steps(0, 2)]),  # positions 1, 2: 1 of 2, 1 of 1
             dataclasses.replace(cell, alpha_sim=0.7, stats=[steps(1), steps(2)]),  # 2 of 2, 1 of 2
             dataclasses.replace(cell, alpha_sim=0.7, tree="2,1", stats=[steps(0, 0, 0)])]
    result.groups[10].t_verify["2,1"] = [1.0]
    result = gamma_sweep.SweepResult(SweepSettings(gammas=(2,), max_gens=(10,), simulate=(0.5, 0.7), trees=("2,1",)),
                                     result.prompts, cells, result.groups)
    rows = [sweep_report.cell_row(result, c) for c in cells]
    sweep_report.plot(result, rows, PLOT_ENV, tmp_path / "s.png", tmp_path / "a.png")
    assert drawn == {"simulated α = 0.5": ([1, 2], [0.5, 1.0]), "simulated α = 0.7": ([1, 2], [1.0, 0.5])}


def test_pooled_stats_give_alpha_over_all_judged_tokens():
    a, b = SpecStats(gamma=4), SpecStats(gamma=2)
    a.record_step(drafted=4, accepted=1, target_token=True)  # positions 1, 2 judged: 1 accepted
    a.record_step(drafted=4, accepted=4, target_token=True)  # positions 1..4 judged: all accepted
    b.record_step(drafted=2, accepted=0, target_token=True)  # position 1 judged: rejected
    total = pooled([a, b])
    assert (total.accepted, total.drafted, total.new_tokens, total.target_calls) == (5, 10, 8, 3)
    assert total.alpha == pytest.approx(5 / 7)  # accepted / judged
    assert total.accepted_per_drafted == pytest.approx(5 / 10)  # a different number
    assert total.reached_at == [3, 2, 1, 1] and total.accepted_at == [2, 1, 1, 1]
    assert total.accepted_hist == [1, 1, 0, 0, 1]


# ---------------------------------------------------------------------------
# The simulated drafter
# ---------------------------------------------------------------------------

ALPHA, GAMMA = 0.7, 4


def small_model(config: GPT2Config, seed: int) -> GPT2:
    # Cheap forwards: the statistics matter here, not the model. std 0.3 (not
    # GPT-2's 0.02) so that greedy decoding wanders over many tokens.
    return init_random_weights(GPT2(config), std=0.3, generator=torch.Generator().manual_seed(seed)).eval()


@pytest.fixture(scope="module")
def simulated_runs():
    """Greedy speculative runs with a SimulatedDrafter at ALPHA, beside the
    baseline each one uses as its reference: (baselines, outputs, stats)."""
    target = small_model(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=128), seed=0)
    draft = small_model(GPT2Config(n_layer=1, n_head=1, n_embd=8, vocab_size=128), seed=1)
    g = torch.Generator().manual_seed(0)
    baselines, outputs, stats = [], [], []
    for run in range(5):
        prompt = torch.randint(128, (1, 8), generator=g)
        reference = generate(target, prompt, 300)
        drafter = SimulatedDrafter(draft, reference, ALPHA, seed=run)
        out, st = speculative_generate(target, drafter, prompt, gamma=GAMMA, max_new_tokens=300)
        baselines.append(reference)
        outputs.append(out)
        stats.append(st)
    return baselines, outputs, stats


def test_simulated_acceptance_is_alpha_within_four_standard_errors(simulated_runs):
    _, _, stats = simulated_runs
    reached = sum(sum(s.reached_at) for s in stats)
    assert reached >= 1200, f"only {reached} judged positions: the check needs more"
    # Each judged (reached) position is one Bernoulli(ALPHA) trial: about 1,360 of them here, so 4 standard errors
    # are about 0.05; a drafter at alpha 0.6 or 0.8 fails.
    tolerance = 4 * math.sqrt(ALPHA * (1 - ALPHA) / reached)
    assert abs(pooled(stats).alpha - ALPHA) < tolerance, (pooled(stats).alpha, reached)


def test_greedy_output_under_simulation_equals_the_baseline(simulated_runs):
    baselines, outputs, _ = simulated_runs
    for baseline, out in zip(baselines, outputs):
        assert torch.equal(out, baseline)


# ---------------------------------------------------------------------------
# The whole sweep on tiny models
# ---------------------------------------------------------------------------


def test_tiny_sweep_writes_all_outputs_with_the_documented_columns(tmp_path, prompt_tokenizer, monkeypatch):
    groups = []  # the runs of each lockstep call, by kind and gamma, in the order they were handed over

    def recorded(methods, clock):
        groups.append(list(methods))
        return lockstep(methods, clock)

    monkeypatch.setattr(gamma_sweep, "lockstep", recorded)
    assert main(TINY_SWEEP + ["--out", str(tmp_path)]) == 0
    # Every prompt's baseline and cells run together (warm-up: 1 call; 2 repeats x 2 max_gens x 2 prompts), with the
    # step costs' rounds beside them after the warm-up, and who moves first rotates with the repeat and the prompt.
    assert len(groups) == 1 + 2 * 2 * 2 and groups[0] == [0, 1, 2]
    assert all(sorted(g[:3]) == [0, 1, 2] and g[3:] == ["beside"] for g in groups[1:])
    assert {g[0] for g in groups} == {0, 1, 2}  # each run moves first somewhere
    for name in OUTPUTS:
        assert (tmp_path / name).is_file() and (tmp_path / name).stat().st_size > 0, name
    # One axis that fits a laptop screen, and a small acceptance plot.
    assert png_size(tmp_path / "speedup_vs_gamma.png") == (1000, 700)
    assert png_size(tmp_path / "acceptance_per_position.png") == (800, 500)

    header, rows = read_csv(tmp_path / "sweep.csv")
    assert header == list(COLUMNS)
    assert [(int(r["max_gen"]), int(r["gamma"])) for r in rows] == [(6, 1), (6, 3), (10, 1), (10, 3)]
    for r in rows:
        assert r["alpha_sim"] == ""  # the real draft
        assert int(r["tokens"]) == 2 * int(r["max_gen"])  # two prompts, end-of-text ignored
        assert float(r["speedup_min"]) <= float(r["speedup"]) <= float(r["speedup_max"])
        # The theory columns are spec_decoding.stats' functions at the pooled alpha.
        alpha, gamma = float(r["alpha"]), int(r["gamma"])
        assert float(r["expected_tokens"]) == pytest.approx(expected_tokens_per_step(alpha, gamma))
        assert float(r["predicted_speedup"]) == pytest.approx(predicted_speedup(
            alpha, gamma, float(r["t_draft_ms"]), float(r["t_target_ms"]), float(r["t_verify_ms"])))
        assert float(r["efficiency"]) == pytest.approx(float(r["speedup"]) / float(r["predicted_speedup"]))
        assert float(r["c"]) == pytest.approx(float(r["t_draft_ms"]) / float(r["t_target_ms"]))
        assert r["identical_runs"] == r["compared_runs"] == "4"  # greedy: 2 prompts x 2 repeats, all lossless

    report = json.loads((tmp_path / "sweep.json").read_text())
    for key in ("device", "device_name", "dtype", "torch", "threads", "models", "date"):
        assert key in report["environment"], key
    assert report["environment"]["models"] == {"target": "tiny", "draft": "tiny-draft"}
    assert report["environment"]["path"].startswith(("fast path", "readable path"))  # gpt2.fast.status
    assert list(report["columns"]) == list(COLUMNS)
    assert len(report["rows"]) == 4 and len(report["cells"][1]["position_acceptance"]) == 3

    md = (tmp_path / "sweep.md").read_text()
    assert "RANDOM WEIGHTS" in md and "SIMULATED" not in md
    assert "| max_gen | γ | speedup [min-max] | tok/s spec | tok/s base | α |" in md
    assert "predicted | efficiency |" in md


def test_a_gpu_warms_up_on_every_prompt_at_full_length():
    # The H100 run of docs/results/2026-11-26h-gpu-h100 warmed up on 32 tokens of 100, and the H200 run of
    # docs/results/2026-11-27a-gpu-h200 on the first prompt only: the first timed repeat of the speculative runs
    # was far slower than the next, while the baseline's repeats agreed.
    prompts = [("prose", torch.zeros(1, 36, dtype=torch.long)), ("code", torch.ones(1, 39, dtype=torch.long))]
    assert gamma_sweep.warmup_runs(torch.device("cpu"), prompts, (50, 100, 200)) == (1, 32)
    assert gamma_sweep.warmup_runs(torch.device("cpu"), prompts, (6, 10)) == (1, 6)
    assert gamma_sweep.warmup_runs(torch.device("cuda"), prompts, (50, 100, 200)) == (2, 200)


def test_step_cost_rounds_take_turns_at_even_points_of_the_runs():
    log = []  # the run's tokens so far, and "round" where the timer ran one

    class Timer:
        def round(self):
            log.append("round")

    def run(pause):  # 20 tokens, one a step
        for tokens in range(1, 21):
            log.append(tokens)
            pause(tokens)

    lockstep({"run": run, "beside": ComponentTimer.during(Timer(), 4, 20)}, clock=lambda: 0.0)
    # Round i once the run is past (2i + 1) * 20 // 8 = 2, 7, 12, 17 tokens (a tie goes to the run, named first).
    assert [log[i - 1] for i, entry in enumerate(log) if entry == "round"] == [3, 8, 13, 18]
    assert log.count("round") == 4 and log[-1] == 20


def test_simulated_sweep_is_labelled_and_controls_acceptance(tmp_path, prompt_tokenizer):
    assert main(TINY_SWEEP + ["--simulate-acceptance", "0.5", "1.0", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "sweep.md").read_text()
    assert "SIMULATED ACCEPTANCE (alpha_sim = 0.5, 1)" in md and "| α_sim |" in md
    assert "Greedy check: 32 of 32" in md and "Runs part from the baseline" not in md
    report = json.loads((tmp_path / "sweep.json").read_text())
    assert report["simulated_acceptance"] == [0.5, 1.0]
    assert any("SIMULATED ACCEPTANCE" in label for label in report["labels"])

    _, rows = read_csv(tmp_path / "sweep.csv")
    assert len(rows) == 8
    for r in rows:
        assert r["identical_runs"] == r["compared_runs"] == "4"  # greedy output unchanged by the simulation
        if float(r["alpha_sim"]) == 1.0:
            assert float(r["alpha"]) == 1.0
            assert float(r["accepted_per_drafted"]) == 1.0


def test_runs_that_part_from_the_baseline_are_explained(tmp_path, prompt_tokenizer, monkeypatch):
    real = sweep_report.cell_row  # as if no run had matched the baseline: how a half-precision sweep can read
    monkeypatch.setattr(sweep_report, "cell_row", lambda result, cell: {**real(result, cell), "identical_runs": 0})
    assert main(TINY_SWEEP + ["--simulate-acceptance", "0.5", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "sweep.md").read_text()
    assert "Greedy check: 0 of 16 speculative runs" in md
    assert "Runs part from the baseline where its top two logits nearly tie" in md
    assert "a simulated drafter copies the baseline, so after such a point its proposals leave the path" in md


def test_token_trees_are_swept_beside_the_gammas(tmp_path, prompt_tokenizer):
    args = TINY_SWEEP + ["--simulate-acceptance", "0.6", "--tree", "2,1", "nodes 3 depth 2", "3", "--out",
                         str(tmp_path)]
    assert main(args) == 0
    _, rows = read_csv(tmp_path / "sweep.csv")
    assert [(int(r["max_gen"]), r["gamma"], r["tree"]) for r in rows] == [
        (n, g, t) for n in (6, 10)
        for g, t in (("1", ""), ("3", ""), ("2", "2,1"), ("2", "nodes 3 depth 2"), ("1", "3"))]
    for r in rows:
        assert r["identical_runs"] == r["compared_runs"] == "4"  # greedy trees reproduce the baseline
        if r["tree"]:  # E is the measured tokens per call; one draft pass per depth; t_v over the tree's nodes
            E = float(r["tokens_per_call"])
            assert float(r["expected_tokens"]) == pytest.approx(E)
            t_d, t_t, t_v = float(r["t_draft_ms"]), float(r["t_target_ms"]), float(r["t_verify_ms"])
            assert float(r["predicted_speedup"]) == pytest.approx(E * t_t / (int(r["gamma"]) * t_d + t_v))
    md = (tmp_path / "sweep.md").read_text()
    assert "| 6 | tree 2,1 | 0.6 |" in md and "Tree rows (spec_decoding/tree_loop.py)" in md
    report = json.loads((tmp_path / "sweep.json").read_text())
    assert report["settings"]["trees"] == ["2,1", "nodes 3 depth 2", "3"]
    t_verify = report["components_seconds"]["6"]["t_verify"]  # the tree "3" and gamma 3 keep their own samples
    assert set(t_verify) == {"1", "3", "tree 2,1", "tree nodes 3 depth 2", "tree 3"}
    assert len(t_verify["3"]) == len(t_verify["tree 3"]) > 0


def test_the_labels_name_the_shapes_and_the_peers_float32_weights():
    """--random-weights takes the tiny names too: it was labelled 'the presets' real GPT-2 shapes'; and with int8
    weights the peer computed in float32 unsaid."""
    result = types.SimpleNamespace(settings=SweepSettings(gammas=(2,), max_gens=(6,), peer="transformers"))
    env = {"weights": "random", "models": {"target": "tiny", "draft": "tiny-draft"}, "quantize": "int8"}
    text = " ".join(sweep_report.labels(result, env))
    assert "RANDOM WEIGHTS (the shapes of tiny and tiny-draft)" in text
    assert "The peer's transformers models compute in float32 from the same rounded weights." in text
    env = {"weights": "random", "models": {"target": "gpt2-large", "draft": "gpt2-large"}}
    assert "RANDOM WEIGHTS (the shapes of gpt2-large):" in " ".join(sweep_report.labels(result, env))


def test_pooled_tree_stats_add_up_per_depth_and_rank():
    a, b = SpecStats(2, tree="2,1"), SpecStats(2, tree="2,1")
    a.record_tree_step(4, (1, 0), judged=2, target_token=True)
    b.record_tree_step(4, (0,), judged=2, target_token=True)
    total = pooled([a, b])
    assert total.accepted_rank == [[1, 1], [1]] and total.accepted_at == [2, 1] and total.reached_at == [2, 2]


def test_int8_sweep_quantises_both_models_and_stays_lossless_against_the_int8_target(tmp_path, prompt_tokenizer):
    args = ["--tiny", "--quantize", "int8", "--gamma", "2", "--max-gen", "6", "--prompts", "1", "--repeats", "1",
            "--component-calls", "1", "--no-progress", "--out", str(tmp_path)]
    assert main(args) == 0
    md = (tmp_path / "sweep.md").read_text()
    assert "INT8 WEIGHTS: both models' weight matrices are quantised" in md
    assert "- dtype: float32, int8 weights (gpt2/fast/quantize.py)" in md
    assert json.loads((tmp_path / "sweep.json").read_text())["environment"]["quantize"] == "int8"
    _, (row,) = read_csv(tmp_path / "sweep.csv")
    assert row["identical_runs"] == row["compared_runs"] == "1"  # the int8 pair reproduces the int8 target


def test_peer_transformers_runs_beside_ours(tmp_path, prompt_tokenizer):
    pytest.importorskip("transformers")
    args = ["--tiny", "--draft-equals-target", "--peer", "transformers", "--gamma", "2", "--max-gen", "6",
            "--prompts", "1", "--repeats", "1", "--component-calls", "1", "--no-progress", "--out", str(tmp_path)]
    assert main(args) == 0
    header, rows = read_csv(tmp_path / "sweep.csv")
    assert header == list(COLUMNS) + list(PEER_COLUMNS)
    (row,) = rows
    assert float(row["alpha"]) == 1.0  # the target drafting for itself
    assert float(row["hf_speedup"]) > 0 and float(row["ours_over_hf"]) > 0
    assert row["hf_identical_runs"] == "1"  # the same weights give transformers the same greedy tokens
    assert "HF speedup" in (tmp_path / "sweep.md").read_text()


def test_the_peers_sampling_runs_draw_as_they_would_alone_whoever_moves_first():
    """transformers samples from torch's global generator: the hf baseline and hf assisted runs, taking turns,
    reseeded and drew from each other's stream, so their tokens changed with who moved first."""
    pytest.importorskip("transformers")
    pair = common.build_pair("tiny", "tiny-draft", weights="tiny")
    settings = SweepSettings(gammas=(2,), max_gens=(10,), sampling=SamplingConfig(1.0), peer="transformers")
    runner = gamma_sweep.Runner(pair, settings)
    cells = [gamma_sweep.Cell(10, 2, None)]
    jobs = gamma_sweep.jobs_of(settings, cells, gamma_sweep.Group(5, 10))
    ids = torch.tensor([[464, 1893, 286, 4881, 318]])
    alone = [lockstep({"run": runner.method(kind, cell, ids, 10, 0, None)}, time.perf_counter)["run"][1][0]
             for kind, cell, _ in jobs]
    assert [kind for kind, _, _ in jobs] == ["baseline", "speculative", "hf baseline", "hf assisted"]
    for shift in range(len(jobs)):
        together = [out for _, out, _ in gamma_sweep.run_together(runner, jobs, ids, 10, 0, None, shift)]
        assert all(torch.equal(a, b) for a, b in zip(together, alone)), shift


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tiny", "--simulate-acceptance", "1.5"], "must lie in [0, 1]"),
        (["--tiny", "--simulate-acceptance", "0.5", "--temperature", "0.8"], "greedy decoding only"),
        (["--tiny", "--simulate-acceptance", "0.5", "--peer", "transformers"], "cannot simulate"),
        (["--random-weights", "--target", "gpt9"], "no preset named 'gpt9'"),
        (["--tiny", "--random-weights"], "--tiny and --random-weights are alternatives: pick one"),
        (["--tiny", "--prompts", "0"], "--prompts must be between 1 and"),
        (["--tiny", "--quantize", "int8", "--dtype", "bfloat16"], "int8 weights are for the CPU in float32"),
        (["--tiny", "--tree", "0,2"], "integers >= 1 such as 3,2,1,1"),
        (["--tiny", "--tree", "2", "--peer", "transformers"], "--peer has no token trees"),
        (["--tiny", "--tree", "2", "--simulate-acceptance", "0.9", "--tree-profile", "0.2"], "sum to <= 1"),
        (ONE_RUN + ["--tree", "2", "--simulate-acceptance", "0.5", "--tree-profile", "nan"],
         "--tree-profile values are probabilities"),
        (ONE_RUN + ["--threads", str(os.cpu_count() + 1)], "--threads must lie in 1.."),
        *((["--tiny", option, value], "repeats and component calls must be >= 1 and warm-up >= 0")
          for option, value in (("--repeats", "0"), ("--warmup", "-1"), ("--component-calls", "0"))),
    ],
)
def test_user_mistakes_exit_with_one_line(args, message, capsys, tmp_path):
    assert run_cli(main, ["--out", str(tmp_path)] + args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        # gamma + 1 or a tree's nodes + 1 must fit the window after the longest prompt (36 tokens) and max_gen 4
        (["--gamma", "984"], "--gamma 984 verifies 985 tokens in one pass"),
        (["--gamma", "1023"], "give gammas of at most 983"),
        (["--tree", "1000,1000"], "--tree '1000,1000' verifies 1001001 tokens"),
        (["--out", ""], "--out is empty"),
    ],
)
def test_settings_checked_against_the_encoded_prompts_exit_with_one_line(args, message, capsys, tmp_path,
                                                                        prompt_tokenizer):
    assert run_cli(main, ["--out", str(tmp_path)] + ONE_RUN + args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_runs_whose_caches_would_not_fit_in_memory_together_are_refused(capsys, tmp_path, prompt_tokenizer,
                                                                        monkeypatch):
    # Tiny pair: 1.5 MiB of full-window caches a run. On a 4 GiB machine, the baseline and 100 gammas x 14 simulated
    # alphas (1,401 runs, 2.05 GiB) are refused before any run.
    monkeypatch.setattr(common, "machine_memory", lambda: 4 * 2**30)
    many = ["--gamma", *map(str, range(1, 101)), "--simulate-acceptance", *(f"{a / 20:g}" for a in range(1, 15))]
    assert run_cli(main, ONE_RUN + many + ["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: the runs timed together in lockstep would hold 2.1 GiB of KV caches at once, more than "
                   "half of this machine's 4 GiB: give fewer --gamma, --tree or --simulate-acceptance values, one "
                   "sweep each")
    assert not (tmp_path / "out").exists()
    # The line itself: on a 64 MiB machine 21 runs (31.5 MiB) run, 22 do not.
    monkeypatch.setattr(common, "machine_memory", lambda: 64 * 2**20)
    assert run_cli(main, ONE_RUN + ["--gamma", *map(str, range(1, 21)), "--out", str(tmp_path / "ok")]) == 0
    assert run_cli(main, ONE_RUN + ["--gamma", *map(str, range(1, 22)), "--out", str(tmp_path / "no")]) == 2


def test_a_value_given_twice_is_swept_once(tmp_path, prompt_tokenizer):
    """The cells are keyed by γ and max_gen: a repeated value counted its tokens and runs twice over."""
    args = ONE_RUN + ["--gamma", "1", "1", "--max-gen", "4", "4", "--simulate-acceptance", "0.5", "0.5", "--tree", "2",
                      "2", "--out", str(tmp_path)]
    assert main(args) == 0
    _, rows = read_csv(tmp_path / "sweep.csv")
    assert [(r["gamma"], r["tree"], r["tokens"], r["identical_runs"], r["compared_runs"]) for r in rows] == [
        ("1", "", "4", "1", "1"), ("1", "2", "4", "1", "1")]
    for field, values in (("gammas", (2, 2)), ("max_gens", (8, 8)), ("simulate", (0.5, 0.5)), ("trees", ("2", "2"))):
        with pytest.raises(ValueError, match=f"{field} must be distinct"):
            SweepSettings(**{field: values})


def test_a_rows_rates_are_its_tokens_over_its_seconds_and_its_step_costs_lie_within_the_run(tmp_path,
                                                                                              prompt_tokenizer):
    started = time.perf_counter()
    assert main(ONE_RUN + ["--gamma", "2", "--tree", "2", "--max-gen", "6", "--out", str(tmp_path)]) == 0
    wall_seconds = time.perf_counter() - started
    _, rows = read_csv(tmp_path / "sweep.csv")
    assert len(rows) == 2
    for r in rows:
        tokens = int(r["tokens"])
        assert tokens == 6  # one prompt, one repeat
        assert float(r["spec_tok_s"]) * float(r["spec_seconds"]) == pytest.approx(tokens)
        assert float(r["base_tok_s"]) * float(r["base_seconds"]) == pytest.approx(tokens)
        for column in ("t_draft_ms", "t_target_ms", "t_verify_ms", "start_target_ms", "start_draft_ms"):
            assert 0 < float(r[column]) / 1e3 < wall_seconds, column


def test_the_step_costs_time_passes_of_the_sizes_they_name(prompt_tokenizer):
    """t_t and t_d one token, t_v(γ+1) γ + 1 tokens, a tree's t_v its largest tree's nodes + 1, the start-ups the
    whole prompt: the target's passes in one round of the component timer, by their new tokens."""
    pair = common.build_pair("", "", weights="tiny", accelerate=False)
    settings = SweepSettings(gammas=(2, 12), max_gens=(4,), trees=("3,2",))  # γ 12: the longest pass
    group = gamma_sweep.Group(prompt_len=7, context_len=9)
    timer = ComponentTimer(pair, group, settings, seed=0)
    widths = []
    hook = pair.target.register_forward_pre_hook(lambda module, args: widths.append(args[0].size(1)))
    try:
        timer.round()
    finally:
        hook.remove()
    assert widths == [1, 3, 13, 10, 7]  # t_t, t_v(3), t_v(13), the tree of 3 + 6 nodes and its root, S_t


def test_a_simulated_trees_profile_may_sum_to_one_and_not_past_it():
    """α_sim then the profile's 2nd, 3rd, ... candidates: a sum of 1 is allowed, also where float addition puts
    it a rounding above 1 (0.1 + (0.34 + 0.56)); 1.01 is not."""
    assert SweepSettings(simulate=(0.1,), trees=("2",), tree_profile=(0.34, 0.56)).simulate == (0.1,)
    with pytest.raises(ValueError, match=r"\(alpha_sim 0.11, then --tree-profile 0.34 0.56\) must sum to <= 1"):
        SweepSettings(simulate=(0.11,), trees=("2",), tree_profile=(0.34, 0.56))


@pytest.mark.parametrize("text, parents", [
    ("3,2", (-1, 0, 0, 0, 1, 1, 2, 2, 3, 3)),  # each node of a level has its own children
    ("nodes 8 depth 4", (-1, 0, 0, 1, 1, 3, 3, 5, 5)),  # levels of 2 hanging from the first node above
    ("nodes 7 depth 3", (-1, 0, 0, 0, 1, 1, 1, 4)),  # levels of 3, the last holding the 1 node left
])
def test_the_verification_cost_of_a_tree_is_timed_on_the_largest_tree_its_shape_can_grow(text, parents):
    tree = gamma_sweep.largest_tree(parse_shape(text))
    assert tree.parents == parents and tree.tokens == (0,) * len(parents)


def test_runs_too_short_to_draft_show_no_alpha_and_the_gammas_come_in_order(tmp_path, prompt_tokenizer):
    # One new token comes from the prefill: nothing is drafted or judged, so α (0 of 0) predicts nothing.
    args = ONE_RUN + ["--gamma", "4", "1", "--max-gen", "1", "--simulate-acceptance", "1", "--out", str(tmp_path)]
    assert main(args) == 0
    _, rows = read_csv(tmp_path / "sweep.csv")
    assert [r["gamma"] for r in rows] == ["1", "4"]  # the plot draws its lines in this order
    for r in rows:
        assert r["alpha"] == r["expected_tokens"] == r["predicted_speedup"] == r["efficiency"] == "", r
    assert json.loads((tmp_path / "sweep.json").read_text())["rows"][0]["alpha"] is None


def test_a_results_folder_that_is_a_file_is_refused_before_the_models_load(capsys, tmp_path, monkeypatch):
    (tmp_path / "afile").touch()
    monkeypatch.setattr(gamma_sweep, "build_pair", lambda *a, **k: pytest.fail("the models were built first"))
    assert run_cli(main, ONE_RUN + ["--out", str(tmp_path / "afile")]) == 2
    assert capsys.readouterr().err.strip().endswith("is a file: give a folder for the results")


def test_a_results_folder_inside_a_file_is_one_line_and_exit_2(capsys, tmp_path, prompt_tokenizer):
    (tmp_path / "afile").touch()
    assert run_cli(main, ONE_RUN + ["--out", str(tmp_path / "afile" / "sub")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --out ") and "cannot be created" in err and "\n" not in err


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs Linux's /sys, which takes no new entries")
def test_a_results_folder_the_file_system_refuses_is_refused_before_the_run():
    # As root, os.access said /sys was writable: the sweep ran, then failed to make its folder.
    with pytest.raises(ValueError, match="cannot be created .* not a folder you can write to"):
        common.results_dir("/sys/gpt2-speculative-results", "sweep", create=False)


def test_a_results_folder_under_home_written_with_a_tilde_goes_there(tmp_path, monkeypatch):
    # --out=~/results (no shell expands a ~ after "=") made a folder named "~" in the working directory.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert common.results_dir("~/results", "sweep") == tmp_path / "home" / "results"
    assert (tmp_path / "home" / "results").is_dir() and not (tmp_path / "~").exists()
    with pytest.raises(ValueError, match="'~no_such_user_here' names no home folder on this machine"):
        common.results_dir("~no_such_user_here/results", "sweep")  # pathlib's RuntimeError was a traceback


def test_the_largest_gamma_that_fits_the_window_runs(tmp_path, prompt_tokenizer):
    assert run_cli(main, ONE_RUN + ["--gamma", "983", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "sweep.csv").is_file()


TINY_MODELS = {"gamma_sweep": ["--tiny"], "decode_speed": ["--models", "tiny", "--draft", "tiny-draft",
                                                               "--no-transformers"],
               "parity_check": ["--tiny"], "drafting": ["--tiny"], "batch_speed": ["--tiny"]}


@pytest.mark.parametrize("module", TINY_MODELS)
@pytest.mark.parametrize("seed", [2**70, -(2**70)])
def test_a_seed_past_64_bits_is_one_line_naming_seed(module, seed, capsys, tmp_path):
    # torch refuses such seeds with "Overflow when unpacking long long", which names no option. Tiny models: were
    # the check lost, no run downloads or builds a real-size model.
    main_of = importlib.import_module(f"benchmarks.{module}").main
    assert run_cli(main_of, TINY_MODELS[module] + ["--seed", str(seed), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --seed must lie in -4611686018427387904..4611686018427387904") and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_with_stderr_closed_a_benchmark_keeps_its_errors_off_stdout():
    # Python gives a process started with stderr closed (2>&-) sys.stderr = None, and print(file=None) writes to
    # stdout, which carries the report.
    command = shlex.join([sys.executable, "-m", "benchmarks.gamma_sweep", "--tiny", "--prompts", "0"]) + " 2>&-"
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done.stdout


def test_with_stderr_open_for_reading_only_a_benchmark_still_says_what_was_wrong(tmp_path):
    # A shell wrapper of `python` (pyenv's) under 2>&- leaves fd 2 open on its script, for reading: the first
    # write to stderr failed, and a usage error became exit code 1 with no message.
    command = shlex.join([sys.executable, "-m", "benchmarks.gamma_sweep", "--tiny", "--prompts", "0"]) + " 2<&0"
    (tmp_path / "in").touch()
    with open(tmp_path / "in") as stdin:  # for reading only
        done = subprocess.run(["bash", "-c", command], stdin=stdin, stdout=subprocess.PIPE, text=True,
                              cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done.stdout


def test_a_result_file_that_cannot_be_written_is_one_line(capsys, tmp_path):
    (tmp_path / "decode_speed.md").mkdir()  # a folder where the report goes: an IsADirectoryError traceback
    args = ["--models", "tiny", "--draft", "tiny-draft", "--no-transformers", "--repeats", "1", "--warmup", "0",
            "--long", "0", "--ks", "2", "--prefix", "8", "--bandwidth-mib", "1", "--out", str(tmp_path)]
    assert run_cli(importlib.import_module("benchmarks.decode_speed").main, args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: [Errno 21] Is a directory") and "Traceback" not in "\n".join(err)


@pytest.mark.parametrize("module, option", [("gamma_sweep", "--simulate-acceptance"), ("decode_speed", "--busy"),
                                            ("parity_check", "--tie-tolerance")])
def test_runs_as_a_module_from_the_repository_root(module, option):
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--help"],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert option in done.stdout
