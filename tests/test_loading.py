"""Loading checkpoints (gpt2/loading.py, gpt2/hub.py): both key layouts, the Hub download
path against a local server that speaks the Hub's file API (hub_server.py),
and every user error with its message."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import REPO_ROOT, TINY, hf_model_from_hub_state, hub_state_dict, make_hf_model, write_checkpoint
from gpt2 import GPT2, GPT2Config, load_model, resolve_dtype
from gpt2 import loading

REPO_ID = "someorg/tiny-gpt2"


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    """Random tiny weights in the Hub layout."""
    return hub_state_dict(make_hf_model(TINY, seed=21))


@pytest.fixture
def folder(tmp_path, state) -> Path:
    """A tiny checkpoint folder in the Hub layout."""
    return write_checkpoint(tmp_path / "tiny", TINY, state)


def rewrite_config(folder: Path, **fields) -> None:
    """Sets `fields` in folder/config.json (the rest as it was)."""
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def assert_holds(model: GPT2, state: dict[str, torch.Tensor]) -> None:
    """`model` holds exactly the checkpoint's weights (Conv1D ones transposed)."""
    params = dict(model.named_parameters())
    assert set(params) == set(state)
    for name, tensor in state.items():
        expected = tensor.t() if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) else tensor
        assert torch.equal(params[name], expected), name


# ---------------------------------------------------------------------------
# Local folders, both layouts
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["hub", "save_pretrained"])
def test_both_key_layouts_load(tmp_path, state, layout):
    folder = write_checkpoint(tmp_path / layout, TINY, state, layout=layout)
    keys = set(load_file(str(folder / "model.safetensors")))
    if layout == "hub":
        assert {"wte.weight", "h.0.attn.bias", "h.0.attn.masked_bias"} <= keys
    else:
        assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys

    model = load_model(folder)
    assert model.config == TINY
    assert not model.training and model.dtype == torch.float32 and model.device.type == "cpu"
    assert_holds(model, state)


