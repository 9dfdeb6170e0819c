"""The fixed prompt set of the benchmarks and the parity check.

Every benchmark decodes the same `(name, text)` prompts, so that numbers from
different scripts and machines describe the same work; the names appear in
result files. How often the draft agrees with the target depends on the kind
of text, so the set is varied (prose, code, a list, a question, a news lead, a
dialogue), most varied first: `--prompts N` takes the first N.

`EARLY_EOS_PROMPTS` read like the end of a web document (a wire-service
footer, a closing line), after which GPT-2 soon emits end-of-text (id 50256):
they exercise the end-of-text rule (nothing follows EOS, no bonus token). They
are kept apart because a speed benchmark wants runs of a fixed length.
"""

from __future__ import annotations

PROMPTS: tuple[tuple[str, str], ...] = (
    ("prose", "The old lighthouse keeper climbed the spiral stairs one last time. For forty years he had "
              "watched the ships pass in the night, and tonight, as the storm gathered over the bay,"),
    ("code", 'def fibonacci(n):\n    """Return the n-th Fibonacci number, computed iteratively."""\n    a, b = 0, 1\n'),
    ("list", "Ten things to pack for a weekend hiking trip:\n1. A waterproof jacket\n2. A first aid kit\n3."),
    ("question", "Q: Why is the sky blue during the day but red at sunset?\nA:"),
    ("news", "WASHINGTON (Reuters) - The Federal Reserve held interest rates steady on Wednesday, saying"),
    ("dialogue", '"Are you sure this is the right road?" Maria asked, squinting at the map.\n"Of course," said Tom. "'),
)

EARLY_EOS_PROMPTS: tuple[tuple[str, str], ...] = (
    ("ap_footer", "The company said it would announce its quarterly results next week.\n\n"
                  "Copyright 2017 The Associated Press. All rights reserved. This material may not be "
                  "published, broadcast, rewritten or redistributed."),
    ("reuters_footer", "Shares of the company rose 3 percent in early trading on Monday.\n\n"
                       "(Reporting by David Shepardson; Editing by Chizu Nomiyama)"),
    ("closing_line", "And that is how the little fox found her way home.\n\nThe End."),
)
