"""Watch speculative decoding work: a small GPT-2 drafts, a large one verifies.

    python spec_decoding_generate.py --gamma 4

On first use this downloads GPT-2 (the draft, 124M) and GPT-2 large (the
target, 774M) into weights/, with progress bars; later runs need no network.
The generated text streams as tokens are committed: tokens the draft proposed
and the target accepted in green, tokens the target chose itself (the
correction after a rejected draft, or the bonus token after a fully accepted
one) in yellow. A stats block follows: the acceptance rate alpha, the mean
tokens per target forward pass, the forward calls of each model, tokens/s and
the time spent drafting vs verifying (Leviathan et al. 2023, Algorithm 1;
Chen et al. 2023). With --compare the target also decodes alone, for the
baseline's tokens/s, the speedup, and (greedy) a check that both outputs are
identical.

Generation stops after --max-gen tokens, at the context window, or after the
end-of-text token <|endoftext|> (id 50256), which is kept as the last token.

stdout carries the text and the stats (or, with --json, exactly one JSON
object); downloads, progress bars and notes go to stderr.
Exit codes: 0 done, 2 bad input (one line "error: ..." on stderr), 130
interrupted with Ctrl-C (what was generated so far and its stats are still
printed), 1 an unexpected failure (--debug shows its traceback).
"""

from __future__ import annotations

import argparse
import codecs
import json
import math
import os
import sys
import time

# torch and the model code are imported inside the functions that use them,
# after the arguments are checked: --help and bad arguments then answer at
# once, without the ~2 s torch import.

DEFAULT_PROMPT = (
    "In a shocking finding, scientist discovered a herd of unicorns living in a remote, "
    "previously unexplored valley, in the Andes Mountains."
)  # the prompt of OpenAI's GPT-2 announcement
EOS_ID = 50256  # <|endoftext|>, GPT-2's end-of-text token

EXIT_OK, EXIT_UNEXPECTED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130

# ANSI colours, used only on a terminal.
ACCEPTED_STYLE = "\033[32m"  # green: drafted by the small model, accepted by the target
TARGET_STYLE = "\033[33m"  # yellow: chosen by the target (correction or bonus token)
DIM, RESET = "\033[2m", "\033[0m"


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------


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
        epilog="Generation stops after --max-gen tokens, at the context window, or after <|endoftext|> "
        "(id 50256), which is kept. Colour: green = drafted and accepted, yellow = chosen by the target; "
        "only on a terminal, and never with --no-color, --json or the NO_COLOR environment variable. "
        "Exit codes: 0 done, 2 bad input, 130 interrupted (Ctrl-C), 1 unexpected error.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "-p", "--prompt", default=DEFAULT_PROMPT,
        help="the text to continue; '-' reads it from stdin (one trailing newline is dropped); "
        "'<|endoftext|>' in it is GPT-2's end-of-text token "
        "(default: GPT-2's unicorn prompt, 'In a shocking finding, scientist discovered a herd of unicorns...')",
    )
    parser.add_argument("--gamma", type=int, default=4, help="tokens the draft proposes per step, >= 1 (default: 4)")
    parser.add_argument("--max-gen", type=int, default=100, help="the most new tokens to generate, >= 1 (default: 100)")
    parser.add_argument(
        "--temperature", type=float, default=0.0,
        help="0 is greedy decoding (deterministic); > 0 samples, higher is more random (default: 0)",
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
        help="seed of the random generator: the same seed and settings give the same sampled text "
        "(default: 0; greedy decoding uses no randomness)",
    )
    parser.add_argument(
        "--draft", default="gpt2",
        help="the draft model: a Hugging Face Hub repo id or a local folder with config.json and "
        "model.safetensors (default: gpt2)",
    )
    parser.add_argument(
        "--target", default="gpt2-large",
        help="the target model, whose output is reproduced: a Hub repo id or a local folder; its vocab.json and "
        "merges.txt are the tokenizer (default: gpt2-large)",
    )
    parser.add_argument(
        "--device", default="auto",
        help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps (default: auto)",
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
        "--weights-dir", default=None,
        help="where Hub models are downloaded to and read from, one folder per repo id "
        "(default: weights/ in this repository)",
    )
    parser.add_argument(
        "--compare", action="store_true",
        help="also decode with the target alone (the baseline) on the same prompt, settings and seed: report both "
        "times, the speedup, and when greedy whether the outputs are identical and where they first differ",
    )
    parser.add_argument(
        "--json", action="store_true",
        help="print exactly one JSON object on stdout (prompt, generated text, token ids, settings, stats, timings, "
        "comparison) instead of the streamed text",
    )
    parser.add_argument("--no-color", action="store_true", help="no colours, even on a terminal")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Raises ValueError, naming the flag and its valid range, for a bad setting."""
    if args.gamma < 1:
        raise ValueError(f"--gamma must be >= 1 (tokens drafted per step), got {args.gamma}: try --gamma 4")
    if args.max_gen < 1:
        raise ValueError(f"--max-gen must be >= 1 (the most new tokens), got {args.max_gen}: try --max-gen 100")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}: try 0 or 0.8")
    if args.top_k is not None and args.top_k < 1:
        raise ValueError(f"--top-k must be >= 1, got {args.top_k}: leave it out for no limit, or try --top-k 50")
    if args.top_p is not None and not (0.0 < args.top_p <= 1.0):
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}: leave it out for no limit, or try --top-p 0.9")


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt text: --prompt, or stdin for '-'. Raises ValueError if empty."""
    if args.prompt != "-":
        if args.prompt == "":
            raise ValueError("the prompt is empty: pass some text with --prompt, or '-p -' to read it from stdin")
        return args.prompt
    if sys.stdin.isatty():
        print("reading the prompt from stdin; end it with Ctrl-D", file=sys.stderr)
    text = sys.stdin.read()
    if text.endswith("\n"):  # `echo text |` adds one
        text = text[:-2] if text.endswith("\r\n") else text[:-1]
    if text == "":
        raise ValueError("the prompt read from stdin is empty: pipe some text in (echo 'Once upon a time' | ...)")
    return text


