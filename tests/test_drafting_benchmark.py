"""benchmarks/drafting.py on tiny models: a short run of the simulated part
writes its table (auto, the best fixed gamma, the heuristic; float32 and int8
drafts) and its JSON, every run checked against plain greedy decoding inside
the benchmark; bad settings are one line and exit 2. Speed is never asserted."""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex

import pytest
import torch

from benchmarks import common, drafting
from benchmarks.common import build_pair, run_cli
from benchmarks.drafting import count_runs, expected_speedups, held_out_best, main, mean_speedups, modelled_seconds
from benchmarks.drafting import same_run_ratios
from spec_decoding import AutoGamma, FixedGamma, ModelDrafter, StepCosts

pytestmark = pytest.mark.usefixtures("single_thread")


def test_a_short_simulated_run_writes_the_table_and_the_json(tmp_path, prompt_tokenizer, monkeypatch):
    built = []  # (seed, quantize) of each random model: the int8 draft must be the float32 draft's weights

    def recorded(config, **kwargs):
        built.append((config, kwargs["seed"], kwargs.get("quantize")))
        return common.random_model(config, **kwargs)

    monkeypatch.setattr(drafting, "random_model", recorded)
    out = tmp_path / "drafting"
    args = ["--tiny", "--parts", "simulated", "--alphas", "0.85", "--gammas", "2", "3", "--repeats", "2",
            "--max-gen", "8", "--model-seeds", "20", "--out", str(out)]
    assert run_cli(main, args) == 0
    draft = common.shape("tiny-draft")
    assert [(seed, q) for config, seed, q in built if config == draft] == [(1, None), (1, "int8")]
    saved = json.loads((out / "drafting.json").read_text(encoding="utf-8"))
    assert saved["command"] == "python -m benchmarks.drafting " + shlex.join(args)  # the arguments given, not sys.argv
    c32, c8 = saved["costs"]["float32"], saved["costs"]["int8"]
    report = (out / "drafting.md").read_text(encoding="utf-8")
    assert (f"t_d float32 {c32['t_draft'] * 1e3:.2f} ms, int8 {c8['t_draft'] * 1e3:.2f} ms; t_v(1) "
            f"{c32['t_verify'][0] * 1e3:.1f} ms, t_v(5) {c32['t_verify'][4] * 1e3:.1f} ms") in report
    assert "## Prompt lookup" not in report  # a part not asked for
    assert "## auto against fixed γ and +2/-1 (simulated α)" in report
    assert "| float32 | 0.85 |" in report and "| int8 | 0.8 |" in report  # α as given, not rounded to 0.8
    runs = json.loads((out / "drafting.json").read_text(encoding="utf-8"))["simulated"]["float32 alpha 0.85"]["runs"]
    assert set(runs) == {"fixed 2", "fixed 3", "auto", "heuristic", "plain"}
    assert all(len(runs[name]["ratios"]) == 2 for name in ("fixed 2", "fixed 3", "auto", "heuristic"))
    assert all(len(runs[name]["modelled"]) == 2 for name in ("fixed 2", "fixed 3", "auto", "heuristic"))
    # α and the K asked count both repeats, not only the last run's counters.
    last = runs["fixed 2"]["stats"]
    assert runs["fixed 2"]["judged"] > sum(last["reached_at"]) and sum(runs["fixed 2"]["gamma_hist"]) > sum(
        last["gamma_hist"])
    assert runs["fixed 2"]["alpha"] == runs["fixed 2"]["accepted"] / runs["fixed 2"]["judged"]
    assert "### The same in expectation (20 coin strings, cost model)" in report
    expected = json.loads((out / "drafting.json").read_text(encoding="utf-8"))["expected"]["int8 alpha 0.8"]
    same_run = expected.pop("same run: auto / best")
    assert set(expected) == {"fixed 2", "fixed 3", "auto", "heuristic"} and all(v > 0 for v in expected.values())
    assert len(same_run) == 10 and same_run == sorted(same_run)  # 20 coin strings in groups of --repeats 2


# t_d 0.2 s, t_v(k) = 1 + 0.04 (k - 1) s
COSTS = StepCosts(t_draft=0.2, t_verify=tuple(1.0 + 0.04 * (k - 1) for k in range(1, 14)))


