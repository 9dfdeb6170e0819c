"""benchmarks/drafting.py on tiny models: a short run of the simulated part
writes its table (auto, the best fixed gamma, the heuristic; float32 and int8
drafts) and its JSON, every run checked against plain greedy decoding inside
the benchmark; bad settings are one line and exit 2. Speed is never asserted."""

from __future__ import annotations

import json

import pytest

from benchmarks.common import run_cli
from benchmarks.drafting import main

pytestmark = pytest.mark.usefixtures("single_thread")


def test_a_short_simulated_run_writes_the_table_and_the_json(tmp_path):
    out = tmp_path / "drafting"
    args = ["--tiny", "--parts", "simulated", "--alphas", "0.8", "--gammas", "2", "3", "--repeats", "2",
            "--max-gen", "8", "--out", str(out)]
    assert run_cli(main, args) == 0
    report = (out / "drafting.md").read_text(encoding="utf-8")
    assert "## auto against fixed γ and +2/-1 (simulated α)" in report
    assert "| float32 | 0.8 |" in report and "| int8 | 0.8 |" in report
    runs = json.loads((out / "drafting.json").read_text(encoding="utf-8"))["simulated"]["float32 alpha 0.8"]["runs"]
    assert set(runs) == {"fixed 2", "fixed 3", "auto", "heuristic", "plain"}
    assert all(len(runs[name]["ratios"]) == 2 for name in ("fixed 2", "fixed 3", "auto", "heuristic"))


@pytest.mark.parametrize("bad", [["--repeats", "0"], ["--gammas", "0"], ["--alphas", "1.5"], ["--ngram", "0"],
                                 ["--p-mins", "-0.1"]])
def test_bad_settings_are_one_line_and_exit_2(bad, capsys):
    assert run_cli(main, ["--tiny", *bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
