"""The commands the README and the docs tell a reader to run still parse: every
option exists and every value passes the script's own checks. Nothing is run.

Checked: README.md, docs/cli.md, docs/parity.md, docs/speculative_decoding.md,
the table of docs/performance.md that gives each README figure's command, and
the usage lines of the scripts' docstrings; the rest of performance.md is a
dated log, whose old commands may use options that have changed since.
"""

from __future__ import annotations

import ast
import importlib
import re
import shlex

import pytest

import spec_decoding_generate as cli
from cli.arguments import check_settings, check_tree
from helpers import REPO_ROOT

DOCS = ("README.md", "docs/cli.md", "docs/parity.md", "docs/speculative_decoding.md")
REPRODUCE = "## Reproducing the README's figures"
COMMAND = re.compile(r"python (-m benchmarks\.\w+|spec_decoding_generate\.py)((?: [^\s`|#]+)*)")


def documented_commands() -> list[tuple[str, str]]:
    """(file, command) for every command of DOCS, of performance.md's reproduction table, and of the usage lines
    in the benchmarks' and the command's module docstrings."""
    texts = {name: (REPO_ROOT / name).read_text(encoding="utf-8") for name in DOCS}
    for path in [*sorted((REPO_ROOT / "benchmarks").glob("*.py")), REPO_ROOT / "spec_decoding_generate.py"]:
        texts[str(path.relative_to(REPO_ROOT))] = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    log = (REPO_ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    start = log.index(REPRODUCE)
    texts["docs/performance.md"] = log[start : log.index("\n## ", start + len(REPRODUCE))]
    return [(name, m.group(0)) for name, text in texts.items() for m in COMMAND.finditer(text)]


def check_command(command: str, capsys) -> None:
    """Raises (ValueError, SystemExit, AssertionError) unless `command` parses: each option is in its script's
    --help, and the script's own checks of the values pass (`parse_args`; the CLI's `check_settings`)."""
    words = shlex.split(command)  # python -m benchmarks.X ARGS, or python spec_decoding_generate.py ARGS
    if words[1] == "spec_decoding_generate.py":
        argv = words[2:]
        if argv == ["--help"]:
            with pytest.raises(SystemExit) as done:
                cli.build_parser().parse_args(argv)
            assert done.value.code == 0
            return
        args = cli.build_parser().parse_args(argv)
        check_settings(args)
        check_tree(args)
        return
    name, argv = words[2], words[3:]
    module = importlib.import_module(name)
    with pytest.raises(SystemExit):
        module.main(["--help"])
    help_text = capsys.readouterr().out
    unknown = [w for w in argv if w.startswith("--") and not re.search(rf"{re.escape(w)}\b", help_text)]
    assert not unknown, f"{command}: {unknown} not in `python -m {name} --help`"
    if hasattr(module, "parse_args"):
        module.parse_args(argv)


def test_the_docs_hold_the_commands_this_test_reads():
    found = documented_commands()
    assert len(found) >= 20, found
    assert {name for name, _ in found} >= {"README.md", "docs/cli.md", "docs/parity.md", "docs/performance.md"}


@pytest.mark.parametrize("where, command", documented_commands(), ids=lambda value: value[:60])
def test_a_documented_command_parses(where, command, capsys):
    check_command(command, capsys)


@pytest.mark.parametrize("command", [
    "python -m benchmarks.batch_speed --new-tokens 48 --batch-size 8",  # the option is --batch-sizes
    "python -m benchmarks.decode_speed --models gpt2-large --ks 1",  # k = 1 is the step, not a verification
    "python spec_decoding_generate.py --gamma 0",
    "python spec_decoding_generate.py --tree 3,2 --gamma 4",
    # The sweep's own usage line said this: alpha_sim 0.8 and the default --tree-profile sum past 1.
    'python -m benchmarks.gamma_sweep --random-weights --simulate-acceptance 0.5 0.8 --tree 2 3,1 "nodes 8 depth 4"',
    "python -m benchmarks.gamma_sweep --random-weights --simulate-acceptance 0.8 --temperature 1",
])
def test_a_stale_command_is_caught(command, capsys):
    with pytest.raises((ValueError, SystemExit, AssertionError)):
        check_command(command, capsys)


def test_docs_cli_describes_every_option_of_the_command(monkeypatch):
    """docs/cli.md names every option the command takes, and no option it does not take."""
    monkeypatch.setenv("COLUMNS", "1000")  # help lines wrapped at a hyphen would split an option's name
    option = re.compile(r"(?<![\w-])--[a-z][a-z-]*")
    options = set(option.findall(cli.build_parser().format_help()))
    documented = set(option.findall((REPO_ROOT / "docs" / "cli.md").read_text(encoding="utf-8")))
    assert len(options) > 20, options
    assert options - documented == set(), "options docs/cli.md does not describe"
    assert documented - options == set(), "options docs/cli.md names that the command does not take"
