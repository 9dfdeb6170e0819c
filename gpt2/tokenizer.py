"""The GPT-2 byte-pair-encoding tokenizer (Radford et al. 2019, section 2.2),
run by `tiktoken`.

A Hugging Face GPT-2 folder carries the vocabulary as `vocab.json` (token
string -> id; each byte is written as a printable character) and the merge
rules as `merges.txt`. In GPT-2 the merge of rank r creates token 256 + r, so
tiktoken's "mergeable ranks" are simply the vocabulary's ids; we read them from
vocab.json and check them against merges.txt. With the files of a downloaded
model nothing else is fetched; without them we fall back to
`tiktoken.get_encoding("gpt2")` (which downloads and caches its own copy, in
TIKTOKEN_CACHE_DIR if set).
"""

from __future__ import annotations

import json
from pathlib import Path

import tiktoken

END_OF_TEXT = "<|endoftext|>"
END_OF_TEXT_ID = 50256
# GPT-2's pre-tokenizer regex: contractions, letter runs, digit runs, other
# symbol runs, and whitespace, each optionally led by one space.
GPT2_SPLIT_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)


def byte_to_vocab_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table: printable,
    non-space Latin-1 bytes stand for themselves; the other 68 bytes are
    shifted to characters 256, 257, ... in byte order."""
    table = {}
    shifted = 0
    for b in range(256):
        ch = chr(b)
        if ch.isprintable() and ch != " ":
            table[b] = ch
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def read_mergeable_ranks(vocab_json: Path, merges_txt: Path) -> dict[bytes, int]:
    """Token bytes -> id for every BPE token (the special token excluded).

    Raises:
        ValueError: the files are not a GPT-2 vocabulary or do not match.
    """
    byte_chars = byte_to_vocab_char()
    char_to_byte = {ch: b for b, ch in byte_chars.items()}
    try:
        vocab = json.loads(Path(vocab_json).read_text(encoding="utf-8"))
        ranks = {
            bytes(char_to_byte[ch] for ch in token): i for token, i in vocab.items() if token != END_OF_TEXT
        }
    except OSError as e:
        raise ValueError(f"cannot read {vocab_json} ({e.strerror}): check its permissions") from None
    except (ValueError, KeyError, AttributeError, TypeError, RecursionError) as e:  # JSON's errors are ValueErrors
        raise ValueError(f"{vocab_json} is not a GPT-2 vocab.json ({type(e).__name__}): download it again") from None
    try:
        merges = Path(merges_txt).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"cannot read {merges_txt} ({e.strerror}): check its permissions") from None
    except UnicodeDecodeError:
        raise ValueError(f"{merges_txt} is not a GPT-2 merges.txt (not UTF-8 text): download it again") from None
    merges = [line for line in merges if line and not line.startswith("#version")]
    ids = list(ranks.values())  # tiktoken needs each id once, and decoding needs all of them
    if not all(type(i) is int for i in ids) or len(ids) != END_OF_TEXT_ID or set(ids) != set(range(END_OF_TEXT_ID)):
        raise ValueError(f"{vocab_json} is not a GPT-2 vocab.json (its ids are not 0, 1, ..., "
                         f"{END_OF_TEXT_ID - 1} each once, then end-of-text): download it again")
    # GPT-2's first 256 ids are the single bytes: those that stand for themselves, then the shifted ones ...
    byte_order = sorted(range(256), key=lambda b: (ord(byte_chars[b]) >= 256, b))
    for i, b in enumerate(byte_order):
        if ranks.get(bytes([b])) != i:  # without every byte, some text could not be encoded
            raise ValueError(f"{vocab_json} is not a GPT-2 vocab.json (id {i} is not the token of byte {b}): "
                             "download it again")
    # ... and each merge "a b" of rank r created the token a+b with id 256 + r.
    tokens = {token: i for token, i in vocab.items() if token != END_OF_TEXT}
    pairs = [line.split(" ") for line in merges]
    if len(pairs) != END_OF_TEXT_ID - 256 or any(
        len(pair) != 2 or tokens.get(pair[0] + pair[1]) != 256 + r for r, pair in enumerate(pairs)
    ):
        raise ValueError(f"{merges_txt} does not match {vocab_json}: take both from the same model folder")
    return ranks


def load_tokenizer(folder: str | Path | None = None) -> tiktoken.Encoding:
    """The GPT-2 tokenizer, from `folder`'s vocab.json + merges.txt if it holds
    them, otherwise (a folder with neither, or None) tiktoken's "gpt2" encoding,
    which tiktoken downloads once and then reads from its cache.

    End-of-text is token 50256 ("<|endoftext|>").

    Raises:
        FileNotFoundError: `folder` does not exist or is not a folder; or
            tiktoken's own files are needed and cannot be had (no network,
            nothing cached).
        ValueError: `folder` is not a str or Path; it holds one of the two
            files without the other; or they are not a GPT-2 vocabulary.
    """
    if folder is None:
        return tiktoken_gpt2(
            "no tokenizer folder was given", "pass a folder holding GPT-2's vocab.json and merges.txt"
        )
    if not isinstance(folder, (str, Path)) or str(folder).strip() == "":
        raise ValueError(
            f"the tokenizer folder must be a folder holding vocab.json and merges.txt (a str or Path), "
            f"or None for tiktoken's GPT-2 files; got {type(folder).__name__} {folder!r}"
        )
    folder = Path(folder)
    try:
        problem = None if folder.is_dir() else "is not a folder" if folder.exists() else "does not exist"
    except OSError:  # a name the file system refuses to look up (too long, say)
        problem = "does not exist"
    if problem is not None:
        raise FileNotFoundError(
            f"tokenizer folder {folder} {problem}: pass the model folder that holds vocab.json and merges.txt, "
            "or None for tiktoken's GPT-2 files"
        )

    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    if not vocab.exists() and not merges.exists():
        return tiktoken_gpt2(
            f"{folder} has no vocab.json and merges.txt", f"copy GPT-2's vocab.json and merges.txt into {folder}"
        )
    # ValueErrors, not FileNotFoundErrors: the folder is there but broken, and
    # the CLI reports a FileNotFoundError from here as tiktoken's files missing.
    for path in (vocab, merges):
        if path.exists() and not path.is_file():
            raise ValueError(f"{path} is not a file: put the model's own {path.name} there")
    for path, other in ((vocab, merges), (merges, vocab)):
        if not path.exists():
            raise ValueError(
                f"{folder} has {other.name} but no {path.name}: a GPT-2 tokenizer needs both, from the same "
                f"model; copy its {path.name} into {folder} (or remove {other.name} to use tiktoken's GPT-2 files)"
            )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_SPLIT_PATTERN,
        mergeable_ranks=read_mergeable_ranks(vocab, merges),
        special_tokens={END_OF_TEXT: END_OF_TEXT_ID},
    )


def tiktoken_gpt2(why: str, fix: str) -> tiktoken.Encoding:
    """tiktoken's own "gpt2" encoding, used because of `why`.

    Raises:
        FileNotFoundError: tiktoken cannot get its files (no network and
            nothing cached); the message says `why` they were needed, and `fix`.
    """
    try:
        return tiktoken.get_encoding("gpt2")
    except (OSError, ValueError) as e:  # requests' errors are OSErrors; a bad download is a ValueError
        raise FileNotFoundError(
            f"{why}, and tiktoken could not get its own 'gpt2' files ({type(e).__name__}; no network?): "
            f"{fix}, or connect to the internet once so that tiktoken caches its files"
        ) from None
