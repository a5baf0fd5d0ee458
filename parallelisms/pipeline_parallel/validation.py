"""Checks on a schedule's compute actions that need no simulation (torch's ``_validate_schedule``, with reasons).

Every stage lives on one rank, runs F once per microbatch, and B once or I then W once per microbatch, each after
that microbatch's F on the same rank. The placement a custom (CSV) schedule implies is read off its actions.
"""

from __future__ import annotations

from .actions import ActionKind, Schedule

__all__ = ["validate_schedule"]

K = ActionKind


def validate_schedule(schedule: Schedule, num_stages: int, num_microbatches: int) -> dict[int, int]:
    """Check the compute actions of ``schedule``; return the ``{stage: rank}`` placement they imply.

    Communication and FSDP actions are ignored (the simulator checks those). Raises ValueError naming the rank,
    the step and the action.
    """
    stage_to_rank: dict[int, int] = {}
    done: dict[tuple[int, ActionKind], set[int]] = {}
    for rank in sorted(schedule):
        for step, action in enumerate(schedule[rank]):
            if action is None or not action.kind.is_compute:
                continue
            where = f"rank {rank} step {step} ({action})"
            if action.stage >= num_stages:
                raise ValueError(
                    f"{where}: stage {action.stage} does not exist, there are {num_stages} (0..{num_stages - 1})"
                )
            owner = stage_to_rank.setdefault(action.stage, rank)
            if owner != rank:
                raise ValueError(
                    f"{where}: stage {action.stage} already runs on rank {owner}; a stage lives on one rank"
                )
            mb = action.microbatch
            assert mb is not None  # compute actions carry a microbatch (Action checks it)
            if mb >= num_microbatches:
                raise ValueError(f"{where}: microbatch {mb} does not exist, there are {num_microbatches}")
            ran = done.setdefault((action.stage, action.kind), set())
            if mb in ran:
                raise ValueError(f"{where}: {action} runs twice")
            needs = {K.B: K.F, K.I: K.F, K.W: K.I}.get(action.kind)
            if needs is not None and mb not in done.get((action.stage, needs), set()):
                raise ValueError(
                    f"{where}: {action} runs before {action.stage}{needs.value}{mb} on this rank; "
                    + ("a backward needs its forward" if needs is K.F else "a weight grad (W) needs its input grad (I)")
                )
            if action.kind is K.B and mb in done.get((action.stage, K.I), set()):
                raise ValueError(f"{where}: microbatch {mb} already ran I; a split backward finishes with W, not B")
            ran.add(mb)
    for stage in range(num_stages):
        _check_counts(stage, done, num_microbatches)
    return stage_to_rank


def _check_counts(stage: int, done: dict[tuple[int, ActionKind], set[int]], num_microbatches: int) -> None:
    def missing(kind: ActionKind, expected: set[int]) -> list[int]:
        return sorted(expected - done.get((stage, kind), set()))

    everything = set(range(num_microbatches))
    if lacking := missing(K.F, everything):
        raise ValueError(f"stage {stage} never runs F for microbatches {lacking} (of {num_microbatches})")
    split = done.get((stage, K.I), set())
    if lacking := missing(K.W, split):
        raise ValueError(f"stage {stage} runs I but never W for microbatches {lacking}; every I needs its W")
    if lacking := missing(K.B, everything - split):
        raise ValueError(f"stage {stage} never runs a backward (B, or I and W) for microbatches {lacking}")
