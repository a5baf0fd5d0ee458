"""Pipeline actions: the words a schedule is written in, in torch's compact notation.

An action is ``<stage><KIND>[<microbatch>]``: ``1F0`` is stage 1's forward of microbatch 0, ``0B3`` a full
backward, ``2I1`` / ``0W2`` the input-grad and weight-grad halves of a split backward (zero bubble), ``1SEND_F0``
and ``2RECV_B1`` the transfers of an activation and of a gradient, ``0UNSHARD`` / ``0RESHARD`` / ``0REDUCE_GRAD``
the FSDP steps of a stage (no microbatch). A schedule is ``dict[rank, list[Action | None]]`` like torch's
``pipeline_order``; ``None`` is a deliberate idle step that only aligns the printed grid.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Action", "ActionKind", "Schedule", "format_schedule"]


class ActionKind(StrEnum):
    """What an action does; the value is its spelling in the compact notation."""

    F = "F"  # forward of one microbatch through one stage
    B = "B"  # full backward (input and weight gradients at once)
    I = "I"  # noqa: E741 - torch's letter: backward for the input gradient only
    W = "W"  # backward for the weight gradient, after its I
    SEND_F = "SEND_F"  # send the stage's output activation to the next stage
    RECV_F = "RECV_F"  # receive the stage's input activation from the previous stage
    SEND_B = "SEND_B"  # send the gradient of the stage's input to the previous stage
    RECV_B = "RECV_B"  # receive the gradient of the stage's output from the next stage
    UNSHARD = "UNSHARD"  # FSDP all-gather of the stage's parameters
    RESHARD = "RESHARD"  # FSDP free of the unsharded parameters
    REDUCE_GRAD = "REDUCE_GRAD"  # FSDP reduce-scatter of the stage's gradients, once per step

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_comm(self) -> bool:
        return self in _COMM

    @property
    def is_backward(self) -> bool:
        """B or I: the actions that consume the gradient of the stage's output."""
        return self in _BACKWARD

    @property
    def takes_microbatch(self) -> bool:
        return self not in _WHOLE_STAGE


_COMPUTE = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W})
_COMM = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B})
_BACKWARD = frozenset({ActionKind.B, ActionKind.I})
_WHOLE_STAGE = frozenset({ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD})

# Longest spellings first so "SEND_F" is not read as "S..." and "REDUCE_GRAD" not as "R...".
_KINDS_PATTERN = "|".join(sorted((re.escape(k.value) for k in ActionKind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"^(\d+)({_KINDS_PATTERN})(\d*)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: ``stage`` does ``kind`` on ``microbatch`` (None for the FSDP kinds)."""

    stage: int
    kind: ActionKind
    microbatch: int | None = None

    def __post_init__(self) -> None:
        if self.stage < 0:
            raise ValueError(f"an action's stage is >= 0, got {self.stage} in {self.kind.value}")
        whole_stage = self.kind in _WHOLE_STAGE
        if not whole_stage and (self.microbatch is None or self.microbatch < 0):
            raise ValueError(
                f"{self.kind.value} needs a microbatch >= 0, got {self.microbatch}; "
                f"write e.g. '{self.stage}{self.kind.value}0'"
            )
        if whole_stage and self.microbatch is not None:
            raise ValueError(
                f"{self.kind.value} acts on a whole stage and takes no microbatch, got {self.microbatch}; "
                f"write '{self.stage}{self.kind.value}'"
            )

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind.value}{mb}"

    @staticmethod
    def parse(text: str) -> Action | None:
        """Reverse of ``str()``: ``"1F0"`` -> ``Action(1, F, 0)``; an empty cell is None (an idle step)."""
        text = text.strip()
        if not text:
            return None
        match = _ACTION_RE.match(text)
        if match is None:
            kinds = ", ".join(k.value for k in ActionKind)
            raise ValueError(
                f"cannot read action {text!r}: expected <stage><kind>[<microbatch>] such as '1F0', '0B3', "
                f"'2RECV_B1' or '0UNSHARD', with kind one of {kinds}"
            )
        stage, kind, mb = match.groups()
        return Action(int(stage), ActionKind(kind), int(mb) if mb else None)


Schedule = dict[int, list[Action | None]]
"""Per-rank action lists, keyed by pp rank; ``None`` is an idle step."""


def format_schedule(schedule: Schedule) -> str:
    """The schedule as a grid, one column per rank and one row per step, like torch's ``_format_pipeline_order``.

    >>> print(format_schedule({0: [Action(0, ActionKind.F, 0)], 1: [None, Action(1, ActionKind.F, 0)]}))
            Rank 0 Rank 1
    Step 0: 0F0
    Step 1:        1F0
    """
    ranks = sorted(schedule)
    steps = max((len(schedule[r]) for r in ranks), default=0)
    cells = [[_cell(schedule[r], step) for r in ranks] for step in range(steps)]
    label_width = len(f"Step {max(steps - 1, 0)}:")
    headers = [f"Rank {r}" for r in ranks]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]
    lines = [" " * (label_width + 1) + " ".join(h.ljust(w) for h, w in zip(headers, widths))]
    for step, row in enumerate(cells):
        label = f"Step {str(step).zfill(len(str(max(steps - 1, 0))))}:".ljust(label_width)
        lines.append(label + " " + " ".join(c.ljust(w) for c, w in zip(row, widths)))
    return "\n".join(line.rstrip() for line in lines)


def _cell(actions: list[Action | None], step: int) -> str:
    if step >= len(actions) or actions[step] is None:
        return ""
    return str(actions[step])