def test_a_tied_checkpoint_that_keeps_only_the_head_loads(tmp_path, state):
    """safetensors' `save_model(GPT2LMHeadModel)` keeps one name of the tied embedding and head, lm_head.weight
    (transformers loads such a file): it is then the token embedding, as the two are one matrix."""
    from safetensors.torch import save_model

    hf = hf_model_from_hub_state(TINY, state)
    folder = tmp_path / "save_model"
    folder.mkdir()
    save_model(hf, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    keys = set(load_file(str(folder / "model.safetensors")))
    assert "lm_head.weight" in keys and "transformer.wte.weight" not in keys
    assert_holds(load_model(folder), state)


@pytest.mark.parametrize("tie", [None, True])
def test_a_head_that_is_not_the_embedding_is_refused_not_dropped(tmp_path, state, tie):
    """A file with wte.weight and another lm_head.weight (the config tied, or silent about it): transformers keeps
    the file's head; dropping it computed other logits (2.7 apart on this tiny model)."""
    head = {**state, "lm_head.weight": torch.randn(TINY.vocab_size, TINY.n_embd)}
    folder = write_checkpoint(tmp_path / "head", TINY, head)
    config = json.loads((folder / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    (folder / "config.json").write_text(json.dumps(config if tie is None else {**config, "tie_word_embeddings": tie}))
    with pytest.raises(ValueError, match="holds an lm_head.weight that is not its wte.weight"):
        load_model(folder)
    padded = {**state, "lm_head.weight": torch.zeros(TINY.vocab_size + 3, TINY.n_embd)}  # refused from the header
    with pytest.raises(ValueError, match="holds an lm_head.weight that is not its wte.weight"):
        load_model(write_checkpoint(tmp_path / "padded", TINY, padded))
    same = {**state, "lm_head.weight": state["wte.weight"].clone()}  # a tied copy loads
    assert_holds(load_model(write_checkpoint(tmp_path / "same", TINY, same)), state)
    wte = state["wte.weight"].clone()
    wte[3, 5] = float("nan")  # in both copies: a damaged file, not an untied head
    damaged = write_checkpoint(tmp_path / "nan", TINY, {**state, "wte.weight": wte, "lm_head.weight": wte.clone()})
    with pytest.raises(ValueError, match="tensor 'wte.weight' in .* holds NaN or infinite values"):
        load_model(damaged)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool])
def test_a_tensor_that_is_not_floating_point_is_refused_naming_it(tmp_path, state, dtype):
    bad = {**state, "h.0.mlp.c_fc.weight": state["h.0.mlp.c_fc.weight"].to(dtype)}
    with pytest.raises(ValueError, match=f"tensor 'h.0.mlp.c_fc.weight' in .* holds {dtype} values, not floating"):
        load_model(write_checkpoint(tmp_path / "ints", TINY, bad))


@pytest.mark.parametrize("error", [OSError(12, "Cannot allocate memory"), MemoryError(),
                                   RuntimeError("unable to mmap 153898112 bytes: Cannot allocate memory (12)")])
def test_too_little_memory_is_not_called_a_corrupt_file(folder, monkeypatch, error):
    """An mmap refused under an address-space limit (ulimit -v) was reported as a corrupt file to delete."""
    import safetensors.torch

    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    with pytest.raises(ValueError, match="not enough memory to (map|read) .*model.safetensors") as info:
        load_model(folder)
    assert "corrupt" not in str(info.value) and "delete" not in str(info.value)


def test_a_folder_given_as_str_or_path_loads(folder, state):
    assert_holds(load_model(str(folder)), state)
    assert_holds(load_model(Path(folder)), state)


def test_load_model_accelerates_on_a_cpu_unless_told_not_to(folder, fast_kernels, monkeypatch):
    from gpt2 import fast

    model = load_model(folder)
    assert fast.status(model).startswith("fast path"), fast.status(model)
    assert model.accelerator.packed, "the kernels' weight copies are made at load time, not at the first pass"
    assert load_model(folder, accelerate=False).accelerator is None
    assert load_model(folder, dtype="bfloat16").accelerator is None  # float32 only
    monkeypatch.setenv("GPT2_PLAIN_LINEAR", "1")
    readable = load_model(folder)
    assert readable.accelerator is None and "GPT2_PLAIN_LINEAR=1" in fast.status(readable)


def test_load_model_takes_accelerate_as_a_bool_only(folder):
    with pytest.raises(ValueError, match="accelerate must be True or False, got 'False'"):
        load_model(folder, accelerate="False")  # a true string: it accelerated


def test_resolve_dtype_takes_a_device_by_name_too():
    assert resolve_dtype("float16", "cpu") == torch.float16  # an AttributeError on 'str'.type
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        resolve_dtype("float16", "gpu")


def test_dtype_by_name_or_torch_dtype(folder):
    assert load_model(folder, dtype="bfloat16").dtype == torch.bfloat16
    assert load_model(folder, dtype=torch.float16).dtype == torch.float16


def test_torch_load_is_never_used(monkeypatch, folder, state):
    def forbidden(*args, **kwargs):
        raise AssertionError("torch.load unpickles arbitrary code; the loader must read safetensors only")

    monkeypatch.setattr(torch, "load", forbidden)
    assert_holds(load_model(folder), state)


# ---------------------------------------------------------------------------
# Downloads from a local Hub
# ---------------------------------------------------------------------------


def served_files(folder: Path) -> dict[str, bytes]:
    """What a Hub repo of a tiny GPT-2 holds: the model, and tokenizer files
    (placeholders: only their download is under test here)."""
    return {
        "config.json": (folder / "config.json").read_bytes(),
        "model.safetensors": (folder / "model.safetensors").read_bytes(),
        "vocab.json": b'{"placeholder": 0}',
        "merges.txt": b"#version: 0.2\n",
        "pytorch_model.bin": b"never fetched",
    }


def test_download_then_reuse_with_no_network(hub, tmp_path, folder, state):
    files = served_files(folder)
    server = hub({REPO_ID: files})
    weights = tmp_path / "weights"

    model = load_model(REPO_ID, weights_dir=weights)
    assert_holds(model, state)
    local = weights / "someorg--tiny-gpt2"
    for name in ("config.json", "model.safetensors", "vocab.json", "merges.txt"):
        assert (local / name).read_bytes() == files[name], name
    assert not (local / "pytorch_model.bin").exists()
    assert sorted(server.files_requested("GET")) == ["config.json", "merges.txt", "model.safetensors", "vocab.json"]

    seen = len(server.requests)
    assert_holds(load_model(REPO_ID, weights_dir=weights), state)
    assert len(server.requests) == seen, "the second run must not touch the network"
    server.stop()
    assert_holds(load_model(REPO_ID, weights_dir=weights), state)  # and works with the Hub gone


def test_a_repo_without_tokenizer_files_downloads_and_is_reused_offline(hub, tmp_path, folder, state):
    files = {name: data for name, data in served_files(folder).items() if name in ("config.json", "model.safetensors")}
    server = hub({REPO_ID: files})
    weights = tmp_path / "weights"
    assert_holds(load_model(REPO_ID, weights_dir=weights), state)

    # config.json twice: the loader's own first request (is the Hub there?), then the download's
    heads = ["config.json", "config.json", "merges.txt", "model.safetensors", "vocab.json"]
    assert sorted(server.files_requested("HEAD")) == heads

    seen = len(server.requests)
    assert_holds(load_model(REPO_ID, weights_dir=weights), state)
    assert len(server.requests) == seen, "files known to be absent are not asked for again"
    server.stop()
    assert_holds(load_model(REPO_ID, weights_dir=weights), state)


def test_no_network_and_no_local_copy_says_what_to_do_without_retrying(no_hub, tmp_path, caplog):
    """huggingface_hub retries a request for a file it has no copy of five
    times, with a warning each (`no_hub` skips only its sleeps); the loader
    asks once, with no retries, and gives up."""
    weights = tmp_path / "weights"
    with pytest.raises(FileNotFoundError) as info:
        load_model(REPO_ID, weights_dir=weights)
    message = str(info.value)
    assert f"'{REPO_ID}'" in message
    assert str(weights / "someorg--tiny-gpt2") in message
    assert "connect to the internet" in message and "put config.json and model.safetensors" in message
    assert "Retrying" not in caplog.text and "thrown while requesting" not in caplog.text
    assert not (weights / "someorg--tiny-gpt2").exists(), "no empty folder left behind"


def test_a_hub_that_answers_with_an_error_is_named_not_taken_for_no_network(hub, tmp_path, folder, state,
                                                                           monkeypatch):
    server = hub({REPO_ID: served_files(folder)})
    weights = tmp_path / "weights"
    for status, fix in ((401, "your token was refused: log in again"), (403, "access was refused: check that your "
                                                                          "account may read this repo"),
                        (429, "too many requests: wait a minute")):
        server.failures = [status] * 10
        with pytest.raises(ValueError, match=f"the Hugging Face Hub answered {status} for config.json of '{REPO_ID}'"
                                             f": {re.escape(fix)}"):
            load_model(REPO_ID, weights_dir=weights)
    for status in (500, 503):  # one server error: the probe lets it pass, huggingface_hub's own requests go on
        server.failures = [status]
        assert_holds(load_model(REPO_ID, weights_dir=weights / str(status)), state)

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE is set and there is no local copy of 'other/repo'"):
        load_model("other/repo", weights_dir=weights)


def test_a_file_that_cannot_be_written_is_not_taken_for_no_network(hub, tmp_path, folder):
    hub({REPO_ID: served_files(folder)})
    blocked = tmp_path / "weights" / "someorg--tiny-gpt2" / "model.safetensors"
    blocked.mkdir(parents=True)  # a folder where the download must write a file
    with pytest.raises(ValueError, match="cannot write .*: free some space, or pass a weights_dir"):
        load_model(REPO_ID, weights_dir=tmp_path / "weights")


def test_a_weights_dir_under_home_written_with_a_tilde_is_the_home_folder(hub, tmp_path, folder, state, monkeypatch):
    """huggingface_hub expands ~ in the folder it writes to: so must the loader that then reads it."""
    hub({REPO_ID: served_files(folder)})
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert_holds(load_model(REPO_ID, weights_dir="~/models"), state)
    assert (tmp_path / "home" / "models" / "someorg--tiny-gpt2" / "model.safetensors").is_file()
    assert not (tmp_path / "~").exists()


def test_a_deleted_tokenizer_file_is_downloaded_again(hub, tmp_path, folder):
    server = hub({REPO_ID: served_files(folder)})
    load_model(REPO_ID, weights_dir=tmp_path / "weights")
    (tmp_path / "weights" / "someorg--tiny-gpt2" / "vocab.json").unlink()  # as its "download it again" says
    load_model(REPO_ID, weights_dir=tmp_path / "weights")
    assert server.files_requested("GET").count("vocab.json") == 2
    assert (tmp_path / "weights" / "someorg--tiny-gpt2" / "vocab.json").read_bytes() == b'{"placeholder": 0}'


def test_a_download_cut_short_before_the_tokenizer_files_fetches_them_next_time(hub, tmp_path, folder, monkeypatch):
    # The model file comes last: had it come before them, a Ctrl-C at vocab.json left a folder that looked complete
    # (both model files, no tokenizer file) and the tokenizer files were never fetched.
    import huggingface_hub

    server = hub({REPO_ID: served_files(folder)})
    fetch = huggingface_hub.hf_hub_download

    def cut_short(repo_id, filename, **kwargs):
        if filename == "vocab.json":
            raise KeyboardInterrupt
        return fetch(repo_id, filename, **kwargs)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", cut_short)
    with pytest.raises(KeyboardInterrupt):
        load_model(REPO_ID, weights_dir=tmp_path / "weights")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fetch)
    load_model(REPO_ID, weights_dir=tmp_path / "weights")
    assert server.files_requested("GET").count("vocab.json") == 1
    assert (tmp_path / "weights" / "someorg--tiny-gpt2" / "merges.txt").read_bytes() == b"#version: 0.2\n"


