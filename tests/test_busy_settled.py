"""benchmarks/busy_settled.py on a tiny model with one busy core: both
settings are reported. It asserts no time."""

from __future__ import annotations

import os

import pytest

from benchmarks.busy_settled import main
from benchmarks.common import run_cli

pytestmark = pytest.mark.usefixtures("single_thread")


def test_a_smoke_run_reports_both_settings(fast_kernels, capsys):  # the chooser is the kernels'
    assert run_cli(main, ["--tiny", "--passes", "3", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "chooser: step" in out and "  fixed: step" in out and "r_5" in out and "on the fast path (gpt2/fast)" in out


def test_without_the_fast_path_it_refuses_to_time_two_identical_settings(monkeypatch, capsys):
    # GPT2_PLAIN_LINEAR forces the readable path: "chooser" and "fixed" would both time it, with no chooser at all.
    monkeypatch.setenv("GPT2_PLAIN_LINEAR", "1")
    assert run_cli(main, ["--tiny", "--passes", "2", "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: busy_settled times the fast path's thread chooser") and "GPT2_PLAIN_LINEAR" in err


@pytest.mark.parametrize("bad, message", [(["--passes", "0"], "--passes and --repeats must be >= 1"),
                                          (["--busy", str(os.cpu_count() + 1)], "--busy must lie in 0.."),
                                          (["--busy", "-1"], "--busy must lie in 0..")])
def test_bad_settings_are_one_line_and_exit_2(bad, message, capsys):
    assert run_cli(main, ["--tiny", "--passes", "2", "--repeats", "1", *bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
