"""The process-free simulator: every schedule runs, broken orders deadlock by name, bubbles and activation peaks."""

from __future__ import annotations

import pytest

from parallelisms.pipeline_parallel import (
    SCHEDULES,
    Action,
    ActionKind,
    Costs,
    DeadlockError,
    P2PMode,
    Schedule,
    format_timeline,
    get_schedule,
    gpipe,
    lower_schedule,
    one_f_one_b,
    schedule_from_csv,
    simulate,
    stage_to_rank,
    validate_schedule,
)

K = ActionKind
MICROBATCHES = [1, 2, 3, 5, 8, 16]
PP_DEGREES = range(1, 9)  # issue 19's grid: pp 2-8 (and 1), stages per rank 1-4, microbatches 1-16, looped and V


def _stages_per_rank(name: str) -> tuple[int, ...]:
    spec = get_schedule(name)
    return (1,) if spec.single_stage else (2,) if spec.placement.value == "v" else (1, 2, 3, 4)


def _refuses_rounds(pp: int, m: int) -> bool:
    """Interleaved1F1B and InterleavedZeroBubble split the microbatches into rounds of max(1, m // pp); m must be a
    multiple of the round (torch's rule too): 5 microbatches on pp 4, for example, are refused."""
    return m % max(1, m // pp) != 0


@pytest.mark.parametrize("pp", PP_DEGREES)
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_simulates_without_deadlock(name: str, pp: int) -> None:
    # Over stages per rank and microbatches (uneven ones too): F before B, I before W, each stage on one rank
    # (validate_schedule); the compute-only list finishes, and so does the lowered one, every SEND meeting its RECV,
    # with the same busy time. The lowered list runs in one p2p mode per (stages per rank, microbatches), the modes
    # taking turns so that each covers every pp, stages per rank and microbatch count: all three everywhere take
    # about twice as long (8.6 s measured on 2 cores, against the 10 s this grid may cost).
    spec, modes, ran, refused = get_schedule(name), list(P2PMode), 0, []
    for spr in _stages_per_rank(name):
        for i, m in enumerate(MICROBATCHES):
            try:
                compute = spec.generate(pp, spr, m)
            except ValueError:  # Interleaved rounds: 5 microbatches on pp 4 (torch refuses them too)
                refused.append((spr, m))
                continue
            placement = stage_to_rank(pp, spr, spec.placement)
            assert validate_schedule(compute, pp * spr, m) == placement
            busy = simulate(compute).busy
            lowered = lower_schedule(compute, placement, m, unshard_reshard=True, reduce_grad=True)
            mode = modes[(pp + spr + i) % len(modes)]
            assert simulate(lowered, p2p=mode).busy == busy, (spr, m, mode)
            ran += 1
    # Nothing else is refused: only the interleaved schedules' uneven rounds, and DualPipeV's fewer than 2 pp.
    rounds = name in ("Interleaved1F1B", "InterleavedZeroBubble")
    fewer = name == "DualPipeV"
    assert all(rounds and _refuses_rounds(pp, m) or fewer and m < 2 * pp for _, m in refused), refused
    assert ran == len(_stages_per_rank(name)) * len(MICROBATCHES) - len(refused) > 0


def _naive_lowering(schedule: Schedule, placement: dict[int, int]) -> Schedule:
    """Each RECV right before its consumer, each SEND right after its producer: what a hand-written loop does."""
    last = max(placement)
    lowered: Schedule = {}
    for rank, actions in schedule.items():
        out: list[Action | None] = []
        for a in (a for a in actions if a is not None):
            if a.kind is K.F and a.stage > 0 and placement[a.stage - 1] != rank:
                out.append(Action(a.stage, K.RECV_F, a.microbatch))
            if a.kind.is_backward and a.stage < last and placement[a.stage + 1] != rank:
                out.append(Action(a.stage, K.RECV_B, a.microbatch))
            out.append(a)
            if a.kind is K.F and a.stage < last and placement[a.stage + 1] != rank:
                out.append(Action(a.stage, K.SEND_F, a.microbatch))
            if a.kind.is_backward and a.stage > 0 and placement[a.stage - 1] != rank:
                out.append(Action(a.stage, K.SEND_B, a.microbatch))
        lowered[rank] = out
    return lowered


def test_blocking_sends_deadlock_1f1b_and_batching_them_does_not() -> None:
    # Megatron's reason for send_forward_recv_backward: in 1F1B's steady state rank 0 sends F1 while rank 1 sends
    # B0 back; with blocking sends each waits for the other's receive.
    naive = _naive_lowering(one_f_one_b(2, 1, 4), {0: 0, 1: 1})
    with pytest.raises(DeadlockError) as error:
        simulate(naive, p2p="blocking")
    message = str(error.value)
    print(f"\n{message}")
    assert "ranks 0, 1 wait forever" in message
    assert "rank 0 step 3 (0SEND_F1): 0SEND_F1 waits for rank 1 to post 1RECV_F1" in message
    assert "rank 1 step 3 (1SEND_B0): 1SEND_B0 waits for rank 0 to post 0RECV_B0" in message
    assert error.value.stuck == {0: Action(0, K.SEND_F, 1), 1: Action(1, K.SEND_B, 0)}
    batched, eager = simulate(naive, p2p="batched"), simulate(naive, p2p="async")
    assert batched.makespan == eager.makespan == simulate(one_f_one_b(2, 1, 4)).makespan


def test_cyclic_compute_order_deadlocks_naming_the_ranks() -> None:
    # Rank 1 starts with microbatch 1, whose forward rank 0 runs only after microbatch 0's backward.
    cyclic = schedule_from_csv("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")
    with pytest.raises(
        DeadlockError,
        match=r"(?s)ranks 0, 1 wait forever.*0B0\): needs 1B0 from rank 1.*"
        r"1F1\): needs 0F1 from rank 0",
    ):
        simulate(cyclic)


def test_send_without_receive_hangs_the_end_of_step_wait() -> None:
    # isend/irecv never block, but the step's final wait on an unmatched send does.
    lonely = {0: [Action(0, K.F, 0), Action(0, K.SEND_F, 0)], 1: []}
    with pytest.raises(
        DeadlockError, match=r"rank 0 at the end of its list: 0SEND_F0 waits for rank 1 to post 1RECV_F0"
    ):
        simulate(lonely, p2p="async", stage_to_rank={0: 0, 1: 1})


def test_mismatched_p2p_order_is_reported() -> None:
    lowered = lower_schedule(gpipe(2, 1, 2), {0: 0, 1: 1}, 2)
    recvs = [i for i, a in enumerate(lowered[1]) if a is not None and a.kind is K.RECV_F]
    lowered[1][recvs[0]], lowered[1][recvs[1]] = lowered[1][recvs[1]], lowered[1][recvs[0]]
    with pytest.raises(
        ValueError,
        match=r"send #0 from rank 0 to rank 1 is 0SEND_F0, but rank 1's receive #0 from "
        r"rank 0 is 1RECV_F1 \(expected 1RECV_F0\)",
    ):
        simulate(lowered)


def test_orders_no_runtime_can_run_are_errors() -> None:
    with pytest.raises(ValueError, match=r"0SEND_F0 sends the output of 0F0, which rank 0 has not run yet"):
        simulate(schedule_from_csv("0SEND_F0,0F0,0B0\n1RECV_F0,1F0,1B0\n"))
    with pytest.raises(ValueError, match=r"0F0 runs while stage 0 is sharded; put 0UNSHARD before it"):
        simulate(schedule_from_csv("0UNSHARD,0RESHARD,0F0,0B0\n"))
    with pytest.raises(ValueError, match=r"0REDUCE_GRAD after 1 of its 2 backwards"):
        simulate(schedule_from_csv("0F0,0F1,0B0,0REDUCE_GRAD,0B1\n"))
    with pytest.raises(ValueError, match=r"1F0 needs its input from rank 0 but 1RECV_F0 was not posted before it"):
        simulate(schedule_from_csv("0F0,0SEND_F0,0RECV_B0,0B0\n1F0,1RECV_F0,1B0,1SEND_B0\n"))


@pytest.mark.parametrize("pp", range(2, 9))
def test_gpipe_and_1f1b_bubble_is_theory(pp: int) -> None:
    for m in range(1, 17):  # below pp (outside torch's 1F1B range) 1F1B is GPipe-like and still (p-1)/(m+p-1)
        theory = (pp - 1) / (m + pp - 1)
        assert simulate(gpipe(pp, 1, m)).bubble_fraction == pytest.approx(theory), m
        assert simulate(one_f_one_b(pp, 1, m)).bubble_fraction == pytest.approx(theory), m


@pytest.mark.parametrize("pp", range(2, 9))
def test_interleaved_1f1b_bubble_is_megatrons(pp: int) -> None:
    # (p-1)/(v m+p-1) with v stages per rank (Megatron-LM), for m a multiple of pp (whole rounds of pp microbatches)
    spec = get_schedule("Interleaved1F1B")
    for v in range(1, 5):
        for m in range(pp, 17, pp):
            bubble = simulate(spec.generate(pp, v, m)).bubble_fraction
            assert bubble == pytest.approx((pp - 1) / (v * m + pp - 1)), (v, m)


def _bubble_and_peaks(name: str, pp: int, m: int, costs: Costs | None = None) -> tuple[float, dict[int, int]]:
    spec = get_schedule(name)
    result = simulate(spec.generate(pp, 1 if spec.single_stage else 2, m), costs or Costs())
    return result.bubble_fraction, dict(result.peak_activations)


def test_interleaving_then_zero_bubble_shrink_the_bubble() -> None:
    pp, m, v = 4, 8, 2
    bubble = {name: _bubble_and_peaks(name, pp, m)[0] for name in SCHEDULES}
    print("\npp=4, 8 microbatches, F=1 B=2 (I=1 W=1):", {k: round(b, 4) for k, b in bubble.items()})
    assert bubble["GPipe"] == pytest.approx(bubble["1F1B"]) == pytest.approx((pp - 1) / (m + pp - 1))
    assert bubble["Interleaved1F1B"] == pytest.approx((pp - 1) / (v * m + pp - 1))  # Megatron's 1/v bubble
    assert bubble["LoopedBFS"] <= bubble["1F1B"]
    assert bubble["InterleavedZeroBubble"] < bubble["Interleaved1F1B"] < bubble["1F1B"]
    assert bubble["ZBVZeroBubble"] < bubble["Interleaved1F1B"]
    # A split backward only helps when I and W are separate: the same order with W free is not zero-bubble.
    unbalanced = _bubble_and_peaks("ZBVZeroBubble", pp, m, Costs(backward_input=1.9, backward_weight=0.1))[0]
    assert unbalanced > bubble["ZBVZeroBubble"]


@pytest.mark.parametrize("m", [4, 8, 16])
def test_1f1b_keeps_at_most_pp_microbatches_gpipe_keeps_all(m: int) -> None:
    pp = 4
    assert _bubble_and_peaks("GPipe", pp, m)[1] == dict.fromkeys(range(pp), m)
    peaks = _bubble_and_peaks("1F1B", pp, m)[1]
    assert peaks == {stage: min(m, pp - stage) for stage in range(pp)}  # stage r holds pp - r
    assert max(peaks.values()) <= pp


def test_transfer_cost_delays_each_hop() -> None:
    # 0F0 [0,1], hop 0.5, 1F0 [1.5,2.5], 1B0 [2.5,4.5], hop 0.5, 0B0 [5,7].
    result = simulate(gpipe(2, 1, 1), Costs(transfer=0.5))
    assert result.makespan == 7.0
    lowered = lower_schedule(gpipe(2, 1, 1), {0: 0, 1: 1}, 1)
    assert simulate(lowered, Costs(transfer=0.5)).makespan == 7.0


def test_print_simulated_timelines() -> None:
    for name, spr in [("1F1B", 1), ("ZBVZeroBubble", 2)]:
        result = simulate(get_schedule(name).generate(4, spr, 8))
        timeline = format_timeline(result)
        print(f"\n{name}, pp=4, 8 microbatches: makespan {result.makespan:g}, bubble {result.bubble_fraction:.3f}")
        print(timeline)
        assert len(timeline.splitlines()) == 4
    assert (
        format_timeline(simulate(gpipe(2, 1, 1)))
        == "rank 0 | 0F0 ... ... ... 0B0 ---\nrank 1 | ... 1F0 1B0 --- ... ..."
    )