def test_a_download_with_one_tokenizer_file_is_used_offline(hub, tmp_path, folder, state, capsys):
    """A repo with vocab.json but no merges.txt (or one the user deleted): the model files are there, so no
    network is no reason to fail (it said there was no local copy, and to put the files it held there)."""
    files = {name: data for name, data in served_files(folder).items() if name != "merges.txt"}
    server = hub({REPO_ID: files})
    weights = tmp_path / "weights"
    load_model(REPO_ID, weights_dir=weights)
    server.stop()
    assert_holds(load_model(REPO_ID, weights_dir=weights), state)
    assert "cannot reach the Hub to complete someorg/tiny-gpt2's tokenizer files" in capsys.readouterr().err


def test_a_download_says_what_it_fetches_and_where(hub, tmp_path, folder, capsys):
    server = hub({REPO_ID: served_files(folder)})
    load_model(REPO_ID, weights_dir=tmp_path / "weights")
    local = tmp_path / "weights" / "someorg--tiny-gpt2"
    assert f"downloading {REPO_ID} from {server.url} into {local}" in capsys.readouterr().err
    load_model(REPO_ID, weights_dir=tmp_path / "weights")
    assert capsys.readouterr().err == "", "nothing to say when the files are there"


def test_unknown_repo_raises_value_error_naming_it(hub, tmp_path, folder):
    hub({REPO_ID: served_files(folder)})
    with pytest.raises(ValueError, match="no model 'someorg/no-such-model' on the Hugging Face Hub"):
        load_model("someorg/no-such-model", weights_dir=tmp_path / "weights")
    assert not (tmp_path / "weights" / "someorg--no-such-model").exists()  # no empty folder left behind


