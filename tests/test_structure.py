"""The layout the code promises its readers: the model imports no speed
machinery, no module imports itself back through others, all C lives in the
speed subpackage, module docstrings stay short, and measured figures live in
docs/performance.md, not in comments or docstrings; each benchmark's --help
names the command that runs it."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from helpers import REPO_ROOT

PACKAGES = ("gpt2", "spec_decoding", "benchmarks", "cli")


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every Python file of the product and benchmarks."""
    modules = {"spec_decoding_generate": REPO_ROOT / "spec_decoding_generate.py"}
    for package in PACKAGES:
        for path in (REPO_ROOT / package).rglob("*.py"):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def runtime_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports when it runs (imports under
    `if TYPE_CHECKING:` are for type checkers only and are left out)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in known and m != name}


def test_the_model_imports_no_speed_machinery():
    modules = project_modules()
    imported = runtime_imports("gpt2.model", modules["gpt2.model"], set(modules))
    assert not {m for m in imported if m.startswith("gpt2.fast")}, imported
    source = modules["gpt2.model"].read_text(encoding="utf-8")
    assert "fast" not in "".join(line for line in source.splitlines() if line.startswith(("import", "from")))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph, as a path that ends where it starts; None if there is none."""
    done, on_path = set(), []

    def walk(name: str) -> list[str] | None:
        if name in on_path:
            return on_path[on_path.index(name) :] + [name]
        if name in done:
            return None
        on_path.append(name)
        for dependency in sorted(graph.get(name, ())):
            cycle = walk(dependency)
            if cycle:
                return cycle
        on_path.pop()
        done.add(name)
        return None

    return next((c for c in map(walk, sorted(graph)) if c), None)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_there_is_no_import_cycle():
    modules = project_modules()
    graph = {name: runtime_imports(name, path, set(modules)) for name, path in modules.items()}
    # A package's __init__ importing its own submodules is the package, not a cycle.
    for name in graph:
        graph[name] = {m for m in graph[name] if not (m.startswith(name + ".") and modules[name].name == "__init__.py")}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_all_c_lives_in_the_speed_subpackage():
    c_files = [p for p in REPO_ROOT.rglob("*") if p.suffix in (".c", ".h") and ".git" not in p.parts]
    assert c_files, "the C sources are part of the repository"
    outside = [p for p in c_files if not p.is_relative_to(REPO_ROOT / "gpt2" / "fast" / "csrc")]
    assert not outside, outside


def test_module_docstrings_say_what_and_why_briefly():
    """Every module of the product, the benchmarks and the tests opens with a
    docstring of at most 15 lines; details belong to the functions, and
    measured figures to docs/performance.md."""
    paths = [*project_modules().values(), *(REPO_ROOT / "tests").glob("*.py")]
    long = {}
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstring = ast.get_docstring(tree) or ""
        assert docstring or not tree.body, f"{path} has no module docstring"  # an empty __init__.py needs none
        if len(docstring.splitlines()) > 15:
            long[str(path.relative_to(REPO_ROOT))] = len(docstring.splitlines())
    assert not long, f"module docstrings of more than 15 lines: {long}"


# A machine's name or a measured time, rate or speedup: what goes stale in a comment.
MEASURED = re.compile(
    r"\b(Zen ?\d|EPYC|Xeon)\b"  # a machine
    r"|\d(\.\d+)? ?(ms|µs|GB/s|MB/s|GiB/s|tokens/s)\b"  # a time or a rate
    r"|\d\.\d+x (faster|slower)",  # a speedup
    re.IGNORECASE,
)


def comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python or C file."""
    source = path.read_text(encoding="utf-8")
    if path.suffix in (".c", ".h"):
        blocks = re.finditer(r"/\*.*?\*/|//[^\n]*", source, re.S)  # /* ... */ and // ... comments
        return [(source[: m.start()].count("\n") + 1, m.group(0)) for m in blocks]
    found = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            found += [(getattr(node, "lineno", 1), docstring)] if docstring else []
    return found


def test_the_measured_figure_pattern_finds_figures(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('"""Fast."""\n\nx = 1  # 46.7 ms a step on 2 Zen 4 cores\n'
                      'y = "12 ms"  # a string is not a comment\n')
    assert [(line, bool(MEASURED.search(text))) for line, text in comments_and_docstrings(sample)] == [
        (3, True), (4, False), (1, False)]  # the comment with a figure, the one without, the docstring


def test_no_measured_figures_in_comments_or_docstrings():
    """Comments and docstrings say what and why; measured figures, which go stale, are dated in
    docs/performance.md with the command that made them."""
    paths = [*project_modules().values(), *(REPO_ROOT / "gpt2" / "fast" / "csrc").glob("*.[ch]")]
    figures = [f"{path.relative_to(REPO_ROOT)}:{line}: {MEASURED.search(text).group(0)!r}"
               for path in paths for line, text in comments_and_docstrings(path) if MEASURED.search(text)]
    assert not figures, figures


def test_tests_take_fixtures_from_conftest_and_helpers_from_helpers():
    """pytest loads conftest.py itself; a test that imports it gets a second copy of its module state."""
    importers = []
    for path in (REPO_ROOT / "tests").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            importers += [path.name for name in names if name.split(".")[0] == "conftest"]
    assert not importers, importers


def test_the_benchmarks_check_their_outputs_with_must_not_assert():
    # `python -O` strips assert: drafting --parts ngram with a verifier that broke losslessness then reported
    # speedups of 1.85x for a decoder whose output differed from greedy decoding, exit code 0.
    asserts = [f"{path.name}:{node.lineno}" for path in sorted((REPO_ROOT / "benchmarks").glob("*.py"))
               for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(node, ast.Assert)]
    assert asserts == [], f"use benchmarks.common.must: {asserts}"


def test_every_benchmark_names_itself_as_it_is_run(capsys, monkeypatch):
    """Benchmarks run as `python -m benchmarks.<name>`: --help's usage line says so (argparse's default would be
    the file name, a command that fails: run as a file, `benchmarks` cannot be imported)."""
    import importlib

    monkeypatch.setenv("COLUMNS", "1000")  # a narrow terminal breaks the usage line after the command

    commands = sorted(name for name, path in project_modules().items()
                      if name.startswith("benchmarks.") and "def main(" in path.read_text(encoding="utf-8"))
    assert len(commands) >= 9, commands
    for name in commands:
        with pytest.raises(SystemExit) as exit_info:
            importlib.import_module(name).main(["--help"])
        assert exit_info.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: python -m {name} "), name


def test_every_benchmark_gives_one_line_for_an_option_it_cannot_parse(capsys):
    """A value argparse cannot read, or an unknown option, is one `error:` line and exit code 2, as every other
    bad setting is (argparse's default prints its whole usage block first)."""
    import importlib

    from benchmarks.common import run_cli

    commands = sorted(name for name, path in project_modules().items()
                      if name.startswith("benchmarks.") and "def main(" in path.read_text(encoding="utf-8"))
    for name in commands:
        assert run_cli(importlib.import_module(name).main, ["--no-such-option", "1"]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.endswith(" (see --help)\n") and err.count("\n") == 1, (name, err)
