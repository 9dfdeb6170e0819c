"""spec_decoding_generate.py end to end, run as a user runs it: a subprocess
(`python spec_decoding_generate.py ...` from the repository root), its exit
code, stdout and stderr; `cli.main([...])` in this process where a subprocess
would only add the ~2 s torch import (bad values, short runs).

The models are tiny random GPT-2s (2 layers, width 32, context 128) with the
real 50257-token vocabulary, written as Hub-style folders (config.json,
model.safetensors in the Conv1D layout, vocab.json, merges.txt). The draft is
the target with slightly perturbed weights, so it agrees with the target often
but not always (0 < alpha < 1). No test reaches the network: HF_ENDPOINT
always points at 127.0.0.1, either at the local Hub server of hub_server.py or
at a closed port.

Each subprocess runs with OMP_NUM_THREADS=1: the models are far too small to
gain from threads, and spinning threads slow them down badly on a busy machine.
"""

from __future__ import annotations

import copy
import fcntl
import io
import json
import os
import pty
import re
import shlex
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch

import gpt2
import spec_decoding_generate as cli
from cli.arguments import GAMMA_SCHEDULES, MAX_PROMPT_BYTES, check_settings, check_tree
from cli.report import describe_gammas, print_batch_summary, print_comparison, speedups_agree, tree_rows
from cli.stream import ACCEPTED_STYLE, RESET, TARGET_STYLE, TokenStream, Unfailing
from gpt2 import GPT2Config, generate, load_model, load_tokenizer
from gpt2.generate import first_difference
from spec_decoding import BatchStats, SpecStats, TreeShape, expected_tokens_per_step
from spec_decoding.schedule import SCHEDULE_NAMES
from helpers import REPO_ROOT, hub_layout, perturbed_copy, tiny_gpt2, write_checkpoint
from hub_server import HubServer, closed_endpoint

SCRIPT = REPO_ROOT / "spec_decoding_generate.py"
# The command's default device, auto, takes a GPU where there is one; these tests describe the CPU (int8, the
# fast path, its dtypes), so every run starts with --device cpu (a test's own --device comes later and wins).
# tests/test_cuda.py runs the command on a GPU.
ON_CPU = ["--device", "cpu"]
CONFIG = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_ctx=128)  # vocab_size 50257: the real tokenizer
SHORT_WINDOW = 32  # the context window of a draft that sees less than the target
DRAFT_NOISE = 0.005  # weight perturbation of the draft: alpha ~ 0.5-0.9 on these models
MAX_GEN = "20"


# ---------------------------------------------------------------------------
# Models and running the script
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Model folders: "target", "draft" (the target, perturbed),
    "short_window_draft" (the draft with a context window of 32 tokens) and
    "other_vocab" (a draft with 50300 tokens)."""
    root = tmp_path_factory.mktemp("cli_models")
    target = tiny_gpt2(CONFIG, seed=0)
    draft = perturbed_copy(target, scale=DRAFT_NOISE, seed=1)
    short = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_ctx=SHORT_WINDOW)
    short_state = hub_layout(draft)
    short_state["wpe.weight"] = short_state["wpe.weight"][:SHORT_WINDOW].contiguous()  # (n_ctx, C)
    other = GPT2Config(n_layer=1, n_head=2, n_embd=32, n_ctx=128, vocab_size=50300)
    return {
        "target": write_checkpoint(root / "target", CONFIG, hub_layout(target), with_tokenizer=True),
        "draft": write_checkpoint(root / "draft", CONFIG, hub_layout(draft), with_tokenizer=True),
        "short_window_draft": write_checkpoint(root / "short_window_draft", short, short_state, with_tokenizer=True),
        "other_vocab": write_checkpoint(root / "other_vocab", other, hub_layout(tiny_gpt2(other, seed=2))),
    }


@pytest.fixture(autouse=True)
def offline(no_hub) -> None:
    """huggingface_hub in this process (`run_main`) points at a closed port too."""


def cli_env(tmp_path: Path, endpoint: str | None = None) -> dict[str, str]:
    """The user's environment minus anything that could reach the real Hub or
    read their Hugging Face token, plus a fixed stdout encoding."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE", "TRANSFORMERS_"))}
    env.pop("NO_COLOR", None)
    env.update(
        HF_ENDPOINT=endpoint or closed_endpoint(),
        HF_HOME=str(tmp_path / "hf_home"),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_XET="1",
        OMP_NUM_THREADS="1",
        PYTHONIOENCODING="utf-8",
    )
    return env


def run_cli(tmp_path: Path, *args: str, stdin: str = "", endpoint: str | None = None) -> subprocess.CompletedProcess:
    """Runs the script from the repository root with downloads going to tmp_path/weights."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), *ON_CPU, "--weights-dir", str(tmp_path / "weights"), *args],
        cwd=REPO_ROOT,
        env=cli_env(tmp_path, endpoint),
        input=stdin,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=120,
    )


def run_main(capsys, *args: str) -> subprocess.CompletedProcess:
    """`cli.main(args)` in this process (argparse's errors exit through
    SystemExit), as a CompletedProcess of its exit code, stdout and stderr."""
    try:
        code = cli.main([*ON_CPU, *args])
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, captured.out, captured.err)


def run_in_pty(tmp_path: Path, args: list[str], *, endpoint: str | None = None, size: tuple[int, int] | None = None):
    """Runs the script with stdout and stderr on a pseudo-terminal of `size`
    (rows, columns; None leaves it 0 x 0, as `script` opens it for a program
    that has no terminal itself). Returns (exit code, everything written)."""
    leader, follower = pty.openpty()
    if size is not None:
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", size[0], size[1], 0, 0))
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), *ON_CPU, "--weights-dir", str(tmp_path / "weights"), *args],
        cwd=REPO_ROOT, env=cli_env(tmp_path, endpoint), stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the script closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return process.wait(timeout=120), b"".join(chunks).decode("utf-8", errors="replace")


def local_models(folders: dict[str, Path], draft: str = "draft") -> list[str]:
    return ["--draft", str(folders[draft]), "--target", str(folders["target"]), "--max-gen", MAX_GEN]


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def assert_bad_input(result: subprocess.CompletedProcess, message: str) -> None:
    """Exit code 2, one line "error: ..." containing `message`, no traceback."""
    assert result.returncode == 2, f"exit {result.returncode}\nstderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    assert message in errors[0], errors[0]
    assert result.stdout == ""


def without_timings(result: dict) -> dict:
    stats = {k: v for k, v in result["stats"].items() if not k.endswith("_seconds")}
    return {**result, "stats": stats, "timings": None}


def prompt_of(n_tokens: int, folders) -> str:
    """A prompt of exactly `n_tokens` tokens."""
    text = " hello" * n_tokens
    assert len(load_tokenizer(folders["target"]).encode(text)) == n_tokens
    return text


# ---------------------------------------------------------------------------
# The normal flow
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["latin-1", "ascii"])
def test_help_on_a_terminal_that_is_not_utf8(tmp_path, encoding):
    """--help holds "α": a latin-1 or ASCII stdout shows it as "?" rather than crash."""
    result = subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=REPO_ROOT, capture_output=True, timeout=120,
                            env=cli_env(tmp_path) | {"PYTHONIOENCODING": encoding})
    assert result.returncode == 0 and result.stderr == b"", result.stderr.decode(errors="replace")[-300:]
    assert result.stdout.startswith(b"usage: spec_decoding_generate.py") and b" ? " in result.stdout


def test_help_documents_every_option_and_its_default(tmp_path):
    result = run_cli(tmp_path, "--help")
    assert_ok(result)
    for option in (
        "--prompt", "--gamma", "--tree", "--tree-nodes", "--tree-depth", "--show-tree", "--max-gen", "--temperature",
        "--top-k", "--top-p", "--seed", "--draft", "--target", "--device", "--dtype", "--quantize", "--weights-dir",
        "--compare", "--json", "--no-color", "--debug", "--prompts-file", "--batch-size", "--ngram", "--draft-p-min",
        "--draft-quantize",
    ):
        assert option in result.stdout, option
    for default in ("default: 4", "default: 100", "default: gpt2)", "default: gpt2-large", "default: auto",
                    "default: float32", "default: 0", "default: none", "default: 8", "default: 3",
                    "default: as --quantize"):
        assert default in " ".join(result.stdout.split()), default


def test_default_flow_streams_the_text_then_the_stats(tmp_path, folders):
    result = run_cli(tmp_path, *local_models(folders), "-p", "Hello world")
    assert_ok(result)
    out = result.stdout
    assert "\nHello world" in out, "the prompt is printed before the generated text"
    for label in ("new tokens", "acceptance α", "accepted per drafted", "tokens/target call", "forward calls",
                  "speed"):
        assert label in out, label
    assert "20 in " in out and "stopped at --max-gen" in out
    assert "\x1b[" not in out, "no colour codes when stdout is a pipe"
    assert "legend" not in out
    assert "target alone" not in out, "no baseline without --compare"


def test_compare_reports_greedy_outputs_identical_and_both_speedups(tmp_path, folders):
    result = run_cli(tmp_path, *local_models(folders), "--compare")
    assert_ok(result)
    assert "identical to the target alone, token for token (20 tokens)" in result.stdout
    assert "target alone" in result.stdout and "step costs" in result.stdout
    assert re.search(r"speedup\s+\d+\.\d\dx measured, \d+\.\d\dx predicted by α and the step costs", result.stdout)


def test_json_is_one_object_with_every_field(tmp_path, folders):
    started = time.perf_counter()
    result = run_cli(tmp_path, *local_models(folders), "--json", "--compare", "-p", "Hello world")
    wall_seconds = time.perf_counter() - started
    assert_ok(result)
    assert result.stdout.count("\n") == 1, "exactly one line of JSON on stdout, nothing else"
    out = json.loads(result.stdout)

    assert out["prompt"] == "Hello world"
    assert out["prompt_token_ids"] == [15496, 995]
    assert len(out["token_ids"]) == 20
    assert out["text"] == load_tokenizer(folders["target"]).decode(out["token_ids"])
    assert len(out["accepted_from_draft"]) == 20
    assert out["interrupted"] is False
    assert out["settings"] == {
        "draft": str(folders["draft"]), "target": str(folders["target"]),
        "draft_folder": str(folders["draft"]), "target_folder": str(folders["target"]),
        "drafter": str(folders["draft"]), "ngram": None, "draft_p_min": None,
        "gamma": 4, "schedule": "fixed 4", "tree": None, "max_gen": 20, "temperature": 0.0, "greedy": True,
        "top_k": None, "top_p": None, "seed": 0, "device": "cpu", "dtype": "float32", "quantize": None,
        "draft_quantize": None, "eos_id": 50256,
    }
    stats = out["stats"]
    assert stats["new_tokens"] == 20 and stats["gamma"] == 4
    assert 0 < stats["alpha"] < 1, "the perturbed draft agrees with the target only partly"
    assert stats["accepted"] == sum(out["accepted_from_draft"])
    assert stats["accepted"] + stats["target_tokens"] == 20
    assert stats["tokens_per_target_call"] == pytest.approx(20 / stats["target_calls"])
    for key in ("target_calls", "draft_calls", "drafted", "plain_steps", "accepted_per_drafted", "accepted_hist",
                "position_acceptance", "draft_seconds", "verify_seconds", "stopped_at_eos"):
        assert key in stats, key
    timings = out["timings"]
    assert set(timings) == {"load_seconds", "generate_seconds", "tokens_per_second", "draft_seconds", "verify_seconds"}
    assert timings["tokens_per_second"] > 0
    # durations within the run: each part positive and the parts inside the whole (not a speed: a wrong clock)
    assert 0 < timings["draft_seconds"] + timings["verify_seconds"] <= timings["generate_seconds"]
    assert 0 < timings["load_seconds"] and timings["load_seconds"] + timings["generate_seconds"] < wall_seconds
    comparison = out["comparison"]
    assert comparison["greedy"] is True and comparison["identical"] is True
    assert comparison["first_difference"] is None
    assert comparison["baseline_token_ids"] == out["token_ids"]
    assert comparison["baseline_tokens_per_second"] > 0 and comparison["speedup"] > 0
    assert comparison["predicted_speedup"] > 0 and isinstance(comparison["speedup_matches_prediction"], bool)
    assert 0 < comparison["outside_steps_seconds"] < comparison["spec_seconds"]  # the prefills at least
    assert set(comparison["step_seconds"]) == {"draft", "target", "verify"}
    assert all(seconds > 0 for seconds in comparison["step_seconds"].values())
    # Each figure is what its parts say (a wrong counter or an inverted ratio passed everything above).
    assert timings["tokens_per_second"] == pytest.approx(20 / timings["generate_seconds"], rel=1e-9)
    assert comparison["baseline_tokens_per_second"] == pytest.approx(20 / comparison["baseline_seconds"], rel=1e-9)
    assert comparison["speedup"] == pytest.approx(
        timings["tokens_per_second"] / comparison["baseline_tokens_per_second"], rel=1e-9)
    assert comparison["step_seconds"]["draft"] == pytest.approx(stats["draft_seconds"] / stats["draft_calls"], rel=1e-9)
    assert comparison["step_seconds"]["verify"] == pytest.approx(
        stats["verify_seconds"] / stats["target_calls"], rel=1e-9)


def test_int8_weights_reproduce_the_int8_target_alone(tmp_path, folders):
    """--quantize int8 quantises both models; greedy speculative output is
    then the int8 target's own, token for token."""
    result = run_cli(tmp_path, *local_models(folders), "--quantize", "int8", "--json", "--compare")
    assert_ok(result)
    out = json.loads(result.stdout)
    assert out["settings"]["quantize"] == "int8"
    assert len(out["token_ids"]) == 20
    assert out["comparison"]["identical"] is True and out["comparison"]["baseline_token_ids"] == out["token_ids"]


