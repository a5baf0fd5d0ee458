"""Lowering adds the transfers and FSDP steps exactly as torch's _PipelineScheduleRuntime does."""

from __future__ import annotations

from collections import Counter

import pytest

from parallelisms.pipeline_parallel import (
    Action,
    ActionKind,
    DeadlockError,
    P2PMode,
    add_reduce_grad,
    defer_recvs,
    dual_pipe_v,
    get_schedule,
    gpipe,
    lower_schedule,
    one_f_one_b,
    simulate,
    stage_to_rank,
    zbv_zero_bubble,
)
from tests.pipeline_parallel.torch_oracle import build_torch_schedule, from_torch, torch_lowered_order

K = ActionKind
CASES = [
    (name, pp, spr, m)
    for name in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
    for pp, spr, m in [(2, 2, 4), (2, 3, 3), (4, 2, 8), (4, 2, 6), (4, 1, 5)]
]
CASES += [("ZBVZeroBubble", pp, 2, m) for pp, m in [(2, 4), (2, 3), (4, 8), (4, 5)]]


@pytest.mark.parametrize(("name", "pp", "stages_per_rank", "num_microbatches"), CASES)
def test_lowering_equals_torch_pipeline_order_with_comms(
    name: str, pp: int, stages_per_rank: int, num_microbatches: int
) -> None:
    spec = get_schedule(name)
    compute = spec.generate(pp, stages_per_rank, num_microbatches)
    placement = stage_to_rank(pp, stages_per_rank, spec.placement)
    lowered = lower_schedule(compute, placement, num_microbatches, unshard_reshard=True, reduce_grad=True)
    assert lowered == torch_lowered_order(name, pp, stages_per_rank, num_microbatches)


@pytest.mark.parametrize(("pp", "num_microbatches"), [(2, 4), (2, 7), (3, 6), (4, 8), (4, 11)])
def test_dual_pipe_v_lowering_is_torchs_with_each_pair_sending_between_its_halves(
    pp: int, num_microbatches: int
) -> None:
    # torch lowers an OVERLAP_F_B as one action: both halves' receives before it, both sends after. Ours lowers
    # the pair as the forward and the backward it runs: the forward's send goes out before the backward. The
    # same actions per rank, the same compute order, and never a later finish.
    placement = stage_to_rank(pp, 2, "v")
    ours = lower_schedule(
        dual_pipe_v(pp, 2, num_microbatches), placement, num_microbatches, unshard_reshard=True, reduce_grad=True
    )
    theirs = torch_lowered_order("DualPipeV", pp, 2, num_microbatches)
    for rank in ours:
        assert Counter(ours[rank]) == Counter(theirs[rank]), rank
        computes = [[a for a in order[rank] if a is not None and a.kind.is_compute] for order in (ours, theirs)]
        assert computes[0] == computes[1], rank
    assert ours != theirs
    for mode in P2PMode:
        simulate(ours, p2p=mode)  # no deadlock, however the transfers are issued
    assert simulate(ours).makespan <= simulate(theirs).makespan


def test_every_send_has_its_recv_on_the_peer_rank() -> None:
    pp, m = 4, 8
    lowered = lower_schedule(zbv_zero_bubble(pp, 2, m), stage_to_rank(pp, 2, "v"), m)
    sends = Counter((a.stage, a.kind, a.microbatch) for acts in lowered.values() for a in acts if a and a.kind.is_comm)
    for (stage, kind, mb), count in sends.items():
        peer = {K.SEND_F: (stage + 1, K.RECV_F), K.SEND_B: (stage - 1, K.RECV_B)}.get(kind)
        if peer is not None:
            assert count == 1 and sends[(peer[0], peer[1], mb)] == 1


def test_no_transfers_between_stages_on_the_same_rank() -> None:
    # ZB-V's turn: stages pp-1 and pp both live on the last rank, so nothing is sent between them.
    pp, m = 4, 8
    lowered = lower_schedule(zbv_zero_bubble(pp, 2, m), stage_to_rank(pp, 2, "v"), m)
    comms = {(a.stage, a.kind) for acts in lowered.values() for a in acts if a is not None and a.kind.is_comm}
    assert (pp - 1, K.SEND_F) not in comms and (pp, K.RECV_F) not in comms
    assert (pp, K.SEND_B) not in comms and (pp - 1, K.RECV_B) not in comms
    assert (pp, K.SEND_F) in comms and (0, K.RECV_B) in comms  # ...but everywhere else
    single = lower_schedule(gpipe(1, 1, 4), {0: 0}, 4)
    assert not any(a is not None and a.kind.is_comm for a in single[0])