def test_a_repo_without_safetensors_raises_value_error(hub, tmp_path, folder):
    files = served_files(folder)
    del files["model.safetensors"]
    hub({REPO_ID: files})
    with pytest.raises(ValueError, match=f"'{REPO_ID}' on the Hugging Face Hub has no model.safetensors"):
        load_model(REPO_ID, weights_dir=tmp_path / "weights")


def test_gpt2_from_the_repository_root_is_a_hub_id_not_the_package_folder(no_hub, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO_ROOT)
    assert (REPO_ROOT / "gpt2").is_dir()  # the package folder the name could be mistaken for
    with pytest.raises(FileNotFoundError) as info:
        load_model("gpt2", weights_dir=tmp_path / "weights")
    assert "cannot download 'gpt2'" in str(info.value)
    assert "has no config.json" not in str(info.value)


def test_an_owner_slash_name_that_is_a_folder_here_is_that_folder(no_hub, monkeypatch, tmp_path, folder):
    (tmp_path / "models" / "gpt2-large").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="^models/gpt2-large has no config.json: a model folder needs"):
        load_model("models/gpt2-large", weights_dir=tmp_path / "weights")
    with pytest.raises(FileNotFoundError, match="cannot download 'models/gpt2-small'"):  # no such folder: a Hub id
        load_model("models/gpt2-small", weights_dir=tmp_path / "weights")
    (tmp_path / "models" / "mine").symlink_to(folder)
    assert load_model("models/mine", accelerate=False).config.n_embd > 0


# ---------------------------------------------------------------------------
# Broken folders and files
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("keep_fraction", [0.5, 0.999, 0.0])
def test_truncated_safetensors_raises_value_error(folder, keep_fraction):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(ValueError, match="is corrupt or truncated.*download it again"):
        load_model(folder)


def test_a_folder_whose_path_is_not_utf8_is_not_called_corrupt(folder, tmp_path):
    # safetensors refuses such a path; that was reported as "corrupt or truncated: delete it and download it again".
    moved = tmp_path / os.fsdecode(b"weights-\xff")  # a Latin-1 name on a Linux file system
    try:
        shutil.copytree(folder, moved)
    except (OSError, UnicodeEncodeError):
        pytest.skip("this file system takes UTF-8 names only")
    with pytest.raises(ValueError, match="has a path that is not valid UTF-8, which safetensors cannot open"):
        load_model(moved)


@pytest.mark.parametrize("name, method", [("model.safetensors", "open"), ("config.json", "read_text")])
def test_an_unreadable_file_is_a_value_error_saying_so_not_a_corrupt_one(folder, monkeypatch, name, method):
    """config.json's PermissionError came through raw; model.safetensors' is not called corrupt."""
    real = getattr(Path, method)

    def refuse(path, *args, **kwargs):
        if path.name == name:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(Path, method, refuse)
    with pytest.raises(ValueError, match=rf"cannot read .*{name} \(Permission denied\): check its permissions"):
        load_model(folder)