def test_an_int8_draft_keeps_the_float32_targets_output(capsys, folders, single_thread):
    """--draft-quantize int8 quantises the draft only: greedy output is the float32 target's own."""
    result = run_main(capsys, *local_models(folders), "--draft-quantize", "int8", "--json", "--compare")
    assert_ok(result)
    out = json.loads(result.stdout)
    assert out["settings"]["quantize"] is None and out["settings"]["draft_quantize"] == "int8"
    assert out["settings"]["drafter"] == f"{folders['draft']} (int8 weights)"
    assert out["comparison"]["identical"] is True and len(out["token_ids"]) == 20
    assert 0 < out["stats"]["alpha"] < 1


@pytest.fixture
def step_costs_cache(tmp_path, monkeypatch):
    """--gamma auto's calibration goes to tmp_path, not the user's cache."""
    import spec_decoding.costs

    monkeypatch.setattr(spec_decoding.costs, "default_cache_dir", lambda: tmp_path / "step-costs")
    return tmp_path / "step-costs"


@pytest.mark.parametrize("gamma", SCHEDULE_NAMES)
def test_gamma_by_name_keeps_the_output_and_reports_the_k_it_chose(capsys, folders, single_thread, step_costs_cache,
                                                                    gamma):
    assert GAMMA_SCHEDULES == SCHEDULE_NAMES  # the CLI keeps its own copy: --help answers without torch
    result = run_main(capsys, *local_models(folders), "--gamma", gamma, "--compare")
    assert_ok(result)
    assert "identical to the target alone, token for token (20 tokens)" in result.stdout
    schedule = "auto" if gamma == "auto" else "heuristic (+2/-1)"
    assert re.search(rf"γ per step\s+{re.escape(schedule)}: K = (\d+ x \d+(, )?)+ steps \(mean \d+\.\d\)",
                     result.stdout), result.stdout
    assert ("the step costs of this pair" in result.stderr) == (gamma == "auto")
    assert len(list(step_costs_cache.glob("*.json"))) == (gamma == "auto")  # measured once, then cached


def test_plain_steps_under_auto_past_the_draft_window_name_both_reasons(capsys, folders, single_thread,
                                                                         step_costs_cache):
    # A 20-token prompt and a 32-token draft window: the steps before the window ran out were auto's to choose,
    # and all were put down to the window.
    args = [*local_models(folders, draft="short_window_draft"), "--gamma", "auto"]
    result = run_main(capsys, *args, "-p", prompt_of(20, folders))
    assert_ok(result)
    assert re.search(r"plain steps\s+\d+ target calls? drafted nothing \(auto chose a plain step where drafting did "
                     r"not pay, or the sequence outgrew the draft's context window of 32 tokens\)", result.stdout), \
        result.stdout


def test_gamma_auto_in_json(capsys, folders, single_thread, step_costs_cache):
    result = run_main(capsys, *local_models(folders), "--gamma", "auto", "--json")
    assert_ok(result)
    out = json.loads(result.stdout)
    assert out["settings"]["gamma"] == "auto" and out["settings"]["schedule"] == "auto"
    assert out["stats"]["gamma"] == 12 and sum(out["stats"]["gamma_hist"]) == out["stats"]["target_calls"]


def test_prompt_lookup_needs_no_draft_model(capsys, folders, single_thread):
    prompt = "one two three four, one two three four, one two three four, one two"
    result = run_main(capsys, "--target", str(folders["target"]), "--draft", "ngram", "--ngram", "2",
                      "--max-gen", MAX_GEN, "-p", prompt, "--compare")
    assert_ok(result)
    assert "identical to the target alone, token for token (20 tokens)" in result.stdout
    assert re.search(r"drafter\s+prompt lookup \(n-gram, suffixes of up to 2 tokens, no model\)", result.stdout)
    assert "loading draft" not in result.stderr  # no model was loaded
    # Eq. 1 assumes every step drafts what it asks: prompt lookup proposes fewer, so no expectation is shown.
    assert re.search(r"tokens/target call\s+\d+\.\d\d \(at most 5\)\n", result.stdout), result.stdout
    json_run = run_main(capsys, "--target", str(folders["target"]), "--draft", "ngram", "--max-gen", MAX_GEN,
                        "-p", prompt, "--json")
    out = json.loads(json_run.stdout)
    assert out["settings"]["ngram"] == 3 and out["settings"]["draft_folder"] is None
    assert out["stats"]["draft_calls"] == 0 and out["stats"]["drafted"] > 0


def test_draft_p_min_keeps_the_output_and_drafts_less(capsys, folders, single_thread):
    always = json.loads(run_main(capsys, *local_models(folders), "--json").stdout)
    result = run_main(capsys, *local_models(folders), "--draft-p-min", "0.9", "--json", "--compare")
    assert_ok(result)
    out = json.loads(result.stdout)
    assert out["comparison"]["identical"] is True and out["token_ids"] == always["token_ids"]
    assert out["stats"]["drafted"] < always["stats"]["drafted"]
    assert "stopping below top probability 0.9" in out["settings"]["drafter"]


def test_sampling_with_a_seed_reproduces_with_the_prompt_from_stdin_too(tmp_path, folders):
    """Two sampled runs with the same seed give the same tokens and counts; the
    second reads its prompt from stdin ("-p -"), one trailing newline dropped."""
    settings = (*local_models(folders), "--json", "--temperature", "1.0", "--top-k", "50", "--top-p", "0.95")
    settings = (*settings, "--seed", "7")
    first = run_cli(tmp_path, *settings, "-p", "Once upon a time")
    second = run_cli(tmp_path, *settings, "-p", "-", stdin="Once upon a time\n")
    assert_ok(first)
    assert_ok(second)
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert b["prompt"] == "Once upon a time"
    assert a["settings"]["temperature"] == 1.0 and a["settings"]["seed"] == 7 and a["settings"]["greedy"] is False
    assert len(a["token_ids"]) == 20
    assert without_timings(a) == without_timings(b)


def test_compare_samples_the_target_alone_with_every_filter_and_the_header_names_them(capsys, folders, single_thread):
    # --compare's baseline is `gpt2.generate` with the same settings and seed; one that dropped --top-p, or a header
    # that left it out, passed every other test.
    settings = ("--temperature", "1.5", "--top-k", "40", "--top-p", "0.6", "--seed", "3", "-p", "Once upon a time")
    text = run_main(capsys, *local_models(folders), "--compare", *settings)
    assert_ok(text)
    assert "sampling at temperature 1.5, top-k 40, top-p 0.6, seed 3" in text.stdout
    out = json.loads(run_main(capsys, *local_models(folders), "--json", "--compare", *settings).stdout)
    target = load_model(folders["target"])
    prompt = torch.tensor([out["prompt_token_ids"]])
    alone = generate(target, prompt, 20, temperature=1.5, top_k=40, top_p=0.6, eos_id=50256,
                     generator=torch.Generator().manual_seed(3))
    without_top_p = generate(target, prompt, 20, temperature=1.5, top_k=40, eos_id=50256,
                             generator=torch.Generator().manual_seed(3))
    T = prompt.size(1)
    assert out["comparison"]["baseline_token_ids"] == alone[0, T:].tolist() != without_top_p[0, T:].tolist()


def test_another_seed_samples_another_text(capsys, folders, single_thread):
    """The seed is used: with it ignored, every test of reproducibility above would still pass."""
    settings = (*local_models(folders), "--json", "--temperature", "1.0", "-p", "Once upon a time")
    texts = [json.loads(run_main(capsys, *settings, "--seed", str(seed)).stdout)["token_ids"] for seed in (7, 8, 7)]
    assert texts[0] == texts[2] != texts[1]


def test_colour_and_legend_on_a_terminal(tmp_path, folders):
    """stdout is a pseudo-terminal here, so the script colours its tokens."""
    code, out = run_in_pty(tmp_path, local_models(folders), size=(24, 100))
    assert code == 0, out
    assert "legend:" in out
    assert ACCEPTED_STYLE in out and TARGET_STYLE in out, "both kinds of token appear in colour"


# ---------------------------------------------------------------------------
# Token trees
# ---------------------------------------------------------------------------


def test_a_tree_gives_the_targets_own_output_and_its_stats(capsys, folders, single_thread):
    result = run_main(capsys, *local_models(folders), "--tree", "3,2,1", "--compare")
    assert_ok(result)
    out = result.stdout
    assert "proposes a token tree per step (3,2,1: up to 15 tokens, 3 deep)" in out
    assert "identical to the target alone, token for token (20 tokens)" in out
    assert re.search(r"tree\s+3,2,1: \d+\.\d drafted tokens per step", out)
    assert re.search(r"  depth 1\s+accepted \d+ of \d+ \(candidate #1 \d+", out), out
    assert re.search(r"speedup\s+\d+\.\d\dx measured, \d+\.\d\dx predicted", out)
    assert "step 1:" not in result.stderr, "no drawings unless asked"


