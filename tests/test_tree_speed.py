"""benchmarks/tree_speed.py on tiny shapes: a short run writes its report
(costs, every config's prediction, the measured ones, the noisy pair), the
predictions follow the profile model exactly, and bad options are one line
with exit 2. Speed itself is never asserted here."""

from __future__ import annotations

import argparse
import json
import shlex

import pytest
import torch

from benchmarks import common, tree_speed
from benchmarks.common import random_model, run_cli, shape
from benchmarks.tree_speed import ceiling, interpolate, main, predict_chain, predict_tree
from spec_decoding import expected_tokens_per_step, speculative_generate

pytestmark = pytest.mark.usefixtures("single_thread")

COSTS = {"r": {1: 1.0, 2: 1.1, 4: 1.5}, "r_tree": {1: 1.0, 2: 1.1, 4: 1.5, 8: 2.5}, "c": {1: 0.2, 2: 0.25}}


def test_a_short_run_writes_the_report(tmp_path):
    out = tmp_path / "ts"
    args = ["--tiny", "--repeats", "1", "--new-tokens", "8", "--prefix", "4", "--measure", "1", "--max-gamma", "2",
            "--noisy-prompts", "1", "--trees", "2", "2,1", "nodes 3 depth 2", "--draft-quantize", "int8",
            "--out", str(out)]
    assert run_cli(main, args) == 0
    report = (out / "tree_speed.md").read_text(encoding="utf-8")
    for heading in ("## Costs relative to one target step", "## Profile strong", "## Profile weak",
                    "## A real acceptance process: the noisy pair"):
        assert heading in report
    result = json.loads((out / "tree_speed.json").read_text(encoding="utf-8"))
    strong, weak = result["profiles"]["strong"], result["profiles"]["weak"]
    configs = {"chain gamma 1", "chain gamma 2", "tree 2", "tree 2,1", "tree nodes 3 depth 2"}
    assert set(weak) == configs
    # The first profile also runs its best predicted chain through the tree loop.
    (as_tree,) = set(strong) - configs
    assert as_tree.endswith("(the chain)")
    for profile, extra in ((weak, set()), (strong, {as_tree})):
        measured = {name for name, c in profile.items() if "speedup" in c}
        assert len(measured) == 2 + len(extra) and extra <= measured  # the best chain and the best tree
        for name in measured:
            assert len(profile[name]["speedups"]) == 1 and profile[name]["tokens_per_call"] >= 1.0
    assert result["best"]["weak"]["tree"].startswith("tree") and result["best"]["weak"]["chain"].startswith("chain")
    assert set(result["ceilings"]["weak"]) == {"measured costs", "verification free (r_k = 1)",
                                                "draft passes 2.5x cheaper", "both"}
    assert "What the costs of width allow (predicted):" in report and "draft tiny-draft (int8 weights)" in report
    # The header says the draft is int8 and how to run it again; the float32 target's path is the forward pass.
    assert result["environment"]["quantize"] == "draft int8" and "draft int8 weights (gpt2/fast/quantize.py)" in report
    assert f"- command: `python -m benchmarks.tree_speed {shlex.join(args)}`" in report
    assert set(result["noisy"]["greedy"]) == {"chain gamma 1", "chain gamma 2", "tree 2", "tree 2,1",
                                              "tree nodes 3 depth 2"}
    for label, results in result["noisy"].items():  # the best tree over the best chain, as the report says it
        best = {kind: max((r["predicted_at_large_costs"] for n, r in results.items() if n.startswith(kind)))
                for kind in ("chain", "tree")}
        assert f"the tree is {best['tree'] / best['chain']:.2f}x the chain" in report


def test_each_cost_is_a_ratio_to_the_target_step_timed_beside_it_and_warm_up_is_left_out(monkeypatch):
    target, draft = random_model(shape("tiny")), random_model(shape("tiny-draft"))
    passes = []  # (model, tokens, tree mask or not) of each forward pass
    for name, model in (("target", target), ("draft", draft)):
        model.register_forward_pre_hook(
            lambda m, args, kwargs, name=name: passes.append((name, args[0].size(1), kwargs.get("mask") is not None)),
            with_kwargs=True)
    base = {("target", 1, False): 2.0, ("target", 3, False): 2.5, ("target", 3, True): 3.0,
            ("draft", 1, True): 0.4, ("draft", 2, True): 0.5}  # seconds of each pass at speed 1
    # Each round times 4 (step, pass) pairs; a pair shares a speed, the speed changes from pair to pair.
    speeds = iter(v for v in [1.0] * 4 + list(range(2, 14)) for _ in range(2))

    def fake_timed(fn):
        fn()
        return base[passes[-1]] * next(speeds)

    monkeypatch.setattr(tree_speed, "timed", fake_timed)
    prompt = torch.zeros(1, 4, dtype=torch.long)
    with torch.inference_mode():  # as main runs it
        costs = tree_speed.measure_costs(target, draft, prompt, [1, 3], [1, 2], repeats=3)
    assert costs["r"] == {1: 1.0, 3: 1.25} and costs["r_tree"] == {1: 1.0, 3: 1.5}
    assert costs["c"] == {1: pytest.approx(0.2), 2: 0.25}
    assert costs["t_t_s"] == 2.0 * 7.5  # the median step of the 3 rounds after the warm-up round (speed 1)