def test_the_cost_model_prices_the_loops_steps():
    # alpha 1: every draft accepted; 10 tokens with gamma 4 take two steps of 4 drafts + 1 target token.
    assert modelled_seconds(FixedGamma(4), 1.0, 10, COSTS, random.Random(0)) == pytest.approx(2 * (4 * 0.2 + 1.16))
    # alpha 0: one token per step; K shrinks to the tokens left - 1 at the end (9 left: 4, ..., 2 left: 1, last: 0).
    ks = [4, 4, 4, 4, 4, 4, 3, 2, 1, 0]
    assert modelled_seconds(FixedGamma(4), 0.0, 10, COSTS, random.Random(0)) == pytest.approx(
        sum(K * 0.2 + 1.0 + 0.04 * K for K in ks))


def test_a_mean_speedup_is_plain_decodings_modelled_seconds_over_the_methods_mean():
    # plain decoding: max_gen steps of t_v(1) = 1.0 s (not t_v(2) = 1.04 s)
    assert mean_speedups({"fixed 1": [2.0, 4.0], "auto": [5.0]}, COSTS, 10) == {"fixed 1": 10 / 3, "auto": 2.0}


def test_the_expected_table_shows_how_often_a_run_like_this_one_puts_auto_below_095(monkeypatch):
    # auto / best in four groups of coin strings: median 0.975, 10th percentile 0.9, below 0.95 in one of four
    # (0.95 itself is not below).
    monkeypatch.setattr(drafting, "same_run_ratios", lambda runs, repeats: [0.9, 0.95, 1.0, 1.1])
    args = argparse.Namespace(alphas=[0.5], int8_alphas=[], max_gen=8, gammas=[1, 2], model_seeds=4, repeats=2)
    table, _ = drafting.expected_table(args, {"float32": COSTS})
    assert table.splitlines()[-1].endswith("| 0.975 [0.900]; 25% |")


def test_the_simulated_table_divides_each_speedup_by_the_best_fixed_gammas():
    def run(speedup, modelled, ratios=(1.0, 1.0)):
        return {"speedup": speedup, "modelled": modelled, "ratios": list(ratios), "alpha": 0.75, "judged": 4,
                "gamma_hist": [0, 3, 2]}

    runs = {"plain": {"seconds": [2.0, 4.0]}, "fixed 1": run(1.5, [1.2, 1.4], (1.4, 1.6)),
            "fixed 2": run(1.2, [1.6, 1.6], (1.2, 1.2)), "auto": run(1.8, [2.0, 2.0]),
            "heuristic": run(1.0, [0.8, 0.8])}
    row = drafting.simulated_table({"case": {"draft": "float32", "alpha": 0.8, "runs": runs}}).splitlines()[-1]
    # plain s 3.00; auto 1.80x, K asked 1:3 2:2; best fixed γ 1 at 1.50x, auto / best 1.2, auto / best held out
    # (fixed 1 in each repeat: 1.4, 1.6) 1.8 / 1.5; cost model: best fixed γ 2 (1.6), auto 2.0 / 1.6, +2/-1 0.8 / 1.6
    assert row == ("| float32 | 0.8 | 3.00 | 1.80x | 1:3 2:2 | 0.75 | 1 | 1.50x | 1.200 | 1.200 | 1.00x | "
                   "1.250 (best 2) | 0.500 |")
    runs["auto"] |= {"alpha": 0.0, "judged": 0, "gamma_hist": [5, 0, 0]}  # plain steps only: α is undefined, not 0
    row = drafting.simulated_table({"case": {"draft": "float32", "alpha": 0.8, "runs": runs}}).splitlines()[-1]
    assert row.startswith("| float32 | 0.8 | 3.00 | 1.80x | 0:5 | - | 1 | 1.50x |"), row