def test_the_header_counts_the_tree_tokens_the_window_holds(capsys, folders, single_thread):
    # It said "up to 200 tokens" on a window of 128; a shape of over 10^4300 tokens failed on printing the number.
    for shape, header in (("200", "(200: up to 127 tokens (what the window holds), 1 deep)"),
                          (",".join(["9" * 35] * 127), "up to 127 tokens (what the window holds), 127 deep)")):
        result = run_main(capsys, *local_models(folders), "--tree", shape, "--max-gen", "2")
        assert_ok(result)
        assert header in result.stdout, result.stdout


def test_tree_alone_drafts_the_default_shape(capsys, folders, single_thread):
    from cli.arguments import DEFAULT_TREE
    from spec_decoding.tree import DEFAULT_TREE as LIBRARY_DEFAULT_TREE

    result = run_main(capsys, *local_models(folders), "--tree", "--json")
    assert_ok(result)
    assert json.loads(result.stdout)["settings"]["tree"] == DEFAULT_TREE == LIBRARY_DEFAULT_TREE


def test_a_dynamic_tree_in_json(capsys, folders, single_thread):
    result = run_main(capsys, *local_models(folders), "--tree-nodes", "6", "--tree-depth", "3", "--json")
    assert_ok(result)
    out = json.loads(result.stdout)
    assert out["settings"]["tree"] == "dynamic 6 nodes, depth 3" and out["settings"]["gamma"] is None
    stats = out["stats"]
    assert stats["tree"] == "dynamic 6 nodes, depth 3" and stats["gamma"] == 3 and len(out["token_ids"]) == 20
    assert sum(stats["accepted_rank"][0]) == stats["accepted_at"][0]


def test_show_tree_draws_each_step_with_the_accepted_path_ticked(capsys, folders, single_thread):
    result = run_main(capsys, *local_models(folders), "--tree", "2,2", "--show-tree", "--json")
    assert_ok(result)
    out = json.loads(result.stdout)
    steps = result.stderr.count("\nstep ")
    assert steps == out["stats"]["target_calls"] and "step 1:\n" in result.stderr
    assert "(root)" in result.stderr and "├── " in result.stderr and "+ target: " in result.stderr
    assert result.stderr.count(" ✓") == out["stats"]["accepted"], "one tick per accepted token"


def test_show_tree_draws_a_chain_as_a_tree_with_the_same_output(capsys, folders, single_thread):
    chain = json.loads(run_main(capsys, *local_models(folders), "--gamma", "3", "--json").stdout)
    drawn = run_main(capsys, *local_models(folders), "--gamma", "3", "--show-tree", "--json")
    assert_ok(drawn)
    assert json.loads(drawn.stdout)["token_ids"] == chain["token_ids"]
    assert "└── " in drawn.stderr and "├── " not in drawn.stderr, "one child per node"
    shown = run_main(capsys, *local_models(folders), "--gamma", "3", "--show-tree", "--max-gen", "4")
    assert_ok(shown)
    assert " proposes 3 tokens per step, " in shown.stdout.splitlines()[0], "the header names the chain, not 1,1,1"


# ---------------------------------------------------------------------------
# Context windows: only the target's limits the run
# ---------------------------------------------------------------------------


def test_a_prompt_past_the_draft_window_goes_on_with_plain_target_steps(capsys, folders, single_thread):
    """A 40-token prompt with a draft whose window is 32: the target's window
    (128) admits it, every step is a plain target step, the output is still
    the target's own, and the run stopped at --max-gen, not at any window."""
    args = local_models(folders, draft="short_window_draft")
    result = run_main(capsys, *args, "--compare", "-p", prompt_of(40, folders))
    assert_ok(result)
    assert "stopped at --max-gen" in result.stdout and "context window (" not in result.stdout
    assert re.search(r"plain steps\s+20 target calls drafted nothing \(the sequence outgrew the draft's context "
                     r"window of 32 tokens\)", result.stdout), result.stdout
    assert re.search(r"acceptance α\s+n/a: nothing was drafted", result.stdout)
    assert "identical to the target alone, token for token (20 tokens)" in result.stdout


def test_plain_steps_once_the_sequence_outgrows_the_draft_window(capsys, folders, single_thread):
    args = [*local_models(folders, draft="short_window_draft"), "--json", "--compare"]
    out = json.loads(run_main(capsys, *args, "-p", prompt_of(20, folders)).stdout)
    stats = out["stats"]
    assert 0 < stats["plain_steps"] < stats["target_calls"], "drafts first, then plain steps past 32 tokens"
    assert stats["accepted"] + stats["target_tokens"] == stats["new_tokens"] == 20
    assert out["comparison"]["identical"] is True
    # The prediction takes eq. 1 for the K each step asked (0 past the draft's window), not γ for every step.
    comparison, hist = out["comparison"], stats["gamma_hist"]
    expected = sum(n * expected_tokens_per_step(stats["alpha"], K) for K, n in enumerate(hist)) / sum(hist)
    cost_per_call = (stats["draft_seconds"] + stats["verify_seconds"]) / stats["target_calls"]
    assert hist[0] == stats["plain_steps"] and comparison["predicted_from"] == "alpha"
    assert comparison["predicted_speedup"] == pytest.approx(
        expected * comparison["step_seconds"]["target"] / cost_per_call, rel=1e-9)
    assert expected < expected_tokens_per_step(stats["alpha"], 4)


def test_the_gpu_rehearsal_shows_nothing_and_leaves_the_schedule_as_it_was(capsys, folders, single_thread):
    """Off the CPU the run is made once untimed first (`rehearse`); run here on the CPU. It drew every tree of
    --show-tree on stderr before the real run drew them again."""
    from gpt2 import load_model
    from spec_decoding import HeuristicGamma, ModelDrafter

    target, draft = (load_model(folders[name], accelerate=False) for name in ("target", "draft"))
    tokenizer, ids = load_tokenizer(folders["target"]), torch.tensor([[15496, 995]])
    for extra in (["--tree", "2,1", "--show-tree", "--compare"], ["--gamma", "heuristic", "--temperature", "1"]):
        args = cli.build_parser().parse_args([*local_models(folders), *extra])
        schedule = None if "--tree" in extra else HeuristicGamma(max_gamma=12)
        drafter = draft if schedule is None else ModelDrafter(draft)
        cli.rehearse(args, check_settings(args), check_tree(args), target, drafter, schedule, ids, tokenizer)
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err == "warming up the cpu device: the run once, untimed and not " \
            "shown ...\n", captured.err
        assert schedule is None or schedule.K == 5, "the rehearsal's K moves stay in its copy of the schedule"


def test_compare_with_a_context_window_of_two(tmp_path, capsys, single_thread):
    """The target's step cost is timed on the prompt's cache, rewound after each step: a window of 2 leaves room
    for one new token and no more, and --compare still predicts (it timed no step, and failed, before)."""
    config = GPT2Config(n_layer=1, n_head=1, n_embd=8, n_ctx=2)
    folders = {role: write_checkpoint(tmp_path / role, config, hub_layout(tiny_gpt2(config, seed=seed)),
                                      with_tokenizer=True) for role, seed in (("target", 0), ("draft", 1))}
    result = run_main(capsys, "--target", str(folders["target"]), "--draft", str(folders["draft"]), "-p", "Hello",
                      "--gamma", "1", "--compare", "--json")
    assert_ok(result)
    comparison = json.loads(result.stdout)["comparison"]
    assert comparison["identical"] and comparison["step_seconds"]["target"] > 0 and comparison["predicted_speedup"] > 0


def test_compare_times_the_target_step_on_the_prompt_and_on_the_whole_text(capsys, folders, monkeypatch):
    """Attention grows with the text: t_t is the mean of the step's cost before the run (on the prompt's cache)
    and after it (on the whole text's)."""
    timed = []

    def fake_steps(target, input_ids, steps=5):
        timed.append(input_ids.size(1))
        return [0.001 * len(timed)] * steps  # 1 ms before the run, 2 ms after

    monkeypatch.setattr(cli, "target_step_seconds", fake_steps)
    out = json.loads(run_main(capsys, *local_models(folders), "--json", "--compare", "-p", "Hello world").stdout)
    assert timed == [2, 2 + 20] and out["comparison"]["step_seconds"]["target"] == pytest.approx(0.0015)


def test_a_run_cut_at_end_of_text_says_so_and_predicts_from_what_it_measured(capsys, folders, monkeypatch,
                                                                             single_thread):
    # The step that reached end-of-text had asked for 4 drafts: "drafts after a rejection are never judged" with no
    # rejection, and eq. 1's 5.00 expected beside 1.00 measured, in the prediction too.
    enc = load_tokenizer(folders["target"])
    prompt = enc.encode("Hello world")
    greedy = generate(load_model(folders["target"]), torch.tensor([prompt]), 3)[0, len(prompt):].tolist()
    monkeypatch.setattr(gpt2, "END_OF_TEXT_ID", greedy[-1])  # the target's third token ends the text
    args = [*local_models(folders), "--gamma", "4", "--compare", "-p", "Hello world"]
    out = json.loads(run_main(capsys, *args, "--json").stdout)
    assert out["stats"]["stopped_at_eos"] and out["token_ids"] == greedy[: greedy.index(greedy[-1]) + 1]
    assert out["comparison"]["predicted_from"] == "tokens_per_target_call"
    text = " ".join(run_main(capsys, *args).stdout.split())
    assert "drafts after a rejection or the end-of-text are never judged" in text
    assert "; end-of-text cut the last step short)" in text
    # End-of-text as the target's own token (the draft is the target: every draft accepted, then the bonus token):
    # the step was whole, and eq. 1 holds.
    gamma = next(i for i in range(1, 3) if greedy[i] not in greedy[:i])
    monkeypatch.setattr(gpt2, "END_OF_TEXT_ID", greedy[gamma])
    args = [*local_models(folders, draft="target"), "--gamma", str(gamma), "--compare", "-p", "Hello world"]
    out = json.loads(run_main(capsys, *args, "--json").stdout)
    assert out["stats"]["stopped_at_eos"] and out["stats"]["target_calls"] == 1
    assert out["token_ids"] == greedy[: gamma + 1]
    assert out["comparison"]["predicted_from"] == "alpha"
    text = " ".join(run_main(capsys, *args).stdout.split())
    assert "drafts after a rejection are never judged" in text and "cut the last step short" not in text


def test_with_p_min_the_prediction_takes_the_measured_tokens_per_call(capsys, folders, single_thread):
    """p_min stops a chain short of γ, so eq. 1 at γ would overstate what a step drafts."""
    args = [*local_models(folders), "--json", "--compare", "--gamma", "8", "--draft-p-min", "1.0"]
    out = json.loads(run_main(capsys, *args, "-p", "Hello world").stdout)
    stats, comparison = out["stats"], out["comparison"]
    assert stats["draft_calls"] < 8 * stats["target_calls"], "p_min stopped the chains early"
    cost_per_call = (stats["draft_seconds"] + stats["verify_seconds"]) / stats["target_calls"]
    assert comparison["predicted_from"] == "tokens_per_target_call"
    assert comparison["predicted_speedup"] == pytest.approx(
        stats["tokens_per_target_call"] * comparison["step_seconds"]["target"] / cost_per_call, rel=1e-9)


