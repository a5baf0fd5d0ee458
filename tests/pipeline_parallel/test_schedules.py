"""Each schedule's compute actions per rank equal torch.distributed.pipelining's own order."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from parallelisms.pipeline_parallel import (
    SCHEDULES,
    ActionKind,
    StagePlacement,
    add_reduce_grad,
    dual_pipe_v,
    get_schedule,
    interleaved_1f1b,
    rank_to_stages,
    stage_to_rank,
    zbv_zero_bubble,
)
from tests.pipeline_parallel.torch_oracle import torch_pipeline_order, torch_runtime_order, torch_schedule

# Even and uneven counts: below pp, not a multiple of pp, and ones torch refuses for interleaving (5, 9, 14).
MICROBATCHES = [1, 2, 3, 4, 5, 6, 8, 9, 10, 12, 14, 16]
STAGES_PER_RANK = {"Interleaved1F1B": (1, 2, 3), "LoopedBFS": (1, 2, 3), "InterleavedZeroBubble": (1, 2, 3)}
STAGES_PER_RANK["ZBVZeroBubble"] = STAGES_PER_RANK["DualPipeV"] = (2,)


def _torch_accepts(name: str, pp: int, stages_per_rank: int, num_microbatches: int) -> bool:
    try:
        torch_schedule(name, pp, stages_per_rank, num_microbatches)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", list(STAGES_PER_RANK))
def test_multi_stage_order_equals_torch_pipeline_order(name: str, pp: int) -> None:
    # Exact, idle steps included, for every microbatch count torch accepts; the others raise in both.
    compared = 0
    for spr in STAGES_PER_RANK[name]:
        for m in MICROBATCHES:
            if not _torch_accepts(name, pp, spr, m):
                with pytest.raises(ValueError):
                    get_schedule(name).generate(pp, spr, m)
                continue
            assert get_schedule(name).generate(pp, spr, m) == torch_pipeline_order(name, pp, spr, m), (spr, m)
            compared += 1
    least = 6 if name == "DualPipeV" else 9  # DualPipeV takes m >= 2 pp: 6 of the counts above on pp 4
    assert compared >= least * len(STAGES_PER_RANK[name])


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
def test_single_stage_order_equals_torch_runtime(name: str, pp: int) -> None:
    # torch runs GPipe / 1F1B by a hand-written loop; a recording stage captures what it computes, in order.
    for m in MICROBATCHES:
        if not _torch_accepts(name, pp, 1, m):  # torch's 1F1B wants m >= pp
            continue
        ours = {rank: add_reduce_grad(actions, m) for rank, actions in get_schedule(name).generate(pp, 1, m).items()}
        assert ours == torch_runtime_order(name, pp, m), m


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
def test_single_stage_order_equals_torch_picture(name: str, pp: int) -> None:
    # torch's pipeline_order of a single-stage schedule is a picture (idle steps dropped, REDUCE_GRAD added).
    # 1F1B's picture numbers the last rank's forwards 1..m instead of 0..m-1; its loop (above) runs 0..m-1.
    for m in [m for m in MICROBATCHES if m >= pp]:
        ours = {rank: add_reduce_grad(actions, m) for rank, actions in get_schedule(name).generate(pp, 1, m).items()}
        theirs = torch_pipeline_order(name, pp, 1, m)
        assert {r: ours[r] for r in range(pp - 1)} == {r: theirs[r] for r in range(pp - 1)}
        if ours[pp - 1] != theirs[pp - 1]:
            forwards = [a.microbatch for a in theirs[pp - 1] if a is not None and a.kind is ActionKind.F]
            assert name == "1F1B" and forwards == list(range(1, m + 1))


def test_registry_has_torchtitan_names_case_insensitive() -> None:
    assert list(SCHEDULES) == [
        "GPipe",
        "1F1B",
        "Interleaved1F1B",
        "LoopedBFS",
        "InterleavedZeroBubble",
        "ZBVZeroBubble",
        "DualPipeV",
    ]
    assert get_schedule("interleaved1f1b").name == "Interleaved1F1B"
    assert get_schedule("ZBVZEROBUBBLE").placement is StagePlacement.V
    assert get_schedule("1f1b").single_stage and not get_schedule("LoopedBFS").single_stage
    assert get_schedule("InterleavedZeroBubble").split_backward and not get_schedule("GPipe").split_backward
    with pytest.raises(ValueError, match="unknown pipeline_parallel_schedule 'DualPipe'.*GPipe, 1F1B, Interleaved1F1B"):
        get_schedule("DualPipe")


def test_interleaved_microbatch_rule_states_the_arithmetic() -> None:
    with pytest.raises(ValueError) as error:
        interleaved_1f1b(4, 2, 9)
    message = str(error.value)
    assert "rounds = max(1, microbatches(9) // pp(4)) = 2" in message and "9 % 2 = 1 != 0" in message
    assert "use 8 or 10 microbatches" in message
    interleaved_1f1b(4, 2, 6)  # one round of 6: torch's flexible rule accepts it


def test_single_stage_schedule_refuses_several_stages_per_rank() -> None:
    with pytest.raises(ValueError, match=r"1F1B runs one stage per rank, got stages_per_rank=2 \(8 stages on pp=4\)"):
        get_schedule("1F1B").generate(4, 2, 8)
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        zbv_zero_bubble(4, 3, 8)
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        dual_pipe_v(2, 1, 8)
    with pytest.raises(ValueError, match="microbatches must be >= 1"):
        get_schedule("GPipe").generate(2, 1, 0)


@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("stages_per_rank", [1, 2, 3])
def test_placement_equals_torch(pp: int, stages_per_rank: int) -> None:
    num_stages = pp * stages_per_rank
    assert stage_to_rank(pp, stages_per_rank) == generate_stage_to_rank_mapping(pp, num_stages, style="loop")
    assert stage_to_rank(pp, stages_per_rank, "v") == generate_stage_to_rank_mapping(pp, num_stages, style="v")
    assert rank_to_stages(pp, stages_per_rank)[0] == list(range(0, num_stages, pp))
    if stages_per_rank == 2:  # the V: rank r owns r and 2 pp - 1 - r
        assert rank_to_stages(pp, 2, StagePlacement.V) == {r: [r, 2 * pp - 1 - r] for r in range(pp)}


def test_dual_pipe_v_wants_a_microbatch_per_stage_and_pairs_forwards_with_backwards() -> None:
    with pytest.raises(ValueError, match=r"3 microbatches for 4 stages .* >= 4, or use ZBVZeroBubble"):
        dual_pipe_v(2, 2, 3)
    order = dual_pipe_v(4, 2, 8)
    # the steady state runs one chunk's forward next to the other chunk's full backward (torch's OVERLAP_F_B)
    rank0 = [str(a) for a in order[0]]
    assert rank0[rank0.index("0F7") + 1] == "7B3" and rank0[rank0.index("7F4") + 1] == "0B0", rank0
    kinds = {a.kind for actions in order.values() for a in actions if a is not None}
    assert kinds == {ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W}  # full and split backwards mixed
    for rank, actions in order.items():  # every microbatch of both stages: one F, and one B or one I + one W
        for stage in (rank, 2 * 4 - 1 - rank):
            done = [a for a in actions if a is not None and a.stage == stage]
            forwards = sorted(a.microbatch for a in done if a.kind is ActionKind.F)
            backwards = sorted(a.microbatch for a in done if a.kind in (ActionKind.B, ActionKind.I))
            weights = sorted(a.microbatch for a in done if a.kind in (ActionKind.B, ActionKind.W))
            assert forwards == backwards == weights == list(range(8)), (rank, stage)