def test_counted_runs_sum_every_prompt_and_seed():
    pair = build_pair("tiny", "tiny-draft", weights="tiny")
    prompts = [torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5, 6, 7]])]

    def counted(prompts, seeds):
        return count_runs(pair.target, lambda: ModelDrafter(pair.draft), prompts, 6, lambda: FixedGamma(3), 1.0,
                          seeds)

    total, alone = counted(prompts, [0, 1]), [counted([ids], [seed]) for ids in prompts for seed in (0, 1)]
    for key in ("drafted", "accepted", "target_calls", "new_tokens", "draft_calls", "judged"):
        assert total[key] == sum(run[key] for run in alone), key
    assert total["new_tokens"] == 2 * 2 * 6 and total["drafted"] > 0
    assert total["wasted"] == total["drafted"] - total["accepted"]
    assert total["alpha"] == total["accepted"] / total["judged"]
    assert total["tokens_per_target_call"] == 24 / total["target_calls"]


def test_a_run_like_this_one_compares_auto_with_the_best_of_the_fixed_medians():
    # Seconds on 4 coin strings, in groups of 2. Group 1: medians fixed 1 2.5, fixed 2 3.5, auto 3.0;
    # group 2: fixed 1 5.0, fixed 2 3.0, auto 4.0. Auto over the best: 2.5 / 3.0 and 3.0 / 4.0, sorted.
    runs = {"fixed 1": [2.0, 3.0, 5.0, 5.0], "fixed 2": [3.0, 4.0, 2.0, 4.0], "auto": [3.0, 3.0, 4.0, 4.0],
            "heuristic": [1.0, 1.0, 1.0, 1.0]}
    assert same_run_ratios(runs, 2) == pytest.approx([0.75, 2.5 / 3.0])
    assert same_run_ratios(runs, 3) == pytest.approx([1.0])  # medians 3, 3, 3; the 4th string makes no group
    assert same_run_ratios(runs, 5) == []


def test_the_best_fixed_gamma_held_out_is_chosen_on_the_other_repeats():
    runs = {"fixed 1": {"ratios": [1.0, 1.3, 1.0]}, "fixed 2": {"ratios": [1.1, 1.1, 1.1]},
            "auto": {"ratios": [9, 9, 9]}}
    # Repeat 0: the others favour fixed 1 (median 1.15 > 1.1), whose ratio there is 1.0; repeat 1: fixed 2
    # (1.0 < 1.1), 1.1; repeat 2: fixed 1, 1.0. The median, 1.0, is what picking gamma from a sweep gets;
    # fixed 1's lucky repeat does not enter it.
    assert held_out_best(runs) == 1.0
    assert held_out_best({"fixed 1": {"ratios": [1.2]}}) is None


class FrozenAuto(AutoGamma):
    """A broken auto that never learns: it stays at its prior."""

    def update(self, drafted, accepted):
        pass


def test_auto_is_near_the_best_fixed_gamma_in_expectation(monkeypatch):
    # 400 coin strings of 64 tokens per alpha: auto within 5% of the best
    # fixed gamma on average at each alpha, and ahead of the +2/-1 rule over
    # the alphas. An auto that does not learn fails at alpha 0.9 (checked
    # below), so the tolerance does not pass anything.
    alphas, gammas = [0.5, 0.7, 0.9], list(range(1, 9))
    auto, heuristic = [], []
    for alpha in alphas:
        speedups = expected_speedups(COSTS, alpha, 64, gammas, seeds=400)
        best = max(v for name, v in speedups.items() if name.startswith("fixed"))
        assert speedups["auto"] >= 0.95 * best, alpha
        auto.append(speedups["auto"] / best)
        heuristic.append(speedups["heuristic"] / best)
    assert sum(auto) > sum(heuristic)
    monkeypatch.setattr(drafting, "AutoGamma", FrozenAuto)
    frozen = expected_speedups(COSTS, 0.9, 64, gammas, seeds=400)
    assert frozen["auto"] < 0.95 * max(v for name, v in frozen.items() if name.startswith("fixed"))


