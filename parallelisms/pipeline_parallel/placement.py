"""Stage placement: which pp rank owns which pipeline stage.

Looped (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble): rank r owns stages r, r + pp, r + 2 pp, ...
so a microbatch loops through the ranks once per stage-per-rank. V (ZBVZeroBubble): with two stages per rank, rank r
owns r and 2 pp - 1 - r, so the last rank holds the two middle stages and the first rank holds the first and the
last (the loss), which is what lets the zero-bubble V schedule start its backward early.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["StagePlacement", "rank_to_stages", "stage_to_rank"]


class StagePlacement(StrEnum):
    LOOP = "loop"
    V = "v"


def stage_to_rank(
    pp: int, stages_per_rank: int, placement: StagePlacement | str = StagePlacement.LOOP
) -> dict[int, int]:
    """``{stage: rank}`` for ``pp * stages_per_rank`` stages.

    The V placement zig-zags: stages 0..pp-1 go down the ranks, pp..2pp-1 come back up, and so on (torch's
    ``generate_stage_to_rank_mapping(style="v")``); with 2 stages per rank, rank r owns r and 2 pp - 1 - r.
    """
    placement = StagePlacement(placement)
    _check_sizes(pp, stages_per_rank)
    num_stages = pp * stages_per_rank
    if placement is StagePlacement.LOOP:
        return {stage: stage % pp for stage in range(num_stages)}
    mapping = {}
    for stage in range(num_stages):
        lap, offset = divmod(stage, pp)
        mapping[stage] = offset if lap % 2 == 0 else pp - 1 - offset
    return mapping


def rank_to_stages(
    pp: int, stages_per_rank: int, placement: StagePlacement | str = StagePlacement.LOOP
) -> dict[int, list[int]]:
    """``{rank: [its stages, ascending]}``, the inverse of :func:`stage_to_rank`."""
    owned: dict[int, list[int]] = {rank: [] for rank in range(pp)}
    for stage, rank in stage_to_rank(pp, stages_per_rank, placement).items():
        owned[rank].append(stage)
    return owned


def _check_sizes(pp: int, stages_per_rank: int) -> None:
    if pp < 1:
        raise ValueError(f"pipeline_parallel_degree must be >= 1, got {pp}")
    if stages_per_rank < 1:
        raise ValueError(f"stages per rank must be >= 1, got {stages_per_rank}")