@pytest.mark.parametrize("prompt_tokens", [120, 127])
def test_the_stop_reason_names_the_targets_window(capsys, folders, single_thread, prompt_tokens):
    """A prompt of 120 (127) tokens leaves room for 8 (1) of the 20 tokens asked for."""
    args = local_models(folders, draft="short_window_draft")
    result = run_main(capsys, *args, "--compare", "-p", prompt_of(prompt_tokens, folders))
    assert_ok(result)
    n_new = 128 - prompt_tokens
    stop = rf"new tokens\s+{n_new} in \d+ target calls?, stopped at the target's context window \(128 tokens\)"
    assert re.search(stop, result.stdout), result.stdout
    assert f"identical to the target alone, token for token ({n_new} token{'s' * (n_new != 1)})" in result.stdout


def test_prompt_longer_than_the_targets_context_window(capsys, folders, single_thread):
    result = run_main(capsys, *local_models(folders), "-p", "hello " * 200)
    assert_bad_input(result, "the context window is 128: shorten it to at most 127 tokens")


# ---------------------------------------------------------------------------
# Settings the library reads differently than one might expect
# ---------------------------------------------------------------------------


def test_a_tiny_temperature_is_greedy(capsys, folders, single_thread):
    """1e-39 would overflow the softmax; below 1e-4 the library decodes greedily."""
    result = run_main(capsys, *local_models(folders), "--temperature", "1e-39", "--compare")
    assert_ok(result)
    assert "\ngreedy (a temperature below 0.0001 is greedy), up to 20 new tokens" in result.stdout
    assert "identical to the target alone, token for token (20 tokens)" in result.stdout


def test_any_integer_is_a_seed(capsys, folders, single_thread):
    """torch takes seeds modulo 2**64: -1 and 2**64 - 1 are the same seed, and
    a seed past 2**64 works too."""
    sampled = [*local_models(folders), "--json", "--temperature", "1.0"]
    runs = {seed: run_main(capsys, *sampled, "--seed", str(seed)) for seed in (-1, 2**64 - 1, 2**70)}
    for result in runs.values():
        assert_ok(result)
    tokens = {seed: json.loads(result.stdout)["token_ids"] for seed, result in runs.items()}
    assert tokens[-1] == tokens[2**64 - 1]
    assert len(tokens[2**70]) == 20


# ---------------------------------------------------------------------------
# Streaming and Ctrl-C, in process
# ---------------------------------------------------------------------------


class Sink:
    """A stdout stand-in that records each write."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> None:
        self.writes.append(text)

    def flush(self) -> None:
        pass


def test_stream_holds_back_a_character_split_across_tokens(folders):
    enc = load_tokenizer(folders["target"])
    text = "a 🙂 and 世界"
    tokens = enc.encode(text)
    assert any(len(enc.decode_single_token_bytes(t).decode("utf-8", errors="ignore")) == 0 for t in tokens), (
        "the test needs a token that is only part of a character"
    )
    sink = Sink()
    stream = TokenStream(enc, sink, color=False)
    for token in tokens:
        stream.on_step([token], 0)
    stream.finish()
    assert "".join(sink.writes) == text
    assert all("\ufffd" not in w for w in sink.writes), "no replacement character: halves are held back"
    assert stream.tokens == tokens


def test_stream_colours_each_token_by_who_chose_it(folders):
    enc = load_tokenizer(folders["target"])
    sink = Sink()
    stream = TokenStream(enc, sink, color=True)
    stream.on_step(enc.encode(" the cat sat"), 2)  # two drafts accepted, then the target's own token
    assert sink.writes == [f"{ACCEPTED_STYLE} the{RESET}", f"{ACCEPTED_STYLE} cat{RESET}", f"{TARGET_STYLE} sat{RESET}"]
    assert stream.accepted == [True, True, False]


def ctrl_c_in_a_target_pass(monkeypatch, when) -> None:
    """Makes `spec_decoding.speculative_generate` raise KeyboardInterrupt (Ctrl-C) in the target's forward pass
    where `when(shapes)` holds: `shapes`, the (rows, tokens) of every target pass so far, this one last."""
    import spec_decoding

    real = spec_decoding.speculative_generate

    def interrupted_generate(target, *args, **kwargs):
        shapes = []

        def ctrl_c(module, inputs):
            shapes.append(tuple(inputs[0].shape))
            if when(shapes):
                raise KeyboardInterrupt

        handle = target.register_forward_pre_hook(ctrl_c)
        try:
            return real(target, *args, **kwargs)
        finally:
            handle.remove()

    monkeypatch.setattr(spec_decoding, "speculative_generate", interrupted_generate)


@pytest.mark.parametrize("output", ["text", "json"])
def test_ctrl_c_prints_the_text_and_stats_so_far_with_exit_code_130(
    tmp_path, folders, capsys, monkeypatch, single_thread, output
):
    """Ctrl-C lands in the target's forward pass of the third step: what the
    first two steps committed is printed, with the stats of those two steps."""
    ctrl_c_in_a_target_pass(monkeypatch, lambda shapes: len(shapes) == 4)  # prefill, step 1, step 2, then step 3
    extra = ["--json"] if output == "json" else []
    code = cli.main([*ON_CPU, "--weights-dir", str(tmp_path / "weights"), *local_models(folders), "--compare", *extra])
    out = capsys.readouterr().out
    assert code == 130
    if output == "json":
        result = json.loads(out)
        assert result["interrupted"] is True
        assert result["stats"]["target_calls"] == 2
        assert 2 <= len(result["token_ids"]) == result["stats"]["new_tokens"] <= 10
        assert result["comparison"] is None, "no baseline after Ctrl-C"
    else:
        assert "[interrupted]" in out
        assert re.search(r"new tokens\s+([2-9]|10) in 2 target calls, interrupted \(Ctrl-C\)", out), out
        assert "acceptance α" in out and "forward calls" in out
        assert "target alone" in out and "speedup" not in out, "no baseline after Ctrl-C"


@pytest.mark.parametrize("output", ["text", "json"])
def test_ctrl_c_in_the_target_alone_leaves_the_finished_run_finished(folders, capsys, monkeypatch, single_thread,
                                                                    output):
    # It read "new tokens 20 in 4 target calls, interrupted (Ctrl-C)" and "target alone: not run" after a whole run.
    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "compare_with_target_alone", ctrl_c)
    extra = ["--json"] if output == "json" else []
    result = run_main(capsys, *local_models(folders), "--compare", "--max-gen", "8", *extra, "-p", "Hello world")
    assert result.returncode == 130
    if output == "json":
        out = json.loads(result.stdout)
        assert out["interrupted"] is False and len(out["token_ids"]) == 8 and out["comparison"] is None
    else:
        assert re.search(r"new tokens\s+8 in \d+ target calls, stopped at --max-gen", result.stdout), result.stdout
        assert "[interrupted]" not in result.stdout
        assert re.search(r"target alone\s+interrupted \(Ctrl-C\) before it finished", result.stdout), result.stdout


# The command with a real SIGINT sent to itself: `where` patches a function the run calls to send it.
REAL_CTRL_C = """
import os, signal, sys, time
import gpt2.loading, spec_decoding
import spec_decoding_generate as cli

where = sys.argv[1]
if where == "loading":  # inside code that swallows KeyboardInterrupt, as torch's import did now and then
    real_shapes = gpt2.loading.stored_shapes

    def stored_shapes(*args):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(10)
        except KeyboardInterrupt:
            pass
        return real_shapes(*args)

    gpt2.loading.stored_shapes = stored_shapes
else:  # in the target's fourth pass: prefill, two steps, then the third
    real_generate = spec_decoding.speculative_generate

    def speculative_generate(target, *args, **kwargs):
        passes = []

        def pass_(module, inputs):
            passes.append(1)
            if len(passes) == 4:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(10)

        handle = target.register_forward_pre_hook(pass_)
        try:
            return real_generate(target, *args, **kwargs)
        finally:
            handle.remove()

    spec_decoding.speculative_generate = speculative_generate
