"""Streaming the committed tokens of a speculative decoding run as text, in
colour on a terminal: green for drafted tokens the target accepted, yellow for
tokens the target chose itself (a correction or a bonus token). And
`Unfailing`, the stderr of progress lines that a failed write does not stop;
`Checked`, the stdout whose failed write is not mistaken for bad input."""

from __future__ import annotations

import codecs
import os

# ANSI colours, used only on a terminal.
ACCEPTED_STYLE = "\033[32m"  # green: drafted by the small model, accepted by the target
TARGET_STYLE = "\033[33m"  # yellow: chosen by the target (correction or bonus token)
DIM, RESET = "\033[2m", "\033[0m"


def wants_color(stream, *, no_color: bool, json_output: bool) -> bool:
    """Colour only on a terminal, never in JSON, with --no-color or NO_COLOR set (no-color.org)."""
    return stream.isatty() and not (no_color or json_output or os.environ.get("NO_COLOR"))


class TokenStream:
    """Writes tokens as text as `speculative_generate` commits them.

    A GPT-2 token is a byte string, and one UTF-8 character (an emoji, a CJK
    character) is often split over two or three tokens. The bytes go through
    an incremental UTF-8 decoder, which holds an incomplete character back
    until the token that completes it arrives (that token's colour is the
    character's), so the streamed text equals the decoded whole.

    `tokens` and `accepted` keep everything committed, for an interrupted run;
    with `out` None nothing is written (--json).
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
            accepted = i < num_accepted
            self.tokens.append(token)
            self.accepted.append(accepted)
            if self.out is not None:
                text = self.decoder.decode(self.tokenizer.decode_single_token_bytes(token))
                self.write(text, ACCEPTED_STYLE if accepted else TARGET_STYLE)
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


class Wrapped:
    """A text stream with its own `write` and `flush`; everything else is the stream's."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def __getattr__(self, name: str):
        if "stream" not in self.__dict__:  # a copy being made: no stream yet
            raise AttributeError(name)
        return getattr(self.stream, name)


class Unfailing(Wrapped):
    """stderr, whose progress lines and errors are dropped where they cannot be written (a full disk, a reader
    that left, a descriptor only for reading): the run and its text on stdout go on. It failed with exit code 1
    and no output, the error about the failed write failing in turn."""

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except (OSError, ValueError):  # ValueError: a closed file
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except (OSError, ValueError):
            pass


class OutputError(Exception):
    """Standard output cannot be written (a full disk, a descriptor open only for reading): the run cannot show its
    text, and no input was at fault."""


class Checked(Wrapped):
    """stdout, whose failed writes raise `OutputError` rather than an OSError, which the command reads as bad input
    (exit code 2); a reader that left (`| head`, BrokenPipeError) stays the caller's to handle."""

    def write(self, text: str) -> int:
        return self.checked(self.stream.write, text)

    def flush(self) -> None:
        self.checked(self.stream.flush)

    def checked(self, call, *args):
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise OutputError(f"standard output cannot be written ({e.strerror or e}): send it to a file or a "
                              "terminal that takes it") from None