def wants_color(args: argparse.Namespace, stream) -> bool:
    """Colour only on a terminal, never in --json, with --no-color or NO_COLOR set (no-color.org)."""
    return stream.isatty() and not (args.no_color or args.json or os.environ.get("NO_COLOR"))


# ---------------------------------------------------------------------------
# Streaming the committed tokens
# ---------------------------------------------------------------------------


class TokenStream:
    """Writes tokens as text as `speculative_generate` commits them.

    A GPT-2 token is a byte string, and one UTF-8 character (an emoji, a CJK
    character) is often split over two or three tokens. The bytes go through
    an incremental UTF-8 decoder, which holds an incomplete character back
    until the token that completes it arrives (that token's colour is the
    character's), so the streamed text equals the decoded whole.

    `tokens` and `accepted` keep everything written, for an interrupted run.
    """

    def __init__(self, tokenizer, out, color: bool) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.color = color
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.tokens: list[int] = []
        self.accepted: list[bool] = []  # per token: drafted and accepted (True), or the target's own

    def on_step(self, tokens: list[int], num_accepted: int) -> None:
        """The loop's callback: the first `num_accepted` tokens were drafted and accepted."""
        for i, token in enumerate(tokens):
            self.tokens.append(token)
            self.accepted.append(i < num_accepted)
            if self.out is not None:
                text = self.decoder.decode(self.tokenizer.decode_single_token_bytes(token))
                self.write(text, ACCEPTED_STYLE if i < num_accepted else TARGET_STYLE)
        if self.out is not None:
            self.out.flush()

    def finish(self) -> None:
        """Flushes bytes left undecoded (an incomplete character becomes U+FFFD)."""
        if self.out is not None:
            self.write(self.decoder.decode(b"", final=True), TARGET_STYLE)
            self.out.flush()

    def write(self, text: str, style: str) -> None:
        if text:
            self.out.write(f"{style}{text}{RESET}" if self.color else text)


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def load_everything(args: argparse.Namespace, prompt: str, device, dtype, quantize: str | None):
    """The draft and target models, the target's tokenizer, the prompt's
    token ids and the two model folders.

    Everything that can be wrong is checked before the weights are read
    (which takes seconds for GPT-2 large): the downloads, the vocabularies
    and the prompt's length, from config.json and the tokenizer alone.

    Raises:
        ValueError, FileNotFoundError: a source that does not exist or cannot
            be downloaded, a corrupt file, vocabularies that do not match, a
            prompt that does not fit the context window.
    """
    import torch

    from gpt2 import GPT2Config, load_model, load_tokenizer
    from gpt2.generate import check_prompt
    from gpt2.loading import resolve_source

    sources = {"draft": args.draft, "target": args.target}
    folders = {role: resolve_source(source, args.weights_dir) for role, source in sources.items()}  # downloads
    configs = {role: GPT2Config.from_hf_config(folder / "config.json") for role, folder in folders.items()}
    try:
        tokenizer = load_tokenizer(folders["target"])  # its vocab.json + merges.txt, else tiktoken's own
    except Exception as e:
        if isinstance(e, ValueError):
            raise  # a broken vocab.json: the message says so
        # tiktoken could not fetch its own files (no network)
        raise FileNotFoundError(
            f"no GPT-2 tokenizer: {folders['target']} has no vocab.json + merges.txt and tiktoken could not get "
            f"its 'gpt2' files ({type(e).__name__}): copy vocab.json and merges.txt of GPT-2 into that folder"
        ) from None

    V = configs["target"].vocab_size
    if configs["draft"].vocab_size != V:
        raise ValueError(
            f"draft and target have different vocabularies ({configs['draft'].vocab_size} vs {V} tokens): "
            "pick a draft model from the target's family, e.g. --draft gpt2"
        )
    if V != tokenizer.n_vocab:
        raise ValueError(
            f"the models have {V} tokens but the GPT-2 tokenizer has {tokenizer.n_vocab}: "
            "use GPT-2 checkpoints (or a folder whose vocab.json matches its model)"
        )
    prompt_ids = tokenizer.encode(prompt, allowed_special="all")  # "<|endoftext|>" in the text is token 50256
    n_ctx = min(configs["draft"].n_ctx, configs["target"].n_ctx)
    check_prompt(torch.tensor([prompt_ids], dtype=torch.long), n_ctx, V)

    models = {}
    for role, source in sources.items():
        print(f"loading {role} {source} from {folders[role]}", file=sys.stderr)
        models[role] = load_model(folders[role], device=device, dtype=dtype, quantize=quantize)
    return models["draft"], models["target"], tokenizer, prompt_ids, folders


