"""benchmarks/batch_speed.py on tiny shapes: a short run writes its tables and
its JSON, with every ratio against B = 1 and the step costs against the
bandwidth bound. Speed itself is never asserted here."""

from __future__ import annotations

import argparse
import json
import os
import re

import pytest

import benchmarks.common
from benchmarks import batch_speed
from benchmarks.batch_speed import main, make_prompts
from benchmarks.common import build_pair, run_cli
from benchmarks.decode_speed import step_bytes, weight_bytes
from gpt2 import generate
from spec_decoding import SimulatedBatchDrafter, speculative_generate

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: a thread pool only adds waiting


@pytest.fixture(scope="module")
def pair():
    """The tiny target and draft (only read by the tests: each run makes its own caches)."""
    return build_pair("tiny", "tiny-draft", weights="tiny")


def test_a_short_run_writes_the_tables_and_the_json(tmp_path, fast_kernels):
    out = tmp_path / "bs"
    args = ["--tiny", "--repeats", "2", "--warmup", "0", "--batch-sizes", "1", "2", "--gammas", "1", "4",
            "--step-batches", "1", "3", "--new-tokens", "6", "--context", "8", "--bandwidth-mib", "16",
            "--out", str(out)]
    assert run_cli(main, args) == 0
    report = (out / "batch_speed.md").read_text(encoding="utf-8")
    for heading in ("## Tokens per second", "## Which gamma for which B", "## Step cost against B", "## Goals"):
        assert heading in report
    assert "- forward pass: fast path: C kernels" in report
    assert "The same 2 prompts (32 +- 12 tokens) at every B" in report  # lengths spread by SPREAD
    summary = json.loads((out / "batch_speed.json").read_text(encoding="utf-8"))["summary"]
    assert summary["throughput"]["1"]["plain_vs_plain_B1"] == 1.0
    assert set(summary["throughput"]["2"]["spec"]) == {"1", "4"}
    assert summary["steps"]["3"]["verify"]["4"]["rows"] == 15  # B (gamma + 1) rows
    assert summary["steps"]["1"]["step_vs_B1"] == 1.0


def test_prompts_differ_in_length():
    prompts = make_prompts(8, 32, 50257, seed=0)
    assert len({len(p) for p in prompts}) > 1 and all(20 <= len(p) <= 44 for p in prompts)


# A run of seconds: the base of the bad settings below, so that a missing check shows as a run, not a long one.
SHORT = ["--tiny", "--batch-sizes", "1", "--gammas", "1", "--step-batches", "1", "--new-tokens", "2",
         "--prompt-len", "14", "--context", "4", "--repeats", "1", "--bandwidth-mib", "1"]


def test_one_new_token_is_a_run_like_any_other(tmp_path, capsys):
    # The warm-up decoded 2 tokens against references of 1: "greedy speculative decoding must reproduce plain
    # decoding" failed before any timing.
    assert run_cli(main, [*SHORT, "--new-tokens", "1", "--out", str(tmp_path)]) == 0, capsys.readouterr().err
    assert (tmp_path / "batch_speed.json").is_file()


@pytest.mark.parametrize("bad, message", [
    (["--batch-sizes", "2", "4"], "must include 1"),
    (["--gammas", "0"], "--gammas must all be >= 1"),
    (["--alpha", "1.5"], r"--alpha must lie in \[0, 1\]"),
    (["--bandwidth-mib", "0"], r"--bandwidth-mib must lie in 1\.\.4096"),
    (["--bandwidth-mib", "-1"], r"--bandwidth-mib must lie in 1\.\.4096"),
    (["--context", "5000"], "give --context at most 1022"),  # + gamma 1 + 1 tokens in a 1024 window
    (["--step-batches", "1", "257"], r"--step-batches must lie in 1\.\.256"),
    (["--batch-sizes", "1", "257"], r"--batch-sizes must lie in 1\.\.256"),
    (["--prompt-len", "2000"], "give --prompt-len at most 1010"),  # + 12 + 2 new tokens in a 1024 window
    (["--threads", str(os.cpu_count() + 1)], r"--threads must lie in 1\.\."),
    (["--out", ""], "--out is empty"),
    (["--prompts", "4097"], r"--prompts must lie in 1\.\.4096"),
    (["--batch-sizes", "1", "2", "--prompts", "1"], r"--prompts must lie in 2\.\.4096 \(enough for the largest of"),
    (["--new-tokens", "1000000000"], "give --new-tokens at most 998$"),  # + the prompt's 14 + 12 in 1024
    (["--gammas", "1000000000"], "give --gammas at most 1019$"),  # + --context 4 + 1 in 1024
    (["--context", "2000", "--gammas", "2000"], "give a smaller --context and --gammas$"),
    (["--context", "1023"], "give --context at most 1022$"),  # one position past the window
    (["--prompt-len", "1011"], "give --prompt-len at most 1010$"),
    (["--warmup", "-1"], "--warmup >= 0"),
    (["--repeats", "0"], "--repeats and --prompts must be >= 1"),
])
def test_bad_settings_are_one_line_and_exit_2(bad, message, capsys, tmp_path):
    assert run_cli(main, SHORT + ["--out", str(tmp_path / "out")] + bad) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert re.search(message, err)


