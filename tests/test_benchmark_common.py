"""benchmarks/common.py's helpers that no benchmark's own tests pin down: the commit in every result's header,
where a verification pass stops fitting the context window, the noise of a noisy draft, which vocabulary
the benchmark prompts are encoded with, and which model names the benchmarks take, fill in or refuse."""

from __future__ import annotations

import argparse
import importlib
import shutil
import subprocess

import pytest
import torch

from benchmarks.common import check_passes_fit, git_commit, load_prompt_tokenizer, noisy_copy, pair_names
from benchmarks.common import random_model, run_cli
from helpers import REPO_ROOT, TINY


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)


def test_the_results_header_names_the_commit_measured_and_whether_files_had_changed():
    head = git("rev-parse", "HEAD") if shutil.which("git") else None
    if head is None or head.returncode != 0:
        assert git_commit() is None  # not a git checkout (an unpacked archive): no commit to name
        return
    commit, head = git_commit(), head.stdout.strip()
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip() != ""
    short, _, suffix = commit.partition("+")
    assert len(short) >= 7 and head.startswith(short), (commit, head)
    assert suffix == ("dirty" if dirty else ""), (commit, dirty)


@pytest.mark.parametrize("used, message", [
    (8, "--gamma 2 verifies 3 tokens in one pass, but after the prompt (8 positions) the context window of 10 has "
        "room for 2: give gammas of at most 1 and trees of at most 1 nodes"),
    (9, "has room for 1: shorten the prompt or the run"),  # no gamma of at least 1 fits
    (12, "(12 positions) the context window of 10 has room for 0: shorten the prompt or the run"),
])
def test_a_pass_past_the_context_window_says_what_still_fits(used, message):
    with pytest.raises(ValueError) as raised:
        check_passes_fit(10, used, "the prompt", {"--gamma 2": 3})
    assert message in str(raised.value)
    check_passes_fit(10, 8, "the prompt", {"--gamma 1": 2})  # a pass that fills the window exactly fits


@pytest.mark.parametrize("relative", [False, True])
def test_a_noisy_copy_adds_noise_of_the_scale_asked_to_weight_matrices_only(relative):
    """The noise added to the weight matrices and embeddings (TINY: 29,856 values) has standard deviation `scale`
    (relative: `scale` times each matrix's own), within 5% (the estimate's own spread is about 0.4%; twice the
    scale fails); layer norms and biases are the original's."""
    model = random_model(TINY, seed=0, accelerate=False)
    copy = noisy_copy(model, scale=0.01, seed=1, relative=relative)
    noise, unchanged = [], []
    with torch.no_grad():
        for (name, before), after in zip(model.named_parameters(), copy.parameters()):
            if name.endswith("weight") and "ln_" not in name:
                noise.append(((after - before) / (before.std() if relative else 1.0)).flatten())
            else:
                unchanged.append(torch.equal(after, before))
        noise = torch.cat(noise)
    assert noise.numel() == 29_856 and all(unchanged) and len(unchanged) == 18
    assert float(noise.std()) == pytest.approx(0.01, rel=0.05)


def test_the_benchmark_prompts_use_the_model_folders_own_vocabulary(tmp_path, gpt2_bpe_dir):
    """A model folder with vocab.json and merges.txt is the prompts' tokenizer (a broken one is reported, not
    replaced by the shared GPT-2 files); a folder without them falls back to GPT-2's."""
    folder = tmp_path / "model"
    folder.mkdir()
    assert load_prompt_tokenizer(folder).encode("Hello world") == [15496, 995]
    shutil.copyfile(gpt2_bpe_dir / "encoder.json", folder / "vocab.json")
    shutil.copyfile(gpt2_bpe_dir / "vocab.bpe", folder / "merges.txt")
    assert load_prompt_tokenizer(folder).encode("Hello world") == [15496, 995]
    (folder / "vocab.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ValueError, match="vocab.json"):
        load_prompt_tokenizer(folder)


@pytest.mark.parametrize("module", ["batch_speed", "drafting", "gamma_sweep", "parity_check", "tree_speed"])
def test_tiny_refuses_the_model_names_it_would_ignore(module, tmp_path, capsys):
    main = importlib.import_module(f"benchmarks.{module}").main
    assert run_cli(main, ["--tiny", "--draft", "gpt2-medium", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == "error: --tiny builds tiny models of its own: drop --draft gpt2-medium, or drop --tiny\n", err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("module, args, message", [
    ("gamma_sweep", ["--draft-equals-target", "--draft", "/no/such"],
     "--draft-equals-target drafts with the target: drop --draft /no/such, or drop --draft-equals-target"),
    ("parity_check", ["--tiny", "--draft", " "], "--tiny builds tiny models of its own: drop --draft ' ', or drop"),
    # a mistyped shape, refused before a random gpt2-large is built (it was built first, then refused)
    ("gamma_sweep", ["--random-weights", "--draft", "nope"], "--draft: no preset named 'nope': choose one of gpt2, "
                                                             "gpt2-medium, gpt2-large, gpt2-xl, distilgpt2, tiny, "
                                                             "tiny-draft"),
    ("parity_check", ["--random-weights", "--target", "gpt2-huge"], "--target: no preset named 'gpt2-huge'"),
    ("parity_check", ["--target", ""], "--target is empty: give a model, or leave it out for the default"),
    ("gamma_sweep", ["--target", "tiny"], "--target tiny is a test shape, not a checkpoint: pass --tiny"),
    ("drafting", ["--parts", "noisy", "ngram", "--draft", "gpt2"],
     "--parts noisy ngram uses no --draft: drop --draft, or add --parts simulated"),
    ("tree_speed", ["--draft", "gpt3"], "--draft: no preset named 'gpt3'"),
])
def test_a_model_name_that_would_be_ignored_or_cannot_be_used_is_refused_naming_its_flag(module, args, message,
                                                                                          tmp_path, capsys):
    main = importlib.import_module(f"benchmarks.{module}").main
    assert run_cli(main, [*args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_the_pair_is_the_names_given_else_gpt2_large_drafted_by_gpt2_and_tiny_its_own():
    args = argparse.Namespace(tiny=False, target=None, draft="distilgpt2")
    assert pair_names(args, presets=True) == ("gpt2-large", "distilgpt2") == (args.target, args.draft)
    assert pair_names(argparse.Namespace(tiny=False, target="gpt2", draft=None), presets=True) == ("gpt2", "gpt2")
    assert pair_names(argparse.Namespace(tiny=True, target=None, draft=None), presets=True) == ("tiny", "tiny-draft")
    folders = argparse.Namespace(tiny=False, target="models/mine", draft="openai-community/gpt2")  # not shapes
    assert pair_names(folders, presets=False) == ("models/mine", "openai-community/gpt2")