sys.exit(cli.main(sys.argv[2:]))
"""


def run_with_real_ctrl_c(tmp_path: Path, where: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", REAL_CTRL_C, where, *ON_CPU, *args], cwd=REPO_ROOT,
                          env=cli_env(tmp_path), capture_output=True, text=True, encoding="utf-8", timeout=120)


def test_ctrl_c_before_anything_is_shown_ends_the_run_at_once(tmp_path, folders):
    """Ctrl-C while torch imported or the models loaded: depending on where the signal landed, torch swallowed the
    KeyboardInterrupt (the run went on to exit 0), turned it into another error (a RecursionError read as a config
    too large, an ImportError) or aborted (SIGABRT)."""
    result = run_with_real_ctrl_c(tmp_path, "loading", *local_models(folders))
    assert (result.returncode, result.stdout) == (130, ""), result
    assert result.stderr.splitlines()[-1] == "interrupted" and "Traceback" not in result.stderr


@pytest.mark.parametrize("prompts", ["one", "file"])
def test_a_real_ctrl_c_once_the_text_streams_prints_the_text_and_stats_so_far(tmp_path, folders, prompts):
    path = tmp_path / "prompts.txt"
    path.write_text("Hello world\n", encoding="utf-8")
    source = ["-p", "Hello world"] if prompts == "one" else ["--prompts-file", str(path)]
    result = run_with_real_ctrl_c(tmp_path, "streaming", *local_models(folders), *source)
    assert result.returncode == 130 and "Traceback" not in result.stderr, result
    if prompts == "one":
        assert "[interrupted]" in result.stdout
        assert re.search(r"new tokens\s+([2-9]|10) in 2 target calls, interrupted \(Ctrl-C\)", result.stdout), result
    else:
        assert re.search(r"\[([2-9]|10) new tokens in 2 target calls, interrupted \(Ctrl-C\);", result.stdout), result


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2, "one output is a prefix of the other"


def comparison_of(spec: list[int], alone: list[int], *, speedup: float, predicted: float, agree: bool,
                  outside: float = 0.01) -> dict:
    return {
        "baseline_token_ids": alone, "baseline_tokens_per_second": 10.0, "baseline_seconds": 0.3,
        "speedup": speedup, "predicted_speedup": predicted, "speedup_matches_prediction": agree,
        "spec_seconds": 0.2, "outside_steps_seconds": outside,
        "step_seconds": {"draft": 0.002, "target": 0.01, "verify": 0.012},
        "greedy": True, "first_difference": first_difference(spec, alone), "predicted_from": "alpha",
    }


def test_compare_report_names_the_first_differing_token(folders, capsys):
    enc = load_tokenizer(folders["target"])
    spec, alone = enc.encode(" the cat sat"), enc.encode(" the dog sat")
    print_comparison(comparison_of(spec, alone, speedup=2.0, predicted=1.9, agree=True), spec, enc)
    out = capsys.readouterr().out
    assert "DIFFERENT from the target alone from new token 1: speculative ' cat' vs target alone ' dog'" in out
    assert "2.00x measured, 1.90x predicted" in out and "disagree" not in out
    assert "draft 2.00 ms, target 10.00 ms, verification 12.00 ms (this run; the target alone took 100.00 ms per " \
        "token)" in out  # 0.3 s for its 3 tokens


def test_the_report_figures_from_known_counts(capsys):
    # Each figure from counts set by hand (the runs above check only the figures' format).
    stats = SpecStats(4, tree="2,1")
    stats.gamma_hist = [1, 0, 2, 0, 1]  # K = 0 once, 2 twice, 4 once
    assert describe_gammas(stats, "auto") == "auto: K = 0 x 1, 2 x 2, 4 x 1 steps (mean 2.0)"
    stats.drafted, stats.target_calls, stats.reached_at, stats.accepted_at = 12, 4, [4, 2], [3, 1]
    assert tree_rows(stats)[0] == ("tree", "2,1: 3.0 drafted tokens per step")  # 12 drafted over 4 steps
    stats.accepted_rank = [[2, 1], [1, 0]]  # depth 1: twice the first candidate, once the second; depth 2: the first
    assert tree_rows(stats)[2:4] == [("  depth 1", "accepted 3 of 4 (candidate #1 2, #2 1)"),
                                     ("  depth 2", "accepted 1 of 2 (candidate #1 1)")]
    batches = [BatchStats(2, 2), BatchStats(2, 1)]
    batches[0].active_rows, batches[1].active_rows = [2, 2, 1], [1]  # 6 rows over 4 steps
    print_batch_summary(batches, 2, 1.0, interrupted=False)
    assert re.search(r"rows per step\s+1\.50 still active on average", capsys.readouterr().out)
    # Within 30% of each other, as a ratio: 4.0 and 3.2 agree, 0.5 and 0.7 do not.
    assert speedups_agree(4.0, 3.2) and speedups_agree(3.2, 4.0) and not speedups_agree(0.5, 0.7)


def test_compare_report_says_plainly_when_the_speedups_disagree(folders, capsys):
    """α = 0 allows no speedup; a measured 2.98x means the load changed."""
    enc = load_tokenizer(folders["target"])
    tokens = enc.encode(" the cat sat")
    print_comparison(comparison_of(tokens, tokens, speedup=2.98, predicted=0.71, agree=False), tokens, enc)
    out = " ".join(capsys.readouterr().out.split())
    assert "2.98x measured, 0.71x predicted" in out
    assert "they disagree by more than 30%, so the measured one is not reliable: the machine's load changed " \
        "between the two runs" in out


def test_compare_report_names_a_long_prefill_when_the_speedups_disagree(folders, capsys):
    # A long prompt and few new tokens: the prefill, in the measured speedup only, is most of the run.
    enc = load_tokenizer(folders["target"])
    tokens = enc.encode(" the cat sat")
    print_comparison(comparison_of(tokens, tokens, speedup=0.91, predicted=1.71, agree=False, outside=0.15),
                     tokens, enc)
    out = " ".join(capsys.readouterr().out.split())
    assert "0.91x measured, 1.71x predicted" in out and "load changed" not in out
    assert "0.15 s of the run's 0.20 s went outside its steps, mostly the prompt's prefill in both models" in out


@pytest.mark.parametrize("speedup, predicted, outside", [
    (1.65, 0.94, 0.06),  # measured above predicted: leaving the prefill out would only widen the gap
    (0.5, 2.0, 0.05),  # below, but 0.05 s of 0.20 s lifts 0.5x to 0.67x only: far from 2.0x still
])
def test_compare_report_blames_the_prefill_only_where_it_can_close_the_gap(folders, capsys, speedup, predicted,
                                                                           outside):
    enc = load_tokenizer(folders["target"])
    tokens = enc.encode(" the cat sat")
    print_comparison(comparison_of(tokens, tokens, speedup=speedup, predicted=predicted, agree=False,
                                   outside=outside), tokens, enc)
    out = " ".join(capsys.readouterr().out.split())
    assert "went outside its steps" not in out and "the machine's load changed between the two runs" in out


# ---------------------------------------------------------------------------
# Bad input: exit code 2, one line, no traceback
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gamma", "0"], "--gamma must be an integer >= 1, 'auto' or 'heuristic', got 0"),
        (["--gamma", "-3"], "--gamma must be an integer >= 1, 'auto' or 'heuristic', got -3"),
        (["--gamma", "abc"], "argument --gamma: must be an integer >= 1, 'auto' or 'heuristic', got 'abc'"),
        (["--gamma", "True"], "argument --gamma: must be an integer >= 1, 'auto' or 'heuristic', got 'True'"),
        (["--gamma", "2.5"], "argument --gamma: must be an integer >= 1, 'auto' or 'heuristic', got '2.5'"),
        (["--gamma", "Auto"], "argument --gamma: must be an integer >= 1, 'auto' or 'heuristic', got 'Auto'"),
        (["--draft", "ngram", "--ngram", "0"], "--ngram must be an integer >= 1, got 0"),
        (["--ngram", "2"], "--ngram is the suffix length of --draft ngram: add --draft ngram"),
        (["--draft", "ngram", "--draft-quantize", "int8"], "--draft-quantize is for a draft model; --draft ngram"),
        (["--draft", "ngram", "--draft-p-min", "0.3"], "--draft-p-min is for a draft model; --draft ngram"),
        (["--draft-p-min", "1.5"], "--draft-p-min must be a probability in [0, 1], got 1.5"),
        (["--gamma", "auto", "--tree", "2,1"], "--gamma auto drafts a chain, one sequence: leave out --tree"),
        (["--draft", "ngram", "--ngram", "2", "--show-tree"], "--show-tree draws only a draft model's chain of a "
                                                             "fixed --gamma, or a token tree: leave out --show-tree, "
                                                             "or --draft ngram --ngram 2"),
        (["--draft-p-min", "0.2", "--tree", "2,1", "--show-tree"],
         "--draft-p-min drafts a chain, one sequence: leave out --tree and --show-tree"),
        # --tree-depth alone is a tree flag too (it once asked for --tree-nodes, which then was refused)
        (["--draft", "ngram", "--gamma", "auto", "--tree-depth", "2"],
         "--gamma auto and --draft ngram draft a chain, one sequence: leave out --tree-depth"),
        (["--gamma", "heuristic", "--prompts-file", "prompts.txt"],
         "--prompts-file decodes every prompt with a draft model's chain of a fixed --gamma: leave out "
         "--gamma heuristic, or give one --prompt instead"),
        # every flag in the way at once (leaving out one of them was refused for the others)
        (["--prompts-file", "prompts.txt", "--tree-nodes", "4", "--tree-depth", "2", "--show-tree", "--draft-p-min",
          "0.1"], "leave out --draft-p-min, --tree-nodes, --tree-depth and --show-tree, or give one --prompt instead"),
        (["--max-gen", "0"], "--max-gen must be an integer >= 1, got 0"),
        (["--temperature", "-0.5"], "--temperature must be a number >= 0 (0 = greedy) and <= 3.4e+38, got -0.5"),
        (["--temperature", "nan"], "--temperature must be a number >= 0 (0 = greedy) and <= 3.4e+38, got nan"),
        (["--temperature", "inf"], "--temperature must be a number >= 0 (0 = greedy) and <= 3.4e+38, got inf"),
        (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),  # no "(or None ...)": the API's, not the flag's
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--top-p", "nan"], "--top-p must be in (0, 1]"),
        (["--top-k", "0"], "--top-k must be an integer >= 1, got 0"),
        (["--weights-dir", " "], "--weights-dir is empty: give the folder for downloads, or leave it out for weights/"),
        (["--draft", ""], "--draft is empty: give a Hub repo id such as gpt2 or a local folder, or leave it out"),
        (["--top-k", "True"], "argument --top-k: invalid int value: 'True'"),
        (["--seed", "1.5"], "argument --seed: invalid int value: '1.5'"),
        (["--prompt", ""], "the prompt is empty"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--tree", "0,2"], "--tree: a tree shape is children per depth, integers >= 1 such as 3,2,1,1; got '0,2'"),
        (["--tree", "abc"], "--tree: a tree shape is children per depth"),
        (["--tree", ""], "--tree: a tree shape is children per depth"),
        (["--tree-nodes", "8"], "--tree-nodes needs --tree-depth: a dynamic tree has a node budget N and a depth D"),
        (["--tree-depth", "3"], "--tree-depth needs --tree-nodes"),
        (["--tree-nodes", "0", "--tree-depth", "1"], "--tree-nodes must be an integer >= 1, got 0"),
        (["--tree-nodes", "3", "--tree-depth", "0"], "--tree-depth must be an integer >= 1, got 0"),
        (["--tree-nodes", "2", "--tree-depth", "3"], "--tree-depth 3 is more than --tree-nodes 2"),
        (["--tree-nodes", "x"], "argument --tree-nodes: invalid int value: 'x'"),
        (["--tree", "2,1", "--tree-nodes", "4", "--tree-depth", "2"], "give --tree (a fixed shape) or --tree-nodes"),
        (["--tree", "2,1", "--gamma", "3"], "give --gamma (a chain of drafted tokens) or a tree"),
        (["--batch-size", "4"], "--batch-size is how many prompts of --prompts-file are decoded together: add "
                                "--prompts-file, or leave out --batch-size"),
    ],
    ids=["gamma-0", "gamma-negative", "gamma-abc", "gamma-bool", "gamma-float", "gamma-Auto", "ngram-0",
         "ngram-without-ngram-draft", "ngram-draft-quantize", "ngram-p-min", "p-min-1.5", "auto-tree", "ngram-tree",
         "p-min-tree-shown", "depth-alone-with-chain-options",
         "heuristic-file", "file-with-everything", "max-gen-0", "negative-temperature", "nan-temperature",
         "inf-temperature", "top-p-0", "top-p-1.5", "top-p-nan", "top-k-0", "weights-dir-blank", "draft-blank",
         "top-k-bool", "seed-float", "empty-prompt",
         "unknown-device", "tree-0", "tree-text", "tree-empty", "tree-nodes-alone", "tree-depth-alone",
         "tree-nodes-0", "tree-depth-0", "tree-too-deep", "tree-nodes-text", "tree-and-dynamic", "tree-and-gamma",
         "batch-size-without-file"],
)
def test_bad_settings(capsys, args, message):
    assert_bad_input(run_main(capsys, *args), message)


def test_a_dynamic_tree_may_be_one_level_deep():
    args = cli.build_parser().parse_args(["--tree-nodes", "3", "--tree-depth", "1"])
    assert check_tree(args) == TreeShape(nodes=3, depth=1)  # three candidates for the next token


@pytest.mark.parametrize("stdin", ["", "\n"], ids=["empty", "blank"])
def test_an_empty_prompt_from_stdin(capsys, monkeypatch, stdin):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    assert_bad_input(run_main(capsys, "-p", "-"), "the prompt read from stdin is empty")


def test_a_byte_order_mark_before_the_prompt_from_stdin_is_dropped(capsys, monkeypatch, folders, single_thread):
    # As --prompts-file drops it: the model saw three more tokens (171, 119, 123) before "Hello world".
    monkeypatch.setattr(sys, "stdin", io.StringIO("\ufeffHello world\r\n"))
    out = json.loads(run_main(capsys, *local_models(folders), "-p", "-", "--json").stdout)
    assert out["prompt"] == "Hello world" and out["prompt_token_ids"] == [15496, 995]


def test_a_closed_or_undecodable_stdin(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", None)  # what Python gives a process started with stdin closed (<&-)
    assert_bad_input(run_main(capsys, "-p", "-"), "'-p -' reads the prompt from stdin, but stdin is closed")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9\n"), encoding="utf-8"))
    assert_bad_input(run_main(capsys, "-p", "-"), "the prompt read from stdin is not UTF-8 text")
    # Under a C or POSIX locale Python's stdin keeps such bytes as lone surrogates instead of raising.
    undecodable = io.TextIOWrapper(io.BytesIO(b"caf\xe9\n"), encoding="utf-8", errors="surrogateescape")
    monkeypatch.setattr(sys, "stdin", undecodable)
    assert_bad_input(run_main(capsys, "-p", "-"), "the prompt read from stdin is not UTF-8 text")


def test_a_prompt_argument_that_is_not_utf8_is_refused(capsys):
    # Bytes of a command-line argument that are not UTF-8 reach Python as lone surrogates, on every locale;
    # the tokenizer would replace them with U+FFFD and continue another prompt.
    assert_bad_input(run_main(capsys, "-p", "caf\udce9"), "the --prompt text is not UTF-8 text")


def test_a_prompt_from_stdin_that_is_not_utf8_in_a_real_process_under_the_c_locale(tmp_path):
    env = cli_env(tmp_path, None) | {"LC_ALL": "C"}
    env.pop("PYTHONIOENCODING")
    result = subprocess.run([sys.executable, str(SCRIPT), "-p", "-"], cwd=REPO_ROOT, env=env, input=b"caf\xe9\n",
                            capture_output=True, timeout=120)
    assert result.returncode == 2 and result.stderr.decode() == "error: the prompt read from stdin is not UTF-8 " \
        "text: save or type it as UTF-8\n", result.stderr.decode()


@pytest.mark.parametrize("locale, args", [({"PYTHONIOENCODING": "latin-1"}, ["-p", "-"]),
                                          ({"LC_ALL": "C", "PYTHONUTF8": "0"}, ["-p", "-"]),
                                          ({"LC_ALL": "C", "PYTHONUTF8": "0"}, ["-p", "café"])],
                         ids=["stdin-latin-1", "stdin-c-locale", "argument-c-locale"])
def test_a_utf8_prompt_under_a_locale_that_is_not_utf8(tmp_path, folders, locale, args):
    # Python decodes stdin and the command line with the locale's encoding (stdin: PYTHONIOENCODING's): "café"
    # became "cafÃ©" under latin-1, and under a C locale without UTF-8 mode it was refused as not UTF-8.
    env = cli_env(tmp_path) | locale
    if "PYTHONIOENCODING" not in locale:
        env.pop("PYTHONIOENCODING")
    result = subprocess.run([sys.executable, str(SCRIPT), *ON_CPU, *local_models(folders), "--max-gen", "1",
                             "--json", *args], cwd=REPO_ROOT, env=env, input="café\n".encode(), capture_output=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    assert json.loads(result.stdout)["prompt"] == "café"


def test_a_prompt_from_stdin_too_long_for_any_context_window(capsys, monkeypatch):
    # `-p - < /dev/zero` filled the memory: reading stops after MAX_PROMPT_BYTES.
    stdin = io.TextIOWrapper(io.BytesIO(b"a" * (MAX_PROMPT_BYTES + 1)), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    assert_bad_input(run_main(capsys, "-p", "-"), "the prompt read from stdin is over 4 MiB, far more than a "
                     "context window holds (GPT-2's: 1024 tokens): pipe in a shorter text")
    assert stdin.buffer.tell() == MAX_PROMPT_BYTES + 1, "read no further than the limit"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full (Linux has one)")
@pytest.mark.parametrize("args", [["-p", "Hello"], ["--help"]])
def test_output_that_cannot_be_written_is_not_bad_input(tmp_path, folders, args):
    # It said "error: [Errno 28] No space left on device" with exit code 2, bad input; --help, whose text argparse
    # writes, ended in a traceback (exit code 1).
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, str(SCRIPT), *ON_CPU, *local_models(folders), *args],
                                cwd=REPO_ROOT, env=cli_env(tmp_path), stdout=full, stderr=subprocess.PIPE,
                                text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.splitlines()[-1] == (
        "error: standard output cannot be written (No space left on device): send it to a file or a terminal that "
        "takes it")


def test_a_bad_value_in_a_real_process_is_one_line_and_exit_code_2(tmp_path):
    assert_bad_input(run_cli(tmp_path, "--top-k", "-3"), "--top-k must be an integer >= 1")


def test_with_stderr_closed_nothing_meant_for_it_reaches_stdout(tmp_path):
    # Python gives a process started with stderr closed (2>&-) sys.stderr = None, and print(file=None) writes to
    # stdout, which --json promises holds one JSON object only.
    command = shlex.join([sys.executable, str(SCRIPT), "--top-k", "-3"]) + " 2>&-"
    done = subprocess.run(["bash", "-c", command], cwd=REPO_ROOT, env=cli_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done.stdout


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, where every write fails")
def test_a_stderr_that_cannot_be_written_leaves_the_run_and_its_text_alone(tmp_path, folders):
    # Every stderr write failing (a full disk; 2>&- under a pyenv shim left fd 2 read-only): the first progress
    # line raised, then the error about it did too: exit code 1 and nothing on stdout.
    command = [sys.executable, str(SCRIPT), *ON_CPU, *local_models(folders), "--max-gen", "6", "-p", "Hello"]
    with open("/dev/full", "w") as full:
        done = subprocess.run(command, cwd=REPO_ROOT, env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=full,
                              text=True, timeout=120)
        bad = subprocess.run([*command, "--top-k", "-3"], cwd=REPO_ROOT, env=cli_env(tmp_path),
                             stdout=subprocess.PIPE, stderr=full, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("draft ") and "new tokens" in done.stdout, done.stdout
    assert bad.returncode == 2 and bad.stdout == ""


def test_main_leaves_stderr_as_it_found_it(capsys):
    # Each in-process call wrapped sys.stderr once more, for good; a copy of the wrapper recursed without end.
    before = sys.stderr
    for _ in range(2):
        assert_bad_input(run_main(capsys, "--top-k", "-3"), "--top-k must be an integer >= 1")
        assert sys.stderr is before
    assert copy.copy(Unfailing(before)).stream is before


def test_debug_adds_the_traceback_and_keeps_the_exit_code(capsys, monkeypatch, folders):
    result = run_main(capsys, "--debug", "--max-gen", "0")  # bad input: exit 2 with or without --debug
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.startswith("Traceback (most recent call last):")
    assert result.stderr.endswith("\nValueError: --max-gen must be an integer >= 1, got 0\n"
                                  "error: --max-gen must be an integer >= 1, got 0\n"), result.stderr

    import spec_decoding

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(spec_decoding, "speculative_generate", broken)
    for debug in ([], ["--debug"]):  # an unexpected failure: exit 1, the hint only without --debug
        result = run_main(capsys, *debug, *local_models(folders), "--max-gen", "2")
        assert result.returncode == 1, result.stderr
        assert ("Traceback" in result.stderr) == bool(debug), result.stderr
        assert result.stderr.endswith("error: unexpected KeyError: 'a bug'"
                                      + ("\n" if debug else " (run with --debug for the traceback)\n"))


def test_with_stdout_closed_it_stops_before_any_work(tmp_path, folders):
    # sys.stdout is None then: the run loaded both models and ended in "unexpected AttributeError" from isatty.
    command = shlex.join([sys.executable, str(SCRIPT), *ON_CPU, *local_models(folders)]) + " >&-"
    done = subprocess.run(["bash", "-c", command], cwd=REPO_ROOT, env=cli_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and done.stderr == "error: standard output is closed: run without >&- (or send it " \
        "to /dev/null)\n", done.stderr


def test_draft_and_target_with_different_vocabularies(capsys, folders, single_thread):
    result = run_main(capsys, "--draft", str(folders["other_vocab"]), "--target", str(folders["target"]))
    assert_bad_input(result, "draft and target have different vocabularies (50300 vs 50257 tokens)")


def without_vocabulary(folders: dict[str, Path], tmp_path: Path) -> Path:
    """The target's folder with its weights and config but no vocab.json and merges.txt."""
    bare = tmp_path / "no_vocabulary"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(folders["target"] / name)
    return bare


