"""Actions in torch's compact notation, and a schedule printed as a grid."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import _Action

from parallelisms.pipeline_parallel import Action, ActionKind, format_schedule, one_f_one_b

SPELLINGS = ["1F0", "0B3", "2I1", "0W2", "1SEND_F0", "1RECV_F12", "2SEND_B1", "2RECV_B1", "0UNSHARD", "3RESHARD"]
SPELLINGS += ["0REDUCE_GRAD"]


@pytest.mark.parametrize("text", SPELLINGS)
def test_action_str_parse_round_trip_matches_torch(text: str) -> None:
    action = Action.parse(text)
    assert action is not None and str(action) == text
    theirs = _Action.from_str(text)
    assert (action.stage, action.kind.value, action.microbatch) == (
        theirs.stage_index,
        theirs.computation_type.value,
        theirs.microbatch_index,
    )
    assert str(theirs) == text


def test_action_parse_empty_cell_is_idle_step() -> None:
    assert Action.parse("") is None and Action.parse("  ") is None


@pytest.mark.parametrize("text", ["F0", "1X0", "1F", "0UNSHARD0", "1f0", "-1F0"])
def test_action_parse_rejects_malformed_text(text: str) -> None:
    with pytest.raises(ValueError, match="1F0|microbatch|no microbatch"):
        Action.parse(text)


def test_action_kinds_classify() -> None:
    assert {k for k in ActionKind if k.is_compute} == {ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W}
    assert {k for k in ActionKind if k.is_comm} == {
        ActionKind.SEND_F,
        ActionKind.RECV_F,
        ActionKind.SEND_B,
        ActionKind.RECV_B,
    }
    assert (
        Action(0, ActionKind.F, 1) == Action.parse("0F1")
        and len({Action(0, ActionKind.F, 1), Action.parse("0F1")}) == 1
    )


def test_format_schedule_prints_1f1b_grid() -> None:
    grid = format_schedule(one_f_one_b(4, 1, 6))
    print(f"\n1F1B, pp=4, 6 microbatches:\n{grid}")
    lines = grid.splitlines()
    assert lines[0].split() == ["Rank", "0", "Rank", "1", "Rank", "2", "Rank", "3"]
    assert lines[1].split() == ["Step", "00:", "0F0"]
    assert lines[4].split() == ["Step", "03:", "3F0"]  # the last rank starts once the first microbatch arrives
    assert lines[11].split() == ["Step", "10:", "0B0", "1B1", "2B2", "3B3"]  # steady state: all ranks busy