def warm_up(model, input_ids) -> None:
    """One uncached forward pass, so one-time costs (CUDA context, kernel
    choice, memory pools) fall on neither timed run."""
    import torch

    with torch.inference_mode():
        model(input_ids)


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (or one ends); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # stops at the shorter
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def per_second(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def clock(device) -> float:
    """Wall time once the device has finished its queued work (GPUs run ahead
    of Python), as the decoding loop times its steps."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
    return time.perf_counter()


def run(args: argparse.Namespace, prompt: str) -> int:
    """Loads, generates (streaming), compares if asked, reports. Returns the exit code."""
    import torch

    from gpt2 import resolve_device, resolve_dtype
    from gpt2.fast.quantize import resolve_quantize
    from spec_decoding import SpecStats, speculative_generate

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    quantize = resolve_quantize(args.quantize, device, dtype)
    if args.temperature == 0 and (args.top_k is not None or args.top_p is not None):
        print("note: --top-k and --top-p only apply when sampling (--temperature > 0)", file=sys.stderr)

    t_load = time.perf_counter()
    draft, target, tokenizer, prompt_ids, folders = load_everything(args, prompt, device, dtype, quantize)
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # (1, T)
    warm_up(draft, input_ids)
    warm_up(target, input_ids)
    load_seconds = clock(device) - t_load

    out = None if args.json else sys.stdout
    color = wants_color(args, sys.stdout)
    if out is not None:
        print_header(args, device, dtype, quantize, color)
        out.write(prompt)
        out.flush()

    stream = TokenStream(tokenizer, out, color)
    stats = SpecStats(args.gamma)  # passed in, so that its counts survive a Ctrl-C
    interrupted = False
    t0 = clock(device)
    try:
        speculative_generate(
            target, draft, input_ids,
            gamma=args.gamma, max_new_tokens=args.max_gen,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            eos_id=EOS_ID, generator=torch.Generator(device=device).manual_seed(args.seed),
            on_step=stream.on_step, stats=stats,
        )
    except KeyboardInterrupt:
        interrupted = True
    spec_seconds = clock(device) - t0
    stream.finish()
    if out is not None:
        out.write("\n")
        if interrupted:
            out.write(f"{DIM}[interrupted]{RESET}\n" if color else "[interrupted]\n")
        out.flush()

    timings = {
        "load_seconds": load_seconds,
        "generate_seconds": spec_seconds,
        "tokens_per_second": per_second(len(stream.tokens), spec_seconds),
        "draft_seconds": stats.draft_seconds,
        "verify_seconds": stats.verify_seconds,
    }
    comparison = None
    if args.compare and not interrupted:
        try:
            comparison = compare_with_target_alone(args, target, input_ids, tokenizer, stream.tokens, timings)
        except KeyboardInterrupt:
            interrupted = True

    if args.json:
        result = {
            "prompt": prompt,
            "prompt_token_ids": prompt_ids,
            "text": tokenizer.decode(stream.tokens),  # "<|endoftext|>" at the end if generation stopped there
            "token_ids": stream.tokens,
            "accepted_from_draft": stream.accepted,
            "settings": {
                "draft": args.draft, "target": args.target,
                "draft_folder": str(folders["draft"]), "target_folder": str(folders["target"]),
                "gamma": args.gamma, "max_gen": args.max_gen,
                "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
                "device": str(device), "dtype": str(dtype).removeprefix("torch."), "quantize": quantize,
                "eos_id": EOS_ID,
            },
            "stats": stats.to_dict(),
            "timings": timings,
            "interrupted": interrupted,
        }
        if args.compare:
            result["comparison"] = comparison  # null if interrupted
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        n_ctx = min(target.config.n_ctx, draft.config.n_ctx)
        stop = stop_reason(stats, interrupted, len(prompt_ids) + len(stream.tokens), n_ctx)
        print_stats(args, stats, len(stream.tokens), timings, stop)
        if args.compare:
            print_comparison(comparison, stream.tokens, tokenizer)
    return EXIT_INTERRUPTED if interrupted else EXIT_OK


def compare_with_target_alone(args, target, input_ids, tokenizer, spec_tokens: list[int], timings: dict) -> dict:
    """Plain decoding with the target (`gpt2.generate`), same prompt, settings
    and seed: its time, the speedup, and whether its tokens equal `spec_tokens`."""
    import torch

    from gpt2 import generate

    print("decoding with the target alone for --compare ...", file=sys.stderr)
    device = input_ids.device
    t0 = clock(device)
    baseline = generate(
        target, input_ids, args.max_gen,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        eos_id=EOS_ID, generator=torch.Generator(device=device).manual_seed(args.seed),
    )
    seconds = clock(device) - t0
    baseline_ids = baseline[0, input_ids.size(1):].tolist()
    tokens_per_second = per_second(len(baseline_ids), seconds)
    return {
        "baseline_text": tokenizer.decode(baseline_ids),
        "baseline_token_ids": baseline_ids,
        "baseline_seconds": seconds,
        "baseline_tokens_per_second": tokens_per_second,
        # a ratio of tokens/s, since sampled runs may stop at different lengths
        "speedup": timings["tokens_per_second"] / tokens_per_second if tokens_per_second > 0 else None,
        "greedy": args.temperature == 0,
        "identical": baseline_ids == spec_tokens,
        "first_difference": first_difference(spec_tokens, baseline_ids),
    }


def stop_reason(stats, interrupted: bool, length: int, n_ctx: int) -> str:
    if interrupted:
        return "interrupted (Ctrl-C)"
    if stats.stopped_at_eos:
        return "stopped at <|endoftext|>"
    if length >= n_ctx:
        return f"stopped at the context window ({n_ctx} tokens)"
    return "stopped at --max-gen"


def print_header(args: argparse.Namespace, device, dtype, quantize: str | None, color: bool) -> None:
    if args.temperature == 0:
        decoding = "greedy"
    else:
        decoding = f"sampling at temperature {args.temperature:g}"
        decoding += f", top-k {args.top_k}" if args.top_k is not None else ""
        decoding += f", top-p {args.top_p:g}" if args.top_p is not None else ""
        decoding += f", seed {args.seed}"
    print(f"draft {args.draft} proposes {args.gamma} tokens per step, target {args.target} verifies them")
    weights = f", {quantize} weights (the output is the {quantize} target's)" if quantize else ""
    print(f"{decoding}, up to {args.max_gen} new tokens, {device} {str(dtype).removeprefix('torch.')}{weights}")
    if color:
        print(
            f"legend: {ACCEPTED_STYLE}drafted and accepted{RESET}  "
            f"{TARGET_STYLE}chosen by the target (correction or bonus token){RESET}"
        )
    print()


def print_rows(rows: list[tuple[str, str]], width: int = 19) -> None:
    for label, value in rows:
        print(f"{label:<{width}} {value}")


def print_stats(args: argparse.Namespace, stats, n_new: int, timings: dict, stop: str) -> None:
    from spec_decoding import expected_tokens_per_step

    print()
    print_rows([
        ("new tokens", f"{n_new} in {stats.target_calls} target calls, {stop}"),
        (
            "acceptance α",
            f"{stats.alpha:.3f} (accepted / judged drafts; {stats.accepted} of {stats.drafted} drafted tokens "
            "accepted)",
        ),
        (
            "tokens/target call",
            f"{stats.tokens_per_target_call:.2f} (at most {args.gamma + 1}; "
            f"{expected_tokens_per_step(stats.alpha, args.gamma):.2f} expected at this α, Leviathan et al. eq. 1)",
        ),
        ("forward calls", f"target {stats.target_calls}, draft {stats.draft_calls} (after the prompt's prefill)"),
        (
            "speed",
            f"{timings['tokens_per_second']:.1f} tokens/s ({timings['generate_seconds']:.2f} s: "
            f"drafting {stats.draft_seconds:.2f} s, verifying {stats.verify_seconds:.2f} s)",
        ),
    ])


def print_comparison(comparison: dict | None, spec_tokens: list[int], tokenizer) -> None:
    if comparison is None:
        print_rows([("target alone", "not run: interrupted (Ctrl-C)")])
        return
    i = comparison["first_difference"]
    baseline = comparison["baseline_token_ids"]
    if not comparison["greedy"]:
        verdict = "sampled: both follow the target's distribution, so they need not match token for token"
    elif i is None:
        verdict = f"identical to the target alone, token for token ({len(spec_tokens)} tokens)"
    else:

        def show(tokens: list[int]) -> str:
            return repr(tokenizer.decode(tokens[i : i + 1])) if i < len(tokens) else "(end)"

        verdict = (
            f"DIFFERENT from the target alone from new token {i}: speculative {show(spec_tokens)} vs "
            f"target alone {show(baseline)} (in float16/bfloat16 a near-tie can flip an argmax)"
        )
    speedup = comparison["speedup"]
    print_rows([
        (
            "target alone",
            f"{comparison['baseline_tokens_per_second']:.1f} tokens/s "
            f"({len(baseline)} tokens in {comparison['baseline_seconds']:.2f} s)",
        ),
        ("speedup", f"{speedup:.2f}x" if speedup is not None else "n/a"),
        ("outputs", verdict),
    ])


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")  # a non-UTF-8 terminal shows '?' instead of crashing
    try:
        check_args(args)
        return run(args, read_prompt(args))
    except KeyboardInterrupt:  # before generation started (loading, downloading)
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout closed early, e.g. `| head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_UNEXPECTED
    except (ValueError, OSError) as e:  # the product's user errors say how to fix them
        if args.debug:
            raise
        print(f"error: {one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as e:
        if args.debug:
            raise
        message = f"unexpected {type(e).__name__}: {one_line(e)} (run with --debug for the traceback)"
        print(f"error: {message}", file=sys.stderr)
        return EXIT_UNEXPECTED


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
