"""Which pipeline microbatch counts the estimator traces instead of the step's own: two smaller counts whose
traces give the real one's by a line (`sampling._affine_trace`), chosen from the rank's own action list
(no process runs, no simulation: the in-flight counts on a rank depend only on its order of actions).

Every count of a pipeline step grows by the same amount with each microbatch: its forwards, backwards and
transfers, the FLOPs and tokens, the tensor-parallel collectives; FSDP's gather and reduction happen once per
step. So the traces at `small` and `large` microbatches give all of them at `m` on a line. The peak memory is
not affine in general: it follows the activations the rank holds in flight, which grow during the warm-up and
then stay (1F1B, Interleaved1F1B) or grow with every microbatch (GPipe). The action list gives that count per
stage and per rank for any m; a pair qualifies when the rank's counts at `large` already equal those at `m`
(the peak is `large`'s) or lie on one line through `small`, `large` and `m` (the peak is extrapolated too).
A 405B first stage under Interleaved1F1B (pp 8, 2 stages per rank, 32 microbatches) is traced at 1 and 16.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from parallelisms.pipeline_parallel import ScheduleSpec, stage_to_rank
from parallelisms.pipeline_parallel.actions import ActionKind

from ..config.pipeline_setup import PipelineSetup


@dataclass(frozen=True)
class MicrobatchSamples:
    small: int
    large: int
    peak_from_large: bool  # the rank's in-flight activations at `large` are those at the real count


def microbatch_samples(setup: PipelineSetup, rank: int) -> MicrobatchSamples | None:
    """The cheapest pair (fewest microbatches traced, fewer than the setup's m) whose traces give rank `rank`'s
    trace at m microbatches; None when no pair is cheaper than tracing m (or the schedule takes no other count)."""
    spec, pp, stages_per_rank, m = setup.schedule, setup.pp, setup.stages_per_rank, setup.microbatches
    in_flight = functools.cache(lambda k: _in_flight(spec, pp, stages_per_rank, k, rank))
    target = in_flight(m)
    if target is None:
        return None
    for total in range(3, m):
        for small in range(1, (total + 1) // 2):
            large = total - small
            at_small, at_large = in_flight(small), in_flight(large)
            if at_small is None or at_large is None:
                continue
            if at_large == target:
                return MicrobatchSamples(small, large, peak_from_large=True)
            # a line through the peaks: the first point needs two microbatches (one has no unsynced backward)
            if small > 1 and all((t - b) * (large - small) == (b - a) * (m - large)
                                 for a, b, t in zip(at_small, at_large, target)):  # fmt: skip
                return MicrobatchSamples(small, large, peak_from_large=False)
    return None


def _in_flight(spec: ScheduleSpec, pp: int, stages_per_rank: int, m: int, rank: int) -> tuple[int, ...] | None:
    """The most microbatches whose activations rank `rank` holds at once, per stage it owns and over them all,
    over the whole step and again from its first weight backward on (from then on gradients are accumulating
    beside the activations: FSDP's unsynced gradients, say); None when the schedule refuses m microbatches."""
    try:
        actions = [a for a in spec.generate(pp, stages_per_rank, m)[rank] if a is not None]
    except ValueError:
        return None
    mine = sorted(s for s, r in stage_to_rank(pp, stages_per_rank, spec.placement).items() if r == rank)
    live = dict.fromkeys(mine, 0)
    peak, peak_after = dict.fromkeys(mine, 0), dict.fromkeys(mine, 0)
    total = total_peak = total_after = 0
    accumulating = False
    for action in actions:
        if action.kind is ActionKind.F:
            live[action.stage] += 1
            total += 1
        elif action.kind in (ActionKind.B, ActionKind.W):  # the activations go with the weight gradients
            live[action.stage] -= 1
            total -= 1
            accumulating = True
        else:
            continue
        peak[action.stage] = max(peak[action.stage], live[action.stage])
        total_peak = max(total_peak, total)
        if accumulating:
            peak_after[action.stage] = max(peak_after[action.stage], live[action.stage])
            total_after = max(total_after, total)
    return (*peak.values(), *peak_after.values(), total_peak, total_after)
