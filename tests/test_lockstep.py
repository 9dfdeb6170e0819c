"""benchmarks/lockstep.py: methods take turns by tokens so far, each is timed
over its own turns only, inference mode survives the first method to finish,
and an error in a method reaches the caller; plain, speculative and
transformers' decoding pause at their steps and return what they return when
called alone. A fake clock stands in for time; the self-check's table is run
on a tiny model (its figures are not asserted)."""

from __future__ import annotations

import types

import pytest
import torch

from benchmarks.common import run_cli
from benchmarks.lockstep import lockstep, main, plain_decoding, rotated, stepwise
from gpt2 import SamplingConfig, generate
from spec_decoding import speculative_generate
from helpers import TINY, tiny_gpt2


def stepper(name: str, tokens_per_step: int, seconds_per_step: float, steps: int, now: list[float], log: list):
    """A method whose steps advance the fake clock `now` and are logged."""

    def call(pause):
        tokens = 0
        for _ in range(steps):
            now[0] += seconds_per_step
            tokens += tokens_per_step
            log.append((name, tokens))
            pause(tokens)
        now[0] += 0.5  # after the last pause: still this method's time
        return name.upper()

    return call


def test_the_method_with_the_fewest_tokens_runs_and_each_is_timed_over_its_own_turns():
    now, log = [0.0], []
    timed = lockstep({"a": stepper("a", 1, 1.0, 6, now, log), "b": stepper("b", 3, 5.0, 2, now, log)},
                     clock=lambda: now[0])
    # Both at 0: a (the first name); then b (0 < 1); a until it passes b's 3 (a tie goes to a); b; a to the end.
    assert log == [("a", 1), ("b", 3), ("a", 2), ("a", 3), ("a", 4), ("b", 6), ("a", 5), ("a", 6)]
    # The fake clock ran 6 + 10 + 1 seconds in all; each method is charged its own steps only.
    assert timed == {"a": (6.5, "A"), "b": (10.5, "B")}


@pytest.mark.parametrize("shift, first", [(0, "a"), (1, "b"), (4, "b"), (-1, "c")])
def test_rotated_methods_change_who_moves_first_and_wins_ties(shift, first):
    """The benchmarks rotate their methods by repeat, so that no method always takes the first turn."""
    now, log = [0.0], []
    methods = {name: stepper(name, 1, 1.0, 2, now, log) for name in "abc"}
    order = "abc"[shift % 3 :] + "abc"[: shift % 3]
    assert list(rotated(methods, shift)) == list(order) and order[0] == first
    lockstep(rotated(methods, shift), clock=lambda: now[0])
    assert [name for name, _ in log] == [*order, *order]  # ties at every turn: the first of the order wins


def test_inference_mode_stays_on_for_a_method_that_outlives_another():
    seen = []

    @torch.inference_mode()
    def short(pause):
        pause(1)

    @torch.inference_mode()
    def long(pause):
        for tokens in range(1, 4):
            pause(tokens)
            seen.append(torch.is_inference_mode_enabled())

    assert not torch.is_inference_mode_enabled()
    lockstep({"short": short, "long": long}, clock=lambda: 0.0)
    assert seen == [True, True, True]  # "short" left inference mode before "long" resumed for the last time
    assert not torch.is_inference_mode_enabled()


def test_an_error_in_a_method_reaches_the_caller():
    def broken(pause):
        pause(1)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        lockstep({"ok": lambda pause: pause(5), "broken": broken}, clock=lambda: 0.0)


def test_after_an_error_the_paused_methods_end_and_clean_up():
    """They stayed suspended for ever: a paused_passes hook stayed on the model, and their caches alive."""
    model = tiny_gpt2(TINY, seed=0)
    ended = []

    def paused(pause):
        try:
            pause(1)
            pause(2)
        finally:
            ended.append("paused")

    def broken(pause):
        pause(1)
        raise RuntimeError("boom")

    plain = plain_decoding(model, torch.tensor([[1, 2, 3]]), 8)
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    try:
        with pytest.raises(RuntimeError, match="boom"):
            lockstep({"plain": plain, "paused": paused, "broken": broken}, clock=lambda: 0.0)
        assert ended == ["paused"]
        assert not model._forward_pre_hooks, "the plain run's pause hook is off the model"
        # Ended after lockstep's inference mode was gone, generate's no_grad restored the state it saw inside it.
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled(), "the thread's autograd mode moved"
    finally:
        torch.set_grad_enabled(True)