def test_a_target_without_vocabulary_files_and_tiktoken_offline(tmp_path, capsys, folders, tiktoken_offline):
    """Where the target's folder has no vocabulary and tiktoken cannot fetch its own (no network), the error
    says which folder and what to copy there."""
    bare = without_vocabulary(folders, tmp_path)
    result = run_main(capsys, "--draft", str(folders["draft"]), "--target", str(bare))
    assert_bad_input(result, f"no GPT-2 tokenizer: {bare} has no vocab.json + merges.txt and tiktoken could not "
                     "get its 'gpt2' files (FileNotFoundError): copy vocab.json and merges.txt of GPT-2 into")
    assert tiktoken_offline, "tiktoken was asked for its files, and no request left"


def test_a_vocabulary_that_cannot_be_read_is_not_called_missing(capsys, folders, monkeypatch):
    """A vocab.json that is there but cannot be read (another user's file) is named with why, not reported as
    missing."""
    import gpt2.tokenizer

    def unreadable(vocab, merges):
        raise PermissionError(13, "Permission denied", str(vocab))

    monkeypatch.setattr(gpt2.tokenizer, "read_mergeable_ranks", unreadable)
    result = run_main(capsys, *local_models(folders))
    assert_bad_input(result, f"Permission denied: '{folders['target'] / 'vocab.json'}'")
    assert "no GPT-2 tokenizer" not in result.stderr


def test_corrupt_weights_file(tmp_path, capsys, folders, single_thread):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "vocab.json", "merges.txt"):
        (broken / name).write_bytes((folders["draft"] / name).read_bytes())
    truncated = (folders["draft"] / "model.safetensors").read_bytes()[:5000]
    (broken / "model.safetensors").write_bytes(truncated)
    result = run_main(capsys, "--draft", str(broken), "--target", str(folders["target"]))
    assert_bad_input(result, "model.safetensors is corrupt or truncated")


def test_a_target_whose_forward_pass_overflows(tmp_path, capsys, folders, single_thread):
    """Embeddings of 3e38 pass the load's check (finite in float32) and overflow where they are added: sampling
    stopped with "unexpected RuntimeError: probability tensor contains either `inf`, `nan` ...", exit 1."""
    state = hub_layout(tiny_gpt2(CONFIG, seed=0))
    state |= {name: torch.full_like(state[name], 3e38) for name in ("wte.weight", "wpe.weight")}  # sum: inf
    overflowing = write_checkpoint(tmp_path / "overflowing", CONFIG, state, with_tokenizer=True)
    args = ["--draft", str(folders["draft"]), "--target", str(overflowing), "--temperature", "1", "-p", "Hello"]
    assert_bad_input(run_main(capsys, *args, "--json"), "the next-token distribution holds NaN or inf")
    streamed = run_main(capsys, *args)  # the prompt is out before the first step: the error goes on a line of its own
    assert streamed.returncode == 2 and streamed.stdout.endswith("Hello\n"), streamed
    assert streamed.stderr.splitlines()[-1].startswith("error: the next-token distribution holds NaN or inf")


