"""Fixtures shared by every test file (helper functions are in helpers.py):

- tiktoken's offline cache, seeded from the real GPT-2 vocabulary (../shared/gpt2-bpe);
- no network for any test: huggingface_hub points at a closed local port and
  tiktoken may not download, unless a test asks for a local Hub; calibrations
  go to a session folder, not the user's cache;
- the local Hub server fixtures (`hub`, `no_hub`, from hub_server.py);
- `fast_kernels`, for the tests of the C fast path;
- `single_thread`, for the tests of tiny models;
- `tiktoken_offline`: tiktoken with nothing cached and no network.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import requests
import tiktoken.load
import tiktoken.registry
import torch

from benchmarks.common import load_prompt_tokenizer
from gpt2.fast import build
from helpers import GPT2_BPE_DIR
from hub_server import closed_endpoint, hub, no_hub, point_huggingface_hub_at  # noqa: F401  (hub, no_hub: fixtures)

# tiktoken names each cached file by the sha1 of the URL it came from.
TIKTOKEN_CACHE_NAMES = {
    "vocab.bpe": "6d1cbeee0f20b3d9449abfede4726ed8212e3aee",
    "encoder.json": "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6",
}


@pytest.fixture(autouse=True)
def seeded_torch():
    """Each test starts from the same global torch seed, whichever worker runs it and after whichever tests:
    a weight drawn without a generator (a test's edit, a default nn.Linear) is the same in every run."""
    torch.manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def offline_tiktoken_cache(tmp_path_factory: pytest.TempPathFactory):
    """Seeds a tiktoken cache with ../shared/gpt2-bpe (when present), so that
    `tiktoken.get_encoding("gpt2")` works with no network, for the whole session."""
    if not GPT2_BPE_DIR.is_dir():
        yield None
        return
    cache = tmp_path_factory.mktemp("tiktoken_cache")
    for source, cached_name in TIKTOKEN_CACHE_NAMES.items():
        shutil.copyfile(GPT2_BPE_DIR / source, cache / cached_name)
    before = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    yield cache
    if before is None:
        del os.environ["TIKTOKEN_CACHE_DIR"]
    else:
        os.environ["TIKTOKEN_CACHE_DIR"] = before


@pytest.fixture(scope="session", autouse=True)
def no_network(tmp_path_factory: pytest.TempPathFactory):
    """No test reaches the network, even one whose checks regress: huggingface_hub talks to a closed local port
    (the `hub` fixture points it at a local server instead), and tiktoken reads only its cache."""

    def refuse(url: str) -> bytes:
        raise ConnectionError(f"tests do not reach the network (tiktoken wanted {url})")

    with pytest.MonkeyPatch.context() as patch:
        point_huggingface_hub_at(patch, closed_endpoint(), tmp_path_factory.mktemp("hf_home"))
        patch.setattr(tiktoken.load, "read_file", refuse)
        yield


@pytest.fixture
def tiktoken_offline(monkeypatch, tmp_path) -> list[str]:
    """tiktoken as on a machine with no network and nothing cached: an empty
    cache folder, no encoding loaded yet, and every download raising requests'
    ConnectionError (no request leaves). Returns the URLs tiktoken asked for."""
    asked = []

    def no_network(url: str) -> bytes:
        asked.append(url)
        raise requests.ConnectionError(f"no network in the tests: {url}")

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty_tiktoken_cache"))
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # forget the "gpt2" loaded by earlier tests
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    return asked


@pytest.fixture(scope="session", autouse=True)
def calibrations_in_a_session_folder(tmp_path_factory: pytest.TempPathFactory):
    """The step costs `gamma="auto"` and the drafting benchmark calibrate go to a folder of this session, not the
    user's cache (a test may point them elsewhere again)."""
    import spec_decoding.costs

    folder = tmp_path_factory.mktemp("step-costs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(spec_decoding.costs, "default_cache_dir", lambda: folder)
        yield folder


@pytest.fixture(scope="session")
def gpt2_bpe_dir() -> Path:
    """../shared/gpt2-bpe (encoder.json, vocab.bpe), or a skip if this clone has none."""
    if not GPT2_BPE_DIR.is_dir():
        pytest.skip(f"the real GPT-2 vocabulary is not at {GPT2_BPE_DIR} (../shared/gpt2-bpe from the repo root)")
    return GPT2_BPE_DIR


@pytest.fixture(scope="session")
def prompt_tokenizer(gpt2_bpe_dir):
    """The tokenizer the benchmarks encode their real prompts with, from the GPT-2 vocabulary
    (../shared/gpt2-bpe; without it a skip, never on the word of the code under test)."""
    return load_prompt_tokenizer(None)


@pytest.fixture(scope="session")
def fast_kernels() -> build.Kernels:
    """The C kernels, built. Skipped only where they truly cannot exist
    (another CPU, no C compiler); a failed build on a machine that has both fails."""
    unsupported = build.cpu_unsupported()
    if unsupported:
        pytest.skip(unsupported)
    if build.compiler() is None:
        pytest.skip("no C compiler on this machine")
    kernels = build.load()
    assert isinstance(kernels, build.Kernels), kernels
    return kernels


@pytest.fixture(scope="module")
def single_thread():
    """Runs a module's tests on one CPU thread, then restores the setting.

    Tiny models are so small that a forward pass is Python overhead plus
    microsecond kernels; a thread pool only adds synchronisation, and on a
    shared machine an oversubscribed pool made the tests ~20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
