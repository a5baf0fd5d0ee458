"""Lowering a compute-only schedule into the list a rank runs: transfers, and optionally the FSDP steps.

The passes are torch's pipelining package's (``_add_unshard_reshard``, ``_add_reduce_grad``, ``_add_send_recv``)
and give the same lists, so a schedule lowered here runs like torch's ``_PipelineScheduleRuntime``:

- :func:`add_send_recv`: after an F whose next stage lives on another rank, ``SEND_F`` here and ``RECV_F`` on that
  rank; after a B or I whose previous stage lives elsewhere, ``SEND_B`` / ``RECV_B``. Nothing between two stages on
  the same rank (the V's turn, or one rank owning consecutive stages of a custom placement). A receive is placed on
  its rank as soon as the send is, so the k-th send on a pair of ranks meets the k-th receive.
- :func:`add_unshard_reshard`: all-gather a stage's parameters before the rank's next computes on it, keep at most
  ``max_active_stages`` stages unsharded, free the others.
- :func:`add_reduce_grad`: one ``REDUCE_GRAD`` per stage right after its last backward (B or W), which is where the
  gradient of the whole step is complete and can be reduce-scattered once.
- :func:`defer_recvs` (optional, after the others): each RECV moved to just before its consumer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from .actions import Action, ActionKind, Schedule

__all__ = ["add_reduce_grad", "add_send_recv", "add_unshard_reshard", "defer_recvs", "lower_schedule"]

K = ActionKind


def lower_schedule(
    schedule: Schedule,
    stage_to_rank: Mapping[int, int],
    num_microbatches: int,
    *,
    unshard_reshard: bool = False,
    reduce_grad: bool = False,
) -> Schedule:
    """Compute-only schedule -> per-rank lists with SEND/RECV (and FSDP steps when asked), idle steps dropped.

    With both FSDP flags this is torch's ``_prepare_schedule_with_comms`` lowering, action for action.
    """
    for rank, actions in schedule.items():
        for index, action in enumerate(actions):
            if action is not None and not action.kind.is_compute:
                raise ValueError(
                    f"rank {rank} step {index}: {action} in a compute-only schedule; lowering adds the SEND/RECV "
                    "and FSDP actions itself, so give only F, B, I and W (or simulate the full lists as they are)"
                )
    lists: dict[int, list[Action | None]] = dict(schedule)
    if unshard_reshard:
        lists = {rank: list(add_unshard_reshard(actions)) for rank, actions in lists.items()}
    if reduce_grad:
        lists = {rank: list(add_reduce_grad(actions, num_microbatches)) for rank, actions in lists.items()}
    num_stages = max(stage_to_rank) + 1
    lowered = add_send_recv(lists, stage_to_rank, num_stages)
    return {rank: list[Action | None](actions) for rank, actions in lowered.items()}


def add_reduce_grad(actions: list[Action | None], num_microbatches: int) -> list[Action]:
    """Append ``<stage>REDUCE_GRAD`` right after the stage's ``num_microbatches``-th B or W; drops idle steps."""
    lowered: list[Action] = []
    backwards: dict[int, int] = defaultdict(int)
    for action in actions:
        if action is None:
            continue
        lowered.append(action)
        if action.kind in (K.B, K.W):
            backwards[action.stage] += 1
            if backwards[action.stage] == num_microbatches:
                lowered.append(Action(action.stage, K.REDUCE_GRAD))
    return lowered


def add_unshard_reshard(actions: list[Action | None], max_active_stages: int = 3) -> list[Action]:
    """Prefetch the parameters of the next ``max_active_stages`` stages the rank computes on; free the rest.

    Before each compute action, the stages among the next ``max_active_stages`` distinct ones that are not yet
    unsharded get ``UNSHARD`` (in the order they will be used), and unsharded stages not among them ``RESHARD``.
    Everything still unsharded is resharded at the end. Drops idle steps.
    """
    compute = [a for a in actions if a is not None]
    # A set, iterated like torch's, so the RESHARDs of one step come in torch's order too.
    active: set[int] = set()
    lowered: list[Action] = []
    for index, action in enumerate(compute):
        upcoming = _next_stages(compute[index:], max_active_stages)
        for stage in [s for s in active if s not in upcoming]:
            active.remove(stage)
            lowered.append(Action(stage, K.RESHARD))
        for stage in [s for s in upcoming if s not in active]:
            active.add(stage)
            lowered.append(Action(stage, K.UNSHARD))
        lowered.append(action)
    lowered += [Action(stage, K.RESHARD) for stage in active]
    return lowered


def _next_stages(actions: list[Action], count: int) -> list[int]:
    stages: list[int] = []
    for action in actions:
        if action.stage not in stages:
            stages.append(action.stage)
            if len(stages) == count:
                break
    return stages


