"""Custom schedules as CSV (torchtitan's ``pipeline_parallel_schedule_csv``): one row per rank, one action per cell.

Row i is rank i's list; a cell is an action in compact notation (``0F0``, ``1B3``, ``2I1``, ``1SEND_F0``); an empty
cell is an idle step. This is the format torch's ``_PipelineScheduleRuntime._load_csv`` / ``_dump_csv`` read and
write, so a schedule written by either reads in the other.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from .actions import Action, Schedule

__all__ = ["read_schedule_csv", "schedule_from_csv", "schedule_to_csv", "write_schedule_csv"]


def schedule_to_csv(schedule: Schedule) -> str:
    """The CSV text of ``schedule``, ranks in order; ranks must be 0..pp-1."""
    ranks = sorted(schedule)
    if ranks != list(range(len(ranks))):
        raise ValueError(f"a schedule CSV has one row per rank 0..pp-1, got ranks {ranks}")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank in ranks:
        writer.writerow(["" if action is None else str(action) for action in schedule[rank]])
    return out.getvalue()


def schedule_from_csv(text: str, source: str = "<csv>") -> Schedule:
    """Read CSV text into ``{rank: actions}``; errors name the row (rank) and column of the bad cell."""
    schedule: Schedule = {}
    for rank, row in enumerate(csv.reader(io.StringIO(text))):
        actions: list[Action | None] = []
        for column, cell in enumerate(row):
            try:
                actions.append(Action.parse(cell))
            except ValueError as error:
                raise ValueError(f"{source} row {rank + 1} (rank {rank}), column {column + 1}: {error}") from None
        schedule[rank] = actions
    if not schedule:
        raise ValueError(f"{source} holds no rows; a schedule CSV has one row of actions per pp rank")
    return schedule


def write_schedule_csv(schedule: Schedule, path: str | Path) -> None:
    Path(path).write_text(schedule_to_csv(schedule))


def read_schedule_csv(path: str | Path) -> Schedule:
    """Read ``pipeline_parallel_schedule_csv``; see :func:`schedule_from_csv`."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"pipeline_parallel_schedule_csv {str(path)!r} is not a file")
    return schedule_from_csv(path.read_text(), source=str(path))