def test_reduce_grad_once_per_stage_after_its_last_backward() -> None:
    pp, m = 4, 8
    lowered = lower_schedule(
        get_schedule("InterleavedZeroBubble").generate(pp, 2, m), stage_to_rank(pp, 2), m, reduce_grad=True
    )
    for rank, lowered_actions in lowered.items():
        actions = [a for a in lowered_actions if a is not None and not a.kind.is_comm]  # RECVs land anywhere
        for stage in (rank, rank + pp):
            reduce_at = [i for i, a in enumerate(actions) if a == Action(stage, K.REDUCE_GRAD)]
            weights = [i for i, a in enumerate(actions) if a is not None and a.stage == stage and a.kind is K.W]
            assert len(reduce_at) == 1 and reduce_at[0] == weights[-1] + 1
    assert add_reduce_grad([Action(0, K.F, 0), None, Action(0, K.B, 0)], 1)[-1] == Action(0, K.REDUCE_GRAD)


def test_lowering_refuses_actions_it_adds_itself() -> None:
    with pytest.raises(ValueError, match=r"rank 0 step 1: 0SEND_F0 in a compute-only schedule"):
        lower_schedule({0: [Action(0, K.F, 0), Action(0, K.SEND_F, 0)], 1: []}, {0: 0, 1: 1}, 1)


def test_lowering_names_the_ranks_when_inputs_never_arrive() -> None:
    # Rank 1 wants microbatch 1 first, rank 0 never sends it before waiting on microbatch 0's gradient.
    cyclic = {0: [Action(0, K.F, 0), Action(0, K.B, 0), Action(0, K.F, 1), Action(0, K.B, 1)]}
    cyclic[1] = [Action(1, K.F, 1), Action(1, K.B, 1), Action(1, K.F, 0), Action(1, K.B, 0)]
    with pytest.raises(ValueError, match=r"rank 0 at 0B0; rank 1 at 1F1"):
        lower_schedule(cyclic, {0: 0, 1: 1}, 2)


@pytest.mark.parametrize(("name", "pp", "stages_per_rank", "num_microbatches"), CASES)
def test_defer_recvs_equals_torch_unless_torch_reorders_a_pair_of_ranks(
    name: str, pp: int, stages_per_rank: int, num_microbatches: int
) -> None:
    # torch's defer_pp_recv may move a receive past an earlier one from the same rank (ZB-V, and ZB1P on pp 2,
    # where one pair of ranks carries activations and gradients); c10d matches in order, so that pairs the
    # wrong tensors. Ours keeps each pair in order and equals torch's wherever torch's does.
    spec = get_schedule(name)
    placement = stage_to_rank(pp, stages_per_rank, spec.placement)
    compute = spec.generate(pp, stages_per_rank, num_microbatches)
    lowered = lower_schedule(compute, placement, num_microbatches, unshard_reshard=True, reduce_grad=True)
    ours = defer_recvs(lowered, placement)
    simulate(ours)
    torch_order = build_torch_schedule(name, pp, stages_per_rank, num_microbatches, defer_pp_recv=True)
    theirs = {rank: from_torch(actions) for rank, actions in torch_order.pipeline_order_with_comms.items()}
    if ours != theirs:
        assert name in ("ZBVZeroBubble", "InterleavedZeroBubble")
        with pytest.raises(ValueError, match="p2p mismatch"):
            simulate(theirs)


def test_deferred_recvs_keep_ranks_busy_when_p2p_ops_are_waited() -> None:
    # Eager receives are fine for isend/irecv (ASYNC), but a rank that waits on its batch of p2p ops stalls on a
    # receive it does not need yet; deferring them restores the 1F1B makespan. Blocking sends still deadlock.
    pp, m = 4, 8
    placement = stage_to_rank(pp, 1)
    eager = lower_schedule(one_f_one_b(pp, 1, m), placement, m)
    deferred = defer_recvs(eager, placement)
    makespan = {mode: simulate(eager, p2p=mode).makespan for mode in P2PMode}
    assert makespan == {P2PMode.ASYNC: 33.0, P2PMode.BATCHED: 45.0, P2PMode.BLOCKING: 45.0}
    assert simulate(deferred, p2p="batched").makespan == simulate(deferred).makespan == 33.0
    with pytest.raises(DeadlockError, match="ranks 0, 1, 2, 3 wait forever"):
        simulate(deferred, p2p="blocking")
