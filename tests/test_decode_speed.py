"""benchmarks/decode_speed.py: a short run on the gpt2 shape writes its report
with the bandwidth bound taken from samples between the timed calls. Speed
itself is never asserted here."""

from __future__ import annotations

import json

import pytest

from benchmarks.common import run_cli
from benchmarks.decode_speed import main


def test_a_short_run_writes_the_report_and_the_bound(tmp_path, capsys):
    out = tmp_path / "ds"
    args = ["--models", "gpt2", "--repeats", "2", "--warmup", "0", "--ks", "2", "5", "--prefix", "8",
            "--long", "4", "--no-transformers", "--plain-linear", "--bandwidth-mib", "16", "--out", str(out)]
    assert run_cli(main, args) == 0
    report = (out / "decode_speed.md").read_text(encoding="utf-8")
    assert "| gpt2 | ours |" in report and "| gpt2 | ours, F.linear |" in report
    assert "r_5" in report and "step @12 (ms)" in report
    result = json.loads((out / "decode_speed.json").read_text(encoding="utf-8"))["results"][0]
    # One bandwidth sample before each implementation's turn in each timed repeat,
    # for the short context and the long one: 2 implementations x 2 repeats x 2.
    assert len(result["read_bandwidth_samples_bytes_per_s"]) == 8
    assert result["bound_s"] == pytest.approx(result["weight_bytes"] / result["read_bandwidth_bytes_per_s"])
    for entry in result["implementations"].values():
        assert entry["fraction_of_bound"] == pytest.approx(result["bound_s"] / entry["step_s"])
        assert set(entry["r"]) == {"2", "5"}  # JSON keys
        assert len(entry["samples"]["k=1"]) == 2


@pytest.mark.parametrize(
    "args, message",
    [(["--ks", "1"], "--ks are verification lengths"), (["--models", "gpt5"], "gpt5"), (["--repeats", "0"], "--repeats")],
)
def test_user_mistakes_exit_with_one_line(args, message, capsys):
    assert run_cli(main, args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
