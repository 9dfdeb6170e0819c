"""benchmarks/busy_settled.py on a tiny model with one busy core: both
settings are reported. It asserts no time."""

from __future__ import annotations

import os

import pytest

from benchmarks.busy_settled import main
from benchmarks.common import run_cli

pytestmark = pytest.mark.usefixtures("single_thread")


def test_a_smoke_run_reports_both_settings(capsys):
    assert run_cli(main, ["--tiny", "--passes", "3", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "chooser: step" in out and "  fixed: step" in out and "r_5" in out


@pytest.mark.parametrize("bad, message", [(["--passes", "0"], "--passes and --repeats must be >= 1"),
                                          (["--busy", str(os.cpu_count() + 1)], "--busy must lie in 0.."),
                                          (["--busy", "-1"], "--busy must lie in 0..")])
def test_bad_settings_are_one_line_and_exit_2(bad, message, capsys):
    assert run_cli(main, ["--tiny", "--passes", "2", "--repeats", "1", *bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
