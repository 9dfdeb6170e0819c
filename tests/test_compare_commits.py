"""benchmarks/compare_commits.py: two checkouts timed side by side. Here both
sides are this checkout, so the run checks the plumbing (workers start,
answer in turn, every decoding run reproduces plain greedy decoding) and the
report's lines; speed itself is never asserted."""

from __future__ import annotations

import re

import pytest

import benchmarks.common
from benchmarks import compare_commits
from benchmarks.common import run_cli
from benchmarks.compare_commits import main
from helpers import REPO_ROOT


def test_a_checkout_against_itself_reports_both_sides_and_the_ratios(capsys):
    args = [str(REPO_ROOT), str(REPO_ROOT), "--tiny", "--repeats", "1", "--new-tokens", "4", "--ks", "5", "9"]
    assert run_cli(main, args + ["--rows", "3", "--draft-int8", "--gamma", "3"]) == 0
    out = capsys.readouterr().out
    assert "distilgpt2 draft (int8)" in out
    for side in ("before", "after"):
        assert re.search(rf"{side}: step [\d.]+ ms, t_v\(5\) [\d.]+ ms, r_5 [\d.]+, t_v\(9\) [\d.]+ ms, r_9 [\d.]+, "
                         r"step of 3 rows [\d.]+x one row, t_d [\d.]+ ms, speedup at alpha 0.8, gamma 3", out)
    labels = ("step", "t_v(5)", "t_v(9)", "step of 3 rows", "draft step t_d", "plain decoding", "speculative decoding")
    for label in labels:
        assert re.search(rf"after / before, {re.escape(label)} time: [\d.]+", out)


def test_a_folder_that_is_not_a_checkout_is_one_line_and_exit_2(tmp_path, capsys):
    assert run_cli(main, [str(tmp_path), str(REPO_ROOT)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not a checkout" in err and len(err.strip().splitlines()) == 1
    for folder in ("", str(tmp_path / ("x" * 300))):  # Popen(cwd=''), and an OSError traceback
        assert run_cli(main, [folder, str(REPO_ROOT)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {folder!r} is not a checkout") and len(err.strip().splitlines()) == 1
    assert run_cli(main, [str(REPO_ROOT), str(REPO_ROOT), "--ks", "0"]) == 2
    assert "--ks must be >= 1" in capsys.readouterr().err
    assert run_cli(main, [str(REPO_ROOT), str(REPO_ROOT), "--gamma", "0"]) == 2
    assert "--gamma and --ks must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("bad, message", [(["--ks", "2000"], "--ks must lie in 1..924"),  # 100 tokens cached
                                          (["--rows", "100000"], "--rows must lie in 1..32"),
                                          (["--new-tokens", "5000"], "--new-tokens must lie in 1..1004"),
                                          (["--gamma", "2000"], "--gamma must lie in 1..1023")])
def test_settings_past_the_window_are_one_line_before_any_worker_starts(bad, message, capfd):
    assert run_cli(main, [str(REPO_ROOT), str(REPO_ROOT), "--tiny", "--repeats", "1", *bad]) == 2
    err = capfd.readouterr().err  # capfd: a worker's output would be here too
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def test_a_failing_worker_is_one_line_and_exit_2(tmp_path, capfd):
    (tmp_path / "gpt2").mkdir()  # a checkout whose gpt2 package has no GPT2: its worker fails on import
    (tmp_path / "gpt2" / "__init__.py").touch()
    (tmp_path / "gpt2" / "model.py").touch()
    assert run_cli(main, [str(tmp_path), str(REPO_ROOT), "--tiny", "--repeats", "1", "--new-tokens", "4"]) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"error: the worker in {tmp_path} failed: ImportError: cannot import name 'GPT2'")
    assert len(err.strip().splitlines()) == 1


def test_batched_steps_whose_caches_would_not_fit_in_memory_are_refused(capfd, monkeypatch):
    # gpt2-large: 32 rows of its whole window, 11.2 GiB a worker, two workers.
    monkeypatch.setattr(benchmarks.common, "machine_memory", lambda: 24 * 2**30)  # this project's machine
    assert run_cli(main, [str(REPO_ROOT), str(REPO_ROOT), "--repeats", "1", "--rows", "32"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("error: the two workers' batched steps would hold 22.5 GiB") and "fewer --rows" in err


def test_the_sides_take_turns_and_the_report_pairs_them_within_a_repeat(monkeypatch, capsys):
    # Workers scripted: each side's costs, the same every repeat, and its plain decoding's seconds per repeat:
    # after / before 2.0, 0.5, 0.75 (median 0.75), where the ratio of the medians would be 2.0 / 2.0.
    answers = {"before": {"step": 0.25, "k=5": 0.375, "rows": 0.5, "draft": 0.125, "speculative": 1.0},
               "after": {"step": 0.2, "k=5": 0.25, "rows": 0.5, "draft": 0.0625, "speculative": 0.5}}
    plain = {"before": [1.0, 2.0, 4.0], "after": [2.0, 1.0, 3.0]}
    asked = []  # (side, command) in the order asked

    class ScriptedWorker:
        def __init__(self, folder, argv):
            self.side = "after" if any(w == "before" for w, _ in asked) else "before"
            asked.append((self.side, "start"))

        def ask(self, command):
            asked.append((self.side, command))
            if command == "runs":
                repeat = asked.count((self.side, "runs")) - 1
                return {"plain": plain[self.side][repeat], "speculative": answers[self.side]["speculative"]}
            return {key: answers[self.side][key] for key in ("step", "k=5", "rows", "draft")}

        def close(self):
            pass

    monkeypatch.setattr(compare_commits, "Worker", ScriptedWorker)
    assert run_cli(main, [str(REPO_ROOT), str(REPO_ROOT), "--tiny", "--repeats", "3"]) == 0
    runs = [side for side, command in asked if command == "runs"]
    assert runs == ["before", "after", "after", "before", "before", "after"]  # who goes first alternates
    out = capsys.readouterr().out
    assert ("before: step 250.0 ms, t_v(5) 375.0 ms, r_5 1.500, step of 8 rows 2.000x one row, t_d 125.00 ms, "
            "speedup at alpha 0.8, gamma 4: 2.00x") in out  # the median of 1, 2, 4
    assert ("after: step 200.0 ms, t_v(5) 250.0 ms, r_5 1.250, step of 8 rows 2.500x one row, t_d 62.50 ms, "
            "speedup at alpha 0.8, gamma 4: 4.00x") in out  # of 4, 2, 6
    ratios = {"step": 0.8, "t_v(5)": 0.667, "step of 8 rows": 1.0, "draft step t_d": 0.5, "plain decoding": 0.75,
              "speculative decoding": 0.5}
    for label, ratio in ratios.items():
        assert f"after / before, {label} time: {ratio:.3f}" in out