def test_a_git_lfs_pointer_is_named_with_the_command_that_fetches_it(folder):
    (folder / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:"
                                              + "0" * 64 + "\nsize 548105171\n")
    with pytest.raises(ValueError, match="model.safetensors is a git-lfs pointer, not the weights .*`git lfs pull`"):
        load_model(folder)


def test_garbage_safetensors_raises_value_error(folder):
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage" + bytes(100))
    with pytest.raises(ValueError, match="is corrupt or truncated"):
        load_model(folder)


def test_missing_config_json_raises_file_not_found(folder):
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model(folder)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model(str(folder))
    (folder / "config.json").mkdir()  # a folder in its place
    with pytest.raises(FileNotFoundError, match="has a config.json that is not a file: a model folder needs"):
        load_model(folder)
    (folder / "config.json").rmdir()
    (folder / "config.json").symlink_to(folder / "gone.json")
    with pytest.raises(FileNotFoundError, match="has a config.json that is a broken link: a model folder needs"):
        load_model(folder)


def test_missing_safetensors_raises_file_not_found(folder):
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"model.safetensors not found.*\.bin checkpoints are not loaded"):
        load_model(folder)


def test_a_folder_that_does_not_exist_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_a_file_given_for_the_model_folder_names_its_folder(folder):
    for source in (folder / "model.safetensors", str(folder / "config.json")):
        with pytest.raises(FileNotFoundError, match=f"is a file, not a model folder: .*such as {folder}$"):
            load_model(source)


def test_empty_source_raises_value_error():
    with pytest.raises(ValueError, match="the model source is empty"):
        load_model("")


def test_a_weights_dir_under_a_home_folder_that_does_not_exist_is_named_as_the_downloads_folder(no_hub):
    # It said "model folder ~no-such-user-for-gpt2-tests/w does not exist", of the folder for downloads.
    with pytest.raises(FileNotFoundError, match=r"^the downloads folder \(weights_dir\) ~no-such-user-for-gpt2-tests/w "
                       "does not exist: '~no-such-user-for-gpt2-tests' names no home folder on this machine; give a "
                       "folder you can write to$"):
        load_model("gpt2", weights_dir="~no-such-user-for-gpt2-tests/w")


NOT_A_HUB_ID = "is neither a local folder with config.json nor a valid Hub id such as 'gpt2'"


@pytest.mark.parametrize(
    "source, error, match",
    [
        ("~no-such-user-for-gpt2-tests", FileNotFoundError, "'~no-such-user-for-gpt2-tests' names no home folder"),
        ("~no-such-user-for-gpt2-tests/model", FileNotFoundError, "names no home folder on this machine"),
        ("x" * 300, ValueError, NOT_A_HUB_ID),  # longer than a file name may be
        (Path("x" * 300), FileNotFoundError, "does not exist"),
        ("a b c", ValueError, f"'a b c' {NOT_A_HUB_ID}"),
        ("gpt2:main", ValueError, f"'gpt2:main' {NOT_A_HUB_ID}"),
        ("gpt2\x00", ValueError, NOT_A_HUB_ID),
        (5, ValueError, "the model source must be a Hub repo id such as 'gpt2' or a local folder .*not int 5"),
        (None, ValueError, "the model source must be .*not NoneType None"),
    ],
)
def test_a_source_that_is_no_folder_and_no_hub_id_says_so(no_hub, tmp_path, source, error, match):
    """Each is refused before any download (`no_hub`: a download would fail differently)."""
    weights = tmp_path / "weights"
    with pytest.raises(error, match=match):
        load_model(source, weights_dir=weights)
    assert not weights.exists()


