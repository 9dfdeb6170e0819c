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
            "--long", "4", "--no-transformers", "--plain-linear", "--plain-attention", "--module-blocks",
            "--bandwidth-mib", "16", "--out", str(out)]
    assert run_cli(main, args) == 0
    report = (out / "decode_speed.md").read_text(encoding="utf-8")
    for label in ("ours", "ours, Block modules", "ours, F.linear + SDPA", "ours, SDPA attention"):
        assert f"| gpt2 | {label} |" in report
    assert "r_5" in report and "step @12 (ms)" in report and "% of bound @12" in report
    result = json.loads((out / "decode_speed.json").read_text(encoding="utf-8"))["results"][0]
    assert result["contexts"] == {"short": 8, "long": 12}
    # The bound at the long context adds 4 positions of keys and values, 12 layers x 768 floats each, twice.
    assert result["step_bytes"]["long"] - result["step_bytes"]["short"] == 2 * 12 * 4 * 768 * 4
    assert len(result["implementations"]) == 4
    for entry in result["implementations"].values():
        for slot in ("short", "long"):
            e = entry[slot]
            steps, bandwidth = entry["samples"][f"{slot} k=1"], entry["samples"][f"{slot} bandwidth"]
            assert len(steps) == len(bandwidth) == 2  # one bandwidth (around the step) per timed step
            assert e["bound_s"] == pytest.approx(result["step_bytes"][slot] / e["read_bandwidth_bytes_per_s"])
            # the fraction pairs each step with its own bandwidth sample: median of bound_i / step_i
            expected = sorted(result["step_bytes"][slot] / bw / t for bw, t in zip(bandwidth, steps))
            assert e["fraction_of_bound"] == pytest.approx(sum(expected) / 2)
        assert set(entry["short"]["r"]) == {"2", "5"} and set(entry["long"]["r"]) == {"5"}  # JSON keys


@pytest.mark.parametrize(
    "args, message",
    [(["--ks", "1"], "--ks are verification lengths"), (["--models", "gpt5"], "gpt5"), (["--repeats", "0"], "--repeats")],
)
def test_user_mistakes_exit_with_one_line(args, message, capsys):
    assert run_cli(main, args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