def test_unavailable_device(capsys, folders):
    assert_bad_input(run_main(capsys, *local_models(folders), "--device", "cuda:99"), "device 'cuda:99'")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--quantize", "int4"], "unknown quantisation 'int4': choose none or int8"),
        (["--quantize", "int8", "--dtype", "bfloat16"], "int8 weights are for the CPU in float32, not cpu bfloat16"),
        (["--draft-quantize", "int4"], "unknown quantisation 'int4': choose none or int8"),
        (["--draft-quantize", "int8", "--dtype", "bfloat16"],
         "int8 weights are for the CPU in float32, not cpu bfloat16: use the CPU in float32 (device 'cpu', dtype "
         "float32: --device cpu --dtype float32), or no int8 (quantize=None: leave out --draft-quantize)"),
    ],
    ids=["unknown", "bfloat16", "draft-unknown", "draft-bfloat16"],
)
def test_bad_quantisation(capsys, folders, args, message):
    assert_bad_input(run_main(capsys, *local_models(folders), *args), message)


def test_unsupported_dtype(capsys, folders):
    result = run_main(capsys, *local_models(folders), "--dtype", "float64")
    assert_bad_input(result, "unsupported dtype 'float64': choose float32, float16 or bfloat16")


# ---------------------------------------------------------------------------
# Models from the (local) Hub
# ---------------------------------------------------------------------------


HUB_FILES = ("config.json", "model.safetensors", "vocab.json", "merges.txt")


def hub_files(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in HUB_FILES}


def default_hub(folders) -> HubServer:
    """The default --draft gpt2 --target gpt2-large, served by a local Hub."""
    return HubServer({"gpt2": hub_files(folders["draft"]), "gpt2-large": hub_files(folders["target"])}).start()


def test_hub_first_run_downloads_later_runs_need_no_network(tmp_path, folders):
    server = default_hub(folders)
    try:
        first = run_cli(tmp_path, "--max-gen", MAX_GEN, "--json", endpoint=server.url)
    finally:
        server.stop()
    assert_ok(first)
    assert sorted(server.files_requested("GET")) == sorted(2 * HUB_FILES), "each file downloaded once"
    for repo, role in (("gpt2", "draft"), ("gpt2-large", "target")):
        downloaded = tmp_path / "weights" / repo
        assert hub_files(downloaded) == hub_files(folders[role]), f"{repo} lands in weights/{repo}"
    assert f"downloading gpt2-large from {server.url} into {tmp_path / 'weights' / 'gpt2-large'}" in first.stderr
    assert json.loads(first.stdout)["stats"]["new_tokens"] == 20

    second = run_cli(tmp_path, "--max-gen", MAX_GEN, "--json")  # the server is gone: a closed port
    assert_ok(second)
    assert json.loads(second.stdout)["token_ids"] == json.loads(first.stdout)["token_ids"]
    assert "downloading" not in second.stderr


@pytest.mark.parametrize("size", [(24, 100), None], ids=["24x100", "0x0"])
def test_the_first_run_draws_download_progress_bars_on_a_terminal(tmp_path, folders, size):
    """As a user sees it: stdout and stderr on a pseudo-terminal. A terminal
    that reports no size (0 x 0, as `script` opens one) hides tqdm's bars
    unless the loader gives them a size."""
    server = default_hub(folders)
    try:
        code, out = run_in_pty(tmp_path, ["--max-gen", "1"], endpoint=server.url, size=size)
    finally:
        server.stop()
    assert code == 0, out
    # Which file each finished bar names (its URL cut to the bar's width): a loaded machine may redraw one at 100%.
    bars = re.findall(r"([^\s\]]*/resolve/main/model\.safetensors): 100%\|[^|]*\| 6\.\d\dM/6\.\d\dM", out)
    assert len(set(bars)) == 2, f"one finished bar per model.safetensors:\n{out}"
    # A bar as wide as the terminal, or 80 columns where the terminal reports none.
    width = max(len(line) for line in re.split(r"[\r\n]", out) if "100%|" in line)
    assert 80 < width <= 100 if size else width == 80, width


def test_hub_unknown_repo_id(tmp_path, folders):
    server = HubServer({"gpt2": hub_files(folders["draft"])}).start()
    try:
        result = run_cli(tmp_path, "--target", "nobody/no-such-model", endpoint=server.url)
    finally:
        server.stop()
    assert_bad_input(result, "no model 'nobody/no-such-model' on the Hugging Face Hub")


def test_no_network_and_no_local_copy_fails_at_once_in_one_line(tmp_path):
    """Against a closed port huggingface_hub alone would retry five times for
    23 s, logging each retry; the loader asks once and gives up."""
    result = run_cli(tmp_path, "--max-gen", MAX_GEN)
    assert_bad_input(result, "cannot download 'gpt2' (no network?")
    assert "and there is no complete local copy in" in result.stderr
    assert "connect to the internet and run again (a broken download resumes), or put config.json" in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert "Retrying" not in result.stderr


# ---------------------------------------------------------------------------
# --prompts-file: a batch of prompts, one block (or JSON object) per prompt
# ---------------------------------------------------------------------------

FILE_PROMPTS = ["Hello world", "Once upon a time, in a land far away", "The"]


def single_json(capsys, folders, prompt: str, *args: str) -> dict:
    """The --json result of `prompt` decoded alone with --prompt."""
    result = run_main(capsys, *local_models(folders), "--json", "-p", prompt, *args)
    assert_ok(result)
    return json.loads(result.stdout)


def test_a_prompts_file_gives_one_block_per_prompt_in_input_order(tmp_path, capsys, folders, single_thread):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(FILE_PROMPTS) + "\n", encoding="utf-8")
    result = run_main(capsys, *local_models(folders), "--prompts-file", str(path), "--batch-size", "2")
    assert_ok(result)
    out = result.stdout
    starts = [out.index(f"=== prompt {i + 1} of 3 (line {i + 1}) ===\n{p}") for i, p in enumerate(FILE_PROMPTS)]
    assert starts == sorted(starts), "blocks in input order"
    for prompt in FILE_PROMPTS:  # greedy: each block's text is the prompt's own decoding alone
        assert f"\n{prompt}{single_json(capsys, folders, prompt)['text']}\n" in out
    assert len(re.findall(r"\[20 new tokens in \d+ target calls?, stopped at --max-gen; α \d\.\d{3}", out)) == 3
    assert re.search(r"prompts\s+3 in 2 batches of up to 2", out) and "rows per step" in out
    # α over every row is accepted / judged summed over the rows (accepted / drafted passed the lines above).
    rows = [json.loads(line)["stats"] for line in run_main(capsys, *local_models(folders), "--json", "--prompts-file",
                                                           str(path), "--batch-size", "2").stdout.splitlines()]
    accepted, judged = sum(r["accepted"] for r in rows), sum(sum(r["reached_at"]) for r in rows)  # reached: judged
    assert sum(r["drafted"] for r in rows) != judged, "a batch whose rows judge fewer drafts than they draft"
    assert f"{accepted / judged:.3f} over every row ({accepted} of {judged} judged drafts)" in out


def test_jsonl_and_json_give_one_object_per_prompt_whatever_the_batch_size(tmp_path, capsys, folders, single_thread):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(FILE_PROMPTS)))
    sampling = ["--temperature", "1", "--seed", "7"]
    runs = {}
    for batch_size in ("1", "3"):
        result = run_main(capsys, *local_models(folders), "--json", "--prompts-file", str(path),
                          "--batch-size", batch_size, *sampling)
        assert_ok(result)
        runs[batch_size] = [json.loads(line) for line in result.stdout.splitlines()]
    objects = runs["3"]
    assert [o["prompt"] for o in objects] == FILE_PROMPTS and [o["line"] for o in objects] == [1, 2, 3]
    for i, o in enumerate(objects):
        assert o["stats"]["new_tokens"] == len(o["token_ids"]) == 20 and 0.0 <= o["stats"]["alpha"] <= 1.0
        assert o["settings"]["seed"] == 7 + i and o["batch"]["num_rows"] == 3 and o["batch"]["active_rows"]
        # prompt i samples with seed 7 + i, as --prompt with --seed 7 + i would
        alone = single_json(capsys, folders, FILE_PROMPTS[i], "--temperature", "1", "--seed", str(7 + i))
        assert o["token_ids"] == alone["token_ids"]
    assert [o["token_ids"] for o in runs["1"]] == [o["token_ids"] for o in objects], "the batch size changes nothing"


