"""benchmarks/decode_speed.py on tiny shapes: a short run writes its report,
with the bandwidth bound taken from samples around the timed calls, r_k up
to k = 32 with and without a tree mask, and the bytes an int8 step reads; the
loaded mode (--busy) reports quiet and loaded rows and always stops its
spinning processes. Speed itself is never asserted here."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import math
import os
import shlex
import statistics
import subprocess
import sys

import pytest
import torch

from benchmarks import decode_speed
from benchmarks.common import REPO_ROOT, TINY_TARGET, binary_tree_mask, run_cli
from benchmarks.decode_speed import Spinners, main

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: a thread pool only adds waiting

LABELS = ("ours", "ours, int8 weights", "ours, readable", "ours, tree mask", "ours, int8 weights, tree mask",
          "ours, readable, tree mask")


def test_a_short_run_writes_the_report_and_the_bound(tmp_path, fast_kernels):
    out = tmp_path / "ds"
    args = ["--models", "tiny", "--repeats", "2", "--warmup", "0", "--ks", "2", "5", "32", "--prefix", "8",
            "--long", "4", "--no-transformers", "--readable", "--tree-mask", "--int8", "--bandwidth-mib", "16",
            "--out", str(out)]
    assert run_cli(main, args) == 0
    report = (out / "decode_speed.md").read_text(encoding="utf-8")
    for label in LABELS:
        assert f"| tiny | {label} |" in report
    assert "| k=2 | k=5 | k=32 |" in report and "r_5" in report and "% of bound @12" in report
    assert "- forward pass: fast path: C kernels" in report  # gpt2.fast.status of the model
    result = json.loads((out / "decode_speed.json").read_text(encoding="utf-8"))["results"][0]
    assert result["contexts"] == {"short": 8, "long": 12}
    assert list(result["implementations"]) == list(LABELS) and "loaded" not in result
    for diff in result["max_abs_logit_diff"].values():  # each against the readable path of its model and mask
        assert diff <= 1e-4

    c = TINY_TARGET
    # A step reads each weight once (wte once: it is the LM head too; one row of wpe) and the keys and values of
    # the 8 cached positions and its own, L layers x C floats each, twice.
    C, L, V = c.n_embd, c.n_layer, c.vocab_size
    weights = V * C + C + L * (12 * C * C + 13 * C) + 2 * C  # a block: 2 LayerNorms, 4 matrices and their biases
    assert result["weight_bytes"] == 4 * weights
    assert result["step_bytes"]["short"] == 4 * weights + 2 * L * (8 + 1) * C * 4
    # The long context adds 4 positions of keys and values, L layers x C floats each, twice.
    assert result["step_bytes"]["long"] - result["step_bytes"]["short"] == 2 * c.n_layer * 4 * c.n_embd * 4
    # int8: each block matrix and wte (the LM head) read as 1 byte a weight instead of 4, plus a scale per row.
    C, L, V = c.n_embd, c.n_layer, c.vocab_size
    matrices = L * (C * 3 * C + C * C + C * 4 * C + 4 * C * C) + V * C
    rows = L * (3 * C + C + 4 * C + C) + V
    for label, entry in result["implementations"].items():
        int8 = label.startswith("ours, int8")
        for slot, ks in (("short", {"2", "5", "32"}), ("long", {"5"})):
            e = entry[slot]
            assert result["step_bytes"][slot] - e["step_bytes"] == (3 * matrices - 4 * rows if int8 else 0)
            steps, bandwidth = entry["samples"][f"{slot} k=1"], entry["samples"][f"{slot} bandwidth"]
            assert len(steps) == len(bandwidth) == 2  # one bandwidth (around the step) per timed step
            assert e["bound_s"] == pytest.approx(e["step_bytes"] / e["read_bandwidth_bytes_per_s"])
            # the fraction pairs each step with its own bandwidth sample: median of bound_i / step_i
            assert e["fraction_of_bound"] == pytest.approx(sum(e["step_bytes"] / bw / t
                                                               for bw, t in zip(bandwidth, steps)) / 2)
            # r_k pairs the verification and the step of each repeat: the median of t_v(k)_i / t_step_i
            verify = entry["samples"][f"{slot} k=5"]
            assert e["r"]["5"] == pytest.approx(sum(v / t for v, t in zip(verify, steps)) / 2)
            assert e["r_of_medians"]["5"] == pytest.approx(e["verify_s"]["5"] / e["step_s"])
            assert set(e["r"]) == ks  # JSON keys


def test_the_report_shows_the_figures_of_the_counted_repeats(tmp_path, monkeypatch):
    # Every timing scripted (the calls still run): the tables must show the JSON's paired r_k, not the ratio of
    # medians, and the comparison the others' time over ours; a warm-up repeat must not be counted.
    scripted_times = [0.003, 0.002, 0.007, 0.005, 0.011, 0.013, 0.017, 0.019, 0.023]
    times = itertools.cycle(scripted_times)

    def scripted(fn, *args):
        fn(*args)
        return next(times)

    monkeypatch.setattr(decode_speed, "timed", scripted)
    out = tmp_path / "ds"
    args = ["--models", "tiny", "--repeats", "3", "--warmup", "1", "--ks", "5", "--prefix", "8", "--long", "0",
            "--no-transformers", "--readable", "--bandwidth-mib", "1", "--out", str(out)]
    assert run_cli(main, args) == 0
    report = (out / "decode_speed.md").read_text(encoding="utf-8")
    impl = json.loads((out / "decode_speed.json").read_text(encoding="utf-8"))["results"][0]["implementations"]
    ours, readable = impl["ours"]["short"], impl["ours, readable"]["short"]
    assert all(len(samples) == 3 for samples in impl["ours"]["samples"].values()), "the warm-up is not counted"
    assert f"{ours['r']['5']:.2f}" != f"{ours['r_of_medians']['5']:.2f}", "scripted times that tell them apart"
    assert f"| {1e3 * ours['verify_s']['5']:.1f} | {ours['r']['5']:.2f} |" in report
    assert f"t_v(5) {readable['verify_s']['5'] / ours['verify_s']['5']:.2f}x" in report
    # a step's bandwidth: the mean of the probe's 1 MiB over the scripted times before and after it
    for bw in impl["ours"]["samples"]["short bandwidth"]:
        assert any(bw == pytest.approx((2**20 / a + 2**20 / b) / 2) for a in scripted_times for b in scripted_times)
    # the share of the bound as a percentage
    assert (f"| {decode_speed.ms(ours['bound_s'])} | {100 * ours['fraction_of_bound']:.0f}% | "
            f"{decode_speed.ms(ours['verify_s']['5'])} |") in report


def test_the_speedup_under_load_is_the_median_of_each_repeats_ratio(monkeypatch):
    # The lockstep clock scripted: 3 repeats whose median ratio of baseline to speculative seconds is not the
    # ratio of the median seconds.
    steps, now = itertools.cycle([0.002, 0.001, 0.004, 0.003, 0.006]), [0.0]

    def scripted(device):
        now[0] += next(steps)
        return now[0]

    monkeypatch.setattr(decode_speed, "clock", scripted)
    args = argparse.Namespace(models=["tiny"], draft="tiny-draft", seed=0, gen=8, warmup=0, repeats=3)
    result = decode_speed.bench_speedup(args, Spinners(1))
    of_medians = []
    for phase in ("quiet", "loaded"):
        s = result[phase]["samples"]
        ratios = [b / t for b, t in zip(s["baseline"], s["speculative"])]
        assert result[phase]["speedup"] == statistics.median(ratios)
        assert (result[phase]["speedup_min"], result[phase]["speedup_max"]) == (min(ratios), max(ratios))
        of_medians.append(statistics.median(s["baseline"]) / statistics.median(s["speculative"]))
    assert result["quiet"]["speedup"] != pytest.approx(of_medians[0]), "scripted times that tell the two apart"


def test_the_files_are_written_before_the_report_goes_to_a_reader_that_may_have_left(tmp_path):
    # `... | true`: printing first raised BrokenPipeError (exit 141) and left the results folder empty.
    out = tmp_path / "ds"
    command = shlex.join([sys.executable, "-m", "benchmarks.decode_speed", "--models", "tiny", "--draft", "tiny-draft",
                          "--no-transformers", "--repeats", "1", "--warmup", "0", "--long", "0", "--ks", "2",
                          "--prefix", "8", "--bandwidth-mib", "1", "--out", str(out)]) + " | true"
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert (out / "decode_speed.md").is_file() and (out / "decode_speed.json").is_file(), done.stderr


def test_the_loaded_mode_reports_quiet_and_loaded_rows(tmp_path):
    out = tmp_path / "busy"
    transformers = importlib.util.find_spec("transformers") is not None  # only its rows need it
    args = ["--models", "tiny", "--draft", "tiny-draft", "--busy", "1", "--repeats", "1", "--warmup", "0",
            "--ks", "5", "--prefix", "8", "--long", "0", "--gen", "8", "--bandwidth-mib", "16", "--fixed-threads",
            "--out", str(out), *([] if transformers else ["--no-transformers"])]
    assert run_cli(main, args) == 0
    report = (out / "decode_speed.md").read_text(encoding="utf-8")
    for load in ("quiet", "1 busy"):
        assert f"| tiny | {load} | ours |" in report and f"| tiny | {load} | ours, fixed threads |" in report
        assert f"| tiny | {load} | transformers |" in report or not transformers
    assert "## Speculative decoding under load: tiny-draft -> tiny, simulated α = 0.8, γ = 4" in report
    assert "\n| quiet | " in report and "\n| 1 busy | " in report  # the speedup, one row each
    payload = json.loads((out / "decode_speed.json").read_text(encoding="utf-8"))
    result = payload["results"][0]
    assert set(result["loaded"]) == set(result["implementations"])
    assert set(result["loaded"]["ours"]["short"]["r"]) == {"5"}
    speedup = payload["speedup"]
    assert speedup["quiet"]["speedup"] > 0 and speedup["loaded"]["speedup"] > 0
    assert 0 <= speedup["alpha"] <= 1


def test_spinners_run_only_inside_their_phase_and_always_stop():
    spinners = Spinners(2)
    with spinners.running(False):
        assert spinners.processes == []
    with pytest.raises(RuntimeError), spinners.running(True):
        started = list(spinners.processes)
        assert len(started) == 2 and all(p.poll() is None for p in started)  # spinning
        raise RuntimeError("a failed measurement")
    assert spinners.processes == [] and all(p.poll() is not None for p in started)  # stopped all the same


def test_the_benchmarks_tree_mask_is_a_binary_trees_ancestor_mask():
    expected = torch.tensor([[1, 0, 0, 0, 0],  # node 0: the root
                             [1, 1, 0, 0, 0],  # 1 and 2: children of 0
                             [1, 0, 1, 0, 0],
                             [1, 1, 0, 1, 0],  # 3 and 4: children of 1
                             [1, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(binary_tree_mask(5), expected)
    depth = binary_tree_mask(32).sum(dim=1) - 1  # what the model adds to a node's position
    assert depth.tolist() == [int(math.log2(i + 1)) for i in range(32)]


# A run of seconds: the base of the mistakes below, so that a missing check shows as a run, not a long one.
SHORT = ["--models", "tiny", "--no-transformers", "--repeats", "1", "--warmup", "0", "--long", "0", "--ks", "2",
         "--prefix", "4", "--bandwidth-mib", "1"]


@pytest.mark.parametrize("args, message", [
    (["--ks", "1"], "--ks are verification lengths"),
    (["--ks", "65"], "--ks are verification lengths"),
    (["--models", "gpt5"], "gpt5"),
    (["--repeats", "0"], "--repeats"),
    (["--busy", "-1"], "--busy"),
    (["--busy", str(os.cpu_count() + 1), "--draft", "tiny", "--gen", "2"], "--busy must lie in 0.."),
    (["--busy", "1", "--draft", "tiny", "--gen", "2000"], "give --gen at most 992"),  # after a 32-token prompt
    (["--bandwidth-mib", "0"], "--bandwidth-mib must lie in 1..4096"),
    (["--bandwidth-mib", "100000000"], "--bandwidth-mib must lie in 1..4096"),
    (["--threads", str(os.cpu_count() + 1)], "--threads must lie in 1.."),
    (["--out", ""], "--out is empty"),
])
def test_user_mistakes_exit_with_one_line(args, message, capsys, tmp_path):
    assert run_cli(main, SHORT + ["--out", str(tmp_path / "out")] + args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("args", [["--prefix", "2000"], ["--busy", "1", "--draft", "tiny", "--gen", "2000"]])
def test_a_setting_that_cannot_fit_the_window_leaves_no_results_folder(args, capsys, tmp_path):
    assert run_cli(main, SHORT + ["--out", str(tmp_path / "out")] + args) == 2
    assert "context window of 1024" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


class RecordingSpinners:
    """Stands in for Spinners: whether its spinning processes would be running."""

    def __init__(self, n: int) -> None:
        self.n, self.busy = n, False

    @contextlib.contextmanager
    def running(self, busy: bool):
        self.busy = busy
        yield
        self.busy = False


@pytest.mark.parametrize("n", [0, 1])
def test_odd_repeats_reverse_both_orders_and_the_spinners_run_in_the_loaded_phase_only(n):
    spinners = RecordingSpinners(n)
    args = argparse.Namespace(warmup=1, repeats=2)
    got = [(rep, phase, item, spinners.busy)
           for rep, phase, item in decode_speed.interleaved(["a", "b"], args, spinners)]
    quiet = [("quiet", "a", False), ("quiet", "b", False)]
    loaded = [("loaded", "a", True), ("loaded", "b", True)] if n else []
    even, odd = quiet + loaded, (quiet + loaded)[::-1]  # odd repeats: the phases and the items backwards
    assert got == [(rep, *x) for rep, order in ((0, even), (1, odd), (2, even)) for x in order]
