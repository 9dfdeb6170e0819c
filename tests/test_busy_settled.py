"""benchmarks/busy_settled.py on a tiny model with one busy core: both
settings are reported. It asserts no time."""

from __future__ import annotations

import pytest

from benchmarks.busy_settled import main
from benchmarks.common import run_cli

pytestmark = pytest.mark.usefixtures("single_thread")


def test_a_smoke_run_reports_both_settings(capsys):
    assert run_cli(main, ["--tiny", "--passes", "3", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "chooser: step" in out and "  fixed: step" in out and "r_5" in out


def test_bad_settings_are_one_line_and_exit_2(capsys):
    assert run_cli(main, ["--tiny", "--passes", "0"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