@pytest.mark.parametrize("weights_dir", ["", " "])
def test_an_empty_weights_dir_is_refused_not_taken_for_the_current_folder(no_hub, weights_dir, monkeypatch, tmp_path):
    """An unset variable (--weights-dir "$W") meant '.': from the repository root, gpt2 downloaded into the gpt2/
    package folder, which then counted as the model."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="weights_dir is empty: pass the folder for downloads, or None"):
        load_model("gpt2", weights_dir=weights_dir)


@pytest.mark.parametrize("weights_dir", [5, 1.5, b"weights", ["weights"]])
def test_a_weights_dir_that_is_no_path_raises_value_error(no_hub, weights_dir):
    match = f"weights_dir must be the folder for downloads .*not {type(weights_dir).__name__}"
    with pytest.raises(ValueError, match=match):
        load_model(REPO_ID, weights_dir=weights_dir)


def test_a_weights_dir_that_is_a_file_raises_value_error(hub, tmp_path, folder):
    hub({REPO_ID: served_files(folder)})
    weights = tmp_path / "weights"
    weights.write_text("a file where the downloads should go")
    with pytest.raises(ValueError, match=f"cannot create the download folder {weights / 'someorg--tiny-gpt2'} "
                                         r"\(Not a directory\): pass a weights_dir"):
        load_model(REPO_ID, weights_dir=weights)


def test_a_weights_dir_the_file_system_cannot_look_up_raises_value_error(no_hub, tmp_path):
    # It was an OSError, "[Errno 36] File name too long: '.../gpt2/vocab.json'", naming neither cause nor fix.
    weights = tmp_path / ("y" * 300)  # one name over the 255 bytes file systems allow
    with pytest.raises(ValueError, match=r"cannot use the download folder .* \(File name too long\): pass a "
                                         r"weights_dir \(--weights-dir\) that is a writable folder"):
        load_model("gpt2", weights_dir=weights)


def test_n_positions_is_the_window_where_config_json_keeps_a_stale_n_ctx(folder, state):
    # As transformers reads it: n_positions sizes wpe; an older n_ctx beside it is not the window.
    n_positions = json.loads((folder / "config.json").read_text())["n_positions"]
    rewrite_config(folder, n_ctx=2 * n_positions)
    model = load_model(folder)
    assert model.config.n_ctx == n_positions
    assert_holds(model, state)


def test_a_folder_under_home_written_with_a_tilde_loads(monkeypatch, folder, state):
    monkeypatch.setenv("HOME", str(folder.parent))
    assert_holds(load_model(f"~/{folder.name}"), state)


@pytest.mark.parametrize(
    "field, value",
    [("n_layer", True), ("n_head", 2.0), ("layer_norm_epsilon", "x"), ("layer_norm_epsilon", None),
     ("layer_norm_epsilon", True), ("layer_norm_epsilon", -1e-5), ("layer_norm_epsilon", float("nan")),
     ("layer_norm_epsilon", float("inf")), ("layer_norm_epsilon", 0)],
)
def test_a_config_field_of_the_wrong_kind_raises_value_error(field, value):
    with pytest.raises(ValueError, match=f"GPT2Config.{field} must be a positive"):
        GPT2Config(**{field: value})
    assert GPT2Config(layer_norm_epsilon=1).layer_norm_epsilon == 1.0  # an int is a number


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", "is not valid JSON"),
        ("[" * 100_000, "is not valid JSON"),  # nested past Python's recursion limit
        ('{"n_embd": ' + "9" * 5000 + "}", "is not valid JSON"),  # past Python's 4300 digits
        (json.dumps({"model_type": "llama", "n_layer": 2}), "describes a 'llama' model"),
        (json.dumps({"model_type": "gpt2", "n_head": 4}), "lacks the GPT-2 field"),
    ],
)
def test_bad_config_json_raises_value_error(folder, text, match):
    (folder / "config.json").write_text(text)
    with pytest.raises(ValueError, match=match):
        load_model(folder)


def test_a_tensor_that_does_not_fit_the_config_names_it_and_both_shapes(folder, state):
    config = dict(TINY.to_hf_dict(), vocab_size=TINY.vocab_size + 1)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'wte.weight' .* shape \(101, 32\) but the config needs \(102, 32\)"):
        load_model(folder)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"n_embd": 2**20}, r"'wte.weight' .* shape \(101, 32\) but the config needs \(101, 1048576\)"),
        ({"vocab_size": 10**9}, r"'wte.weight' .* shape \(101, 32\) but the config needs \(1000000000, 32\)"),
        ({"n_positions": 10**8, "n_ctx": 10**8},
         r"'wpe.weight' .* shape \(64, 32\) but the config needs \(100000000, 32\)"),
        ({"n_layer": 10**6}, r"lacks 11999976 tensor\(s\) the config needs, e.g. 'h.2.ln_1.weight'"),
        ({"n_layer": 20000}, r"lacks 239976 tensor\(s\) the config needs, e.g. 'h.2.ln_1.weight'"),
        ({"n_embd": 48, "n_head": 4}, r"'wte.weight' .* shape \(101, 32\) but the config needs \(101, 48\)"),
        ({"n_positions": 10**30, "n_ctx": 10**30}, r"GPT2Config.n_ctx must be a positive integer \(at most 2\*\*31"),
        ({"n_embd": 2**31 - 1, "n_head": 1}, "config.json's sizes make tensors too large to exist"),
        ({"layer_norm_epsilon": 10**400}, "GPT2Config.layer_norm_epsilon must be a positive number"),
    ],
)
def test_huge_sizes_in_config_json_are_refused_from_the_header_before_anything_is_built(
    folder, monkeypatch, fields, match
):
    """Sizes that do not match the weights are caught from the safetensors
    header alone: the weights are never read and no model is allocated (which
    would take terabytes, or minutes for a million blocks)."""

    def forbidden(*args, **kwargs):
        raise AssertionError("config.json must be checked against the header before this")

    monkeypatch.setattr(loading, "load_state_dict", forbidden)
    monkeypatch.setattr(GPT2, "to_empty", forbidden)
    rewrite_config(folder, **fields)
    with pytest.raises(ValueError, match=match):
        load_model(folder)


def test_a_conv1d_weight_stored_transposed_names_it_and_both_shapes(tmp_path, state):
    bad = dict(state)
    bad["h.1.mlp.c_fc.weight"] = state["h.1.mlp.c_fc.weight"].t().contiguous()  # (out, in) instead of (in, out)
    folder = write_checkpoint(tmp_path / "bad", TINY, bad)
    expected = r"'h.1.mlp.c_fc.weight' .* shape \(128, 32\) but the config needs \(32, 128\)"
    with pytest.raises(ValueError, match=expected):
        load_model(folder)


def test_a_missing_tensor_raises_value_error_naming_it(tmp_path, state):
    folder = write_checkpoint(tmp_path / "bad", TINY, {k: v for k, v in state.items() if k != "ln_f.bias"})
    with pytest.raises(ValueError, match="lacks 1 tensor.*'ln_f.bias'"):
        load_model(folder)


@pytest.mark.parametrize("name, value", [("h.0.mlp.c_fc.weight", float("nan")), ("ln_f.bias", float("inf")),
                                         ("wte.weight", -float("inf"))])
def test_a_tensor_holding_nan_or_infinity_is_refused_naming_it(tmp_path, state, name, value):
    damaged = {**state, name: state[name].clone()}
    damaged[name].view(-1)[7] = value  # one value of all: greedy would decode garbage, sampling fail mid-run
    folder = write_checkpoint(tmp_path / "damaged", TINY, damaged)
    with pytest.raises(ValueError, match=f"tensor '{name}' in .* holds NaN or infinite values: the checkpoint is "
                                         "damaged, download it again"):
        load_model(folder)


FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e8m0fnu]


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_a_float8_checkpoint_loads_tied_and_its_nan_is_refused(tmp_path, state, dtype):
    # isfinite and nan_to_num take no float8, and float8_e8m0fnu's isfinite calls its NaN finite.
    stored = {name: tensor.to(dtype) for name, tensor in state.items()}
    tied = {**stored, "lm_head.weight": stored["wte.weight"].clone()}
    model = load_model(write_checkpoint(tmp_path / "float8", TINY, tied))
    assert torch.equal(model.wte.weight, stored["wte.weight"].float())
    stored["ln_f.bias"] = torch.tensor([float("nan")] * TINY.n_embd).to(dtype)
    with pytest.raises(ValueError, match="tensor 'ln_f.bias' in .* holds NaN or infinite values"):
        load_model(write_checkpoint(tmp_path / "nan", TINY, stored))


@pytest.mark.parametrize("stored, dtype, too_large_for", [
    (torch.float64, "float32", "float32"), (torch.float64, "bfloat16", "float32"),
    (torch.float32, "float16", "float16"),
])
def test_a_value_too_large_for_the_dtype_it_loads_in_is_refused(tmp_path, state, stored, dtype, too_large_for):
    big = {name: tensor.to(stored) for name, tensor in state.items()}
    big["ln_f.weight"] = torch.full_like(big["ln_f.weight"], 1e39 if stored == torch.float64 else 1e5)
    fix = "the checkpoint is damaged" if too_large_for == "float32" else "load it in float32"
    with pytest.raises(ValueError, match=f"tensor 'ln_f.weight' in .* holds values too large for "
                                         f"torch.{too_large_for}: {fix}"):
        load_model(write_checkpoint(tmp_path / "big", TINY, big), dtype=dtype)


def test_finite_weights_whose_sum_overflows_float32_still_load(tmp_path, state):
    huge = {**state, "ln_f.weight": torch.full_like(state["ln_f.weight"], 3e38)}  # finite, the sum is not
    assert_holds(load_model(write_checkpoint(tmp_path / "huge", TINY, huge)), huge)


def test_a_checkpoint_with_more_layers_than_the_config_raises_value_error(tmp_path, state):
    folder = write_checkpoint(tmp_path / "deeper", TINY, state)
    shallower = GPT2Config(**{**TINY.__dict__, "n_layer": 1})
    (folder / "config.json").write_text(json.dumps(shallower.to_hf_dict()))
    with pytest.raises(ValueError, match="holds 2 layers \\(e.g. 'h.1.\\*'\\) but config.json says n_layer 1: "
                                         "is config.json from the same checkpoint"):
        load_model(folder)


# openai-community/gpt2's config.json as published on the Hub, with the tiny sizes.
HUB_GPT2_CONFIG = {
    "activation_function": "gelu_new",
    "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1,
    "bos_token_id": 50256,
    "embd_pdrop": 0.1,
    "eos_token_id": 50256,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2",
    "n_ctx": 64,
    "n_embd": 32,
    "n_head": 4,
    "n_layer": 2,
    "n_positions": 64,
    "resid_pdrop": 0.1,
    "summary_activation": None,
    "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True,
    "summary_type": "cls_index",
    "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    "vocab_size": 101,
}
# distilgpt2's extra fields, and those transformers' save_pretrained writes out (GPT-2's own values).
DISTILGPT2_EXTRA = {"_num_labels": 1, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
SAVE_PRETRAINED_EXTRA = {
    "add_cross_attention": False, "n_inner": None, "reorder_and_upcast_attn": False,
    "scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True, "tie_word_embeddings": True,
    "use_cache": True, "transformers_version": "4.57.0",
}


@pytest.mark.parametrize(
    "extra",
    [
        {},
        DISTILGPT2_EXTRA,
        SAVE_PRETRAINED_EXTRA,
        {**SAVE_PRETRAINED_EXTRA, "n_inner": 4 * 32, "activation_function": "gelu_pytorch_tanh"},  # the same MLP
        {**SAVE_PRETRAINED_EXTRA, "reorder_and_upcast_attn": True},  # float32 scores: the same function
    ],
    ids=["gpt2", "distilgpt2", "save_pretrained", "same_mlp_spelled_out", "reorder_and_upcast_attn"],
)
def test_the_official_config_json_fields_load(folder, state, extra):
    (folder / "config.json").write_text(json.dumps({**HUB_GPT2_CONFIG, **extra}))
    assert_holds(load_model(folder), state)


@pytest.mark.parametrize(
    "field, value",
    [
        ("activation_function", "relu"),
        ("activation_function", "gelu"),  # the exact erf GELU, not GPT-2's tanh approximation
        ("activation_function", None),
        ("scale_attn_weights", False),
        ("scale_attn_by_inverse_layer_idx", True),
        ("add_cross_attention", True),
        ("tie_word_embeddings", False),
        ("n_inner", 100),
        ("n_inner", 4 * 32 + 1),
    ],
)
def test_a_config_json_setting_this_model_does_not_compute_raises_value_error(folder, field, value):
    """Loaded anyway, the weights would silently compute another function."""
    rewrite_config(folder, **{field: value})
    match = f'sets "{field}": {json.dumps(value)}, .*only GPT-2\'s own settings are supported'
    with pytest.raises(ValueError, match=match):
        load_model(folder)


def test_an_untied_lm_head_is_refused_not_dropped(tmp_path, state):
    """A checkpoint with its own lm_head.weight (tie_word_embeddings false):
    dropping it, as a tied copy is, would compute other logits."""
    untied = {**state, "lm_head.weight": torch.randn(TINY.vocab_size, TINY.n_embd)}
    folder = write_checkpoint(tmp_path / "untied", TINY, untied)
    rewrite_config(folder, tie_word_embeddings=False)
    with pytest.raises(ValueError, match='"tie_word_embeddings": false, which this hand-written GPT-2 does not'):
        load_model(folder)


@pytest.mark.parametrize("dtype", ["float64", torch.float64, torch.int8, "fp16"])
def test_unsupported_dtype_raises_value_error(folder, dtype):
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model(folder, dtype=dtype)


@pytest.mark.parametrize(
    "device, match",
    [("cuda", "is not available"), ("cuda:3", "is not available|does not exist"), ("tpu", "unknown device 'tpu'")],
)
def test_unavailable_device_raises_value_error(folder, device, match):
    index = int(device.partition(":")[2] or 0)
    if device.startswith("cuda") and torch.cuda.is_available() and index < torch.cuda.device_count():
        pytest.skip(f"this machine has a CUDA GPU, so {device!r} is available")
    with pytest.raises(ValueError, match=match):
        load_model(folder, device=device)


def test_a_device_error_comes_before_any_download(no_hub, tmp_path):
    with pytest.raises(ValueError, match="unknown device"):
        load_model(REPO_ID, device="tpu", weights_dir=tmp_path / "weights")
    assert not (tmp_path / "weights").exists()


def test_a_checkpoint_stored_in_float16_loads_as_float32(tmp_path, state):
    half = {k: v.half() for k, v in state.items()}
    folder = tmp_path / "half"
    folder.mkdir()
    save_file(half, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    model = load_model(folder)
    assert model.dtype == torch.float32
    assert torch.equal(model.wte.weight, half["wte.weight"].float())
