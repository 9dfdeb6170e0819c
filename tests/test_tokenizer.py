"""The GPT-2 tokenizer (gpt2/tokenizer.py) with the real vocabulary from
../shared/gpt2-bpe: golden ids, round trips, and agreement with tiktoken's
own "gpt2" encoding (read offline from the cache conftest.py seeds)."""

from __future__ import annotations

import json
import shutil

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
    with pytest.raises(ValueError, match="does not match"):
        load_tokenizer(tmp_path)


def test_a_vocab_json_that_is_not_json_raises_value_error(tmp_path, model_folder):
    (tmp_path / "vocab.json").write_text("{not json", encoding="utf-8")
    shutil.copyfile(model_folder / "merges.txt", tmp_path / "merges.txt")
    with pytest.raises(ValueError, match="is not a GPT-2 vocab.json"):
        load_tokenizer(tmp_path)
