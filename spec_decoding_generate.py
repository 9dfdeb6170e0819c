"""Watch speculative decoding work (Leviathan et al. 2023, Algorithm 1; Chen
et al. 2023): a small GPT-2 drafts, a large one verifies.

    python spec_decoding_generate.py --gamma 4

On first use this downloads GPT-2 (the draft, 124M) and GPT-2 large (the
target, 774M) into weights/; later runs need no network. The text streams as
tokens are committed: drafted tokens the target accepted in green, tokens the
target chose itself in yellow (cli/stream.py); the stats follow (α, tokens per
target call, tokens/s: cli/report.py). --compare also decodes with the target
alone, --tree drafts a token tree, --prompts-file decodes prompts in batches;
the options and their checks are in cli/arguments.py. stdout carries the text
and the stats (--json: one JSON object per prompt), stderr the rest. Exit
codes: 0 done, 2 bad input (one line "error: ..."), 130 Ctrl-C (the text and
stats so far still printed), 1 an unexpected failure; --debug adds tracebacks.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback

from cli.arguments import (
    DEFAULT_NGRAM,
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNEXPECTED,
    NGRAM_DRAFT,
    build_parser,
    check_settings,
    check_tree,
    read_prompt,
    read_prompts_file,
)
from cli.stream import Checked, OutputError, Unfailing

# torch and the model code are imported inside the functions that use them:
# --help and argparse's own errors then answer at once, without the torch import.


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def load_everything(
    args: argparse.Namespace, prompts: list[str], device, dtype, quantize: dict[str, str | None],
    lines: list[int] | None = None, draft_length: tuple[str, int] | None = None,
):
    """The draft and target models, the target's tokenizer, the token ids of
    each prompt and the model folders (no draft model, None, for --draft
    ngram). `quantize`: each role's weight quantisation. `lines`: the
    prompts' line numbers in --prompts-file (errors name them), or None for
    the one --prompt. `draft_length`: (flag, value), the most tokens a step
    drafts (--gamma, or a tree's depth), or None for a named --gamma.

    Everything that can be wrong is checked before the weights are read
    (which takes seconds for GPT-2 large): the downloads, the vocabularies,
    the prompt's length and the draft length, from config.json and the
    tokenizer alone. Only the target's context window limits them.

    Raises:
        ValueError, FileNotFoundError: a source that does not exist or cannot
            be downloaded, a corrupt file, vocabularies that do not match, a
            prompt or a draft length that does not fit the target's context window.
    """
    import torch

    from gpt2 import GPT2Config, load_model, load_tokenizer
    from gpt2.generate import check_prompt
    from gpt2.hub import resolve_source
    from spec_decoding.schedule import check_draft_length

    sources = {"target": args.target} if args.draft == NGRAM_DRAFT else {"draft": args.draft, "target": args.target}
    folders = {role: resolve_source(source, args.weights_dir) for role, source in sources.items()}  # downloads
    configs = {role: GPT2Config.from_hf_config(folder / "config.json") for role, folder in folders.items()}
    try:
        tokenizer = load_tokenizer(folders["target"])  # its vocab.json + merges.txt, else tiktoken's own
    except Exception as e:
        if isinstance(e, ValueError) or any((folders["target"] / f).exists() for f in ("vocab.json", "merges.txt")):
            raise  # a broken or unreadable vocab.json: the message says so
        # tiktoken could not fetch its own files (no network)
        raise FileNotFoundError(
            f"no GPT-2 tokenizer: {folders['target']} has no vocab.json + merges.txt and tiktoken could not get "
            f"its 'gpt2' files ({type(e).__name__}): copy vocab.json and merges.txt of GPT-2 into that folder"
        ) from None

    V = configs["target"].vocab_size
    if "draft" in configs and configs["draft"].vocab_size != V:
        raise ValueError(
            f"draft and target have different vocabularies ({configs['draft'].vocab_size} vs {V} tokens): "
            "pick a draft model from the target's family, e.g. --draft gpt2"
        )
    if V != tokenizer.n_vocab:
        raise ValueError(
            f"the models have {V} tokens but the GPT-2 tokenizer has {tokenizer.n_vocab}: "
            "use GPT-2 checkpoints (or a folder whose vocab.json matches its model)"
        )
    # "<|endoftext|>" in the text is token 50256
    prompt_ids = [tokenizer.encode(prompt, allowed_special="all") for prompt in prompts]
    for i, ids in enumerate(prompt_ids):
        try:
            check_prompt(torch.tensor([ids], dtype=torch.long), configs["target"].n_ctx, V)
        except ValueError as e:
            if lines is None:
                raise
            raise ValueError(f"line {lines[i]} of {args.prompts_file}: {e}") from None
    if draft_length is not None:
        check_draft_length(draft_length[1], draft_length[0], configs["target"].n_ctx)

    models = {}
    for role, source in sources.items():
        print(f"loading {role} {source} from {folders[role]}", file=sys.stderr)
        models[role] = load_model(folders[role], device=device, dtype=dtype, quantize=quantize[role])
    return models.get("draft"), models["target"], tokenizer, prompt_ids, folders


def warm_up(model, input_ids) -> None:
    """One uncached forward pass over the prompt (as much of it as the
    model's window holds), so one-time costs (CUDA context, kernel choice,
    memory pools) fall on neither timed run."""
    import torch

    with torch.inference_mode():
        model(input_ids[:, : model.config.n_ctx])


def rehearse(args, sampling, tree, target, draft, schedule, input_ids, tokenizer) -> None:
    """The run once, untimed and unshown, and with --compare the target alone
    too: a GPU pays a one-time cost for each new shape of pass (loading and
    choosing kernels), so the first run at each sequence length would be
    timed far slower than the next. A copy of the schedule, so that what it
    learns does not carry over into the timed run. Ctrl-C ends the program."""
    import copy

    from cli.stream import TokenStream

    print(f"warming up the {input_ids.device.type} device: the run once, untimed and not shown ...", file=sys.stderr)
    _, _, interrupted = speculate(args, sampling, tree, target, draft, copy.deepcopy(schedule), input_ids,
                                  TokenStream(tokenizer, None, False), draw_trees=False)
    if interrupted:
        raise KeyboardInterrupt
    if args.compare:
        decode_alone(args, sampling, target, input_ids)


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------


def per_second(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def run(args: argparse.Namespace, sampling, tree, prompt: str) -> int:
    """Loads, generates (streaming), compares if asked, reports. Returns the exit code.

    `sampling`: the checked `SamplingConfig` of args (`check_settings`);
    `tree`: the `TreeShape` to draft, or None for a chain (`check_tree`)."""
    import torch

    from cli import report
    from cli.stream import DIM, RESET, TokenStream, wants_color
    from gpt2 import resolve_device, resolve_dtype
    from gpt2.fast.quantize import resolve_quantize
    from spec_decoding.stats import clock
    from spec_decoding.tree import TreeShape

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    quantize = resolve_quantize(args.quantize, device, dtype)
    draft_quantize = resolve_draft_quantize(args, quantize, device, dtype)
    if sampling.greedy and (args.top_k is not None or args.top_p is not None):
        print("note: --top-k and --top-p only apply when sampling (--temperature > 0)", file=sys.stderr)

    t_load = time.perf_counter()
    if tree is not None:
        name = "the depth of --tree" if tree.is_static else (
            f"--tree-nodes {tree.nodes} --tree-depth {tree.depth} (levels of {tree.width}): the depth reached")
        draft_length = (name, tree.max_depth)
    else:
        draft_length = None if isinstance(args.gamma, str) else ("--gamma", args.gamma)
    draft, target, tokenizer, (prompt_ids,), folders = load_everything(
        args, [prompt], device, dtype, {"draft": draft_quantize, "target": quantize}, draft_length=draft_length
    )
    if tree is None and args.show_tree:  # a chain drawn as the tree with one child per node: the same output
        tree = TreeShape(branching=(1,) * args.gamma)
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # (1, T)
    for model in (draft, target):
        if model is not None:
            warm_up(model, input_ids)
    drafter_name = drafter_description(args, draft_quantize)
    drafter, schedule = (None, None) if tree is not None else make_drafter_and_schedule(args, target, draft)
    load_seconds = clock(device) - t_load  # with --gamma auto, the step costs' calibration (once per machine)
    if device.type != "cpu":
        rehearse(args, sampling, tree, target, draft if tree is not None else drafter, schedule, input_ids, tokenizer)
    # --compare: plain target steps timed right before the speculative run, on the prompt (and after it, on the text)
    target_steps = [target_step_seconds(target, input_ids)] if args.compare else []

    interruptible()
    out = None if args.json else sys.stdout
    color = wants_color(sys.stdout, no_color=args.no_color, json_output=args.json)
    if out is not None:
        report.print_header(
            draft=drafter_name, target=args.target, gamma=args.gamma, tree=tree if args.gamma is None else None,
            target_n_ctx=target.config.n_ctx,
            max_gen=args.max_gen,
            decoding=report.describe_decoding(sampling, args.seed), device=device, dtype=dtype, quantize=quantize,
            color=color,
        )
        out.write(prompt)
        out.flush()

    stream = TokenStream(tokenizer, out, color)
    try:
        stats, spec_seconds, interrupted = speculate(
            args, sampling, tree, target, draft if tree is not None else drafter, schedule, input_ids, stream
        )
    except ValueError:  # mid-run (a model's logits overflowed: gpt2.sampling.sample): the error on a line of its own
        if out is not None:
            out.write("\n")
            out.flush()
        raise
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
    comparison, compare_interrupted = None, False  # Ctrl-C in the target-alone run: the speculative one is whole
    if args.compare and not interrupted:
        try:
            text_ids = torch.tensor([prompt_ids + stream.tokens], device=device)  # (1, prompt + new tokens)
            target_steps.append(target_step_seconds(target, text_ids))
            comparison = compare_with_target_alone(
                args, sampling, target, input_ids, tokenizer, stats, stream.tokens, timings, target_steps
            )
        except KeyboardInterrupt:
            compare_interrupted = True

    if args.json:
        result = {
            "prompt": prompt,
            "prompt_token_ids": prompt_ids,
            "text": tokenizer.decode(stream.tokens),  # "<|endoftext|>" at the end if generation stopped there
            "token_ids": stream.tokens,
            "accepted_from_draft": stream.accepted,
            "settings": {**settings_record(args, sampling, folders, device, dtype, quantize,
                                           draft_quantize=draft_quantize, drafter=drafter_name, schedule=schedule),
                         "tree": None if tree is None else str(tree)},
            "stats": stats.to_dict(),
            "timings": timings,
            "interrupted": interrupted,
        }
        if args.compare:
            result["comparison"] = comparison  # null if interrupted
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        stop = report.stop_reason(
            stats, interrupted=interrupted, max_gen=args.max_gen,
            length=len(prompt_ids) + len(stream.tokens), target_n_ctx=target.config.n_ctx,
        )
        report.print_stats(
            stats, stop=stop, length=len(prompt_ids) + len(stream.tokens),
            draft_n_ctx=None if draft is None else draft.config.n_ctx, timings=timings, drafter=drafter_name,
            schedule=None if schedule is None else schedule.describe(),
            drafts_in_full=args.draft != NGRAM_DRAFT and args.draft_p_min is None,
        )
        if args.compare:
            report.print_comparison(comparison, stream.tokens, tokenizer, started=compare_interrupted)
    return EXIT_INTERRUPTED if interrupted or compare_interrupted else EXIT_OK


def settings_record(
    args, sampling, folders, device, dtype, quantize: str | None, seed: int | None = None, *,
    draft_quantize: str | None, drafter: str, schedule=None,
) -> dict:
    """The settings as given, for --json ("greedy" says how the temperature
    was read; "drafter" and "schedule" what they became)."""
    from gpt2 import END_OF_TEXT_ID

    ngram = args.draft == NGRAM_DRAFT
    return {
        "draft": args.draft, "target": args.target,
        "draft_folder": None if ngram else str(folders["draft"]), "target_folder": str(folders["target"]),
        "drafter": drafter, "ngram": (DEFAULT_NGRAM if args.ngram is None else args.ngram) if ngram else None,
        "draft_p_min": args.draft_p_min,
        "gamma": args.gamma, "schedule": None if schedule is None else schedule.describe(), "max_gen": args.max_gen,
        "temperature": args.temperature, "greedy": sampling.greedy,
        "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed if seed is None else seed,
        "device": str(device), "dtype": str(dtype).removeprefix("torch."), "quantize": quantize,
        "draft_quantize": None if ngram else draft_quantize,
        "eos_id": END_OF_TEXT_ID,
    }


def resolve_draft_quantize(args, quantize: str | None, device, dtype) -> str | None:
    """The draft's weight quantisation: --draft-quantize, else --quantize's."""
    from gpt2.fast.quantize import resolve_quantize

    if args.draft_quantize is None:
        return quantize
    try:
        return resolve_quantize(args.draft_quantize, device, dtype)
    except ValueError as e:  # its message names --quantize
        raise ValueError(str(e).replace("--quantize", "--draft-quantize")) from None


def drafter_description(args, draft_quantize: str | None) -> str:
    """How the header and the stats name the drafter."""
    from cli.report import describe_drafter

    ngram = (DEFAULT_NGRAM if args.ngram is None else args.ngram) if args.draft == NGRAM_DRAFT else None
    return describe_drafter(args.draft, ngram=ngram, quantize=draft_quantize, p_min=args.draft_p_min)


def make_drafter_and_schedule(args, target, draft):
    """The drafter --draft asks for (the draft model, stopping early below
    --draft-p-min; or prompt lookup) and the γ schedule of --gamma. For
    'auto', the step costs of this pair on this machine: read from the
    cache, or measured now (some seconds)."""
    from spec_decoding import ModelDrafter, NgramDrafter
    from spec_decoding.schedule import make_schedule

    if args.draft == NGRAM_DRAFT:
        drafter = NgramDrafter(DEFAULT_NGRAM if args.ngram is None else args.ngram)
    else:
        drafter = ModelDrafter(draft, p_min=args.draft_p_min)
    if args.gamma == "auto":
        print("--gamma auto: the step costs of this pair on this machine (measured once, then cached) ...",
              file=sys.stderr)
    return drafter, make_schedule(args.gamma, target, drafter)


def free_memory(device) -> int | None:
    """Bytes that new tensors on `device` can take now: the memory Linux reports
    available, or the GPU's free memory; None where neither can be read."""
    import torch

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def check_batch_memory(args: argparse.Namespace, target, draft, prompt_ids: list[list[int]], device) -> None:
    """Raises a ValueError if the KV caches of the largest batch of --prompts-file
    (target and draft, each row holding its prompt and --max-gen tokens) would
    not fit in the memory free now: an allocation that big fails, or the
    system stops the process halfway through the run."""
    from gpt2 import KVCache

    free = free_memory(device)
    need = 0
    for start in range(0, len(prompt_ids), args.batch_size):
        batch = prompt_ids[start : start + args.batch_size]
        positions = max(len(ids) for ids in batch) + args.max_gen  # each model clips its cache to its window
        need = max(need, sum(KVCache.nbytes(m.config, len(batch), min(positions, m.config.n_ctx), target.dtype)
                             for m in (target, draft) if m is not None))
    if free is not None and need > free:
        raise ValueError(
            f"--batch-size {args.batch_size} needs {size_text(need)} of KV caches for its longest prompts and "
            f"--max-gen {args.max_gen}, more than the {size_text(free)} free on {device}: give a smaller "
            "--batch-size or --max-gen"
        )


def size_text(nbytes: int) -> str:
    """`nbytes` for a message: in GiB from 1 GiB up, else in MiB (so that little memory does not read 0.0 GiB)."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def run_file(args: argparse.Namespace, sampling, prompts: list[tuple[int, str]]) -> int:
    """Decodes every prompt of --prompts-file, --batch-size of them at a time
    (spec_decoding/batch.py), and prints one block per prompt in input order,
    after each batch (with --json, one JSON object per prompt, one per line),
    then (without --json) the batches' stats. Prompt i samples with its own
    generator, seeded --seed + i. Returns the exit code.

    `prompts`: (line number, text) pairs, from `read_prompts_file`.
    """
    import io

    import torch

    from cli import report
    from cli.stream import TokenStream, wants_color
    from gpt2 import END_OF_TEXT_ID, resolve_device, resolve_dtype
    from gpt2.fast.quantize import resolve_quantize
    from spec_decoding import BatchStats, speculative_generate
    from spec_decoding.stats import clock

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    quantize = resolve_quantize(args.quantize, device, dtype)
    draft_quantize = resolve_draft_quantize(args, quantize, device, dtype)
    drafter_name = drafter_description(args, draft_quantize)
    lines = [line for line, _ in prompts]
    draft, target, tokenizer, prompt_ids, folders = load_everything(
        args, [text for _, text in prompts], device, dtype, {"draft": draft_quantize, "target": quantize}, lines,
        draft_length=("--gamma", args.gamma),
    )
    check_batch_memory(args, target, draft, prompt_ids, device)
    first = torch.tensor([prompt_ids[0]], dtype=torch.long, device=device)  # (1, T)
    warm_up(draft, first)
    warm_up(target, first)
    interruptible()
    color = wants_color(sys.stdout, no_color=args.no_color, json_output=args.json)
    if not args.json:
        report.print_header(
            draft=drafter_name, target=args.target, gamma=args.gamma, max_gen=args.max_gen,
            decoding=report.describe_decoding(sampling, args.seed), device=device, dtype=dtype, quantize=quantize,
            color=color,
        )

    batches, interrupted, seconds = [], False, 0.0
    for start in range(0, len(prompts), args.batch_size):
        rows = list(range(start, min(start + args.batch_size, len(prompts))))
        streams = [TokenStream(tokenizer, None if args.json else io.StringIO(), color) for _ in rows]
        stats = BatchStats(args.gamma, len(rows))  # passed in, so that its counts survive a Ctrl-C
        t0 = clock(device)
        try:
            speculative_generate(
                target, draft, [prompt_ids[i] for i in rows],
                gamma=args.gamma, max_new_tokens=args.max_gen,
                temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                eos_id=END_OF_TEXT_ID, generator=[seeded_generator(args.seed + i, device) for i in rows],
                on_step=lambda row, tokens, accepted: streams[row].on_step(tokens, accepted), stats=stats,
            )
        except KeyboardInterrupt:
            interrupted = True
        batch_seconds = clock(device) - t0
        seconds += batch_seconds
        batches.append(stats)
        for stream, i, row_stats in zip(streams, rows, stats.rows):
            stream.finish()
            length = len(prompt_ids[i]) + len(stream.tokens)
            stop = report.stop_reason(
                row_stats, interrupted=interrupted, max_gen=args.max_gen, length=length,
                target_n_ctx=target.config.n_ctx,
            )
            if args.json:
                json.dump({
                    "index": i, "line": lines[i], "prompt": prompts[i][1], "prompt_token_ids": prompt_ids[i],
                    "text": tokenizer.decode(stream.tokens), "token_ids": stream.tokens,
                    "accepted_from_draft": stream.accepted, "stop": stop, "stats": row_stats.to_dict(),
                    "batch": {"index": len(batches) - 1, "seconds": batch_seconds,
                              **{k: v for k, v in stats.to_dict().items() if k != "rows"}},
                    "settings": {**settings_record(args, sampling, folders, device, dtype, quantize, args.seed + i,
                                                   draft_quantize=draft_quantize, drafter=drafter_name),
                                 "prompts_file": args.prompts_file, "batch_size": args.batch_size},
                    "interrupted": stop == report.INTERRUPTED,  # this row cut short, not one that had finished
                }, sys.stdout)
                sys.stdout.write("\n")
            else:
                report.print_row_block(i, len(prompts), lines[i], prompts[i][1], stream.out.getvalue(), row_stats, stop)
        sys.stdout.flush()
        if interrupted:
            break
    if not args.json:
        report.print_batch_summary(batches, args.batch_size, seconds, interrupted=interrupted)
    return EXIT_INTERRUPTED if interrupted else EXIT_OK


def speculate(args, sampling, tree, target, draft, schedule, input_ids, stream, *, draw_trees: bool = True):
    """`speculative_generate` (a chain: `draft` is the drafter, `schedule`
    the γ schedule), or `tree_speculative_generate` when `tree` is a
    TreeShape (`draft` is the draft model), committing into `stream` as it goes. With
    --show-tree or --debug, and `draw_trees`, each verified tree is drawn on
    stderr. Ctrl-C stops it; what was committed and counted until then stays.

    Returns:
        (SpecStats, seconds, interrupted).
    """
    from cli import report
    from gpt2 import END_OF_TEXT_ID
    from spec_decoding import SpecStats, speculative_generate, tree_speculative_generate
    from spec_decoding.stats import clock

    device = input_ids.device
    # passed in, so that its counts survive a Ctrl-C
    stats = SpecStats(schedule.max_gamma) if tree is None else SpecStats(tree.max_depth, tree=str(tree))
    generator = seeded_generator(args.seed, device)
    interrupted = False
    t0 = clock(device)
    try:
        if tree is None:
            speculative_generate(
                target, draft, input_ids,
                gamma=schedule, max_new_tokens=args.max_gen,
                temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                eos_id=END_OF_TEXT_ID, generator=generator, on_step=stream.on_step, stats=stats,
            )
        else:
            tree_speculative_generate(
                target, draft, input_ids,
                tree=tree, max_new_tokens=args.max_gen,
                temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                eos_id=END_OF_TEXT_ID, generator=generator, on_step=stream.on_step, stats=stats,
                on_tree=report.tree_drawer(stream.tokenizer) if draw_trees and (args.show_tree or args.debug) else None,
            )
    except KeyboardInterrupt:
        interrupted = True
    seconds = clock(device) - t0
    stream.finish()
    return stats, seconds, interrupted


def decode_alone(args, sampling, target, input_ids):
    """The target alone (`gpt2.generate`) on the same prompt, settings and
    seed as the speculative run: (1, T + n) token ids."""
    from gpt2 import END_OF_TEXT_ID, generate

    return generate(
        target, input_ids, args.max_gen,
        temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
        eos_id=END_OF_TEXT_ID, generator=seeded_generator(args.seed, input_ids.device),
    )


def seeded_generator(seed: int, device):
    """A torch.Generator on `device` seeded with `seed`, any integer: torch
    takes seeds modulo 2**64 (-1 is 2**64 - 1) but refuses larger ones."""
    import torch

    return torch.Generator(device=device).manual_seed(seed % 2**64)


def compare_with_target_alone(
    args, sampling, target, input_ids, tokenizer, stats, spec_tokens: list[int], timings: dict,
    target_steps: list[list[float]],
) -> dict:
    """Plain decoding with the target (`gpt2.generate`), same prompt, settings
    and seed: its speed, the measured speedup, and whether its tokens equal
    `spec_tokens`; and the speedup this run's α and step costs predict.

    The two runs are timed one after the other, so a change of the machine's
    load between them skews the measured speedup. The prediction is tokens
    per target call x t_t / the run's measured cost per call (drafting and
    verifying). For a fixed γ drafted by a model, the tokens are eq. 1's at the
    run's α for the K each step asked (`expected_tokens`): Leviathan et al.
    Theorem 3.8 with the verification at its measured cost, exactly, when
    every step drafted γ. For a tree (a --show-tree chain too), a schedule,
    p_min, prompt lookup (no closed form in α) or a run whose last step
    end-of-text cut short, they are the run's measured tokens per call. t_t comes
    from `target_steps`, plain target steps timed right before the speculative
    run on the prompt's cache and right after it on the whole text's, not from
    the baseline: when the load changed, prediction and measurement disagree.
    The mean of their two medians is the step's mean cost over a run whose
    attention grows with the text.
    """
    import statistics

    from cli.report import cut_by_end_of_text, expected_tokens, speedups_agree
    from gpt2.generate import first_difference
    from spec_decoding.stats import clock

    step_seconds = {
        "draft": stats.draft_seconds / stats.draft_calls if stats.draft_calls else 0.0,  # t_d
        "target": statistics.mean(map(statistics.median, target_steps)),  # t_t: at the start and at the end
        "verify": stats.verify_seconds / stats.target_calls,  # t_v(γ + 1)
    }
    closed_form = (stats.tree is None and isinstance(args.gamma, int) and args.draft != NGRAM_DRAFT
                   and args.draft_p_min is None and not cut_by_end_of_text(stats))
    tokens = expected_tokens(stats) if closed_form else stats.tokens_per_target_call
    predicted = tokens * step_seconds["target"] * stats.target_calls / (stats.draft_seconds + stats.verify_seconds)

    print("decoding with the target alone for --compare ...", file=sys.stderr)
    device = input_ids.device
    t0 = clock(device)
    baseline = decode_alone(args, sampling, target, input_ids)
    seconds = clock(device) - t0
    baseline_ids = baseline[0, input_ids.size(1):].tolist()
    tokens_per_second = per_second(len(baseline_ids), seconds)
    # a ratio of tokens/s, since sampled runs may stop at different lengths
    speedup = timings["tokens_per_second"] / tokens_per_second if tokens_per_second > 0 else 0.0
    return {
        "baseline_text": tokenizer.decode(baseline_ids),
        "baseline_token_ids": baseline_ids,
        "baseline_seconds": seconds,
        "baseline_tokens_per_second": tokens_per_second,
        "speedup": speedup,
        "step_seconds": step_seconds,
        "predicted_speedup": predicted,
        "predicted_from": "alpha" if closed_form else "tokens_per_target_call",
        "speedup_matches_prediction": speedups_agree(speedup, predicted),
        "spec_seconds": timings["generate_seconds"],
        # the prompt's prefill in both models and the loop's own work: in the measured speedup, not the predicted
        "outside_steps_seconds": timings["generate_seconds"] - stats.draft_seconds - stats.verify_seconds,
        "greedy": sampling.greedy,
        "identical": baseline_ids == spec_tokens,
        "first_difference": first_difference(spec_tokens, baseline_ids),
    }


def target_step_seconds(target, input_ids, steps: int = 5) -> list[float]:
    """The seconds of each of `steps` plain decoding steps of the target (one
    new token over its KV cache, after the prompt's prefill, the cache rewound
    after each): its step cost t_t, at the load of the moment."""
    import torch

    from spec_decoding.stats import clock

    device = input_ids.device
    prefix = input_ids[:, : target.config.n_ctx - 1]  # (1, P): room for the step's token
    token_ids = prefix[:, -1:]  # (1, 1): any token costs the same
    seconds = []
    with torch.inference_mode():
        cache = target.new_cache(1)
        target(prefix, cache, last_logits_only=True)  # the prefill, not timed
        for _ in range(1 + steps):  # the first step is not counted: a fresh cache's first writes
            t0 = clock(device)
            target(token_ids, cache, last_logits_only=True)
            seconds.append(clock(device) - t0)
            cache.rewind(prefix.size(1))
    return seconds[1:]


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    if sys.stderr is None:  # started with stderr closed (2>&-): print would send progress and errors to stdout
        sys.stderr = open(os.devnull, "w", encoding="utf-8")
    if sys.stdout is None:  # started with stdout closed (>&-): nowhere to write the text, so no work
        print("error: standard output is closed: run without >&- (or send it to /dev/null)", file=sys.stderr)
        return EXIT_UNEXPECTED
    for stream in (sys.stdout, sys.stderr):  # --help and the text: a non-UTF-8 terminal shows '?', no crash
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    stdout, sys.stdout = sys.stdout, Checked(sys.stdout)
    stderr, sys.stderr = sys.stderr, Unfailing(sys.stderr)
    ctrl_c = signal.getsignal(signal.SIGINT)  # Python's KeyboardInterrupt, unless the caller ignores SIGINT
    if ctrl_c is signal.default_int_handler and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, end_at_once)  # until the run shows something (`interruptible`)
    try:
        return run_command(argv)
    finally:
        sys.stdout, sys.stderr = stdout, stderr  # for a caller in this process
        if signal.getsignal(signal.SIGINT) is end_at_once:
            signal.signal(signal.SIGINT, ctrl_c)


def end_at_once(signum, frame) -> None:
    """Ctrl-C before the run shows anything (torch's import, loading, a download): "interrupted", exit code 130, at
    once. A KeyboardInterrupt could land inside torch's import or one of its C++ callbacks, which turned it into
    another error, swallowed it (the run went on), or aborted the process."""
    try:
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), b"\ninterrupted\n")
    except (OSError, ValueError, RuntimeError):  # stderr closed or unwritable; RuntimeError: a write it interrupted
        pass
    os._exit(EXIT_INTERRUPTED)


def interruptible() -> None:
    """From here on Ctrl-C is a KeyboardInterrupt again, which the run catches to print the text and stats so far."""
    if signal.getsignal(signal.SIGINT) is end_at_once:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def run_command(argv: list[str] | None) -> int:
    """The command on stdout and stderr as `main` has set them up: its exit code, errors as one line."""
    args = None
    try:
        args = build_parser().parse_args(argv)  # --help writes its text here
        sampling = check_settings(args)
        tree = check_tree(args)
        if args.prompts_file is not None:  # a fixed chain: check_settings refused trees and --show-tree
            code = run_file(args, sampling, read_prompts_file(args.prompts_file))
        else:
            code = run(args, sampling, tree, read_prompt(args))
        sys.stdout.flush()  # here, where a failed write is caught, not as Python exits
        return code
    except KeyboardInterrupt:  # before the run showed anything, where `end_at_once` could not be installed
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout closed early, e.g. `| head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_UNEXPECTED
    except OutputError as e:  # the text cannot be shown: no input was at fault
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what is left goes nowhere as Python exits
        print(f"error: {e}", file=sys.stderr)
        return EXIT_UNEXPECTED
    except (ValueError, OSError) as e:  # the product's user errors say how to fix them
        debug = args is not None and args.debug
        if debug:
            traceback.print_exc()
        print(f"error: {one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as e:
        debug = args is not None and args.debug
        if debug:
            traceback.print_exc()
        hint = "" if debug else " (run with --debug for the traceback)"
        print(f"error: unexpected {type(e).__name__}: {one_line(e)}{hint}", file=sys.stderr)
        return EXIT_UNEXPECTED


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