def test_a_bad_results_folder_fails_before_any_model_is_built(monkeypatch, capsys, tmp_path):
    def no_models(*args, **kwargs):
        raise AssertionError("--out must be checked before the models are built")

    monkeypatch.setattr(batch_speed, "build_pair", no_models)
    (tmp_path / "afile").touch()
    assert run_cli(main, SHORT + ["--out", str(tmp_path / "afile" / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out ") and "cannot be created" in err and len(err.strip().splitlines()) == 1


def test_runs_whose_caches_would_not_fit_in_memory_together_are_refused(capsys, tmp_path):
    # gpt2-large and gpt2: 442 KB of keys and values a row and position; 385 rows x 5 runs x ~1,020 positions
    # would be ~870 GB at once in lockstep. Refused before any model is built.
    args = ["--batch-sizes", "1", "128", "256", "--prompts", "256", "--gammas", "1", "2", "3", "4",
            "--new-tokens", "900", "--prompt-len", "100", "--out", str(tmp_path / "out")]
    assert run_cli(main, args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the runs timed together in lockstep would hold 8") and "fewer --gammas" in err
    assert "\n" not in err and not (tmp_path / "out").exists()


def test_a_step_cost_whose_cache_would_not_fit_in_memory_is_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(benchmarks.common, "machine_memory", lambda: 24 * 2**30)  # this project's machine
    # gpt2-large: 256 rows x ~1,000 positions x 360 KB = ~88 GiB in one pass (it raised from the allocator).
    args = ["--batch-sizes", "1", "--gammas", "1", "--step-batches", "1", "256", "--context", "1000",
            "--out", str(tmp_path / "out")]
    assert run_cli(main, args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: a step cost's pass would hold 88") and "a shorter --context" in err
    assert "\n" not in err and not (tmp_path / "out").exists()


def test_the_best_gamma_is_the_one_whose_shown_ratio_is_highest(pair):
    # Chosen by the median of tokens/s, gamma 2 (9.5 > 9 tok/s) was named best beside its own 0.95x against
    # gamma 1's 1.8x: the medians of the ratios within each repeat, which the report shows, decide.
    args = argparse.Namespace(new_tokens=10, prompts=1, batch_sizes=[1], gammas=[1, 2], step_batches=[1], alpha=0.8,
                              context=4)
    plain_seconds, spec = [1.0, 2.0, 4.0], {1: [9.0, 9.0, 9.0], 2: [9.5, 1.0, 20.0]}  # tok/s per repeat
    repeats = [{"plain B=1": plain_seconds[i], "t_step B=1": 0.01, "t_d B=1": 0.001, "bandwidth B=1": 1e10,
                "flops B=1": 1e10, "t_v B=1 gamma=1": 0.011, "t_v B=1 gamma=2": 0.012,
                **{f"spec B=1 gamma={g}": (10 / spec[g][i], {"new_tokens": 10, "alpha": 0.5,
                                                             "tokens_per_target_call": 2.0}) for g in (1, 2)}}
               for i in range(3)]
    entry = batch_speed.summarise(repeats, args, pair)["throughput"][1]
    assert entry["spec"][2]["tokens_per_s"] > entry["spec"][1]["tokens_per_s"]
    assert entry["spec"][1]["vs_plain_same_B"] > entry["spec"][2]["vs_plain_same_B"] and entry["best_gamma"] == 1


def test_each_ratio_compares_within_a_repeat_with_the_batch_it_names(pair):
    # Tokens/s per repeat: plain B=1 10, 5, 2.5; plain B=2 20, 20, 10; speculative B=2 (gamma 1) 40, 25, 20.
    args = argparse.Namespace(new_tokens=10, prompts=1, batch_sizes=[1, 2], gammas=[1], step_batches=[1], alpha=0.8,
                              context=4)
    seconds = {"plain B=1": [1.0, 2.0, 4.0], "plain B=2": [0.5, 0.5, 1.0], "spec B=1 gamma=1": [0.5, 1.0, 1.0],
               "spec B=2 gamma=1": [0.25, 0.4, 0.5]}
    costs = {"t_step B=1": 0.01, "t_d B=1": 0.001, "bandwidth B=1": 1e10, "flops B=1": 1e10, "t_v B=1 gamma=1": 0.011}
    stats = {"new_tokens": 10, "alpha": 0.5, "tokens_per_target_call": 2.0}
    repeats = [{**costs, **{key: (s[i], stats) if key.startswith("spec") else s[i] for key, s in seconds.items()}}
               for i in range(3)]
    entry = batch_speed.summarise(repeats, args, pair)["throughput"][2]
    assert entry["plain_vs_plain_B1"] == 4.0  # the median of 2, 4, 4
    assert entry["spec"][1]["vs_plain_same_B"] == 2.0  # of 2, 1.25, 2: against plain decoding of 2 rows
    assert entry["spec"][1]["vs_plain_B1"] == 5.0  # of 4, 5, 8: against plain decoding one prompt at a time


def test_settings_that_just_fit_the_context_window_are_taken():
    # --context 1022 + a pass of gamma 1 + 1 tokens fills the 1024 positions; so do a 1010-token prompt, 12 more
    # for the longest and 2 new tokens.
    args = batch_speed.parse_args(SHORT + ["--context", "1022", "--prompt-len", "1010"])
    assert (args.context, args.prompt_len) == (1022, 1010)


def test_which_to_shrink_lowers_the_first_option_while_it_can_stay_at_least_1():
    assert batch_speed.which_to_shrink(5, ("--a", 3), ("--b", 4)) == "give --a at most 1"
    assert batch_speed.which_to_shrink(5, ("--a", 3), ("--b", 5)) == "give --b at most 2"
    assert batch_speed.which_to_shrink(5, ("--a", 5), ("--b", 5)) == "give a smaller --a and --b"


def test_a_speculative_run_sums_the_counters_of_its_batches(pair):
    # 3 prompts 2 at a time: the sums of the batches of 2 and 1 run here, the second meeting the coins of rows 2..
    # Row i meets the same coins whatever B, so one batch of 3 accepts alike, in fewer target calls.
    prompts = make_prompts(3, 6, pair.target.config.vocab_size, seed=0)
    references = generate(pair.target, prompts, 5)
    paused = []
    totals = batch_speed.spec_run(pair.target, pair.draft, prompts, references, 2, 5, 2, 0.5, seed=3)(paused.append)

    def stats_of(first: int, last: int):
        drafter = SimulatedBatchDrafter(pair.draft, references[first:last], 0.5, seed=3, first_row=first)
        rows, stats = speculative_generate(pair.target, drafter, prompts[first:last], gamma=2, max_new_tokens=5)
        assert rows == references[first:last]
        return stats

    batches, whole = [stats_of(0, 2), stats_of(2, 3)], stats_of(0, 3)
    for key in ("new_tokens", "accepted", "judged", "target_calls"):
        assert totals[key] == sum(getattr(stats, key) for stats in batches), key
    assert (totals["new_tokens"], totals["accepted"], totals["judged"]) == (15, whole.accepted, whole.judged)
    assert 0 < whole.accepted < whole.judged and whole.target_calls < totals["target_calls"]
    assert totals["alpha"] == totals["accepted"] / totals["judged"]
    assert totals["tokens_per_target_call"] == 15 / totals["target_calls"]
    assert paused == sorted(paused) and paused[-1] == 15  # the tokens so far, after each row's step


def test_the_arithmetic_rate_counts_the_product_it_times(monkeypatch):
    operands, seconds = [], iter([0.5, 0.25, 1.0, 0.5, 0.5])

    def fake_timed(fn, a, b):
        operands.append((a.shape, b.shape))
        return next(seconds)

    monkeypatch.setattr(batch_speed, "timed", fake_timed)
    rate = batch_speed.arithmetic_rate()
    (m, k), (k_b, n) = operands[0]
    assert k == k_b and len(operands) == 5
    assert rate == 2 * m * k * n / 0.25  # 2 flops a multiply-add, over the fastest of the 5 calls


def test_a_step_of_b_rows_reads_the_weights_once_and_every_rows_cache(pair):
    model, context = pair.target, 10
    one = step_bytes(model, context, False)
    assert one == step_bytes(model, context, False, rows=1)
    assert step_bytes(model, context, False, rows=4) - one == 3 * (one - weight_bytes(model, False))


def test_a_step_costs_rates_are_the_means_of_the_samples_around_it(monkeypatch, pair):
    rates, bandwidths = iter([1.0, 3.0, 10.0, 30.0]), iter([100.0, 300.0, 1000.0, 3000.0])
    monkeypatch.setattr(batch_speed, "arithmetic_rate", lambda: next(rates))
    probe = argparse.Namespace(sample=lambda: next(bandwidths))
    args = argparse.Namespace(batch_sizes=[1], gammas=[1], step_batches=[1, 2], new_tokens=2, alpha=0.5,
                              context=4, seed=0)
    prompts = make_prompts(2, 6, pair.target.config.vocab_size, seed=0)
    got = batch_speed.one_repeat(pair, args, prompts, generate(pair.target, prompts, 2), False, probe, seed=0)
    assert (got["flops B=1"], got["flops B=2"]) == (2.0, 20.0)
    assert (got["bandwidth B=1"], got["bandwidth B=2"]) == (200.0, 2000.0)


def hand_made_repeat(plain: dict, spec: dict, costs: dict) -> dict:
    """One repeat's samples from seconds of plain runs and of gamma 1 runs ({B: seconds}, 10 new tokens a
    prompt, one prompt) and step costs ({B: (t_step, t_d, t_v of gamma 1)}); bandwidth and rate 1e6 a second."""
    repeat = {f"plain B={B}": s for B, s in plain.items()}
    repeat |= {f"spec B={B} gamma=1": (s, {"new_tokens": 10, "alpha": 0.5, "tokens_per_target_call": 2.0})
               for B, s in spec.items()}
    for B, (t_step, t_d, t_v) in costs.items():
        repeat |= {f"t_step B={B}": t_step, f"t_d B={B}": t_d, f"t_v B={B} gamma=1": t_v,
                   f"bandwidth B={B}": 1e6, f"flops B={B}": 1e6}
    return repeat


def test_speculation_stops_paying_at_the_first_b_where_it_is_no_faster(pair):
    # B = 2 runs exactly as fast as plain decoding (1.0x), and its costs predict exactly 1.0x: with alpha 0 a step
    # yields 1 token, 0.75 s of t_step against 0.25 s of drafting and 0.5 s of verifying.
    args = argparse.Namespace(new_tokens=10, prompts=1, batch_sizes=[1, 2], gammas=[1], step_batches=[1, 2],
                              alpha=0.0, context=4, prompt_len=8)
    repeat = hand_made_repeat({1: 1.0, 2: 0.5}, {1: 0.5, 2: 0.5}, {1: (0.5, 0.125, 0.125), 2: (0.75, 0.25, 0.5)})
    summary = batch_speed.summarise([repeat], args, pair)
    assert summary["steps"][2]["verify"][1]["predicted_speedup"] == 1.0
    assert summary["speculation_stops_paying_at_B"] == {"measured": 2, "predicted": 2}
    report = "\n".join(batch_speed.report_lines(summary, args))
    assert "measured at B = 2; predicted from the step costs at B = 2" in report
    # the step table in ms: t_step, its ratio to one row's, the bandwidth bound; t_d, the rows of a pass, t_v
    bound = step_bytes(pair.target, 4, False, rows=2) / 1e6
    assert summary["steps"][2]["bound_s"] == bound and bound > 1  # seconds: a mistake in ms shows in its digits
    assert f"| 2 | 750.0 | 1.50x | {1e3 * bound:.1f} |" in report and "| 250.0 | 4 | 500.0 |" in report

    faster = hand_made_repeat({1: 1.0, 2: 0.5}, {1: 0.5, 2: 0.25}, {1: (0.5, 0.125, 0.125), 2: (0.5, 0.125, 0.125)})
    summary = batch_speed.summarise([faster], args, pair)
    assert summary["speculation_stops_paying_at_B"] == {"measured": None, "predicted": None}
    report = "\n".join(batch_speed.report_lines(summary, args))
    assert "measured at B = none of [1, 2]; predicted from the step costs at B = none of [1, 2]" in report