def test_a_prompts_file_of_one_prompt(tmp_path, capsys, folders, single_thread):
    """One line is a batch of one row: the prompt's own decoding, timed within the run."""
    path = tmp_path / "prompts.txt"
    path.write_text("Hello world\n", encoding="utf-8")
    started = time.perf_counter()
    result = run_main(capsys, *local_models(folders), "--json", "--prompts-file", str(path))
    wall_seconds = time.perf_counter() - started
    assert_ok(result)
    (row,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert row["token_ids"] == single_json(capsys, folders, "Hello world")["token_ids"]
    assert row["batch"]["num_rows"] == 1 and 0 < row["batch"]["seconds"] < wall_seconds


@pytest.mark.parametrize("output", ["text", "json"])
def test_ctrl_c_in_a_batch_leaves_a_row_that_had_finished_finished(tmp_path, capsys, folders, monkeypatch,
                                                                   single_thread, output):
    """A long prompt fills the target's window of 128 within a few steps and leaves the batch; Ctrl-C lands in
    the next step, which verifies the short prompt alone. Each row, not the batch, says whether it was cut short
    (both read "interrupted" before)."""
    # the first pass after the long row left the batch
    ctrl_c_in_a_target_pass(monkeypatch, lambda shapes: shapes[-1][0] == 1 and any(B == 2 for B, _ in shapes))
    path = tmp_path / "prompts.txt"
    path.write_text("Hello" + " hello" * 119 + "\nHello world\n", encoding="utf-8")  # 120 and 2 tokens
    extra = ["--json"] if output == "json" else []
    result = run_main(capsys, *local_models(folders), "--max-gen", "100", "--prompts-file", str(path),
                      "--batch-size", "2", *extra)
    assert result.returncode == 130, result.stderr
    if output == "json":
        long, short = [json.loads(line) for line in result.stdout.splitlines()]
        assert long["stop"] == "stopped at the target's context window (128 tokens)" and not long["interrupted"]
        assert len(long["prompt_token_ids"]) + len(long["token_ids"]) == 128
        assert short["stop"] == "interrupted (Ctrl-C)" and short["interrupted"]
        assert 1 <= len(short["token_ids"]) < 100
    else:
        assert re.search(r"\[8 new tokens in \d+ target calls?, stopped at the target's context window \(128 tokens\);",
                         result.stdout), result.stdout
        assert re.search(r"\[\d+ new tokens? in \d+ target calls?, interrupted \(Ctrl-C\);", result.stdout)
        assert re.search(r"prompts\s+2 in 1 batch of up to 2, interrupted \(Ctrl-C\)", result.stdout)


@pytest.mark.parametrize("sampling_filter",
                         [[], ["--top-k", "1"], ["--top-p", "0.5"], ["--top-k", "1", "--top-p", "0.5"]])
def test_a_filter_without_temperature_is_noted_and_changes_nothing(capsys, folders, single_thread, sampling_filter):
    """Greedy decoding (no --temperature) with --top-k or --top-p, or both: a note says they apply only when
    sampling, and the text is the greedy one."""
    result = run_main(capsys, *local_models(folders), "--json", "-p", "Hello world", *sampling_filter)
    assert_ok(result)
    noted = "note: --top-k and --top-p only apply when sampling (--temperature > 0)" in result.stderr
    assert noted == bool(sampling_filter)
    assert json.loads(result.stdout)["token_ids"] == single_json(capsys, folders, "Hello world")["token_ids"]


@pytest.mark.parametrize("sampling_filter", [["--top-k", "1"], ["--top-p", "1e-9"]])
def test_a_filter_that_keeps_one_token_samples_the_greedy_text_alone_and_batched(tmp_path, capsys, folders,
                                                                                 single_thread, sampling_filter):
    """--top-k and --top-p reach the sampler on both paths (a CLI that dropped them passed every other test)."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in FILE_PROMPTS))
    greedy = [single_json(capsys, folders, p)["token_ids"] for p in FILE_PROMPTS]
    alone = [single_json(capsys, folders, p, "--temperature", "1", *sampling_filter)["token_ids"]
             for p in FILE_PROMPTS]
    result = run_main(capsys, *local_models(folders), "--json", "--prompts-file", str(path), "--batch-size", "3",
                      "--temperature", "1", *sampling_filter)
    assert_ok(result)
    batched = [json.loads(line)["token_ids"] for line in result.stdout.splitlines()]
    assert alone == batched == greedy


@pytest.mark.parametrize(
    "content, args, message",
    [
        ("", [], "is empty: write one prompt per line"),
        ("Hello\n\nworld\n", [], "line 2 of {path} is empty"),
        # A prompt of one space runs with -p " " and as JSON: a line of spaces says how to write it.
        ("Hello\n \nworld\n", [], 'line 2 of {path} is blank (whitespace only): write one prompt on every line (a '
                                   'prompt of spaces only: as JSON Lines, {{"prompt": " "}})'),
        ("Hello\n" + "hello " * 200 + "\n", [], "line 2 of {path}: the prompt has 201 tokens but the context window"),
        ('{"prompt": "Hello"}\n{"text": "world"}\n', [], 'line 2 of {path} has no "prompt" text'),
        ('{"prompt": "Hello"}\n{"prompt": \n', [], "line 2 of {path} is not JSON"),
        ('{"prompt": "caf\\udce9"}\n', [], "the prompt of line 1 of {path} is not UTF-8 text"),
        ("Hello\n", ["--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
        ("Hello\n", ["-p", "Hi"], "give --prompt or --prompts-file, not both"),
        ("Hello\n", ["--compare"], "--prompts-file decodes every prompt with a draft model's chain of a fixed "
                                   "--gamma: leave out --compare, or give one --prompt instead"),
        ("Hello\n", ["--tree", "2", "--show-tree"], "leave out --tree and --show-tree, or give one --prompt instead"),
    ],
    ids=["empty-file", "empty-line", "blank-line", "line-too-long", "jsonl-no-prompt", "jsonl-broken",
         "jsonl-surrogate",
         "batch-size-0", "prompt-and-file", "compare", "tree"],
)
def test_bad_prompts_files(tmp_path, capsys, folders, single_thread, content, args, message):
    path = tmp_path / "prompts.txt"
    path.write_text(content, encoding="utf-8")
    result = run_main(capsys, *local_models(folders), "--prompts-file", str(path), *args)
    assert_bad_input(result, message.format(path=path))


def test_a_batch_whose_caches_would_not_fit_in_memory(tmp_path, capsys, folders, single_thread, monkeypatch):
    """The largest batch's KV caches against the memory free now: target and draft each hold 2 layers of keys and
    values of 32 floats a position (1 KiB a position for both), for 3 rows of up to the longest prompt + 20."""
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(FILE_PROMPTS) + "\n", encoding="utf-8")
    lengths = [len(load_tokenizer(folders["target"]).encode(p)) for p in FILE_PROMPTS]
    need = 3 * (max(lengths) + int(MAX_GEN)) * 2 * 2 * (2 * CONFIG.n_embd) * 4
    monkeypatch.setattr(cli, "free_memory", lambda device: need - 1)
    result = run_main(capsys, *local_models(folders), "--prompts-file", str(path), "--batch-size", "3")
    assert_bad_input(result, f"--batch-size 3 needs {need / 2**20:.1f} MiB of KV caches for its longest prompts and "
                     f"--max-gen 20, more than the {(need - 1) / 2**20:.1f} MiB free on cpu: give a smaller "
                     "--batch-size or --max-gen")
    monkeypatch.setattr(cli, "free_memory", lambda device: need)  # just enough: it runs
    assert_ok(run_main(capsys, *local_models(folders), "--prompts-file", str(path), "--batch-size", "3"))


def test_memory_sizes_in_messages_are_in_gib_from_1_gib_and_in_mib_below():
    assert [cli.size_text(n) for n in (3 * 2**29, 2**30, 2**30 - 2**19, 5 * 2**20)] == [
        "1.5 GiB", "1.0 GiB", "1023.5 MiB", "5.0 MiB"]


def test_free_memory_is_what_linux_reports_available():
    free = cli.free_memory(torch.device("cpu"))
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert free is not None and 0 < free <= total, (free, total)


def test_a_missing_prompts_file(tmp_path, capsys):
    assert_bad_input(run_main(capsys, "--prompts-file", str(tmp_path / "nope.txt")), "nope.txt: no such file")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gamma", "99999999999999999999"], "--gamma is 99999999999999999999"),
        (["--gamma", "1000000000", "--show-tree"], "--gamma is 1000000000"),
        (["--tree-nodes", "1000000000", "--tree-depth", "1000000000"],
         "--tree-nodes 1000000000 --tree-depth 1000000000 (levels of 1): the depth reached is 1000000000"),
        # It said "--tree-depth is 250", a depth never given: 1000 nodes in levels of 4 reach 250 levels.
        (["--tree-nodes", "1000", "--tree-depth", "300"],
         "--tree-nodes 1000 --tree-depth 300 (levels of 4): the depth reached is 250"),
        (["--tree", ",".join(["1"] * 300)], "the depth of --tree is 300"),
        (["--temperature", "1", "--top-p", "1e-300", "--gamma", "3"], None),
    ],
    ids=["gamma-huge", "gamma-huge-show-tree", "tree-depth-huge", "dynamic-tree-too-deep", "tree-too-deep",
         "top-p-below-float32"],
)
def test_draft_lengths_the_window_cannot_hold_and_a_top_p_below_float32(capsys, folders, single_thread, args, message):
    # A draft length is checked against the target's window before the weights are read (and before
    # anything is sized by it); a top_p that float32 cannot tell from 0 still keeps the likeliest token.
    result = run_main(capsys, *local_models(folders), *args)
    if message is None:
        assert_ok(result)
    else:
        window = f"more tokens than the target's context window of {CONFIG.n_ctx} could ever verify"
        assert_bad_input(result, f"{message}, {window}: give at most {CONFIG.n_ctx - 1}")


def test_a_prompts_file_that_is_a_folder(tmp_path, capsys):
    assert_bad_input(run_main(capsys, "--prompts-file", str(tmp_path)), "is a folder: give a text file")


@pytest.mark.parametrize("path, message", [("", "--prompts-file is empty: give a text file"),
                                           (" ", "--prompts-file is empty: give a text file"),
                                           ("/dev/zero", "--prompts-file /dev/zero is not a file: give a text file")])
def test_a_prompts_file_that_is_empty_text_or_a_device(capsys, path, message):
    assert_bad_input(run_main(capsys, "--prompts-file", path), message)


def test_a_prompts_file_may_be_a_pipe(tmp_path):
    fifo = tmp_path / "prompts"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", f"printf 'Hello\\nOnce upon a time\\n' > {fifo}"])
    try:
        assert cli.read_prompts_file(str(fifo)) == [(1, "Hello"), (2, "Once upon a time")]
    finally:  # the read ends at the writer's end of file, so the writer is done; if the read failed, it blocks
        writer.kill()
        writer.wait()


@pytest.mark.parametrize("content", ['Hello\r\nOnce upon a time\r\n',
                                     '{"prompt": "Hello"}\n{"prompt": "Once upon a time"}\n'], ids=["text", "JSON"])
def test_a_prompts_file_that_starts_with_a_byte_order_mark(tmp_path, content):
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"\xef\xbb\xbf" + content.encode())  # UTF-8's byte-order mark, as Windows Notepad writes it
    assert cli.read_prompts_file(str(path)) == [(1, "Hello"), (2, "Once upon a time")]


@pytest.mark.parametrize("line, why", [('{"prompt": "x", "a": ' + "[" * 10**5 + "]" * 10**5 + "}", "nested too deeply"),
                                       ('{"prompt": "x", "a": ' + "1" * 5000 + "}", "a number of too many digits")],
                         ids=["deep", "long-number"])
def test_a_json_line_that_python_cannot_read(tmp_path, capsys, line, why):
    # A RecursionError was an "unexpected" error with exit code 1; a 5000-digit number said to call
    # sys.set_int_max_str_digits().
    path = tmp_path / "prompts.jsonl"
    path.write_text(line + "\n", encoding="utf-8")
    assert_bad_input(run_main(capsys, "--prompts-file", str(path)),
                     f'line 1 of {path} is not JSON ({why}): write {{"prompt": "..."}}')


def test_a_prompts_file_that_cannot_be_read(tmp_path, capsys):
    path = str(tmp_path / ("x" * 300))  # past any file system's longest name
    assert_bad_input(run_main(capsys, "--prompts-file", path),
                     f"--prompts-file {path} cannot be read (File name too long): give a text file you can read")


def test_a_prompts_file_is_read_up_to_its_limit_and_refused_past_it(tmp_path, monkeypatch):
    monkeypatch.setattr("cli.arguments.MAX_PROMPTS_FILE_BYTES", 2**20)  # 1 MiB here, not 256
    path = tmp_path / "prompts.txt"
    line = b"a" * 1023 + b"\n"  # 1 KiB
    path.write_bytes(line * 1024)  # exactly the limit
    assert len(cli.read_prompts_file(str(path))) == 1024
    path.write_bytes(line * 1024 + b"b")  # one byte past it
    with pytest.raises(ValueError, match=f"--prompts-file {path} is over 1 MiB: split it"):
        cli.read_prompts_file(str(path))


def test_a_prompts_file_line_too_long_for_any_context_window(tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text("Hello\n" + "a" * (MAX_PROMPT_BYTES + 1) + "\n", encoding="utf-8")
    assert_bad_input(run_main(capsys, "--prompts-file", str(path)), f"line 2 of {path} is over 4 MiB")


def test_a_config_json_with_a_field_of_the_wrong_kind(tmp_path, capsys, folders):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("model.safetensors", "vocab.json", "merges.txt"):
        (broken / name).write_bytes((folders["target"] / name).read_bytes())
    config = json.loads((folders["target"] / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "layer_norm_epsilon": "x"}))
    result = run_main(capsys, "--draft", str(folders["draft"]), "--target", str(broken))
    assert_bad_input(result, "config.json: GPT2Config.layer_norm_epsilon must be a positive number such as 1e-5")
