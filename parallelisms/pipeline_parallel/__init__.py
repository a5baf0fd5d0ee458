"""Pipeline parallelism: schedules as data, their lowering, custom CSV schedules, and a process-free simulator.

A schedule is ``dict[rank, list[Action | None]]`` made by one pure function of (pp, stages per rank, microbatches)
(``SCHEDULES``, torchtitan's names), lowered with SEND/RECV and FSDP actions by ``lower_schedule``, and checked by
``simulate`` (deadlocks, the bubble, activation peaks) before any process runs it.
"""

from .actions import Action, ActionKind, Schedule, format_schedule
from .lowering import add_reduce_grad, add_send_recv, add_unshard_reshard, defer_recvs, lower_schedule
from .placement import StagePlacement, rank_to_stages, stage_to_rank
from .schedule_csv import csv_schedule_spec, read_schedule_csv, schedule_from_csv, schedule_to_csv, write_schedule_csv
from .schedules import (
    SCHEDULES,
    ScheduleSpec,
    dual_pipe_v,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    interleaved_zero_bubble,
    looped_bfs,
    one_f_one_b,
    zbv_zero_bubble,
)
from .simulator import Costs, DeadlockError, Interval, P2PMode, SimulationResult, format_timeline, simulate
from .validation import validate_schedule

__all__ = [
    "SCHEDULES",
    "csv_schedule_spec",
    "Action",
    "ActionKind",
    "Costs",
    "DeadlockError",
    "Interval",
    "P2PMode",
    "Schedule",
    "ScheduleSpec",
    "SimulationResult",
    "StagePlacement",
    "add_reduce_grad",
    "add_send_recv",
    "add_unshard_reshard",
    "defer_recvs",
    "dual_pipe_v",
    "format_schedule",
    "format_timeline",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_zero_bubble",
    "looped_bfs",
    "lower_schedule",
    "one_f_one_b",
    "rank_to_stages",
    "read_schedule_csv",
    "schedule_from_csv",
    "schedule_to_csv",
    "simulate",
    "stage_to_rank",
    "validate_schedule",
    "write_schedule_csv",
    "zbv_zero_bubble",
]
