"""Custom schedules as CSV (torchtitan's ``pipeline_parallel_schedule_csv``): one row per rank, one action per cell.

Row i is rank i's list; a cell is an action in compact notation (``0F0``, ``1B3``, ``2I1``, ``1SEND_F0``); an empty
cell is an idle step. This is the format torch's ``_PipelineScheduleRuntime._load_csv`` / ``_dump_csv`` read and
write, so a schedule written by either reads in the other.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from .actions import Action, ActionKind, Schedule
from .placement import StagePlacement, stage_to_rank
from .schedules import ScheduleSpec
from .validation import validate_schedule

__all__ = ["csv_schedule_spec", "read_schedule_csv", "schedule_from_csv", "schedule_to_csv", "write_schedule_csv"]


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


def csv_schedule_spec(path: str | Path, pp: int, num_microbatches: int) -> ScheduleSpec:
    """The CSV file's schedule as a ``ScheduleSpec`` (torchtitan's ``pipeline_parallel_schedule_csv``).

    Only its compute actions are kept; the lowering derives the transfers and FSDP actions as for the named
    schedules. Its stages per rank, the placement (looped or V) and whether the backward is split are read off
    the actions, which must cover ``num_microbatches`` on ``pp`` ranks (validate_schedule's checks).
    """
    source = read_schedule_csv(path)
    if sorted(source) != list(range(pp)):
        raise ValueError(f"pipeline_parallel_schedule_csv {str(path)!r} has {len(source)} rows; it needs one per "
                         f"pipeline rank, pipeline_parallel_degree={pp}")  # fmt: skip
    schedule: Schedule = {r: [a for a in acts if a is not None and a.kind.is_compute] for r, acts in source.items()}
    stages = {a.stage for actions in schedule.values() for a in actions if a is not None}
    num_stages = max(stages, default=-1) + 1
    if num_stages == 0 or num_stages % pp:
        raise ValueError(f"pipeline_parallel_schedule_csv {str(path)!r} runs {num_stages} stages; a multiple of "
                         f"pipeline_parallel_degree={pp} is needed (the same number on every rank)")  # fmt: skip
    mapping = validate_schedule(schedule, num_stages, num_microbatches)
    per_rank = num_stages // pp
    placement = next((p for p in StagePlacement if stage_to_rank(pp, per_rank, p) == mapping), None)
    if placement is None:
        raise ValueError(f"pipeline_parallel_schedule_csv {str(path)!r} places stages {mapping}: neither "
                         f"looped (rank r runs r, r + pp, ...) nor V; the model splits for one of those")  # fmt: skip
    kinds = {a.kind for actions in schedule.values() for a in actions if a is not None}

    def generate(pp_: int, stages_per_rank: int, microbatches: int) -> Schedule:
        if (pp_, stages_per_rank, microbatches) != (pp, per_rank, num_microbatches):
            raise ValueError(
                f"pipeline_parallel_schedule_csv {str(path)!r} is for pp {pp}, {per_rank} stages per rank and "
                f"{num_microbatches} microbatches, not ({pp_}, {stages_per_rank}, {microbatches})"
            )
        return {r: list(actions) for r, actions in schedule.items()}

    return ScheduleSpec(
        name=f"csv:{path}", generate=generate, placement=placement, single_stage=per_rank == 1,
        split_backward=bool(kinds & {ActionKind.I, ActionKind.W}), stages_per_rank=per_rank,
    )  # fmt: skip
