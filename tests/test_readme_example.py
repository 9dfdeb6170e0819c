"""The README's examples hold: its Python API block runs as written, from a
first download on, and its example output has the labels the command prints.

The API example loads "gpt2" and "gpt2-large" from the Hub. Here a local Hub
(hub_server.py) serves two tiny GPT-2s under those ids, with the real GPT-2
vocabulary; the weights folder and the step-cost cache are redirected to
tmp_path, and the example's own code block is executed unchanged from the
working directory a reader would use (its `weights/gpt2-large` is relative).
"""

from __future__ import annotations

import re

import torch

import gpt2.hub
import spec_decoding.costs
from gpt2 import GPT2Config
from helpers import REPO_ROOT, hub_layout, perturbed_copy, tiny_gpt2, write_checkpoint

CONFIG = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_ctx=128)  # the real vocabulary: 50257 tokens


def readme_example() -> str:
    """The code block under the README's "Python API" heading."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Python API") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def hub_files(model, folder) -> dict[str, bytes]:
    folder = write_checkpoint(folder, CONFIG, hub_layout(model), with_tokenizer=True)
    return {name: (folder / name).read_bytes() for name in ("config.json", "model.safetensors", "vocab.json",
                                                            "merges.txt")}


def test_the_readme_example_runs(hub, tmp_path, monkeypatch, single_thread, capsys):
    target = tiny_gpt2(CONFIG, seed=0)
    draft = perturbed_copy(target, scale=0.005, seed=1)
    server = hub({"gpt2-large": hub_files(target, tmp_path / "served" / "target"),
                  "gpt2": hub_files(draft, tmp_path / "served" / "draft")})
    monkeypatch.setattr(gpt2.hub, "WEIGHTS_DIR", tmp_path / "weights")
    monkeypatch.setattr(spec_decoding.costs, "default_cache_dir", lambda: tmp_path / "step-costs")
    monkeypatch.chdir(tmp_path)

    names: dict = {}
    exec(compile(readme_example(), "README.md (Python API)", "exec"), names)  # its own asserts run too

    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["gpt2", "gpt2-large"]
    assert set(server.files_requested("GET")) == {"config.json", "model.safetensors", "vocab.json", "merges.txt"}
    printed = capsys.readouterr().out
    assert printed.startswith("The meaning of life is"), printed
    enc, ids, baseline = names["enc"], names["ids"], names["baseline"]
    assert torch.equal(baseline[0, : ids.size(1)], ids[0]) and baseline.size(1) == ids.size(1) + 50
    prompts = [enc.encode("Hello"), enc.encode("Once upon a time")]
    rows, stats = names["rows"], names["stats"]  # the batch, the example's last call
    assert [row[: len(p)] for row, p in zip(rows, prompts)] == prompts
    assert stats.new_tokens == sum(len(row) - len(p) for row, p in zip(rows, prompts)) == 2 * 50


def test_the_example_is_found():
    code = readme_example()
    assert "speculative_generate(" in code and "load_model(" in code, code


def readme_output() -> list[str]:
    """The lines of the README's example output under "What the output means", after its `$` command."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## What the output means") :]
    return re.search(r"```\n\$ [^\n]*\n(.*?)```", section, re.S).group(1).splitlines()


def stats_labels(lines: list[str]) -> list[str]:
    """The labels of the stats block, which opens with "new tokens": each line's first column (21 characters, as
    cli/report.py aligns them)."""
    start = next(i for i, line in enumerate(lines) if line.startswith("new tokens "))
    return [line[:21].strip() for line in lines[start:] if len(line) > 21 and line[20] == " " and line[21] != " "]


def test_the_readme_explains_the_output_the_command_prints(tmp_path, single_thread, capsys, no_hub):
    import spec_decoding_generate as cli

    target = tiny_gpt2(CONFIG, seed=0)
    folders = {}
    for role, model in (("target", target), ("draft", perturbed_copy(target, scale=0.005, seed=1))):
        folders[role] = write_checkpoint(tmp_path / role, CONFIG, hub_layout(model), with_tokenizer=True)
    assert cli.main(["--draft", str(folders["draft"]), "--target", str(folders["target"]), "--max-gen", "20",
                     "--compare", "--no-color", "--device", "cpu"]) == 0  # the README's run: on a CPU
    printed = capsys.readouterr().out.splitlines()

    documented = readme_output()
    assert stats_labels(documented) == stats_labels(printed), (documented, printed)
    assert len(stats_labels(documented)) == 12
    header = [re.sub(r"\S*/(draft|target)\b", r"\1", line) for line in printed[:2]]  # folders -> their role
    assert header == [re.sub(r"tiny/(draft|target)\b", r"\1", line) for line in documented[:2]]
