"""Pipeline schedules as data: one pure function of (pp, stages per rank, microbatches) per schedule.

Each returns the compute actions (F, B, or I and W) of every rank, ``dict[rank, list[Action | None]]``, in the order
the rank runs them, equal to torch's pipelining package's ``pipeline_order`` (the ``None`` steps only align the
printed grid; the simulator computes the real idle time). :func:`~.lowering.lower_schedule` adds the transfers and
the FSDP steps. ``SCHEDULES`` maps torchtitan's names to these functions; :func:`get_schedule` reads a name
case-insensitively.

Papers: GPipe (Huang et al. 2019), 1F1B (PipeDream-Flush, Narayanan et al. 2021), interleaved 1F1B (Megatron-LM,
arXiv:2104.04473), looped BFS (arXiv:2211.05953), zero bubble ZB1P and ZB-V (arXiv:2401.10241), DualPipeV (the V form
of DeepSeek-V3's DualPipe, arXiv:2412.19437).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .actions import Action, ActionKind, Schedule
from .placement import StagePlacement

__all__ = [
    "SCHEDULES",
    "ScheduleSpec",
    "dual_pipe_v",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_zero_bubble",
    "looped_bfs",
    "one_f_one_b",
    "zbv_zero_bubble",
]

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741 - torch's letters


def gpipe(pp: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    """Fill and drain: every forward, then every backward (torch's ``ScheduleGPipe``); keeps all m activations."""
    _check_args("GPipe", pp, stages_per_rank, num_microbatches, single_stage=True)
    order: Schedule = {}
    for rank in range(pp):
        actions: list[Action | None] = [None] * rank
        actions += [Action(rank, F, mb) for mb in range(num_microbatches)]
        actions += [None] * (3 * (pp - 1 - rank))  # the first gradient comes back after pp - 1 - rank hops
        actions += [Action(rank, B, mb) for mb in range(num_microbatches)]
        order[rank] = actions
    return order


def one_f_one_b(pp: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    """1F1B: ``pp - 1 - rank`` warm-up forwards, then one forward and one backward, then the remaining backwards.

    A stage holds at most ``pp - rank`` microbatches of activations, against m under GPipe, for the same bubble.
    This is the order torch's ``Schedule1F1B`` runs; its ``pipeline_order`` (a picture, not run) numbers the last
    rank's forwards from 1.
    """
    _check_args("1F1B", pp, stages_per_rank, num_microbatches, single_stage=True)
    order: Schedule = {}
    for rank in range(pp):
        warmup = min(num_microbatches, pp - 1 - rank)
        actions: list[Action | None] = [None] * rank
        actions += [Action(rank, F, mb) for mb in range(warmup)]
        actions += [None] * (2 * (pp - 1 - rank))  # wait for the first gradient
        for k in range(num_microbatches - warmup):  # steady state: forward k + warmup, backward k
            actions += [Action(rank, F, warmup + k), Action(rank, B, k)]
        for mb in range(num_microbatches - warmup, num_microbatches):  # cool-down, in step with the ranks below
            actions += [None, Action(rank, B, mb)]
        order[rank] = actions
    return order


def looped_bfs(pp: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    """Breadth first: all microbatches through a rank's first stage, then its next; backwards in reverse."""
    _check_args("LoopedBFS", pp, stages_per_rank, num_microbatches)
    order: Schedule = {}
    for rank in range(pp):
        stages = range(rank, pp * stages_per_rank, pp)
        actions: list[Action | None] = [None] * rank
        for stage in stages:
            actions += [Action(stage, F, mb) for mb in range(num_microbatches)]
        actions += [None] * (2 * (pp - 1 - rank))
        for stage in reversed(stages):
            actions += [Action(stage, B, mb) for mb in reversed(range(num_microbatches))]
        order[rank] = actions
    return order


def interleaved_1f1b(pp: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    """Interleaved (depth-first) 1F1B over a rank's looped stages, in rounds of ``microbatches_per_round``.

    Needs ``num_microbatches % rounds == 0`` with ``rounds = max(1, num_microbatches // pp)`` (torch's flexible
    rule; multiples of pp and anything up to pp qualify).
    """
    _check_args("Interleaved1F1B", pp, stages_per_rank, num_microbatches)
    per_round = _microbatches_per_round("Interleaved1F1B", pp, num_microbatches)
    return {
        rank: _interleaved_rank(pp, stages_per_rank, num_microbatches, per_round, rank, zero_bubble=False)
        for rank in range(pp)
    }


def interleaved_zero_bubble(pp: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    """ZB1P: interleaved 1F1B with the backward split into I and W, the weight gradients deferred into the bubble.

    Rank r delays its W by r steps; warm-up is one forward per hop instead of two. Same microbatch rule as
    :func:`interleaved_1f1b`.
    """
    _check_args("InterleavedZeroBubble", pp, stages_per_rank, num_microbatches)
    per_round = _microbatches_per_round("InterleavedZeroBubble", pp, num_microbatches)
    order = {
        rank: _interleaved_rank(pp, stages_per_rank, num_microbatches, per_round, rank, zero_bubble=True)
        for rank in range(pp)
    }
    return _pad_forward_waits(order)


def zbv_zero_bubble(pp: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    """ZB-V: two stages per rank placed as a V (rank r owns r and 2 pp - 1 - r), split backward (arXiv:2401.10241 §6).

    Built for ``max(2 pp - 1, m)`` microbatches and cut back to m, as torch does, so fewer microbatches than
    ``2 pp - 1`` leave idle steps but stay a valid order.
    """
    _check_args("ZBVZeroBubble", pp, stages_per_rank, num_microbatches)
    if stages_per_rank != 2:
        raise ValueError(
            f"ZBVZeroBubble places exactly 2 stages per rank (a V: rank r owns r and 2*pp-1-r), got "
            f"stages_per_rank={stages_per_rank} ({pp * stages_per_rank} stages on pp={pp}); use {2 * pp} stages, "
            "or Interleaved1F1B / InterleavedZeroBubble for other counts"
        )
    return {rank: _zbv_rank(pp, num_microbatches, rank) for rank in range(pp)}


def dual_pipe_v(pp: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    """DualPipeV: the V placement of ZB-V, a steady state that pairs one chunk's forward with the other chunk's
    full backward, and zero-bubble I / W split only where it fills the warm-up and cool-down (torch's
    ``ScheduleDualPipeV``, after DeepSeek's DualPipe).

    torch writes each pair as one ``OVERLAP_F_B`` action and, unless a callback overlaps them (to hide an MoE
    all-to-all behind the other microbatch's compute), runs its forward and then its backward. This order writes
    the pair as those two actions, so the lowering, the simulator and the runtime need no composite kind. Needs
    at least ``2 pp`` microbatches (one per stage), as torch's does.
    """
    _check_args("DualPipeV", pp, stages_per_rank, num_microbatches)
    if stages_per_rank != 2:
        raise ValueError(
            f"DualPipeV places exactly 2 stages per rank (a V: rank r owns r and 2*pp-1-r), got "
            f"stages_per_rank={stages_per_rank} ({pp * stages_per_rank} stages on pp={pp}); use {2 * pp} stages"
        )
    if num_microbatches < 2 * pp:
        raise ValueError(
            f"DualPipeV needs at least one microbatch per stage: {num_microbatches} microbatches for {2 * pp} "
            f"stages (pp={pp} x 2); raise training.local_batch_size or lower pipeline_parallel_microbatch_size so "
            f"that local_batch_size / microbatch_size >= {2 * pp}, or use ZBVZeroBubble"
        )
    return {rank: _dual_pipe_v_rank(pp, num_microbatches, rank) for rank in range(pp)}


@dataclass(frozen=True)
class ScheduleSpec:
    """A named schedule: its generator and what it needs from the stage split."""

    name: str
    generate: Callable[[int, int, int], Schedule]
    """``generate(pp, stages_per_rank, num_microbatches)`` -> the compute actions per rank."""
    placement: StagePlacement
    """Looped (rank r owns r, r+pp, ...) or V (r and 2*pp-1-r)."""
    single_stage: bool
    """Exactly one stage per rank (torch's ``PipelineScheduleSingle``); otherwise several may be."""
    split_backward: bool
    """Backward split into I (input grad) and W (weight grad)."""
    stages_per_rank: int | None = None
    """Fixed by a custom (CSV) schedule; None: the named schedules take any count their placement allows."""


SCHEDULES: Mapping[str, ScheduleSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            ScheduleSpec("GPipe", gpipe, StagePlacement.LOOP, single_stage=True, split_backward=False),
            ScheduleSpec("1F1B", one_f_one_b, StagePlacement.LOOP, single_stage=True, split_backward=False),
            ScheduleSpec(
                "Interleaved1F1B", interleaved_1f1b, StagePlacement.LOOP, single_stage=False, split_backward=False
            ),
            ScheduleSpec("LoopedBFS", looped_bfs, StagePlacement.LOOP, single_stage=False, split_backward=False),
            ScheduleSpec(
                "InterleavedZeroBubble",
                interleaved_zero_bubble,
                StagePlacement.LOOP,
                single_stage=False,
                split_backward=True,
            ),
            ScheduleSpec("ZBVZeroBubble", zbv_zero_bubble, StagePlacement.V, single_stage=False, split_backward=True),
            ScheduleSpec("DualPipeV", dual_pipe_v, StagePlacement.V, single_stage=False, split_backward=True),
        )
    }
)
"""torchtitan's ``pipeline_parallel_schedule`` names -> their specs."""


def get_schedule(name: str) -> ScheduleSpec:
    """The schedule called ``name``, matched case-insensitively (``"interleaved1f1b"`` is Interleaved1F1B)."""
    by_lower = {key.lower(): spec for key, spec in SCHEDULES.items()}
    spec = by_lower.get(name.strip().lower())
    if spec is None:
        raise ValueError(
            f"unknown pipeline_parallel_schedule {name!r}; expected one of {', '.join(SCHEDULES)} (any case), "
            "or a custom schedule in pipeline_parallel_schedule_csv"
        )
    return spec


def _check_args(name: str, pp: int, stages_per_rank: int, num_microbatches: int, single_stage: bool = False) -> None:
    if pp < 1:
        raise ValueError(f"{name}: pipeline_parallel_degree must be >= 1, got {pp}")
    if num_microbatches < 1:
        raise ValueError(f"{name}: the number of microbatches must be >= 1, got {num_microbatches}")
    if stages_per_rank < 1:
        raise ValueError(f"{name}: stages per rank must be >= 1, got {stages_per_rank}")
    if single_stage and stages_per_rank != 1:
        raise ValueError(
            f"{name} runs one stage per rank, got stages_per_rank={stages_per_rank} "
            f"({pp * stages_per_rank} stages on pp={pp}); split the model into {pp} stages, or use a multi-stage "
            "schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)"
        )


def _microbatches_per_round(name: str, pp: int, num_microbatches: int) -> int:
    """Interleaved schedules run microbatches in rounds; every round has the same size (torch's flex rule)."""
    rounds = max(1, num_microbatches // pp)
    if num_microbatches % rounds != 0:
        below = max(m for m in range(1, num_microbatches) if m % max(1, m // pp) == 0)
        above = next(m for m in range(num_microbatches + 1, 2 * num_microbatches + pp) if m % max(1, m // pp) == 0)
        raise ValueError(
            f"{name} runs microbatches in equal rounds: rounds = max(1, microbatches({num_microbatches}) // "
            f"pp({pp})) = {rounds}, and {num_microbatches} % {rounds} = {num_microbatches % rounds} != 0; use "
            f"{below} or {above} microbatches (a multiple of pp, or at most pp, always works), i.e. change "
            "training.local_batch_size or pipeline_parallel_microbatch_size"
        )
    return num_microbatches // rounds


def _interleaved_rank(
    pp: int, n_local: int, num_microbatches: int, per_round: int, rank: int, zero_bubble: bool
) -> list[Action | None]:
    """One rank of interleaved 1F1B / ZB1P: warm-up forwards, steady F + B (or F + I [+ W]), cool-down backwards.

    A port of torch's ``_get_warmup_ops`` + ``_get_1f1b_rank_ops``: the local stage of step ``k`` advances every
    ``per_round`` steps, forwards through the rank's stages in order and backwards in reverse.
    """
    hop_factor = 1 if zero_bubble else 2  # a forward and a backward per hop, or only the forward
    warmup = min((n_local - 1) * per_round + hop_factor * (pp - 1 - rank), num_microbatches * n_local)
    microbatch_ops = n_local * num_microbatches
    steady = microbatch_ops - warmup

    def forward_stage(step: int) -> int:
        return (step // per_round) % n_local * pp + rank

    def backward_stage(step: int) -> int:
        return (n_local - 1 - (step - warmup) // per_round % n_local) * pp + rank

    # Idle steps so every rank's first backward lines up (pure layout, as torch's grid).
    post_warmup = pp - 1 - rank if zero_bubble else n_local * pp + 2 * (pp - 1 - rank) - warmup - rank
    next_mb: dict[tuple[int, ActionKind], int] = defaultdict(int)

    def take(stage: int, kind: ActionKind) -> Action:
        mb = next_mb[stage, kind]
        next_mb[stage, kind] = mb + 1
        return Action(stage, kind, mb)

    backward_kind = I if zero_bubble else B
    backward_stages: list[int] = []  # stage of each backward, in order; a W later repeats them oldest first
    weights_done = 0
    actions: list[Action | None] = [None] * rank
    for step in range(warmup + microbatch_ops):
        if step < warmup:
            actions.append(take(forward_stage(step), F))
            if step == warmup - 1:
                actions += [None] * post_warmup
            continue
        if step < warmup + steady:
            actions.append(take(forward_stage(step), F))
        elif not zero_bubble:
            actions.append(None)  # cool-down: one idle step per backward, in step with the other ranks
        actions.append(take(backward_stage(step), backward_kind))
        backward_stages.append(backward_stage(step))
        # ZB1P: rank r runs its first r backwards without W, then one W after each I, oldest first.
        if zero_bubble and step - warmup >= rank:
            actions.append(take(backward_stages[weights_done], W))
            weights_done += 1
    if zero_bubble:
        actions += [take(stage, W) for stage in backward_stages[weights_done:]]
    return actions


def _pad_forward_waits(order: Schedule) -> Schedule:
    """Insert idle steps where a forward would run before its input exists (torch's ``_add_bubbles_to_actions``).

    Walks all ranks one step at a time; an F whose previous stage has not run that microbatch in an earlier step
    waits. Only the printed grid changes: the order of actions on every rank stays the same.
    """
    seen: set[tuple[int, int]] = set()  # (stage, microbatch) forwards done in earlier steps
    pointer = dict.fromkeys(order, 0)
    padded: Schedule = {rank: [] for rank in order}
    while any(pointer[rank] < len(order[rank]) for rank in order):
        done_now: set[tuple[int, int]] = set()
        advanced = False
        for rank in sorted(order):
            if pointer[rank] >= len(order[rank]):
                continue
            action = order[rank][pointer[rank]]
            if action is not None and action.kind is F and action.stage != 0:
                if (action.stage - 1, action.microbatch) not in seen:
                    padded[rank].append(None)  # wait a step for the input
                    continue
            padded[rank].append(action)
            pointer[rank] += 1
            advanced = True
            if action is not None and action.kind is F and action.microbatch is not None:
                done_now.add((action.stage, action.microbatch))
        # Every rank waiting and none advancing means an F waits for a forward that no rank will run.
        waiting = {r: str(order[r][pointer[r]]) for r in order if pointer[r] < len(order[r])}
        assert advanced, f"forwards wait on each other: {waiting}"
        seen |= done_now
    return padded


def _zbv_rank(pp: int, num_microbatches: int, rank: int) -> list[Action | None]:
    """One rank of ZB-V, a port of torch's ``ScheduleZBVZeroBubble._calculate_single_rank_operations``."""
    n_micro = max(2 * pp - 1, num_microbatches)
    chunk0, chunk1 = rank, 2 * pp - 1 - rank  # the V: down through chunk 0, back up through chunk 1
    order = _RankOrder([None] * rank)
    add, counts = order.add, order.counts
    for _ in range(2 * (pp - rank) - 1):  # warm-up 1: forwards of chunk 0 until the first reaches the turn
        add(chunk0, F)
    for _ in range(rank):  # warm-up 2: alternate the two chunks
        add(chunk1, F)
        add(chunk0, F)
    for _ in range(pp - rank):  # warm-up 3: chunk 1 runs forward, then its whole backward
        add(chunk1, F)
        add(chunk1, I)
        add(chunk1, W)
    while counts[chunk1, F] < counts[chunk0, F] or counts[chunk0, F] < n_micro:  # steady state
        if counts[chunk0, F] < n_micro:
            add(chunk0, F)
        add(chunk0, I)
        add(chunk0, W)
        add(chunk1, F)
        add(chunk1, I)
        add(chunk1, W)
    for _ in range(rank):  # cool-down: input grads first, weight grads fill the tail
        add(chunk0, I)
        add(chunk1, I)
    for _ in range(pp - rank):
        add(chunk0, I)
        add(chunk0, W)
    while counts[chunk1, W] < counts[chunk1, I]:
        add(chunk1, W)
    while counts[chunk0, W] < counts[chunk0, I]:
        add(chunk0, W)
    # Built for n_micro >= 2 pp - 1 microbatches; the extra ones become idle steps.
    return [
        a if a is not None and a.microbatch is not None and a.microbatch < num_microbatches else None
        for a in order.actions
    ]


def _dual_pipe_v_rank(pp: int, num_microbatches: int, rank: int) -> list[Action | None]:
    """One rank of DualPipeV, a port of torch's ``ScheduleDualPipeV._calculate_single_rank_operations``."""
    chunk0, chunk1 = rank, 2 * pp - 1 - rank
    order = _RankOrder([])
    add, add_weight = order.add, order.add_weight

    def add_pair(forward_stage: int, backward_stage: int) -> None:  # torch's OVERLAP_F_B, run in sequence
        add(forward_stage, F)
        add(backward_stage, B)

    for _ in range(2 * (pp - rank - 1)):  # 1: chunk 0 forwards
        add(chunk0, F)
    for _ in range(rank + 1):  # 2: both chunks forward
        add(chunk0, F)
        add(chunk1, F)
    for _ in range(pp - rank - 1):  # 3: chunk 1 zero bubble (I, a pending W, F)
        add(chunk1, I)
        add_weight()
        add(chunk1, F)
    for step in range(num_microbatches - 2 * pp + rank + 1):  # 4: the steady pairs
        if step == 0 and rank == pp - 1:  # the turn of the V: not paired, a smaller bubble
            add(chunk0, F)
            add(chunk1, B)
        else:
            add_pair(chunk0, chunk1)
        add_pair(chunk1, chunk0)
    for _ in range(pp - rank - 1):  # 5: chunk 1 backward, chunk 1 forward with chunk 0 backward
        add(chunk1, B)
        add_pair(chunk1, chunk0)
    split = False  # 6: both chunks' backwards; the second half splits into I and a later W
    for step in range(rank + 1):
        split = split or (step == (rank + 1) // 2 and rank % 2 == 1)
        add(chunk1, I if split else B)
        split = split or (step == (rank + 1) // 2 and rank % 2 == 0)
        add(chunk0, I if split else B)
    for _ in range(pp - rank - 1):  # 7: a W, then chunk 0's next backward
        add_weight()
        add(chunk0, I if split else B)
    for _ in range(rank + 1):  # 8: the weight gradients left
        add_weight()
    return order.actions


@dataclass
class _RankOrder:
    """One rank's actions as a V schedule writes them: each (stage, kind) numbers its microbatches in order; a
    B counts as both halves of its microbatch (the I and the W numbers advance together), and an I queues its W
    for ``add_weight``, which takes the oldest."""

    actions: list[Action | None]
    counts: dict[tuple[int, ActionKind], int] = field(default_factory=lambda: defaultdict(int))
    weights_due: list[Action] = field(default_factory=list)

    def add(self, stage: int, kind: ActionKind) -> None:
        mb = self.counts[stage, I] if kind is B else self.counts[stage, kind]
        self.actions.append(Action(stage, kind, mb))
        if kind is B:
            self.counts[stage, I] += 1
            self.counts[stage, W] += 1
            return
        self.counts[stage, kind] += 1
        if kind is I:
            self.weights_due.append(Action(stage, W, mb))

    def add_weight(self) -> None:
        if self.weights_due:
            action = self.weights_due.pop(0)
            self.actions.append(action)
            self.counts[action.stage, W] += 1