def test_predictions_follow_the_profile_model():
    # A chain: Leviathan et al.'s E at alpha = a_1, gamma draft passes and a (gamma + 1)-token verification.
    chain = predict_chain(3, 0.6, COSTS)
    assert chain["E"] == pytest.approx(expected_tokens_per_step(0.6, 3))
    assert chain["cost"] == pytest.approx(3 * 0.2 + 1.5)
    assert chain["predicted"] == pytest.approx(chain["E"] / chain["cost"])
    # Tree 2,1 at a = (0.5, 0.3): depth 1 accepts rank 0 or 1 (0.8); below each, rank 0 (0.5 of that).
    levels = [[(0, 0), (0, 1)], [(0, 0), (1, 0)]]
    tree = predict_tree(levels, (0.5, 0.3), COSTS)
    assert tree["E"] == pytest.approx(1 + 0.5 + 0.3 + 0.5 * 0.5 + 0.3 * 0.5)
    # The draft's first pass, one pass over the 2 depth-1 nodes, and a 5-token tree verification.
    assert tree["cost"] == pytest.approx(0.2 + 0.25 + interpolate(COSTS["r_tree"], 5))
    assert tree["nodes"] == 4 and tree["levels"] == [2, 2]
    # A 3rd candidate past the profile's two is never the target's token: it adds a node, not an expected token.
    wider = predict_tree([[(0, 0), (0, 1), (0, 2)]], (0.5, 0.3), COSTS)
    assert wider["E"] == pytest.approx(1 + 0.5 + 0.3) and wider["nodes"] == 3


def test_ceilings_reprice_the_same_configs_with_width_made_cheap():
    """At the measured costs, the ceiling is the best predicted chain and tree;
    with verification free, a wide shallow tree overtakes (it gains
    acceptance at depth 1 and pays only its draft passes)."""
    levels = {("weak", "tree 3"): [[(0, 0), (0, 1), (0, 2)]],
              ("weak", "tree 2,1"): [[(0, 0), (0, 1)], [(0, 0), (1, 0)]],
              ("strong", "tree 3"): [[(0, 0), (0, 1), (0, 2)]]}
    c = ceiling(levels, "weak", range(1, 4), COSTS)
    weak = {name: lv for (profile, name), lv in levels.items() if profile == "weak"}
    at_measured = {name: predict_tree(lv, (0.5, 0.15, 0.07), COSTS)["predicted"] for name, lv in weak.items()}
    best = max(at_measured, key=at_measured.get)
    chains = {g: predict_chain(g, 0.5, COSTS)["predicted"] for g in range(1, 4)}
    assert c["measured costs"]["tree"] == best and c["measured costs"]["tree_predicted"] == at_measured[best]
    assert c["measured costs"]["chain"] == f"chain gamma {max(chains, key=chains.get)}"
    assert c["measured costs"]["tree_vs_chain"] == pytest.approx(at_measured[best] / max(chains.values()))
    free = c["verification free (r_k = 1)"]
    assert free["tree_predicted"] > c["measured costs"]["tree_predicted"]
    assert free["tree_vs_chain"] > c["measured costs"]["tree_vs_chain"]
    # Draft passes 2.5x cheaper, with and without verification free: the best of each kind at those costs.
    cheap = {**COSTS, "c": {n: v / 2.5 for n, v in COSTS["c"].items()}}
    for variant, costs in (("draft passes 2.5x cheaper", cheap),
                           ("both", {**cheap, "r": dict.fromkeys(COSTS["r"], 1.0),
                                     "r_tree": dict.fromkeys(COSTS["r_tree"], 1.0)})):
        chain = max(predict_chain(g, 0.5, costs)["predicted"] for g in range(1, 4))
        tree = max(predict_tree(lv, (0.5, 0.15, 0.07), costs)["predicted"] for lv in weak.values())
        assert c[variant]["chain_predicted"] == pytest.approx(chain)
        assert c[variant]["tree_predicted"] == pytest.approx(tree)


