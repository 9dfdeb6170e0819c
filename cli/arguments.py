"""The command line of spec_decoding_generate.py: its options, the check of
their values (by the library: `SamplingConfig`, `check_integer`, `TreeShape`;
a bad value is a ValueError naming its flag), and the prompts (from --prompt,
stdin, or --prompts-file).

argparse's own errors (an unknown flag, `--gamma abc`) are one line
"error: ..." and exit code 2, like every other bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DEFAULT_PROMPT = (
    "In a shocking finding, scientist discovered a herd of unicorns living in a remote, "
    "previously unexplored valley, in the Andes Mountains."
)  # the prompt of OpenAI's GPT-2 announcement

EXIT_OK, EXIT_UNEXPECTED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
DEFAULT_GAMMA = 4
DEFAULT_BATCH_SIZE = 8  # prompts of --prompts-file decoded together
DEFAULT_TREE = "2,2"  # spec_decoding.tree.DEFAULT_TREE (not imported here: --help answers without torch)
GAMMA_SCHEDULES = ("auto", "heuristic")  # spec_decoding.schedule.SCHEDULE_NAMES (not imported here, as above)
NGRAM_DRAFT = "ngram"  # --draft ngram: prompt lookup, no draft model
DEFAULT_NGRAM = 3

# No prompt this long fits a context window (GPT-2's 1024 tokens are some KB of text): reading stops there, so that
# `-p - < /dev/zero` is an error, not a process that fills the memory.
MAX_PROMPT_BYTES = 4 * 2**20
MAX_PROMPTS_FILE_BYTES = 256 * 2**20  # --prompts-file as a whole: a pipe may never end

# The library names a sampling setting by its argument; the user knows it by its flag.
SAMPLING_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p"}


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but its errors (unknown flag, `--gamma abc`) are one line
    "error: ..." on stderr with exit code 2, like every other bad input."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="spec_decoding_generate.py",
        description="Speculative decoding with GPT-2: a small draft model proposes --gamma tokens, "
        "the large target model checks them all in one forward pass and keeps the ones it agrees with. "
        "Greedy output is exactly the target's own; sampled output has exactly its distribution.",
        epilog="Generation stops after --max-gen tokens, at the target's context window, or after <|endoftext|> "
        "(id 50256), which is kept. Past the draft's context window the target goes on alone. "
        "Colour: green = drafted and accepted, yellow = chosen by the target; "
        "only on a terminal, and never with --no-color, --json or the NO_COLOR environment variable. "
        "Exit codes: 0 done, 2 bad input, 130 interrupted (Ctrl-C), 1 unexpected error or output closed early.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "-p", "--prompt", default=None,
        help="the text to continue; '-' reads it from stdin (one trailing newline is dropped); "
        "'<|endoftext|>' in it is GPT-2's end-of-text token "
        "(default: GPT-2's unicorn prompt, 'In a shocking finding, scientist discovered a herd of unicorns...')",
    )
    parser.add_argument(
        "--prompts-file", default=None, metavar="FILE",
        help="decode every prompt of FILE instead of --prompt: one prompt per line, or JSON Lines with a "
        '"prompt" field on each line ({"prompt": "..."}); --batch-size of them at a time, printed as one block '
        "per prompt in input order (with --json, one JSON object per prompt, one per line); a draft model's "
        "chain of a fixed --gamma, so not with --draft ngram, --draft-p-min, a named --gamma, a tree, --show-tree or "
        "--compare",
    )
    parser.add_argument(
        "--batch-size", type=int, default=None,
        help=f"with --prompts-file, how many prompts are decoded together in one batch, >= 1 (default: "
        f"{DEFAULT_BATCH_SIZE}). "
        "Prompt i of the file (from 0) samples with seed --seed + i, so its text does not depend on the batch",
    )
    parser.add_argument(
        "--gamma", type=gamma_value, default=None,
        help="tokens the draft proposes per step, a chain: an integer >= 1; 'auto', before each step the number "
        "that maximises the expected tokens per second at the acceptance rate seen so far, from the draft's and "
        "the target's step costs (measured once per model pair and machine, some seconds, then cached); or "
        "'heuristic', Hugging Face's rule (+2 after a step whose drafts were all accepted, -1 otherwise). "
        f"The output does not depend on it (default: {DEFAULT_GAMMA}, unless a tree is given)",
    )
    parser.add_argument(
        "--tree", nargs="?", const=DEFAULT_TREE, default=None, metavar="SHAPE",
        help="draft a token tree instead of a chain: children per node at each depth, e.g. 3,2,1,1 (3 candidates "
        "for the next token, 2 for the one after each, ...); the target verifies the whole tree in one pass and "
        f"keeps the longest path it agrees with (spec_decoding/tree_loop.py); --tree alone: {DEFAULT_TREE}",
    )
    parser.add_argument(
        "--tree-nodes", type=int, default=None, metavar="N",
        help="a dynamic token tree (EAGLE-2): at most N drafted tokens, each level keeping the candidates of highest "
        "draft probability; needs --tree-depth",
    )
    parser.add_argument("--tree-depth", type=int, default=None, metavar="D",
                        help="the depth of a dynamic token tree; needs --tree-nodes")
    parser.add_argument(
        "--show-tree", action="store_true",
        help="draw each step's tree on stderr, the accepted path marked with a tick (a draft model's chain of a "
        "fixed --gamma is drawn as a tree with one child per node); --debug draws a tree's steps too",
    )
    parser.add_argument("--max-gen", type=int, default=100, help="the most new tokens to generate, >= 1 (default: 100)")
    parser.add_argument(
        "--temperature", type=float, default=0.0,
        help="0 is greedy decoding (deterministic), and so is any temperature below 1e-4; "
        "> 0 samples, higher is more random (default: 0)",
    )
    parser.add_argument(
        "--top-k", type=int, default=None,
        help="when sampling, keep only the k most likely tokens, k >= 1 (default: no limit)",
    )
    parser.add_argument(
        "--top-p", type=float, default=None,
        help="when sampling, keep the most likely tokens up to this probability mass, in (0, 1] (default: no limit)",
    )
    parser.add_argument(
        "--seed", type=int, default=0,
        help="seed of the random generator, any integer: the same seed and settings give the same sampled text "
        "(default: 0; greedy decoding uses no randomness)",
    )
    parser.add_argument(
        "--draft", default="gpt2",
        help="the draft model: a Hugging Face Hub repo id or a local folder with config.json and "
        "model.safetensors; or 'ngram', no model: prompt lookup, proposing the tokens that followed the last "
        "earlier occurrence of the text's last --ngram tokens (shorter suffixes next; with no match at all, a "
        "plain target step) (default: gpt2)",
    )
    parser.add_argument(
        "--ngram", type=int, default=None,
        help=f"with --draft ngram: the longest suffix it matches, >= 1 (default: {DEFAULT_NGRAM})",
    )
    parser.add_argument(
        "--draft-p-min", type=float, default=None,
        help="stop drafting at the first position where the draft's top probability is below this, in [0, 1], "
        "as llama.cpp's --draft-p-min: fewer wasted drafts (default: always draft --gamma tokens)",
    )
    parser.add_argument(
        "--target", default="gpt2-large",
        help="the target model, whose output is reproduced: a Hub repo id or a local folder; its vocab.json and "
        "merges.txt are the tokenizer (default: gpt2-large)",
    )
    parser.add_argument(
        "--device", default="auto",
        help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps (default: auto); off the CPU one prompt's "
        "run is first made untimed",
    )
    parser.add_argument(
        "--dtype", default="float32",
        help="float32, or float16 / bfloat16 where the device supports them (default: float32)",
    )
    parser.add_argument(
        "--quantize", default="none",
        help="none, or int8: both models' weight matrices rounded to int8 with a scale per row, and read as int8 "
        "on the CPU (float32 only): a quarter of the bytes per token, so faster decoding; the output is then "
        "exactly that of the int8 target, which differs a little from the float32 one (default: none)",
    )
    parser.add_argument(
        "--draft-quantize", default=None,
        help="none or int8, for the draft model only: int8 makes drafting cheaper while the output stays exactly "
        "the float32 target's (CPU, float32 only) (default: as --quantize)",
    )
    parser.add_argument(
        "--weights-dir", default=None,
        help="where Hub models are downloaded to and read from, one folder per repo id "
        "(default: weights/ in this repository)",
    )
    parser.add_argument(
        "--compare", action="store_true",
        help="also decode with the target alone (the baseline) on the same prompt, settings and seed: report both "
        "speeds, the measured speedup next to the one this run's α and step costs predict (a warning when they "
        "disagree: the machine's load changed), and when greedy whether the outputs are identical",
    )
    parser.add_argument(
        "--json", action="store_true",
        help="print exactly one JSON object on stdout (prompt, generated text, token ids, settings, stats, timings, "
        "comparison) instead of the streamed text",
    )
    parser.add_argument("--no-color", action="store_true", help="no colours, even on a terminal")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error (before its one line; the exit code stays the same)")
    return parser


def check_settings(args: argparse.Namespace):
    """The sampling settings, as the library's `SamplingConfig`. The library
    checks every value (a temperature below 1e-4 is greedy there); its
    ValueError names the flag.

    Raises:
        ValueError: a bad --gamma, --max-gen, --temperature, --top-k, --top-p,
            --batch-size (or one without --prompts-file), drafter option
            (`check_drafter`), an empty --weights-dir, --target or --draft, or
            --prompts-file with --prompt or --compare.
    """
    from gpt2.generate import check_integer
    from gpt2.sampling import SamplingConfig

    if args.gamma is not None and not isinstance(args.gamma, str):
        try:
            check_integer(args.gamma, "--gamma", 1)  # as speculative_generate checks gamma
        except ValueError:
            raise ValueError(f"--gamma must be an integer >= 1, 'auto' or 'heuristic', got {args.gamma}") from None
    check_drafter(args)
    check_integer(args.max_gen, "--max-gen", 1)
    if args.batch_size is not None and args.prompts_file is None:
        raise ValueError("--batch-size is how many prompts of --prompts-file are decoded together: add "
                         "--prompts-file, or leave out --batch-size")
    args.batch_size = check_integer(DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size,
                                    "--batch-size", 1)
    if args.weights_dir is not None and not args.weights_dir.strip():
        raise ValueError("--weights-dir is empty: give the folder for downloads, or leave it out for weights/")
    for flag, model in (("--target", args.target), ("--draft", args.draft)):
        if not model.strip():
            raise ValueError(f"{flag} is empty: give a Hub repo id such as gpt2 or a local folder, or leave it out "
                             "for the default")
    if args.prompts_file is not None and args.prompt is not None:
        raise ValueError("give --prompt or --prompts-file, not both")
    try:
        return SamplingConfig(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        name, rest = str(e).split(" ", 1)
        rest = rest.replace(" (or None for no limit)", "")  # the API's; the command's no limit is leaving it out
        raise ValueError(f"{SAMPLING_FLAGS.get(name, name)} {rest}") from None


def gamma_value(text: str) -> int | str:
    """--gamma as given: an integer (checked later, with the other values),
    or the name of a schedule."""
    if text in GAMMA_SCHEDULES:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, 'auto' or 'heuristic', got {text!r}") from None


def check_drafter(args: argparse.Namespace) -> None:
    """--ngram, --draft-p-min, --draft-quantize and a named --gamma against
    --draft and the other ways to decode. Each refusal names every flag in
    the way, so that following its advice never leads to another refusal of
    the same flags.

    Raises:
        ValueError: --ngram below 1 or without --draft ngram; --draft-p-min
            outside [0, 1]; --draft-p-min or --draft-quantize with --draft
            ngram, which has no model; --prompts-file (a draft model's chain
            of a fixed --gamma for every prompt) with prompt lookup,
            --draft-p-min, a named --gamma, a tree flag, --show-tree or
            --compare; those three with a token tree, or with --show-tree
            (which draws a draft model's fixed chain, or a tree).
    """
    from gpt2.generate import check_integer

    if args.ngram is not None:
        check_integer(args.ngram, "--ngram", 1)
        if args.draft != NGRAM_DRAFT:
            raise ValueError(f"--ngram is the suffix length of --draft {NGRAM_DRAFT}: add --draft {NGRAM_DRAFT}, "
                             "or leave out --ngram")
    if args.draft_p_min is not None and not 0.0 <= args.draft_p_min <= 1.0:
        raise ValueError(f"--draft-p-min must be a probability in [0, 1], got {args.draft_p_min}")
    if args.draft == NGRAM_DRAFT:
        for flag, value in (("--draft-p-min", args.draft_p_min), ("--draft-quantize", args.draft_quantize)):
            if value is not None:
                raise ValueError(f"{flag} is for a draft model; --draft {NGRAM_DRAFT} has none: leave out {flag}")
    tree_options = {"--tree": args.tree, "--tree-nodes": args.tree_nodes, "--tree-depth": args.tree_depth}
    tree_flags = [flag for flag, value in tree_options.items() if value is not None]
    lookup = f"--draft {NGRAM_DRAFT}" + ("" if args.ngram is None else f" --ngram {args.ngram}")
    chain_only = [f"--gamma {args.gamma}"] if isinstance(args.gamma, str) else []
    chain_only += [lookup] if args.draft == NGRAM_DRAFT else []
    chain_only += ["--draft-p-min"] if args.draft_p_min is not None else []
    if args.prompts_file is not None:
        in_the_way = chain_only + tree_flags + ["--show-tree"] * args.show_tree + ["--compare"] * args.compare
        if in_the_way:
            raise ValueError(f"--prompts-file decodes every prompt with a draft model's chain of a fixed --gamma: "
                             f"leave out {and_list(in_the_way)}, or give one --prompt instead")
    if chain_only and tree_flags:
        verb = "drafts" if len(chain_only) == 1 else "draft"
        raise ValueError(f"{and_list(chain_only)} {verb} a chain, one sequence: leave out "
                         f"{and_list(tree_flags + ['--show-tree'] * args.show_tree)}")
    if chain_only and args.show_tree:
        raise ValueError(f"--show-tree draws only a draft model's chain of a fixed --gamma, or a token tree: "
                         f"leave out --show-tree, or {and_list(chain_only)}")


def and_list(items: list[str]) -> str:
    """The items as a sentence lists them: a; a and b; a, b and c."""
    return " and ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else items)


def check_tree(args: argparse.Namespace):
    """The token tree of --tree or --tree-nodes/--tree-depth, as the
    library's `TreeShape`, or None for a chain (then args.gamma is set to its
    default if it was not given). (With --show-tree a chain is run as the
    tree with one child per node, which gives the same output, to be drawn:
    spec_decoding_generate.py makes it once --gamma is checked against the
    target's window.)

    Raises:
        ValueError: a bad or half-given tree, or a tree together with --gamma.
    """
    from gpt2.generate import check_integer
    from spec_decoding.tree import TreeShape

    dynamic = args.tree_nodes is not None or args.tree_depth is not None
    if args.tree is not None and dynamic:
        raise ValueError("give --tree (a fixed shape) or --tree-nodes with --tree-depth (a dynamic tree), not both")
    if (args.tree is not None or dynamic) and args.gamma is not None:
        raise ValueError("give --gamma (a chain of drafted tokens) or a tree (--tree, --tree-nodes), not both")
    if dynamic:
        if args.tree_nodes is None or args.tree_depth is None:
            given, missing = ("--tree-nodes", "--tree-depth")[:: 1 if args.tree_depth is None else -1]
            raise ValueError(f"{given} needs {missing}: a dynamic tree has a node budget N and a depth D")
        nodes = check_integer(args.tree_nodes, "--tree-nodes", 1)
        depth = check_integer(args.tree_depth, "--tree-depth", 1)
        if depth > nodes:
            raise ValueError(f"--tree-depth {depth} is more than --tree-nodes {nodes}: N nodes are at most N deep")
        return TreeShape(nodes=nodes, depth=depth)
    if args.tree is not None:
        try:
            return TreeShape.parse(args.tree)
        except ValueError as e:
            raise ValueError(f"--tree: {e}") from None
    if isinstance(args.gamma, str):  # a schedule's name: checked by check_drafter
        return None
    args.gamma = check_integer(DEFAULT_GAMMA if args.gamma is None else args.gamma, "--gamma", 1)
    return None


def unicode_text(text: str, what: str) -> str:
    """`text`, or a ValueError naming `what` if it is not Unicode text: bytes
    that were not UTF-8 reach Python as lone surrogates (on the command line,
    and on stdin under a C or POSIX locale), which the tokenizer would
    silently replace with U+FFFD, continuing another prompt."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not UTF-8 text: save or type it as UTF-8") from None
    return text


