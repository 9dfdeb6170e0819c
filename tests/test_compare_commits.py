"""benchmarks/compare_commits.py: two checkouts timed side by side. Here both
sides are this checkout, so the run checks the plumbing (workers start,
answer in turn, every decoding run reproduces plain greedy decoding) and the
report's lines; speed itself is never asserted."""

from __future__ import annotations

import re

import pytest

import benchmarks.common
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
