"""The parity check (benchmarks/parity_check.py) on tiny models: it finds no
divergence where there is none, explains an injected near-tie by its gap, and
calls a broken verifier a BUG.

The near-tie and end-of-text cases use `EditedTarget`, a tiny GPT-2 whose
logits at one sequence position are overwritten, differently for one-token
calls (plain decoding) and batched calls (speculative verification): a
controlled stand-in for the kernel differences of half precision.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

import spec_decoding.loop
from benchmarks import parity_check
from benchmarks.common import build_pair, run_cli
from benchmarks.parity_check import (
    ParitySettings,
    check_parity,
    compare_prompt,
    count_differing,
    encode_suite,
    main,
    tokens_after_eos,
)
from benchmarks.prompts import EARLY_EOS_PROMPTS, PROMPTS
from gpt2 import GPT2, GPT2Config, init_random_weights
from gpt2.generate import first_difference
from helpers import REPO_ROOT
from spec_decoding.acceptance import Verdict, speculative_sampling_greedy

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: a thread pool only adds waiting

SMALL = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_ctx=64, vocab_size=101)
EOS = 100  # end-of-text of the SMALL vocabulary
PROMPT = torch.tensor([[5, 17, 42, 8, 99, 23]])  # (1, T), T = 6
T = PROMPT.size(1)
SETTINGS = ParitySettings(gamma=3, max_new_tokens=12, eos_id=EOS)
CLOSED = "http://127.0.0.1:9"  # a proxy nothing listens on: a subprocess's download attempts fail at once


class EditedTarget(GPT2):
    """A GPT-2 whose logits row scoring sequence position `position` is
    passed through `edit(row, batched)`, batched = the call fed more than one
    token (speculative verification) rather than one (plain decoding)."""

    def __init__(self, config: GPT2Config, position: int, edit: Callable[[torch.Tensor, bool], None]) -> None:
        super().__init__(config)
        init_random_weights(self, generator=torch.Generator().manual_seed(0))
        self.position = position
        self.edit = edit

    def forward(self, input_ids, cache=None, *, mask=None, last_logits_only=False):
        P = 0 if cache is None else cache.length
        logits = super().forward(input_ids, cache, mask=mask, last_logits_only=last_logits_only)  # (1, T_out, V)
        T_in, T_out = input_ids.size(1), logits.size(1)
        row = self.position - (P + T_in - T_out + 1)  # row 0 scores position P + T_in - T_out + 1
        if 0 <= row < T_out:
            self.edit(logits[0, row], T_in > 1)
        return logits


def small_draft() -> GPT2:
    return init_random_weights(GPT2(SMALL), generator=torch.Generator().manual_seed(1)).eval()


def near_tie(a: int, b: int) -> Callable[[torch.Tensor, bool], None]:
    """Makes a and b the top two tokens, 2^-24 (6e-8) apart: a wins in batched
    calls, b in one-token calls."""

    def edit(row: torch.Tensor, batched: bool) -> None:
        row -= row.max() + 1.0  # every logit <= -1
        half, above = torch.tensor(0.5), torch.nextafter(torch.tensor(0.5), torch.tensor(1.0))
        row[a], row[b] = (above, half) if batched else (half, above)

    return edit


def force_eos(row: torch.Tensor, batched: bool) -> None:
    row[EOS] = row.max() + 10.0


# ---------------------------------------------------------------------------
# The helpers
# ---------------------------------------------------------------------------


def test_tokens_after_eos_flags_anything_after_end_of_text():
    assert tokens_after_eos([1, 2, 3], EOS) == 0
    assert tokens_after_eos([1, 2, EOS], EOS) == 0
    assert tokens_after_eos([EOS], EOS) == 0
    assert tokens_after_eos([1, EOS, 7], EOS) == 1
    assert tokens_after_eos([EOS, EOS, 4], EOS) == 2  # counted from the first EOS


def test_first_difference_and_count_differing():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # the shorter one ended first
    assert count_differing([1, 2, 3, 4], [1, 9, 3, 7]) == 2
    assert count_differing([1, 2], [1, 2, 3, 4]) == 2


def explain(tokens_b: list[int], tokens_s: list[int], row_b: torch.Tensor, row_s: torch.Tensor, tolerance: float,
            after_eos: bool = False) -> parity_check.Divergence:
    d = first_difference(tokens_b, tokens_s)
    return parity_check.explain_divergence(d, parity_check.Evidence.at(tokens_b, row_b, d, None),
                                           parity_check.Evidence.at(tokens_s, row_s, d, None), row_b, row_s,
                                           tolerance, after_eos)


def test_a_divergence_whose_logits_differ_by_more_than_rounding_is_a_bug():
    # Each run took its own argmax, both gaps are small, but the rows differ by 4e-4 of their scale: more than the
    # float32 rounding between the two paths (~1e-6), so not a near-tie.
    row_b, row_s = torch.tensor([100.0, 99.95, 10.0]), torch.tensor([99.96, 99.99, 10.0])
    d = explain([0], [1], row_b, row_s, SETTINGS.relative_tolerance(torch.float32))
    assert d.verdict == "BUG" and d.reason.startswith("the two runs' logits differ by 0.04, more than rounding")
    row_b, row_s = torch.tensor([100.0, 99.999, 10.0]), torch.tensor([99.999, 100.0, 10.0])  # 1e-5 of the scale
    assert explain([0], [1], row_b, row_s, SETTINGS.relative_tolerance(torch.float32)).verdict == "near-tie"
    tied = torch.tensor([1.0, 1.0, 0.0])  # an exact tie: the one parting the fast path's zero tolerance allows
    assert explain([0], [1], tied, tied, SETTINGS.relative_tolerance(torch.float32, fast_path=True)).verdict == \
        "near-tie"


def test_the_tie_tolerance_is_zero_on_the_fast_path(fast_kernels):
    target = build_pair("", "", weights="tiny").target
    assert SETTINGS.tolerance_for(target) == 0.0  # bit-exact: any parting of untied logits is a BUG
    target.accelerator = None
    assert SETTINGS.tolerance_for(target) == parity_check.DEFAULT_TIE_TOLERANCE


def test_a_run_that_goes_on_after_end_of_text_is_named():
    row = torch.tensor([3.0, 1.0, EOS])
    d = explain([7, EOS], [7, EOS, 0], row, row, 1e-4, after_eos=True)
    assert d.verdict == "BUG" and d.reason == "the speculative path went on after end-of-text"
    d = explain([7, 0], [7], row, row, 1e-4)
    assert d.reason == "one path stopped early without end-of-text while the other went on"


def test_a_divergence_without_logits_from_one_run_is_named():
    row = torch.tensor([3.0, 1.0, 0.5])
    for row_b, row_s in ((row, None), (None, row)):
        d = explain([0], [1], row_b, row_s, 1e-4)
        assert d.verdict == "BUG" and d.reason == "no target logits were recorded for this position in one run"
        assert d.logit_delta is None and d.tolerance is None


# ---------------------------------------------------------------------------
# The check on the benchmark suite
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("draft_equals_target", [False, True], ids=["tiny-draft", "draft-is-target"])
@pytest.mark.parametrize("path", ["fast", "readable"])
def test_fp32_suite_has_no_divergence(path, draft_equals_target, request):
    if path == "fast":
        request.getfixturevalue("fast_kernels")  # skips where the C kernels cannot exist
    pair = build_pair("", "", weights="tiny", draft_equals_target=draft_equals_target, dtype="float32",
                      accelerate=path == "fast")
    assert (pair.target.accelerator is not None) == (path == "fast")
    prompts, tokenizer, _ = encode_suite(list(PROMPTS) + list(EARLY_EOS_PROMPTS), pair, pair.device)
    report = check_parity(pair.target, pair.draft, prompts, ParitySettings(gamma=3, max_new_tokens=8), tokenizer)

    summary = report.summary()
    assert summary["prompts"] == len(PROMPTS) + len(EARLY_EOS_PROMPTS)
    assert summary["identical"] == summary["prompts"]
    assert summary["differing_tokens"] == summary["divergences"] == summary["bugs"] == 0
    assert summary["eos_violations"] == 0
    if path == "fast":  # batch-invariant kernels: a position's logits do not depend on the pass
        assert summary["max_logit_delta"] == 0.0
    else:  # the two passes compute the logits differently, but only in the last bits
        assert 0 <= summary["max_logit_delta_relative"] < 1e-5
    if draft_equals_target:
        assert all(p.alpha == 1.0 for p in report.prompts)  # every draft accepted: bonus tokens ran


# ---------------------------------------------------------------------------
# An injected near-tie
# ---------------------------------------------------------------------------


def test_injected_near_tie_is_reported_with_its_gap_and_called_a_near_tie():
    position = T + 2  # the third new token: a one-token step in plain decoding
    target = EditedTarget(SMALL, position, near_tie(a=11, b=13)).eval()
    result = compare_prompt(target, small_draft(), "tied", PROMPT, SETTINGS)

    d = result.divergence
    assert d is not None and d.position == 2
    assert (d.baseline.token, d.speculative.token) == (13, 11)  # one-token call: b; batched: a
    assert (d.baseline.top1, d.speculative.top1) == (13, 11)  # each path took its own argmax
    assert d.baseline.deficit == d.speculative.deficit == 0.0
    for run in (d.baseline, d.speculative):
        assert 0 < run.gap < 1e-7 and run.gap == pytest.approx(2.0**-24)
    assert d.verdict == "near-tie"
    assert d.tolerance > d.baseline.gap
    assert result.baseline[:2] == result.speculative[:2]  # identical before the tie
    assert result.differing_tokens >= 1


# ---------------------------------------------------------------------------
# A broken verifier
# ---------------------------------------------------------------------------


def test_broken_verifier_is_reported_as_a_bug_with_a_large_gap(monkeypatch):
    calls = []

    def broken(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> Verdict:
        verdict = speculative_sampling_greedy(target_logits, draft_tokens)
        calls.append(verdict)
        if len(calls) != 2:
            return verdict
        # Second step: append the target's *least* likely token instead of its choice.
        row = target_logits[verdict.num_accepted]  # (V,)
        return Verdict(accepted=verdict.accepted, next_token=int(row.argmin()))

    monkeypatch.setattr(spec_decoding.loop, "speculative_sampling_greedy", broken)
    target = init_random_weights(GPT2(SMALL), generator=torch.Generator().manual_seed(0)).eval()
    result = compare_prompt(target, small_draft(), "broken", PROMPT, SETTINGS)

    d = result.divergence
    assert d is not None and d.verdict == "BUG"
    assert d.speculative.token != d.speculative.top1  # it did not take the target's argmax...
    assert d.speculative.top1 == d.baseline.token  # ...which is what plain decoding took
    assert d.speculative.deficit > 100 * d.tolerance  # and missed it by far more than rounding could
    assert d.logit_delta < 1e-5  # the logits themselves agree: the fault is in the choice
    assert "speculative path" in d.reason


# ---------------------------------------------------------------------------
# End of text through both paths
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("draft_is_target", [False, True], ids=["tiny-draft", "draft-is-target"])
def test_both_paths_stop_at_end_of_text(draft_is_target):
    target = EditedTarget(SMALL, T + 3, force_eos).eval()
    draft = target if draft_is_target else small_draft()  # the target drafts EOS inside an accepted draft
    result = compare_prompt(target, draft, "eos", PROMPT, SETTINGS)

    assert result.identical
    assert len(result.baseline) == 4 and result.baseline[-1] == EOS
    assert result.after_eos == {"baseline": 0, "speculative": 0} and result.eos_ok


# ---------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------


def test_cli_writes_the_report_and_passes(tmp_path):
    code = main(["--tiny", "--dtypes", "float32", "--prompts", "1", "--max-gen", "6", "--gamma", "2",
                 "--out", str(tmp_path)])

    assert code == 0
    payload = json.loads((tmp_path / "parity.json").read_text())
    assert payload["passed"] is True
    assert payload["environment"]["torch"] == torch.__version__
    summary = payload["dtypes"][0]["summary"]
    assert summary["dtype"] == "float32" and summary["prompts"] == 1 + len(EARLY_EOS_PROMPTS)
    assert summary["identical"] == summary["prompts"]
    report = (tmp_path / "parity.md").read_text()
    assert "## Summary" in report and "| float32 |" in report
    assert "Neither path produced a token after end-of-text, in any prompt or dtype." in report


def test_the_report_names_the_forward_pass_of_each_dtype(tmp_path, fast_kernels):
    assert main(["--tiny", "--dtypes", "float32,bfloat16", "--prompts", "1", "--max-gen", "2",
                 "--out", str(tmp_path)]) == 0
    path = json.loads((tmp_path / "parity.json").read_text())["environment"]["path"]
    float32, bfloat16 = path.split(" | bfloat16: ")  # the float32 kernels; bfloat16 cannot take them
    assert float32.startswith("float32: fast path:") and bfloat16.startswith("readable path"), path
    assert f"- forward pass: {path}" in (tmp_path / "parity.md").read_text()


@pytest.mark.parametrize("stdout", ["closed early", "cp1252"])
def test_a_reader_that_stops_early_or_cannot_encode_the_report_is_no_bug_and_no_traceback(tmp_path, stdout):
    # `| head -1` closes the pipe before the report comes: not exit code 1, which says a BUG was found.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "cp1252" if stdout == "cp1252" else "utf-8"}
    env.pop("PYTHONUNBUFFERED", None)  # a pipe's stdout is buffered: the report is written as the run ends
    env.update(HTTPS_PROXY=CLOSED, HTTP_PROXY=CLOSED, NO_PROXY="")  # without ../shared, no tokenizer download
    with subprocess.Popen(
            [sys.executable, "-m", "benchmarks.parity_check", "--tiny", "--dtypes", "float32", "--prompts", "1",
             "--max-gen", "4", "--out", str(tmp_path)], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE) as process:  # closes both pipes
        if stdout == "closed early":
            process.stdout.close()
            err = process.stderr.read().decode()
        else:
            out, err = (stream.decode("cp1252") for stream in process.communicate())
            assert "| ?logit |" not in out and "max abs(?logit)" in out  # Δ is not in cp1252
        code = process.wait()
    assert "Traceback" not in err and code == (141 if stdout == "closed early" else 0), err


def test_a_broken_pipe_with_stdout_closed_is_no_bug_either(monkeypatch):
    def broken(argv):  # stderr piped to a reader that left, stdout closed (>&-)
        raise BrokenPipeError

    monkeypatch.setattr(sys, "stdout", None)
    assert run_cli(broken, []) == 141


def test_cli_exits_1_on_a_float32_bug(tmp_path, monkeypatch):
    def always_wrong(target_logits, draft_tokens):
        verdict = speculative_sampling_greedy(target_logits, draft_tokens)
        return Verdict(verdict.accepted, int(target_logits[verdict.num_accepted].argmin()))

    monkeypatch.setattr(spec_decoding.loop, "speculative_sampling_greedy", always_wrong)
    code = main(["--tiny", "--dtypes", "float32", "--prompts", "1", "--max-gen", "4", "--out", str(tmp_path)])

    assert code == 1
    payload = json.loads((tmp_path / "parity.json").read_text())
    assert payload["passed"] is False and payload["dtypes"][0]["summary"]["bugs"] >= 1
    report = (tmp_path / "parity.md").read_text()
    assert "**BUG**" in report
    figures = r" \| ".join([r"\d[\d.e+-]*"] * 4)  # each run's gap, abs(Δlogit) and the tolerance, as figures
    assert re.search(rf"\| prose \| \d+ \| [^|]+ \| [^|]+ \| {figures} \| BUG \|", report)


@pytest.mark.parametrize("bad, message", [
    (["--tie-tolerance", "inf"], "--tie-tolerance must lie in (0, 1]"),  # every parting would be called a tie
    (["--gamma", "1000000000"], "--gamma must be less than 1024"),  # refused before the models are built
])
def test_bad_settings_are_one_line_and_exit_2(bad, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(parity_check, "build_pair", lambda *a, **k: pytest.fail("the settings come first"))
    assert run_cli(main, ["--tiny", "--dtypes", "float32", "--out", str(tmp_path / "out"), *bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def test_a_run_that_fails_leaves_no_results_folder(tmp_path, capsys):
    # The folder was made first: every offline run of the default command left an empty one in benchmarks/results.
    out = tmp_path / "out"
    assert run_cli(main, ["--target", str(tmp_path / "missing"), "--dtypes", "float32", "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("out", ["afile/sub", ""])
def test_a_bad_results_folder_is_one_line_and_exit_2(out, tmp_path, capsys):
    (tmp_path / "afile").touch()
    assert run_cli(main, ["--tiny", "--dtypes", "float32", "--prompts", "1", "--max-gen", "2",
                          "--out", str(tmp_path / out) if out else out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out ") and len(err.strip().splitlines()) == 1, err  # before any model is built