def test_plain_decoding_pauses_before_its_own_passes_only():
    model = tiny_gpt2(TINY, seed=0)
    ids = torch.tensor([[1, 2, 3]])
    paused = []

    def plain(pause):
        return plain_decoding(model, ids, 4)(lambda tokens: (paused.append(tokens), pause(tokens)))

    def other(pause):  # passes of the same model between plain's turns
        for tokens in range(1, 6):
            model(ids)
            pause(tokens)

    timed = lockstep({"plain": plain, "other": other}, clock=lambda: 0.0)
    out = timed["plain"][1]
    assert out.tolist() == generate(model, ids, 4).tolist()
    assert paused == [0, 0, 1, 2, 3]  # before the prefill, then before each token's pass; not before "other"'s
    assert not model._forward_pre_hooks  # the hook is gone after the run


def test_plain_decoding_samples_as_generate_does_with_its_seed():
    model = tiny_gpt2(TINY, seed=0)
    ids = torch.tensor([[1, 2, 3]])
    sampling = SamplingConfig(temperature=1.0, top_k=20)
    timed = lockstep({"a": plain_decoding(model, ids, 12, sampling, seed=7),
                      "b": plain_decoding(model, ids, 12, sampling, seed=8)}, clock=lambda: 0.0)
    for name, seed in (("a", 7), ("b", 8)):
        alone = generate(model, ids, 12, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(seed))
        assert timed[name][1].tolist() == alone.tolist()
    assert timed["a"][1].tolist() != timed["b"][1].tolist()  # the seeds matter: the check above can fail


def test_speculative_decoding_pauses_after_each_step_with_its_tokens_so_far():
    target, draft = tiny_gpt2(TINY, seed=0), tiny_gpt2(TINY, seed=1)
    ids = torch.tensor([[1, 2, 3]])
    paused, steps = [], []

    def run(on_step):
        def logged(new, accepted):
            steps.append(len(new))
            on_step(new, accepted)
        return speculative_generate(target, draft, ids, gamma=3, max_new_tokens=20, on_step=logged)

    def speculative(pause):
        return stepwise(run)(lambda tokens: (paused.append(tokens), pause(tokens)))

    timed = lockstep({"speculative": speculative, "plain": plain_decoding(target, ids, 20)}, clock=lambda: 0.0)
    out, stats = timed["speculative"][1]
    assert out.tolist() == timed["plain"][1].tolist() == generate(target, ids, 20).tolist()
    assert len(paused) == stats.target_calls > 1  # one pause a step
    assert paused == [sum(steps[: i + 1]) for i in range(len(steps))] and paused[-1] == 20


def test_transformers_generate_pauses_as_its_tokens_arrive():
    pytest.importorskip("transformers")
    from benchmarks.hf_peer import PausingStreamer, hf_generate, to_transformers

    model = tiny_gpt2(TINY, seed=0)
    hf_model, ids = to_transformers(model), torch.tensor([[1, 2, 3]])
    for assistant, gamma in ((None, None), (hf_model, 3)):  # plain generate, then assisted generation
        paused = []

        def peer(pause):
            return hf_generate(hf_model, ids, 10, SamplingConfig(), assistant=assistant, gamma=gamma,
                               streamer=PausingStreamer(lambda tokens: (paused.append(tokens), pause(tokens))))

        timed = lockstep({"peer": peer, "plain": plain_decoding(model, ids, 10)}, clock=lambda: 0.0)
        assert timed["peer"][1].tolist() == timed["plain"][1].tolist()  # the same weights, the same greedy tokens
        # The prompt first (0 tokens), then each step's: one a step, or gamma + 1 when the target drafts for itself.
        assert paused == ([*range(11)] if assistant is None else [0, 4, 8, 10])


def test_the_self_check_prints_its_table(capsys):
    assert run_cli(main, ["--tiny", "--repeats", "1"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1].split("|")
    assert row[1].strip() == "tiny" and all(float(cell) > 0 for cell in row[3:6])


def test_the_self_checks_figures_from_scripted_timings(monkeypatch):
    # Per repeat, in seconds: called before 2 and after 6 (mean 4), in lockstep alone 8, in a thread 3, the two in
    # lockstep 5 and 4, then 3 and 6. Alone / called: 8 / 4 = 2; thread / called: 0.75; slower / faster: 1.25 and
    # 2, the largest 2 (their median would be 1.625).
    from benchmarks import lockstep as module  # the module: its function `lockstep` is imported above

    ticks = iter([0, 2, 10, 13, 20, 26, 30, 32, 40, 43, 50, 56])  # each pair: the start and end of a called run
    turns = iter([{"plain": (8.0, None)}, {"a": (5.0, None), "b": (4.0, None)},
                  {"plain": (8.0, None)}, {"a": (3.0, None), "b": (6.0, None)}])
    monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    monkeypatch.setattr(module, "lockstep", lambda methods, clock: next(turns))
    assert module.check("tiny", 2, repeats=2) == ["tiny", "2", "2.000", "0.750", "2.000"]


def test_the_self_check_refuses_bad_settings(capsys):
    assert run_cli(main, ["--repeats", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --repeats must be >= 1"
