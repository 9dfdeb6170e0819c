"""spec_decoding_generate.py end to end, run as a user runs it: a subprocess
(`python spec_decoding_generate.py ...` from the repository root), its exit
code, stdout and stderr.

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

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import spec_decoding_generate as cli
from helpers import REPO_ROOT, write_checkpoint
from gpt2 import GPT2, GPT2Config, load_tokenizer
from gpt2.loading import CONV1D_SUFFIXES
from hub_server import HubServer, closed_endpoint
from helpers import perturbed_copy, tiny_gpt2

SCRIPT = REPO_ROOT / "spec_decoding_generate.py"
CONFIG = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_ctx=128)  # vocab_size 50257: the real tokenizer
DRAFT_NOISE = 0.005  # weight perturbation of the draft: alpha ~ 0.5-0.9 on these models
MAX_GEN = "20"

# huggingface_hub retries a refused connection 5 times with 1 + 2 + 4 + 8 + 8 s
# of backoff. The "no network" test runs the script through this launcher,
# which only skips those sleeps (the retries still happen) and then runs the
# script unchanged as __main__.
NO_BACKOFF_LAUNCHER = (
    "import runpy, sys; sys.path.insert(0, 'tests'); "
    "from hub_server import _NoSleepTime; from huggingface_hub.utils import _http; _http.time = _NoSleepTime(); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


# ---------------------------------------------------------------------------
# Models and running the script
# ---------------------------------------------------------------------------


def hub_layout(model: GPT2) -> dict[str, torch.Tensor]:
    """Our weights under the Hub's names, Conv1D weights back in (in, out)."""
    return {
        name: (t.t() if name.endswith(CONV1D_SUFFIXES) else t).contiguous()
        for name, t in model.state_dict().items()
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Model folders: "target", "draft" (the target, perturbed) and
    "other_vocab" (a draft with 50300 tokens)."""
    root = tmp_path_factory.mktemp("cli_models")
    target = tiny_gpt2(CONFIG, seed=0)
    draft = perturbed_copy(target, scale=DRAFT_NOISE, seed=1)
    other = GPT2Config(n_layer=1, n_head=2, n_embd=32, n_ctx=128, vocab_size=50300)
    return {
        "target": write_checkpoint(root / "target", CONFIG, hub_layout(target), with_tokenizer=True),
        "draft": write_checkpoint(root / "draft", CONFIG, hub_layout(draft), with_tokenizer=True),
        "other_vocab": write_checkpoint(root / "other_vocab", other, hub_layout(tiny_gpt2(other, seed=2))),
    }


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


def run_cli(
    tmp_path: Path,
    *args: str,
    stdin: str = "",
    endpoint: str | None = None,
    launcher: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """Runs the script from the repository root with downloads going to tmp_path/weights."""
    return subprocess.run(
        [sys.executable, *launcher, str(SCRIPT), "--weights-dir", str(tmp_path / "weights"), *args],
        cwd=REPO_ROOT,
        env=cli_env(tmp_path, endpoint),
        input=stdin,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=120,
    )


def local_models(folders: dict[str, Path]) -> list[str]:
    return ["--draft", str(folders["draft"]), "--target", str(folders["target"]), "--max-gen", MAX_GEN]


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


# ---------------------------------------------------------------------------
# The normal flow
# ---------------------------------------------------------------------------


def test_help_documents_every_option_and_its_default(tmp_path):
    result = run_cli(tmp_path, "--help")
    assert_ok(result)
    for option in (
        "--prompt", "--gamma", "--max-gen", "--temperature", "--top-k", "--top-p", "--seed", "--draft",
        "--target", "--device", "--dtype", "--quantize", "--weights-dir", "--compare", "--json", "--no-color",
        "--debug",
    ):
        assert option in result.stdout, option
    for default in ("default: 4", "default: 100", "default: gpt2)", "default: gpt2-large", "default: auto",
                    "default: float32", "default: 0", "default: none"):
        assert default in " ".join(result.stdout.split()), default


def test_default_flow_streams_the_text_then_the_stats(tmp_path, folders):
    result = run_cli(tmp_path, *local_models(folders), "-p", "Hello world")
    assert_ok(result)
    out = result.stdout
    assert "\nHello world" in out, "the prompt is printed before the generated text"
    for label in ("new tokens", "acceptance α", "tokens/target call", "forward calls", "speed"):
        assert label in out, label
    assert "20 in " in out and "stopped at --max-gen" in out
    assert "\x1b[" not in out, "no colour codes when stdout is a pipe"
    assert "legend" not in out
    assert "target alone" not in out, "no baseline without --compare"


def test_compare_reports_greedy_outputs_identical_and_the_speedup(tmp_path, folders):
    result = run_cli(tmp_path, *local_models(folders), "--compare")
    assert_ok(result)
    assert "identical to the target alone, token for token (20 tokens)" in result.stdout
    assert "target alone" in result.stdout and "speedup" in result.stdout


def test_json_is_one_object_with_every_field(tmp_path, folders):
    result = run_cli(tmp_path, *local_models(folders), "--json", "--compare", "-p", "Hello world")
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
        "gamma": 4, "max_gen": 20, "temperature": 0.0, "top_k": None, "top_p": None, "seed": 0,
        "device": "cpu", "dtype": "float32", "quantize": None, "eos_id": 50256,
    }
    stats = out["stats"]
    assert stats["new_tokens"] == 20 and stats["gamma"] == 4
    assert 0 < stats["alpha"] < 1, "the perturbed draft agrees with the target only partly"
    assert stats["accepted"] == sum(out["accepted_from_draft"])
    assert stats["tokens_per_target_call"] == pytest.approx(20 / stats["target_calls"])
    for key in ("target_calls", "draft_calls", "drafted", "accepted_hist", "position_acceptance",
                "draft_seconds", "verify_seconds", "stopped_at_eos"):
        assert key in stats, key
    timings = out["timings"]
    assert set(timings) == {"load_seconds", "generate_seconds", "tokens_per_second", "draft_seconds", "verify_seconds"}
    assert timings["tokens_per_second"] > 0
    comparison = out["comparison"]
    assert comparison["greedy"] is True and comparison["identical"] is True
    assert comparison["first_difference"] is None
    assert comparison["baseline_token_ids"] == out["token_ids"]
    assert comparison["baseline_tokens_per_second"] > 0 and comparison["speedup"] > 0


def test_int8_weights_reproduce_the_int8_target_alone(tmp_path, folders):
    """--quantize int8 quantises both models; greedy speculative output is
    then the int8 target's own, token for token."""
    result = run_cli(tmp_path, *local_models(folders), "--quantize", "int8", "--json", "--compare")
    assert_ok(result)
    out = json.loads(result.stdout)
    assert out["settings"]["quantize"] == "int8"
    assert len(out["token_ids"]) == 20
    assert out["comparison"]["identical"] is True and out["comparison"]["baseline_token_ids"] == out["token_ids"]
    text = run_cli(tmp_path, *local_models(folders), "--quantize", "int8")
    assert_ok(text)
    assert "cpu float32, int8 weights (the output is the int8 target's)" in text.stdout


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
    assert a["settings"]["temperature"] == 1.0 and a["settings"]["seed"] == 7
    assert len(a["token_ids"]) == 20
    assert without_timings(a) == without_timings(b)


def test_colour_and_legend_on_a_terminal(tmp_path, folders):
    """stdout is a pseudo-terminal here, so the script colours its tokens."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--weights-dir", str(tmp_path / "weights"), *local_models(folders)],
        cwd=REPO_ROOT, env=cli_env(tmp_path), stdin=subprocess.DEVNULL, stdout=follower, stderr=subprocess.PIPE,
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
    stderr = process.stderr.read().decode()
    process.stderr.close()
    assert process.wait(timeout=120) == 0, stderr
    out = b"".join(chunks).decode("utf-8")
    assert "legend:" in out
    assert cli.ACCEPTED_STYLE in out and cli.TARGET_STYLE in out, "both kinds of token appear in colour"


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
    stream = cli.TokenStream(enc, sink, color=False)
    for token in tokens:
        stream.on_step([token], 0)
    stream.finish()
    assert "".join(sink.writes) == text
    assert all("\ufffd" not in w for w in sink.writes), "no replacement character: halves are held back"
    assert stream.tokens == tokens


@pytest.mark.parametrize("output", ["text", "json"])
def test_ctrl_c_prints_the_text_and_stats_so_far_with_exit_code_130(tmp_path, folders, capsys, monkeypatch, output):
    """Ctrl-C lands in the target's forward pass of the third step: what the
    first two steps committed is printed, with the stats of those two steps."""
    import spec_decoding

    real = spec_decoding.speculative_generate

    def interrupted_generate(target, *args, **kwargs):
        calls = []

        def ctrl_c(module, inputs):
            calls.append(inputs[0].size(1))
            if len(calls) == 4:  # prefill, step 1, step 2, then step 3's verification
                raise KeyboardInterrupt

        handle = target.register_forward_pre_hook(ctrl_c)
        try:
            return real(target, *args, **kwargs)
        finally:
            handle.remove()

    monkeypatch.setattr(spec_decoding, "speculative_generate", interrupted_generate)
    extra = ["--json"] if output == "json" else []
    code = cli.main(["--weights-dir", str(tmp_path / "weights"), *local_models(folders), "--compare", *extra])
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


def test_first_difference():
    assert cli.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert cli.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert cli.first_difference([1, 2], [1, 2, 3]) == 2, "one output is a prefix of the other"


def test_compare_report_names_the_first_differing_token(folders, capsys):
    enc = load_tokenizer(folders["target"])
    spec, alone = enc.encode(" the cat sat"), enc.encode(" the dog sat")
    comparison = {
        "baseline_token_ids": alone, "baseline_tokens_per_second": 10.0, "baseline_seconds": 0.3,
        "speedup": 2.0, "greedy": True, "first_difference": cli.first_difference(spec, alone),
    }
    cli.print_comparison(comparison, spec, enc)
    out = capsys.readouterr().out
    assert "DIFFERENT from the target alone from new token 1: speculative ' cat' vs target alone ' dog'" in out
    assert "2.00x" in out


# ---------------------------------------------------------------------------
# Bad input: exit code 2, one line, no traceback
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, stdin, message",
    [
        (["--gamma", "0"], "", "--gamma must be >= 1"),
        (["--gamma", "abc"], "", "argument --gamma: invalid int value: 'abc'"),
        (["--max-gen", "0"], "", "--max-gen must be >= 1"),
        (["--temperature", "-0.5"], "", "--temperature must be >= 0"),
        (["--top-p", "0"], "", "--top-p must be in (0, 1]"),
        (["--top-p", "1.5"], "", "--top-p must be in (0, 1]"),
        (["--top-k", "0"], "", "--top-k must be >= 1"),
        (["--prompt", ""], "", "the prompt is empty"),
        (["-p", "-"], "", "the prompt read from stdin is empty"),
        (["-p", "-"], "\n", "the prompt read from stdin is empty"),
    ],
    ids=["gamma-0", "gamma-abc", "max-gen-0", "negative-temperature", "top-p-0", "top-p-1.5", "top-k-0",
         "empty-prompt", "empty-stdin", "blank-stdin"],
)
def test_bad_settings(tmp_path, args, stdin, message):
    assert_bad_input(run_cli(tmp_path, *args, stdin=stdin), message)


def test_prompt_longer_than_the_context_window(tmp_path, folders):
    result = run_cli(tmp_path, *local_models(folders), "-p", "hello " * 200)
    assert_bad_input(result, "the context window is 128: shorten it to at most 127 tokens")


def test_draft_and_target_with_different_vocabularies(tmp_path, folders):
    result = run_cli(tmp_path, "--draft", str(folders["other_vocab"]), "--target", str(folders["target"]))
    assert_bad_input(result, "draft and target have different vocabularies (50300 vs 50257 tokens)")


def test_corrupt_weights_file(tmp_path, folders):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "vocab.json", "merges.txt"):
        (broken / name).write_bytes((folders["draft"] / name).read_bytes())
    truncated = (folders["draft"] / "model.safetensors").read_bytes()[:5000]
    (broken / "model.safetensors").write_bytes(truncated)
    result = run_cli(tmp_path, "--draft", str(broken), "--target", str(folders["target"]))
    assert_bad_input(result, "model.safetensors is corrupt or truncated")


def test_unavailable_device(tmp_path, folders):
    assert_bad_input(run_cli(tmp_path, *local_models(folders), "--device", "cuda:99"), "device 'cuda:99'")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--quantize", "int4"], "unknown quantisation 'int4': choose none or int8"),
        (["--quantize", "int8", "--dtype", "bfloat16"], "int8 weights are for the CPU in float32, not cpu bfloat16"),
    ],
    ids=["unknown", "bfloat16"],
)
def test_bad_quantisation(tmp_path, folders, args, message):
    assert_bad_input(run_cli(tmp_path, *local_models(folders), *args), message)


def test_unsupported_dtype(tmp_path, folders):
    result = run_cli(tmp_path, *local_models(folders), "--dtype", "float64")
    assert_bad_input(result, "unsupported dtype 'float64': choose float32, float16 or bfloat16")


# ---------------------------------------------------------------------------
# Models from the (local) Hub
# ---------------------------------------------------------------------------


HUB_FILES = ("config.json", "model.safetensors", "vocab.json", "merges.txt")


def hub_files(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in HUB_FILES}


def test_hub_first_run_downloads_later_runs_need_no_network(tmp_path, folders):
    """The default --draft gpt2 --target gpt2-large, served by the local Hub."""
    server = HubServer({"gpt2": hub_files(folders["draft"]), "gpt2-large": hub_files(folders["target"])}).start()
    try:
        first = run_cli(tmp_path, "--max-gen", MAX_GEN, "--json", endpoint=server.url)
    finally:
        server.stop()
    assert_ok(first)
    assert sorted(server.files_requested("GET")) == sorted(2 * HUB_FILES), "each file downloaded once"
    for repo, role in (("gpt2", "draft"), ("gpt2-large", "target")):
        downloaded = tmp_path / "weights" / repo
        assert hub_files(downloaded) == hub_files(folders[role]), f"{repo} lands in weights/{repo}"
    assert json.loads(first.stdout)["stats"]["new_tokens"] == 20

    second = run_cli(tmp_path, "--max-gen", MAX_GEN, "--json")  # the server is gone: a closed port
    assert_ok(second)
    assert json.loads(second.stdout)["token_ids"] == json.loads(first.stdout)["token_ids"]


def test_hub_unknown_repo_id(tmp_path, folders):
    server = HubServer({"gpt2": hub_files(folders["draft"])}).start()
    try:
        result = run_cli(tmp_path, "--target", "nobody/no-such-model", endpoint=server.url)
    finally:
        server.stop()
    assert_bad_input(result, "no model 'nobody/no-such-model' on the Hugging Face Hub")


def test_no_network_and_no_local_copy(tmp_path):
    result = run_cli(tmp_path, "--max-gen", MAX_GEN, launcher=("-c", NO_BACKOFF_LAUNCHER))
    assert_bad_input(result, "cannot download 'gpt2'")
    assert "no local copy" in result.stderr
