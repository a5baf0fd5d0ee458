"""Run every rank's action list without processes: deadlocks, timelines, the bubble and activation peaks.

Each rank runs its list in order, one action at a time. A compute action starts when the rank is free and its
input exists: F of stage s and microbatch m needs F of s - 1 for m, a B or I needs the B or I of s + 1 for m and its
own F, a W its I. Across ranks the input arrives by a RECV when the lists carry SEND/RECV actions (a lowered
schedule); a compute-only schedule gets its inputs directly, at the producer's end plus the transfer cost.

Point-to-point matching is FIFO per ordered pair of ranks, as c10d matches untagged isend/irecv: the k-th send from
rank a to rank b meets the k-th receive on b from a, and must carry the same stage and microbatch. A matched pair
completes ``Costs.transfer`` after the later of the two posts. ``P2PMode`` says when a rank waits:

- ``ASYNC``: a SEND or RECV is posted and the rank moves on; the consumer of a RECV waits for it (torch's
  ``_PipelineScheduleRuntime``, isend/irecv). Unmatched posts at the end of the step hang the final wait.
- ``BATCHED``: consecutive SEND/RECV actions are one ``batch_isend_irecv``; the rank waits for the whole batch.
- ``BLOCKING``: every SEND/RECV waits for its peer (send/recv).

A rank that can never proceed is a deadlock, reported with every stuck rank and what it waits for in one message.
Activations of (stage, microbatch) live from its F until its B, or its W when the backward is split.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from .actions import Action, ActionKind, Schedule

__all__ = ["Costs", "DeadlockError", "Interval", "P2PMode", "SimulationResult", "format_timeline", "simulate"]

K = ActionKind


class P2PMode(StrEnum):
    ASYNC = "async"
    BATCHED = "batched"
    BLOCKING = "blocking"


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Duration of each action kind, in arbitrary units (a stage's forward is 1 by default)."""

    forward: float = 1.0
    backward: float = 2.0
    """A full backward: input and weight gradients, about twice a forward."""
    backward_input: float = 1.0
    backward_weight: float = 1.0
    transfer: float = 0.0
    """A matched SEND/RECV pair (or an implicit transfer in a compute-only schedule)."""
    unshard: float = 0.0
    reshard: float = 0.0
    reduce_grad: float = 0.0

    def of(self, kind: ActionKind) -> float:
        """The duration of one action of ``kind`` (SEND/RECV: 0, their pair costs ``transfer``)."""
        return {
            K.F: self.forward,
            K.B: self.backward,
            K.I: self.backward_input,
            K.W: self.backward_weight,
            K.UNSHARD: self.unshard,
            K.RESHARD: self.reshard,
            K.REDUCE_GRAD: self.reduce_grad,
        }.get(kind, 0.0)


