"""benchmarks/busy_settled.py on a tiny model with one busy core: both
settings are reported. It asserts no time."""

from __future__ import annotations

import os
import time

import pytest
import torch

from benchmarks import busy_settled
from benchmarks.busy_settled import main
from benchmarks.common import random_model, run_cli, shape
from gpt2 import fast
from helpers import ForwardRecorder

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


def test_the_settings_alternate_and_the_report_takes_medians_over_rounds(monkeypatch, capsys, fast_kernels):
    # Scripted rounds: a decode step of these seconds, a five-token pass twice it, and alternating, half a step
    # and three times that; medians 0.3 s (chooser) and 0.5 s (fixed).
    steps = {"chooser": [0.2, 0.4, 0.3], "fixed": [0.5, 0.1, 0.6]}
    rounds = []  # the setting of each round, from the accelerate call that starts it
    accelerate = fast.accelerate

    def recording(model, **kwargs):
        if "adapt_threads" in kwargs:  # a round's, not the model's first
            rounds.append("chooser" if kwargs["adapt_threads"] else "fixed")
        return accelerate(model, **kwargs)

    def scripted(model, passes):
        step = steps[rounds[-1]][rounds.count(rounds[-1]) - 1]
        return {"step": step, "verify5": 2 * step, "mixed_step": step / 2, "mixed_verify5": 1.5 * step}

    monkeypatch.setattr(fast, "accelerate", recording)
    monkeypatch.setattr(busy_settled, "measure", scripted)
    assert run_cli(main, ["--tiny", "--passes", "2", "--repeats", "3", "--busy", "0"]) == 0
    assert rounds == ["chooser", "fixed", "fixed", "chooser", "chooser", "fixed"]  # reversed every other round
    out = capsys.readouterr().out
    assert "tiny, 0 busy core(s) of 1 threads, 2 passes of each kind, medians over 3 round(s)" in out
    assert ("chooser: step 300.0 ms, t_v(5) 600.0 ms, r_5 2.00; alternating: step 150.0 ms, t_v(5) 450.0 ms, "
            "r_5 3.00") in out
    assert "  fixed: step 500.0 ms, t_v(5) 1000.0 ms, r_5 2.00; alternating: step 250.0 ms, t_v(5) 750.0 ms" in out


def test_each_timed_pass_runs_on_the_100_token_cache(fast_kernels):
    model = random_model(shape("tiny"), seed=0)
    with ForwardRecorder(model) as recorder, torch.inference_mode():
        start = time.perf_counter()
        medians = busy_settled.measure(model, 3)
        wall = time.perf_counter() - start
    seen = [(call.tokens, call.cached) for call in recorder.calls]  # (new tokens, cached positions) of each pass
    warm_up, alternating = [(1, 100), (5, 100)] * 2, [(1, 100), (5, 100)] * 3
    assert seen == [(100, 0), *warm_up, *[(1, 100)] * 3, *[(5, 100)] * 3, *alternating]  # steps, then five-token passes
    assert set(medians) == {"step", "verify5", "mixed_step", "mixed_verify5"}
    assert all(0 < seconds < wall for seconds in medians.values())
