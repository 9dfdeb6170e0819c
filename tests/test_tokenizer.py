"""The GPT-2 tokenizer (gpt2/tokenizer.py) with the real vocabulary from
../shared/gpt2-bpe: golden ids, round trips, and agreement with tiktoken's
own "gpt2" encoding (read offline from the cache conftest.py seeds)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tiktoken

from gpt2 import END_OF_TEXT_ID, load_tokenizer

TEXTS = [
    "Hello world",
    "hello world",
    "I'll say it's 2024: don't you've we're they'd?",
    "    indented code:\n\tfor i in range(10):\n\t\tprint(i ** 2)  # squares\n",
    "Numbers 1234567890 and 3.14159, hex 0xDEADBEEF.",
    "Crème brûlée, naïve façade, Ångström, Straße.",
    "日本語のテキストと中文文本，한국어 텍스트.",
    "Emoji: 👍🏽 🇫🇷 👨‍👩‍👧‍👦 🤖!!",
    "Whitespace   runs\n\n\n and \t\t tabs \r\n at the end   ",
    "combining: e\u0301 a\u0308, zero\u200bwidth, nbsp\u00a0here",
    "",
]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, gpt2_bpe_dir):
    """A model folder holding the real vocab.json + merges.txt, as downloaded."""
    folder = tmp_path_factory.mktemp("gpt2_folder")
    shutil.copyfile(gpt2_bpe_dir / "encoder.json", folder / "vocab.json")
    shutil.copyfile(gpt2_bpe_dir / "vocab.bpe", folder / "merges.txt")
    return folder


@pytest.fixture(scope="module")
def enc(model_folder) -> tiktoken.Encoding:
    return load_tokenizer(model_folder)


def test_golden_ids(enc):
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.encode("hello world") == [31373, 995]
    assert enc.encode(" the") == [262]
    assert enc.decode([15496, 995]) == "Hello world"


def test_end_of_text_is_50256_and_the_vocabulary_has_50257_tokens(enc):
    assert END_OF_TEXT_ID == 50256
    assert enc.eot_token == 50256
    assert enc.n_vocab == 50257
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    assert enc.decode([50256]) == "<|endoftext|>"
    # As plain text (the default), the marker is refused rather than silently split.
    with pytest.raises(ValueError):
        enc.encode("<|endoftext|>")


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(enc, text):
    ids = enc.encode(text)
    assert all(0 <= i < 50256 for i in ids)
    assert enc.decode(ids) == text


def test_every_byte_is_a_token(enc):
    # GPT-2 is byte level: each of the 256 bytes has a token, so any text encodes.
    assert enc.encode_single_token(b"!") == 0
    assert enc.encode_single_token(b"\n") == 198
    assert enc.encode_single_token(b" ") == 220
    data = bytes(range(256))
    assert enc.decode_bytes([enc.encode_single_token(bytes([b])) for b in range(256)]) == data


def test_agrees_with_tiktoken_gpt2_encoding(enc):
    reference = tiktoken.get_encoding("gpt2")
    for text in TEXTS:
        assert enc.encode(text) == reference.encode(text), text
    assert enc.n_vocab == reference.n_vocab


def test_without_a_folder_falls_back_to_tiktoken_gpt2(tmp_path, gpt2_bpe_dir):
    # The fallback reads tiktoken's cache, which conftest.py seeds from gpt2_bpe_dir.
    for fallback in (load_tokenizer(None), load_tokenizer(tmp_path)):  # tmp_path has no vocab files
        assert fallback.encode("Hello world") == [15496, 995]
        assert fallback.eot_token == 50256


def test_merges_from_another_vocabulary_raise_value_error(tmp_path, model_folder):
    (tmp_path / "vocab.json").write_bytes((model_folder / "vocab.json").read_bytes())
    lines = (model_folder / "merges.txt").read_text(encoding="utf-8").splitlines()
    header, merges = lines[:1], lines[1:]
    (tmp_path / "merges.txt").write_text("\n".join(header + merges[::-1]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="merges.txt does not match .*vocab.json: take both from the same model"):
        load_tokenizer(tmp_path)


def test_vocab_with_shifted_ids_raises_value_error(tmp_path, model_folder):
    vocab = json.loads((model_folder / "vocab.json").read_text(encoding="utf-8"))
    shifted = {token: (i + 1) % len(vocab) for token, i in vocab.items()}
    (tmp_path / "vocab.json").write_text(json.dumps(shifted), encoding="utf-8")
    shutil.copyfile(model_folder / "merges.txt", tmp_path / "merges.txt")
    with pytest.raises(ValueError, match="is not a GPT-2 vocab.json"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize(
    "edit",
    [
        lambda v: v | {"Ġthe": 5},  # two tokens with one id: tiktoken would panic
        lambda v: v | {"zzzzqqqq": 5},  # an extra token with a taken id: every id still there, one twice
        lambda v: {t: i for t, i in v.items() if i < 300 or i == 50256},  # ids 300.. missing: decoding would fail
        lambda v: v | {"!": -1},
        lambda v: v | {"!": 0.5},
    ],
    ids=["duplicate", "extra-token-duplicate", "missing", "negative", "not-an-integer"],
)
def test_vocab_ids_that_are_not_each_id_once_raise_value_error(tmp_path, model_folder, edit):
    vocab = json.loads((model_folder / "vocab.json").read_text(encoding="utf-8"))
    (tmp_path / "vocab.json").write_text(json.dumps(edit(vocab)), encoding="utf-8")
    merges = (model_folder / "merges.txt").read_text(encoding="utf-8").splitlines()
    (tmp_path / "merges.txt").write_text("\n".join(merges[:45]) + "\n", encoding="utf-8")  # ids 256..299
    with pytest.raises(ValueError, match=r"is not a GPT-2 vocab.json \(its ids are not 0, 1, ..., 50255 each once"):
        load_tokenizer(tmp_path)


def test_a_vocab_json_that_cannot_be_read_says_so(model_folder, monkeypatch):
    real_read_text = Path.read_text

    def refuse(path, *args, **kwargs):
        if path.name == "vocab.json":
            raise PermissionError(13, "Permission denied", str(path))  # another user's file, say
        return real_read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", refuse)
    with pytest.raises(ValueError, match=r"cannot read .*vocab.json \(Permission denied\): check its permissions"):
        load_tokenizer(model_folder)


@pytest.mark.parametrize(
    "edit, match",
    [
        # Every id still there once, but "H" renamed: text with that byte could not be encoded (tiktoken panicked).
        (lambda v: {("Hzzq" if t == "H" else t): i for t, i in v.items()}, r"id 39 is not the token of byte 72"),
        # "!" and '"' trade ids: every text with them would be other token ids than GPT-2's.
        (lambda v: v | {"!": v['"'], '"': v["!"]}, r"id 0 is not the token of byte 33"),
    ],
    ids=["a byte missing", "two bytes swapped"],
)
def test_a_vocab_json_whose_byte_tokens_are_not_gpt2s_raises_value_error(tmp_path, model_folder, edit, match):
    vocab = json.loads((model_folder / "vocab.json").read_text(encoding="utf-8"))
    (tmp_path / "vocab.json").write_text(json.dumps(edit(vocab)), encoding="utf-8")
    shutil.copyfile(model_folder / "merges.txt", tmp_path / "merges.txt")
    with pytest.raises(ValueError, match=r"vocab.json is not a GPT-2 vocab.json \(" + match):
        load_tokenizer(tmp_path)


def test_merged_tokens_that_trade_ids_raise_value_error(tmp_path, model_folder):
    # Two tokens past the bytes swapped: the first and last merge still match, the ones in between do not.
    vocab = json.loads((model_folder / "vocab.json").read_text(encoding="utf-8"))
    by_id = {i: t for t, i in vocab.items()}
    a, b = by_id[1000], by_id[30000]
    (tmp_path / "vocab.json").write_text(json.dumps(vocab | {a: 30000, b: 1000}), encoding="utf-8")
    shutil.copyfile(model_folder / "merges.txt", tmp_path / "merges.txt")
    with pytest.raises(ValueError, match="merges.txt does not match .*vocab.json: take both from the same model"):
        load_tokenizer(tmp_path)


def test_a_merges_txt_that_is_not_text_is_named(tmp_path, model_folder):
    shutil.copyfile(model_folder / "vocab.json", tmp_path / "vocab.json")
    (tmp_path / "merges.txt").write_bytes((model_folder / "merges.txt").read_bytes() + b"\xe9")
    with pytest.raises(ValueError, match=r"merges.txt is not a GPT-2 merges.txt \(not UTF-8 text\): download it"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("text", ["{not json", "[" * 100_000], ids=["not JSON", "nested past the recursion limit"])
def test_a_vocab_json_that_is_not_json_raises_value_error(tmp_path, model_folder, text):
    (tmp_path / "vocab.json").write_text(text, encoding="utf-8")
    shutil.copyfile(model_folder / "merges.txt", tmp_path / "merges.txt")
    with pytest.raises(ValueError, match="is not a GPT-2 vocab.json"):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------------------
# Folders that are not a tokenizer, and tiktoken's fallback offline
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("folder", [None, "empty folder"])
def test_with_no_network_the_fallback_says_how_to_get_the_files(tiktoken_offline, tmp_path, folder):
    if folder is not None:
        folder = tmp_path / folder
        folder.mkdir()
    with pytest.raises(FileNotFoundError) as info:
        load_tokenizer(folder)
    message = str(info.value)
    assert "tiktoken could not get its own 'gpt2' files (ConnectionError; no network?)" in message
    assert "vocab.json and merges.txt" in message and "connect to the internet once" in message
    assert ("no tokenizer folder was given" if folder is None else f"{folder} has no vocab.json") in message
    assert tiktoken_offline, "the fallback went to tiktoken's download"


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda tmp: tmp / "nowhere", FileNotFoundError, "tokenizer folder .*nowhere does not exist"),
        (lambda tmp: tmp / ("x" * 300), FileNotFoundError, "does not exist"),  # a name too long to look up
        (lambda tmp: tmp / "model" / "vocab.json", FileNotFoundError, "tokenizer folder .*vocab.json is not a folder"),
        (lambda tmp: 5, ValueError, "the tokenizer folder must be a folder .*got int 5"),
        (lambda tmp: "", ValueError, "the tokenizer folder must be a folder .*got str ''"),
    ],
    ids=["missing", "name_too_long", "a_file", "an_int", "empty"],
)
def test_a_folder_that_is_no_folder_says_so(tiktoken_offline, tmp_path, model_folder, make, error, match):
    shutil.copytree(model_folder, tmp_path / "model")
    with pytest.raises(error, match=match):
        load_tokenizer(make(tmp_path))
    assert not tiktoken_offline, "no fallback to tiktoken's files for a path that is wrong"


@pytest.mark.parametrize(
    "vocab, merges, match",
    [
        ("file", None, "has vocab.json but no merges.txt: .*copy its merges.txt into"),
        (None, "file", "has merges.txt but no vocab.json: .*copy its vocab.json into"),
        ("folder", "file", "vocab.json is not a file"),
        ("folder", None, "vocab.json is not a file"),
        ("file", "folder", "merges.txt is not a file"),
    ],
)
def test_a_folder_with_half_a_tokenizer_names_the_missing_file(
    tiktoken_offline, tmp_path, model_folder, vocab, merges, match
):
    for name, kind in (("vocab.json", vocab), ("merges.txt", merges)):
        if kind == "file":
            shutil.copyfile(model_folder / name, tmp_path / name)
        elif kind == "folder":
            (tmp_path / name).mkdir()
    with pytest.raises(ValueError, match=match):
        load_tokenizer(tmp_path)
    assert not tiktoken_offline, "half a tokenizer is an error, not a reason to fetch tiktoken's"
