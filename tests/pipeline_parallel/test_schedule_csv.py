"""Custom schedules as CSV (pipeline_parallel_schedule_csv): round trip, and torch reads ours and we read torch's."""

from __future__ import annotations

from pathlib import Path

import pytest

from parallelisms.pipeline_parallel import (
    interleaved_1f1b,
    lower_schedule,
    one_f_one_b,
    read_schedule_csv,
    schedule_from_csv,
    schedule_to_csv,
    simulate,
    stage_to_rank,
    validate_schedule,
    write_schedule_csv,
)
from tests.pipeline_parallel.torch_oracle import build_torch_schedule, from_torch, torch_schedule

GOLDEN_1F1B_PP2_M3 = "0F0,,,0F1,0B0,0F2,0B1,,0B2\n,1F0,1B0,1F1,1B1,1F2,1B2\n"


def test_csv_round_trip_golden(tmp_path: Path) -> None:
    schedule = one_f_one_b(2, 1, 3)
    assert schedule_to_csv(schedule) == GOLDEN_1F1B_PP2_M3
    write_schedule_csv(schedule, tmp_path / "1f1b.csv")
    assert (tmp_path / "1f1b.csv").read_text() == GOLDEN_1F1B_PP2_M3
    assert read_schedule_csv(tmp_path / "1f1b.csv") == schedule
    lowered = lower_schedule(schedule, stage_to_rank(2, 1), 3, reduce_grad=True)
    assert schedule_from_csv(schedule_to_csv(lowered)) == lowered  # comm and FSDP actions too


def test_csv_reads_torch_dump_and_torch_reads_ours(tmp_path: Path) -> None:
    pp, spr, m = 2, 2, 4
    ours = interleaved_1f1b(pp, spr, m)
    theirs = torch_schedule("Interleaved1F1B", pp, spr, m)
    theirs._dump_csv(str(tmp_path / "torch.csv"), format="compute_only")
    assert read_schedule_csv(tmp_path / "torch.csv") == ours

    write_schedule_csv(ours, tmp_path / "ours.csv")
    reader = build_torch_schedule("LoopedBFS", pp, spr, m)  # a different schedule, overwritten by the CSV
    reader._load_csv(str(tmp_path / "ours.csv"), format="compute_only")
    assert {r: from_torch(a) for r, a in reader.pipeline_order.items()} == ours
    lowered = lower_schedule(ours, stage_to_rank(pp, spr), m, unshard_reshard=True, reduce_grad=True)
    assert {r: from_torch(a) for r, a in reader.pipeline_order_with_comms.items()} == lowered


def test_custom_csv_schedule_validates_and_simulates() -> None:
    # A hand-written 2-rank schedule: its placement is read off the actions.
    schedule = schedule_from_csv("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    assert validate_schedule(schedule, num_stages=2, num_microbatches=2) == {0: 0, 1: 1}
    assert simulate(schedule).makespan == 9.0  # 0F0 0F1 | 1F0 1B0 | 0B0 with 1F1 1B1 | 0B1


def test_csv_bad_cell_names_row_and_column() -> None:
    with pytest.raises(ValueError, match=r"<csv> row 2 \(rank 1\), column 3: cannot read action '1Q0'"):
        schedule_from_csv("0F0,0B0\n1F0,1B0,1Q0\n")
    with pytest.raises(ValueError, match="holds no rows"):
        schedule_from_csv("")
    with pytest.raises(ValueError, match="not a file"):
        read_schedule_csv("/nonexistent/schedule.csv")


def test_validate_schedule_explains_wrong_orders() -> None:
    with pytest.raises(ValueError, match=r"rank 0 step 0 \(0B0\): 0B0 runs before 0F0 on this rank"):
        validate_schedule(schedule_from_csv("0B0,0F0\n"), 1, 1)
    with pytest.raises(ValueError, match="stage 0 already runs on rank 0"):
        validate_schedule(schedule_from_csv("0F0,0B0\n0F1,0B1\n"), 1, 2)
    with pytest.raises(ValueError, match=r"stage 0 runs I but never W for microbatches \[0\]"):
        validate_schedule(schedule_from_csv("0F0,0I0\n"), 1, 1)
    with pytest.raises(ValueError, match=r"stage 1 never runs F for microbatches \[1\]"):
        validate_schedule(schedule_from_csv("0F0,0F1,0B0,0B1\n1F0,1B0\n"), 2, 2)