def from_command_line(text: str) -> str:
    """An argument as typed: where Python's locale is not UTF-8 (a C locale with PYTHONUTF8=0), it decodes an
    argument's UTF-8 bytes wrongly, each to a lone surrogate; those bytes, read as UTF-8, are the text. An
    argument that is not UTF-8 comes back as it was, for `unicode_text` to refuse."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        try:
            return os.fsencode(text).decode("utf-8")  # the bytes Python was given
        except UnicodeError:
            return text


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt text: --prompt (by default GPT-2's unicorn prompt), or stdin
    for '-'. Raises ValueError if empty, not UTF-8 text or unreadable, or
    (from stdin) over MAX_PROMPT_BYTES."""
    if args.prompt is None:
        return DEFAULT_PROMPT
    if args.prompt != "-":
        if args.prompt == "":
            raise ValueError("the prompt is empty: pass some text with --prompt, or '-p -' to read it from stdin")
        return unicode_text(from_command_line(args.prompt), "the --prompt text")
    if sys.stdin is None:  # started with stdin closed
        raise ValueError("'-p -' reads the prompt from stdin, but stdin is closed: pipe some text in, or pass it "
                         "with --prompt")
    if sys.stdin.isatty():
        print("reading the prompt from stdin; end it with Ctrl-D", file=sys.stderr)
    buffer = getattr(sys.stdin, "buffer", None)  # the bytes, UTF-8 whatever the locale or PYTHONIOENCODING says
    try:
        text = buffer.read(MAX_PROMPT_BYTES + 1) if buffer is not None else sys.stdin.read(MAX_PROMPT_BYTES + 1)
    except OSError as e:
        raise ValueError(f"the prompt cannot be read from stdin ({e.strerror or e}): pipe some text in, or pass it "
                         "with --prompt") from None
    if len(text) > MAX_PROMPT_BYTES:
        raise ValueError(f"the prompt read from stdin is over {MAX_PROMPT_BYTES // 2**20} MiB, far more than a "
                         "context window holds (GPT-2's: 1024 tokens): pipe in a shorter text")
    try:
        text = unicode_text(text.decode("utf-8") if buffer is not None else text, "the prompt read from stdin")
        if buffer is not None and os.name == "nt":
            text = text.replace("\r\n", "\n")  # as Python's stdin reads text there
    except UnicodeDecodeError:
        raise ValueError("the prompt read from stdin is not UTF-8 text: save or type it as UTF-8") from None
    text = text.removeprefix("\ufeff")  # a byte-order mark (Windows editors write one), as --prompts-file drops it
    if text.endswith("\n"):  # `echo text |` adds one
        text = text[:-2] if text.endswith("\r\n") else text[:-1]
    if text == "":
        raise ValueError("the prompt read from stdin is empty: pipe some text in (echo 'Once upon a time' | ...)")
    return text