def test_interpolation_between_and_beyond_the_measured_points():
    table = {1: 1.0, 2: 1.2, 4: 1.6}
    assert interpolate(table, 2) == 1.2
    assert interpolate(table, 3) == pytest.approx(1.4)
    assert interpolate(table, 6) == pytest.approx(2.0)  # the last two points' slope


@pytest.mark.parametrize(
    "args, message",
    [(["--profiles", "medium"], "unknown profile 'medium'"), (["--repeats", "0"], "must be >= 1"),
     (["--trees", "0,2"], "integers >= 1"), (["--trees", "nodes 3 depth 5"], "give depth <= nodes"),
     # a verification pass after a 64-token prompt and 40 new tokens must fit the 1024-token window
     (["--trees", "1000,1000"], "--trees '1000,1000' verifies 1001001 tokens in one pass"),
     (["--max-gamma", "5000"], "--max-gamma 5000 verifies 5001 tokens in one pass"),
     (["--max-gamma", "920"], "give gammas of at most 919"),
     (["--prefix", "1000"], "give --prefix at most 992"),  # the cost passes go up to 32 tokens
     (["--out", ""], "--out is empty"),
     # all prompts were made up front, after the whole run: 10^20 of them ran out of memory
     (["--noisy-prompts", "100000000000000000000"], "--noisy-prompts must lie in 1..1000 (random prompts, made up "
                                                    "front)"),
     (["--trees", "nodes ² depth 1"], "a tree shape is children per depth"),  # int('²') named no option
     (["--out", "x" * 300], "cannot be used (File name too long): give a folder you can write to")],
)
def test_bad_options_are_one_line_and_exit_2(args, message, capsys, tmp_path):
    short = ["--repeats", "1", "--cost-repeats", "1", "--measure", "1", "--noisy-prompts", "1", "--trees", "2"]
    assert run_cli(main, ["--tiny", *short, "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def test_runs_whose_caches_would_not_fit_in_memory_together_are_refused(capsys, tmp_path, monkeypatch):
    # Tiny pair: 1.5 MiB of full-window caches a run; plain, 10 chains and 10 trees of 2 profiles, the chain as a
    # tree: 42 runs on a 64 MiB machine.
    monkeypatch.setattr(common, "machine_memory", lambda: 64 * 2**20)
    assert run_cli(main, ["--tiny", "--measure", "10", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the runs timed together in lockstep would hold ")
    assert err.endswith("give a smaller --measure or fewer --profiles") and not (tmp_path / "out").exists()


def test_each_config_is_compared_with_the_best_chain_within_each_repeat():
    # Speedups per repeat. The best chain has the highest median (1.6); the tree's ratios to it are 1.25, 0.5 and
    # 0.8, median 0.8, where the ratio of the two medians (1.5 / 1.6) would say 0.94.
    configs = {"gamma 2": {"kind": "chain", "speedup": 1.2, "speedups": [1.0, 1.2, 1.3]},
               "gamma 4": {"kind": "chain", "speedup": 1.6, "speedups": [1.2, 3.0, 1.6]},
               "2,2": {"kind": "tree", "speedup": 1.5, "speedups": [1.5, 1.5, 1.28]}}
    best = tree_speed.compare_best(configs)
    assert (best["chain"], best["tree"]) == ("gamma 4", "2,2")
    assert best["tree_vs_chain"] == configs["2,2"]["vs_best_chain"] == pytest.approx(0.8)
    assert configs["gamma 4"]["vs_best_chain"] == 1.0


def test_the_noisy_pairs_alpha_and_tokens_per_call_are_pooled_over_its_runs_and_priced_at_the_configs_cost(monkeypatch):
    runs = []

    def recorded(*args, **kwargs):
        out, stats = speculative_generate(*args, **kwargs)
        runs.append((kwargs["temperature"], stats))
        return out, stats

    monkeypatch.setattr(tree_speed, "speculative_generate", recorded)
    configs = {"gamma 4": {"kind": "chain", "gamma": 4, "cost": 2.0}}
    result = tree_speed.noisy_pair(configs, {}, argparse.Namespace(noisy_prompts=2, new_tokens=24))
    for temperature in (0.0, 1.0):
        mine = [s for t, s in runs if t == temperature]
        accepted, judged = sum(s.accepted for s in mine), sum(s.judged for s in mine)
        assert judged < sum(s.drafted for s in mine), "a pair whose drafts after a rejection go unjudged"
        assert result[(temperature, "gamma 4")]["alpha"] == accepted / judged
        # Tokens per call pooled too, and the speedup they predict at the config's cost (2 target steps a call).
        per_call = sum(s.new_tokens for s in mine) / sum(s.target_calls for s in mine)
        assert result[(temperature, "gamma 4")]["tokens_per_call"] == per_call
        assert result[(temperature, "gamma 4")]["predicted_at_large_costs"] == per_call / 2.0
