"""One rank prefix per console line. torchrun prefixes every teed line with `[<role><local rank>]:`; the launcher
makes it the global rank in the trainer's own form, and the ranks' logging then adds none, so a line reads
`[rank0] time LEVEL module: msg` whether torchrun or the rank wrote the prefix."""

from __future__ import annotations

import os

PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"  # torchrun's agent reads it
RANK_PREFIX_TEMPLATE = "[rank${rank}] "


def prefix_teed_lines() -> None:
    """In the launcher, before the agent starts: torchrun writes `[rank<global rank>] ` before each teed line."""
    os.environ.setdefault(PREFIX_TEMPLATE_ENV, RANK_PREFIX_TEMPLATE)


def rank_prefix(rank: int) -> str:
    """The prefix a rank's log format adds: none when torchrun writes it, else `[rank<rank>] `."""
    return "" if os.environ.get(PREFIX_TEMPLATE_ENV) == RANK_PREFIX_TEMPLATE else f"[rank{rank}] "