def read_prompts_file(path: str) -> list[tuple[int, str]]:
    """The prompts of --prompts-file, each with its line number (from 1).

    One prompt per line; or, if the first line starts with "{" (after any
    leading whitespace), JSON Lines:
    every line a JSON object with a "prompt" string.

    A pipe counts as a file (`--prompts-file <(grep ... prompts.txt)`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: an empty path, a folder or a device, a file that cannot
            be read or is over MAX_PROMPTS_FILE_BYTES, not UTF-8 text, an
            empty file, an empty line or one over MAX_PROMPT_BYTES, a JSON
            line without a "prompt" string (the message names the line).
    """
    if not path.strip():
        raise ValueError("--prompts-file is empty: give a text file with one prompt per line")
    file = Path(path)
    try:
        if file.is_dir():
            raise ValueError(f"--prompts-file {path} is a folder: give a text file with one prompt per line")
        if not file.exists():
            raise FileNotFoundError(f"--prompts-file {path}: no such file")
        if not (file.is_file() or file.is_fifo()):  # a device: /dev/zero would be read forever
            raise ValueError(f"--prompts-file {path} is not a file: give a text file with one prompt per line")
        with file.open("rb") as f:
            raw = f.read(MAX_PROMPTS_FILE_BYTES + 1)
    except FileNotFoundError:
        raise
    except OSError as e:  # no permission, a name too long, a file the system cannot read
        raise ValueError(f"--prompts-file {path} cannot be read ({e.strerror or e}): give a text file you can "
                         "read") from None
    if len(raw) > MAX_PROMPTS_FILE_BYTES:
        raise ValueError(f"--prompts-file {path} is over {MAX_PROMPTS_FILE_BYTES // 2**20} MiB: split it, and "
                         "decode the parts one after another")
    try:
        text = raw.decode("utf-8-sig")  # -sig: a byte-order mark (Windows editors write one) is dropped
        text = text.replace("\r\n", "\n").replace("\r", "\n")  # every system's line ends, as open() reads text
    except UnicodeDecodeError:
        raise ValueError(f"--prompts-file {path} is not UTF-8 text") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the file's final newline ends the last line
    if not lines:
        raise ValueError(f"--prompts-file {path} is empty: write one prompt per line")
    json_lines = lines[0].lstrip().startswith("{")
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():  # a stray blank line; a prompt of spaces only is written as JSON: {"prompt": " "}
            what = "empty" if not line else "blank (whitespace only)"
            raise ValueError(f"line {number} of {path} is {what}: write one prompt on every line"
                             + ('' if not line or json_lines else ' (a prompt of spaces only: as JSON Lines, '
                                '{"prompt": " "})'))
        if len(line) > MAX_PROMPT_BYTES:  # characters: at least as many bytes
            raise ValueError(f"line {number} of {path} is over {MAX_PROMPT_BYTES // 2**20} MiB, far more than a "
                             "context window holds (GPT-2's: 1024 tokens): write one prompt per line")
        prompt = line
        if json_lines:
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as e:  # JSONDecodeError; arrays nested too deep; a huge integer
                why = e.msg if isinstance(e, json.JSONDecodeError) else (
                    "nested too deeply" if isinstance(e, RecursionError) else "a number of too many digits")
                raise ValueError(f'line {number} of {path} is not JSON ({why}): write {{"prompt": "..."}}') from None
            prompt = record.get("prompt") if isinstance(record, dict) else None
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f'line {number} of {path} has no "prompt" text: write {{"prompt": "..."}}')
            unicode_text(prompt, f"the prompt of line {number} of {path}")  # JSON can escape a lone surrogate
        prompts.append((number, prompt))
    return prompts