BAD_SETTINGS = [  # (the settings, what the one line must say)
    (["--repeats", "0"], "--repeats must be >= 1"), (["--ngram", "0"], "--ngram must be >= 1"),
    (["--gammas", "0"], "--gammas must lie in 1..12"), (["--gammas", "2", "13"], "--gammas must lie in 1..12"),
    *(([option, value], "--alphas, --int8-alphas and --p-mins must lie in [0, 1]")
      for option, value in (("--alphas", "1.5"), ("--p-mins", "-0.1"), ("--int8-alphas", "-1"))),
    *((["--noise", value], "--noise must lie in 0..10.0") for value in ("nan", "inf", "-1", "1e308", "10.5")),
    (["--threads", str(os.cpu_count() + 1)], f"--threads must lie in 1..{os.cpu_count()}"),
    (["--out", ""], "--out is empty"),
    (["--parts", "simulated", "--alphas", "--int8-alphas"], "the simulated part needs an α"),
    (["--max-gen", "1000"], "--max-gen 1000 new tokens after the longest prompt"),
    (["--max-gen", "1000000000"], "give --max-gen at most 965"),
    (["--noisy-prompts", "7"], "--noisy-prompts must lie in 1..6"),
    (["--model-seeds", "1000000"], "--model-seeds must lie in 1..100000"),  # priced for hours after the timed runs
]


@pytest.mark.parametrize("bad, message", BAD_SETTINGS, ids=[" ".join(bad) for bad, _ in BAD_SETTINGS])
def test_bad_settings_are_one_line_and_exit_2(bad, message, capsys, tmp_path, prompt_tokenizer):
    short = ["--parts", "noisy", "--repeats", "1", "--max-gen", "4", "--noisy-prompts", "1", "--noisy-seeds", "1"]
    assert run_cli(main, ["--tiny", *short, "--out", str(tmp_path / "out"), *bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and message in err, err


def test_the_longest_max_gen_the_window_allows_is_emitted_whole(tmp_path, prompt_tokenizer):
    # The repetitive prompt is 59 tokens: 965 new ones fill the tiny models' window of 1024; one more is refused.
    window = ["--tiny", "--parts", "ngram", "--repeats", "1", "--out"]
    assert run_cli(main, [*window, str(tmp_path / "too-long"), "--max-gen", "966"]) == 2
    assert run_cli(main, [*window, str(tmp_path), "--max-gen", "965"]) == 0
    runs = json.loads((tmp_path / "drafting.json").read_text(encoding="utf-8"))["ngram"]["runs"]
    emitted = {name: run["stats"]["new_tokens"] for name, run in runs.items() if name != "plain"}
    assert len(emitted) == 4 and set(emitted.values()) == {965}, emitted


def test_methods_whose_caches_would_not_fit_in_memory_together_are_refused(capsys, tmp_path, monkeypatch):
    # Tiny pair: 1.5 MiB of full-window caches a method; plain, 12 fixed γ, auto and +2/-1 on a 32 MiB machine.
    monkeypatch.setattr(common, "machine_memory", lambda: 32 * 2**20)
    args = ["--tiny", "--parts", "simulated", "--gammas", *map(str, range(1, 13)), "--out", str(tmp_path / "out")]
    assert run_cli(main, args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the runs timed together in lockstep would hold ") and err.endswith("fewer --gammas")
    assert not (tmp_path / "out").exists()


def test_the_noisy_part_alone_carries_the_environment_header(tmp_path, prompt_tokenizer):
    # Its timed speedups came without a device, threads, commit or date when no other part ran.
    short = ["--parts", "noisy", "--repeats", "1", "--max-gen", "4", "--noisy-prompts", "1", "--noisy-seeds", "1",
             "--p-mins", "0", "--out", str(tmp_path)]
    assert run_cli(main, short) == 0
    environment = json.loads((tmp_path / "drafting.json").read_text(encoding="utf-8"))["environment"]
    assert environment["models"] == {"noisy pair": str(drafting.NOISY_CONFIG)} and environment["threads"] >= 1
    report = (tmp_path / "drafting.md").read_text(encoding="utf-8")
    assert "- device: cpu" in report
    t = json.loads((tmp_path / "drafting.json").read_text(encoding="utf-8"))["noisy"]["t_draft"]
    assert (f"t_d float32 {t['float32'] * 1e3:.3f} ms, int8 {t['int8'] * 1e3:.3f} ms, target step "
            f"{t['t_target'] * 1e3:.3f} ms") in report