@dataclass(frozen=True)
class Interval:
    """``action`` ran on its rank from ``start`` to ``end`` (a SEND/RECV: from its post to its completion)."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` found: when each action ran, the makespan, and the activation peaks."""

    timelines: Mapping[int, tuple[Interval, ...]]
    """Per rank, its actions in the order they ran, with times."""
    makespan: float
    busy: Mapping[int, float]
    """Per rank, time spent in F, B, I and W."""
    peak_activations: Mapping[int, int]
    """Per stage, the most microbatches whose activations were alive at once."""
    peak_activations_per_rank: Mapping[int, int]
    """Per rank, the same summed over its stages."""

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time: ``1 - sum(busy) / (pp * makespan)``; (p-1)/(m+p-1) for GPipe and 1F1B."""
        if self.makespan == 0:
            return 0.0
        return 1.0 - sum(self.busy.values()) / (len(self.busy) * self.makespan)


class DeadlockError(ValueError):
    """No rank can proceed; ``stuck`` maps each waiting rank to the action it waits at."""

    def __init__(self, message: str, stuck: Mapping[int, Action]) -> None:
        super().__init__(message)
        self.stuck = dict(stuck)


def simulate(
    schedule: Schedule,
    costs: Costs = Costs(),
    p2p: P2PMode | str = P2PMode.ASYNC,
    stage_to_rank: Mapping[int, int] | None = None,
) -> SimulationResult:
    """Run ``schedule`` (compute-only, or lowered with SEND/RECV and FSDP actions) on every rank at once.

    ``stage_to_rank`` defaults to the placement the actions imply. Raises :class:`DeadlockError` when ranks wait
    on each other forever, and ValueError for an order no runtime can execute (a SEND before its F, a compute on a
    resharded stage, mismatched p2p pairs).
    """
    return _Simulation(schedule, costs, P2PMode(p2p), stage_to_rank).run()


def format_timeline(result: SimulationResult, unit: float = 1.0) -> str:
    """The simulated timeline, one row per rank and one cell per ``unit`` of time.

    A compute action shows its label in its first cell and ``-`` over the rest; ``.`` is idle (the bubble).
    """
    steps = int(round(result.makespan / unit))
    computes = [iv for tl in result.timelines.values() for iv in tl if iv.action.kind.is_compute]
    width = max((len(str(iv.action)) for iv in computes), default=1)
    lines = []
    for rank, timeline in result.timelines.items():
        cells = ["." * width] * steps
        for iv in timeline:
            first, last = int(round(iv.start / unit)), int(round(iv.end / unit))
            if not iv.action.kind.is_compute or last == first:
                continue
            cells[first] = str(iv.action).ljust(width)
            for cell in range(first + 1, last):
                cells[cell] = "-" * width
        lines.append(f"rank {rank} | " + " ".join(cells))
    return "\n".join(lines)


@dataclass
class _Post:
    action: Action
    time: float
    peer_rank: int
    channel: tuple[int, int]  # (src rank, dst rank)
    index: int  # position in the channel: the k-th send meets the k-th receive
    done: float | None = None  # completion time, once matched


@dataclass
class _Rank:
    actions: list[tuple[int, Action]]  # (step in the given list, action), idle steps dropped
    pc: int = 0
    clock: float = 0.0
    batch: list[_Post] | None = None  # posted and not yet complete (BATCHED / BLOCKING)
    timeline: list[Interval] = field(default_factory=list)


class _Simulation:
    def __init__(self, schedule: Schedule, costs: Costs, p2p: P2PMode, stage_to_rank: Mapping[int, int] | None) -> None:
        self.costs, self.p2p = costs, p2p
        self.ranks = {r: _Rank([(i, a) for i, a in enumerate(schedule[r]) if a is not None]) for r in sorted(schedule)}
        self.stage_to_rank = dict(stage_to_rank) if stage_to_rank is not None else _infer_placement(schedule)
        self.num_stages = max(self.stage_to_rank, default=-1) + 1
        every = [a for r in self.ranks.values() for _, a in r.actions]
        self.uses_comms = any(a.kind.is_comm for a in every)
        self.uses_unshard = any(a.kind is K.UNSHARD for a in every)
        self.forwards: dict[int, int] = defaultdict(int)  # per stage: its microbatch count
        for a in every:
            if a.kind is K.F:
                self.forwards[a.stage] += 1
        self.finished: dict[Action, float] = {}  # compute and FSDP actions -> end time
        self.posts: dict[tuple[int, Action], _Post] = {}  # (rank, comm action) -> its post
        self.channels: dict[tuple[int, int, bool], list[_Post]] = defaultdict(list)  # (src, dst, is_send)
        self.unsharded: set[int] = set()
        self.backwards_done: dict[int, int] = defaultdict(int)
        self.reduced: set[int] = set()
        self.live: dict[int, int] = defaultdict(int)  # per stage: microbatches with activations alive
        self.live_rank: dict[int, int] = defaultdict(int)
        self.peak: dict[int, int] = defaultdict(int)
        self.peak_rank: dict[int, int] = defaultdict(int)

    def run(self) -> SimulationResult:
        while not all(state.pc == len(state.actions) for state in self.ranks.values()):
            progress = False
            for rank in self.ranks:
                while self._advance(rank):
                    progress = True
            if not progress:
                raise self._deadlock()
        unmatched = [p for p in self.posts.values() if p.done is None]
        if unmatched:  # ASYNC only: the end-of-step wait on these never returns
            raise self._deadlock()
        timelines = {r: tuple(s.timeline) for r, s in self.ranks.items()}
        ends = [iv.end for tl in timelines.values() for iv in tl]
        busy = {r: sum(iv.end - iv.start for iv in tl if iv.action.kind.is_compute) for r, tl in timelines.items()}
        return SimulationResult(
            timelines=timelines,
            makespan=max(ends, default=0.0),
            busy=busy,
            peak_activations={s: self.peak[s] for s in range(self.num_stages)},
            peak_activations_per_rank={r: self.peak_rank[r] for r in self.ranks},
        )

    # -- one step of one rank -------------------------------------------------------------------------------

    def _advance(self, rank: int) -> bool:
        state = self.ranks[rank]
        if state.pc == len(state.actions):
            return False
        step, action = state.actions[state.pc]
        self._check_owner(rank, step, action)
        if action.kind.is_comm:
            return self._advance_comm(rank)
        ready = self._input_time(rank, step, action)
        if ready is None:
            return False
        self._check_fsdp(rank, step, action)
        start = max(state.clock, ready)
        end = start + self.costs.of(action.kind)
        state.timeline.append(Interval(action, start, end))
        state.clock = end
        state.pc += 1
        self.finished[action] = end
        self._track_activations(rank, action)
        return True

    def _advance_comm(self, rank: int) -> bool:
        state = self.ranks[rank]
        if self.p2p is P2PMode.ASYNC:
            step, action = state.actions[state.pc]
            post = self._post(rank, step, action)
            state.timeline.append(Interval(action, post.time, post.time))
            state.pc += 1
            return True
        posted_now = state.batch is None
        if state.batch is None:
            run = 1
            if self.p2p is P2PMode.BATCHED:
                while state.pc + run < len(state.actions) and state.actions[state.pc + run][1].kind.is_comm:
                    run += 1
            state.batch = [self._post(rank, *state.actions[state.pc + i]) for i in range(run)]
        if any(p.done is None for p in state.batch):
            return posted_now  # posting may unblock a peer even though this rank now waits
        for post in state.batch:
            assert post.done is not None
            state.timeline.append(Interval(post.action, post.time, post.done))
        state.clock = max([state.clock] + [p.done for p in state.batch if p.done is not None])
        state.pc += len(state.batch)
        state.batch = None
        return True

    def _post(self, rank: int, step: int, action: Action) -> _Post:
        """Post a SEND or RECV at the rank's clock; match it with the peer's post at the same channel position."""
        kind, stage, mb = action.kind, action.stage, action.microbatch
        self._check_owner(rank, step, action)
        if (rank, action) in self.posts:
            raise ValueError(f"rank {rank} step {step}: {action} is posted twice; each transfer happens once")
        if kind in (K.SEND_F, K.SEND_B):
            produced_by = (
                [Action(stage, K.F, mb)] if kind is K.SEND_F else [Action(stage, K.B, mb), Action(stage, K.I, mb)]
            )
            if not any(p in self.finished for p in produced_by):
                raise ValueError(
                    f"rank {rank} step {step}: {action} sends the output of {produced_by[0]}, which rank {rank} "
                    "has not run yet; put the SEND after the action that produces it"
                )
        peer_stage = stage + 1 if kind in (K.SEND_F, K.RECV_B) else stage - 1
        if peer_stage not in self.stage_to_rank:
            raise ValueError(f"rank {rank} step {step}: {action} has no peer, stage {peer_stage} does not exist")
        peer = self.stage_to_rank[peer_stage]
        is_send = kind in (K.SEND_F, K.SEND_B)
        channel = (rank, peer) if is_send else (peer, rank)
        mine = self.channels[(*channel, is_send)]
        post = _Post(action, self.ranks[rank].clock, peer, channel, len(mine))
        mine.append(post)
        self.posts[(rank, action)] = post
        theirs = self.channels[(*channel, not is_send)]
        if post.index < len(theirs):
            self._match(post, theirs[post.index])
        return post

    def _match(self, post: _Post, other: _Post) -> None:
        send, recv = (post, other) if post.action.kind in (K.SEND_F, K.SEND_B) else (other, post)
        s = send.action
        expected = (
            Action(s.stage + 1, K.RECV_F, s.microbatch)
            if s.kind is K.SEND_F
            else Action(s.stage - 1, K.RECV_B, s.microbatch)
        )
        src, dst = send.channel
        if recv.action != expected:
            raise ValueError(
                f"p2p mismatch: send #{send.index} from rank {src} to rank {dst} is {s}, but rank {dst}'s receive "
                f"#{recv.index} from rank {src} is {recv.action} (expected {expected}); c10d matches sends and "
                "receives between two ranks in posting order, so order them the same on both ranks"
            )
        done = max(send.time, recv.time) + self.costs.transfer
        send.done = recv.done = done

    # -- what a compute action waits for ------------------------------------------------------------------------

    def _input_time(self, rank: int, step: int, action: Action) -> float | None:
        """When the input of ``action`` is on ``rank``; None while it is on its way; raises if it never can be."""
        kind, stage, mb = action.kind, action.stage, action.microbatch
        needs: list[float] = []
        if kind in (K.B, K.I, K.W):
            own = Action(stage, K.F if kind is not K.W else K.I, mb)
            if own not in self.finished:
                raise ValueError(f"rank {rank} step {step}: {action} runs before {own} on this rank")
            needs.append(self.finished[own])
        if kind is K.F and stage > 0:
            time = self._upstream(rank, step, action, [Action(stage - 1, K.F, mb)], Action(stage, K.RECV_F, mb))
        elif kind.is_backward and stage < self.num_stages - 1:
            producers = [Action(stage + 1, K.B, mb), Action(stage + 1, K.I, mb)]
            time = self._upstream(rank, step, action, producers, Action(stage, K.RECV_B, mb))
        else:
            time = 0.0
        if time is None:
            return None
        return max([time] + needs)

    def _upstream(self, rank: int, step: int, action: Action, producers: list[Action], recv: Action) -> float | None:
        producer_rank = self.stage_to_rank.get(producers[0].stage)
        done = [self.finished[p] for p in producers if p in self.finished]
        if producer_rank == rank:  # same rank: it must have run already
            if not done:
                raise ValueError(
                    f"rank {rank} step {step}: {action} needs {producers[0]} from this same rank, which has not "
                    "run it yet; order the rank's list so it comes first"
                )
            return done[0]
        if not self.uses_comms:  # compute-only: the transfer is implicit
            return done[0] + self.costs.transfer if done else None
        post = self.posts.get((rank, recv))
        if post is None:
            raise ValueError(
                f"rank {rank} step {step}: {action} needs its input from rank {producer_rank} but {recv} was not "
                "posted before it; put the RECV earlier (lower_schedule does)"
            )
        return post.done

    # -- checks and bookkeeping ---------------------------------------------------------------------------------

    def _check_owner(self, rank: int, step: int, action: Action) -> None:
        owner = self.stage_to_rank.get(action.stage)
        if owner is None:
            raise ValueError(f"rank {rank} step {step}: {action}: stage {action.stage} is not in the placement")
        if owner != rank:
            raise ValueError(f"rank {rank} step {step}: {action} is on stage {action.stage}, placed on rank {owner}")

    def _check_fsdp(self, rank: int, step: int, action: Action) -> None:
        stage, kind = action.stage, action.kind
        if kind is K.UNSHARD:
            self.unsharded.add(stage)
        elif kind is K.RESHARD:
            self.unsharded.discard(stage)
        elif kind is K.REDUCE_GRAD:
            if self.backwards_done[stage] != self.forwards[stage]:
                raise ValueError(
                    f"rank {rank} step {step}: {action} after {self.backwards_done[stage]} of its "
                    f"{self.forwards[stage]} backwards; the gradient is reduced once, after the stage's last B or W"
                )
            self.reduced.add(stage)
        else:
            if self.uses_unshard and stage not in self.unsharded:
                raise ValueError(
                    f"rank {rank} step {step}: {action} runs while stage {stage} is sharded; "
                    f"put {stage}UNSHARD before it"
                )
            if kind is K.B or kind is K.W:
                if stage in self.reduced:
                    raise ValueError(
                        f"rank {rank} step {step}: {action} runs after {stage}REDUCE_GRAD; reduce after the last "
                        "backward"
                    )
                self.backwards_done[stage] += 1

    def _track_activations(self, rank: int, action: Action) -> None:
        if action.kind is K.F:
            delta = 1
        elif action.kind is K.B or action.kind is K.W:
            delta = -1
        else:
            return
        self.live[action.stage] += delta
        self.live_rank[rank] += delta
        self.peak[action.stage] = max(self.peak[action.stage], self.live[action.stage])
        self.peak_rank[rank] = max(self.peak_rank[rank], self.live_rank[rank])

    def _deadlock(self) -> DeadlockError:
        stuck: dict[int, Action] = {}
        lines = []
        for rank, state in self.ranks.items():
            if state.pc < len(state.actions):
                step, action = state.actions[state.pc]
                stuck[rank] = action
                lines.append(f"rank {rank} step {step} ({action}): {self._waits_for(rank, action)}")
            elif waiting := [p for p in self.posts.values() if p.done is None and self._owner_of(p) == rank]:
                stuck[rank] = waiting[0].action
                lines.append(f"rank {rank} at the end of its list: {self._describe_unmatched(waiting[0])}")
        names = ", ".join(str(r) for r in stuck)
        done = sum(s.pc for s in self.ranks.values())
        total = sum(len(s.actions) for s in self.ranks.values())
        message = (
            f"pipeline schedule deadlocks ({self.p2p.value} p2p): ranks {names} wait forever, after {done} of "
            f"{total} actions ran:\n  " + "\n  ".join(lines)
        )
        return DeadlockError(message, stuck)

    def _owner_of(self, post: _Post) -> int:
        src, dst = post.channel
        return src if post.action.kind in (K.SEND_F, K.SEND_B) else dst

    def _waits_for(self, rank: int, action: Action) -> str:
        state = self.ranks[rank]
        if action.kind.is_comm:
            pending = [p for p in (state.batch or []) if p.done is None]
            return "; ".join(self._describe_unmatched(p) for p in pending) or "not posted"
        mb, stage = action.microbatch, action.stage
        if action.kind is K.F:
            producer, recv = Action(stage - 1, K.F, mb), Action(stage, K.RECV_F, mb)
        else:
            producer, recv = Action(stage + 1, K.B if action.kind is K.B else K.I, mb), Action(stage, K.RECV_B, mb)
        post = self.posts.get((rank, recv))
        if post is not None:
            return f"needs {recv}, which {self._describe_unmatched(post)}"
        return f"needs {producer} from rank {self.stage_to_rank.get(producer.stage)}"

    def _describe_unmatched(self, post: _Post) -> str:
        a = post.action
        if a.kind is K.SEND_F:
            peer_action = Action(a.stage + 1, K.RECV_F, a.microbatch)
        elif a.kind is K.RECV_F:
            peer_action = Action(a.stage - 1, K.SEND_F, a.microbatch)
        elif a.kind is K.SEND_B:
            peer_action = Action(a.stage - 1, K.RECV_B, a.microbatch)
        else:
            peer_action = Action(a.stage + 1, K.SEND_B, a.microbatch)
        return f"{a} waits for rank {post.peer_rank} to post {peer_action}"


def _infer_placement(schedule: Schedule) -> dict[int, int]:
    """``{stage: rank}`` read off the actions; a stage on two ranks is an error."""
    placement: dict[int, int] = {}
    for rank in sorted(schedule):
        for step, action in enumerate(schedule[rank]):
            if action is None:
                continue
            owner = placement.setdefault(action.stage, rank)
            if owner != rank:
                raise ValueError(
                    f"rank {rank} step {step}: {action} puts stage {action.stage} on rank {rank}, but rank {owner} "
                    "also runs it; a stage lives on one rank"
                )
    return placement