def add_send_recv(
    schedule: Mapping[int, list[Action | None]], stage_to_rank: Mapping[int, int], num_stages: int
) -> dict[int, list[Action]]:
    """Add SEND_F/RECV_F/SEND_B/RECV_B between adjacent stages on different ranks (torch's ``_add_send_recv``).

    Ranks are visited round-robin; a rank's next compute action is placed once its input is on the rank (its RECV
    placed, or the producing stage is local and has run), and its send goes right after it with the matching
    receive appended to the peer's list at the same moment. Raises when no rank can place its next action.
    """
    pending = {rank: [a for a in actions if a is not None] for rank, actions in schedule.items()}
    lowered: dict[int, list[Action]] = {rank: [] for rank in schedule}
    placed: dict[int, set[Action]] = {rank: set() for rank in schedule}

    def place(rank: int, action: Action) -> None:
        lowered[rank].append(action)
        placed[rank].add(action)

    while any(pending.values()):
        progress = False
        for rank in sorted(pending):
            if not pending[rank]:
                continue
            action = pending[rank][0]
            if not _input_ready(action, placed[rank], num_stages):
                continue
            place(rank, action)
            transfer = _transfer(action, stage_to_rank, num_stages)
            if transfer is not None:
                send, recv = transfer
                place(rank, send)
                place(stage_to_rank[recv.stage], recv)
            pending[rank].pop(0)
            progress = True
        if not progress:
            stuck = "; ".join(f"rank {r} at {acts[0]}" for r, acts in sorted(pending.items()) if acts)
            raise ValueError(
                f"cannot place the transfers: every rank's next action waits for an input no rank sends ({stuck}); "
                "check that each F follows the F of the previous stage and each B/I the B/I of the next stage "
                "for the same microbatch in an order the ranks can reach"
            )
    return lowered


def _input_ready(action: Action, placed: set[Action], num_stages: int) -> bool:
    """Is the input of ``action`` on its rank: received, or produced by an earlier local action?"""
    mb = action.microbatch
    if action.kind is K.F and action.stage != 0:
        return Action(action.stage, K.RECV_F, mb) in placed or Action(action.stage - 1, K.F, mb) in placed
    if action.kind.is_backward and action.stage != num_stages - 1:
        return (
            Action(action.stage, K.RECV_B, mb) in placed
            or Action(action.stage + 1, K.I, mb) in placed
            or Action(action.stage + 1, K.B, mb) in placed
        )
    return True


def _transfer(action: Action, stage_to_rank: Mapping[int, int], num_stages: int) -> tuple[Action, Action] | None:
    """(send, recv) carrying the output of ``action`` to the adjacent stage, when that stage is on another rank."""
    stage, mb = action.stage, action.microbatch
    if action.kind is K.F and stage != num_stages - 1 and stage_to_rank[stage + 1] != stage_to_rank[stage]:
        return Action(stage, K.SEND_F, mb), Action(stage + 1, K.RECV_F, mb)
    if action.kind.is_backward and stage != 0 and stage_to_rank[stage - 1] != stage_to_rank[stage]:
        return Action(stage, K.SEND_B, mb), Action(stage - 1, K.RECV_B, mb)
    return None


def defer_recvs(
    schedule: Mapping[int, list[Action | None]], stage_to_rank: Mapping[int, int]
) -> dict[int, list[Action]]:
    """Move each RECV of a lowered schedule as late as it can go: right before its consumer (torch's ``defer_pp_recv``).

    A RECV posted long before it is needed makes a rank that waits on its p2p ops (``P2PMode.BATCHED`` /
    ``BLOCKING``) idle for nothing. As torch's ``_defer_recv_ops``, before sending to a higher rank a rank first posts
    the receives it deferred from that rank, so of two neighbours the lower one receives first (pytorch#172668).
    Unlike it, a receive is never moved past an earlier receive from the same rank: c10d matches a pair of ranks'
    sends and receives in posting order, and on a V placement one pair carries both activations and gradients.
    """
    return {rank: _defer_rank(rank, actions, stage_to_rank) for rank, actions in schedule.items()}


def _defer_rank(rank: int, actions: list[Action | None], stage_to_rank: Mapping[int, int]) -> list[Action]:
    deferred: list[Action] = []  # in posting order
    out: list[Action] = []

    def flush(peer: int, upto: Action | None = None) -> None:
        """Post the deferred receives from ``peer``, oldest first, through ``upto`` (all when None)."""
        from_peer = [r for r in deferred if _recv_peer(r, stage_to_rank) == peer]
        if upto is not None:
            from_peer = from_peer[: from_peer.index(upto) + 1]
        out.extend(from_peer)
        for recv in from_peer:
            deferred.remove(recv)

    for action in (a for a in actions if a is not None):
        if action.kind in (K.RECV_F, K.RECV_B):
            deferred.append(action)
            continue
        if action.kind in (K.SEND_F, K.SEND_B):
            peer = stage_to_rank[action.stage + 1 if action.kind is K.SEND_F else action.stage - 1]
            if rank < peer:
                flush(peer)
        consumed = _consumed_recv(action)
        if consumed in deferred:
            flush(_recv_peer(consumed, stage_to_rank), upto=consumed)
        out.append(action)
    if deferred:
        raise ValueError(
            f"rank {rank}: {', '.join(map(str, deferred))} received but never used; every RECV feeds an F, B or I"
        )
    return out


def _recv_peer(recv: Action, stage_to_rank: Mapping[int, int]) -> int:
    return stage_to_rank[recv.stage - 1 if recv.kind is K.RECV_F else recv.stage + 1]


def _consumed_recv(action: Action) -> Action | None:
    if action.kind is K.F:
        return Action(action.stage, K.RECV_F, action.microbatch)
    if action.kind.is_backward:
        return Action(action.stage, K.RECV_B, action.microbatch)
    return None
