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
            "--long", "4", "--no-transformers", "--plain-linear", "--plain-attention", "--module-blocks", "--int8",
            "--bandwidth-mib", "16", "--out", str(out)]
    assert run_cli(main, args) == 0
    report = (out / "decode_speed.md").read_text(encoding="utf-8")
    for label in ("ours", "ours, int8 weights", "ours, Block modules", "ours, F.linear + SDPA", "ours, SDPA attention"):
        assert f"| gpt2 | {label} |" in report
    assert "r_5" in report and "step @12 (ms)" in report and "% of bound @12" in report
    result = json.loads((out / "decode_speed.json").read_text(encoding="utf-8"))["results"][0]
    assert result["contexts"] == {"short": 8, "long": 12}
    # The bound at the long context adds 4 positions of keys and values, 12 layers x 768 floats each, twice.
    assert result["step_bytes"]["long"] - result["step_bytes"]["short"] == 2 * 12 * 4 * 768 * 4
    assert len(result["implementations"]) == 5
    # int8 weights: each of the 12 x 4 block matrices and wte (the LM head) read as 1 byte a weight instead
    # of 4, plus a float32 scale per row.
    matrices = 12 * (768 * 3 * 768 + 768 * 768 + 768 * 4 * 768 + 4 * 768 * 768) + 50257 * 768
    rows = 12 * (3 * 768 + 768 + 4 * 768 + 768) + 50257
    int8 = result["implementations"]["ours, int8 weights"]
    assert result["step_bytes"]["short"] - int8["short"]["step_bytes"] == 3 * matrices - 4 * rows
    assert result["max_abs_logit_diff"]["ours, int8 weights"] <= 1e-3  # against its own readable path
    for label, entry in result["implementations"].items():
        for slot in ("short", "long"):
            e = entry[slot]
            if label != "ours, int8 weights":
                assert e["step_bytes"] == result["step_bytes"][slot]
            steps, bandwidth = entry["samples"][f"{slot} k=1"], entry["samples"][f"{slot} bandwidth"]
            assert len(steps) == len(bandwidth) == 2  # one bandwidth (around the step) per timed step
            assert e["bound_s"] == pytest.approx(e["step_bytes"] / e["read_bandwidth_bytes_per_s"])
            # the fraction pairs each step with its own bandwidth sample: median of bound_i / step_i
            expected = sorted(e["step_bytes"] / bw / t for bw, t in zip(bandwidth, steps))
            assert e["fraction_of_bound"] == pytest.approx(sum(expected) / 2)
            # r_5 pairs the verification and the step of each repeat: the median of t_v(5)_i / t_step_i
            verify = entry["samples"][f"{slot} k=5"]
            assert e["r"]["5"] == pytest.approx(sum(v / t for v, t in zip(verify, steps)) / 2)
            assert e["r_of_medians"]["5"] == pytest.approx(e["verify_s"]["5"] / e["step_s"])
        assert set(entry["short"]["r"]) == {"2", "5"} and set(entry["long"]["r"]) == {"5"}  # JSON keys


@pytest.mark.parametrize(
    "args, message",
    [(["--ks", "1"], "--ks are verification lengths"), (["--models", "gpt5"], "gpt5"), (["--repeats", "0"], "--repeats")],
)
def test_user_mistakes_exit_with_one_line(args, message, capsys):
    assert run_cli(main, args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
