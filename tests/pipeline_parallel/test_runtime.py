"""The pipeline interpreter on real gloo worlds: every schedule it runs gives the gradients of one process
running the whole model on the same microbatches; 1F1B holds at most pp microbatches per stage (measured in the
bytes autograd saves: rank r peaks at pp - r microbatches' activations, GPipe at all of them), and the
schedules it cannot run yet are refused naming the ones it can."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallelisms.pipeline_parallel import get_schedule, lower_schedule, rank_to_stages, stage_to_rank
from parallelisms.pipeline_parallel.interpreter import PipelineSchedule
from parallelisms.pipeline_parallel.stage import BoundaryMeta, PipelineStage
from tests.world import WorldError, run_world

DIM, MB, LAYERS_PER_STAGE = 8, 3, 2


def _whole_model(num_stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(num_stages * LAYERS_PER_STAGE):
        layers += [nn.Linear(DIM, DIM), nn.Tanh()]
    return nn.Sequential(*layers)


def _stage_part(model: nn.Sequential, stage: int) -> nn.Sequential:
    per = 2 * LAYERS_PER_STAGE  # a Linear and a Tanh per layer
    return model[stage * per : (stage + 1) * per]  # shares the parameters: grads land in `model`


def _microbatches(n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(MB, DIM, generator=g) for _ in range(n)], [torch.randn(MB, DIM, generator=g) for _ in range(n)]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).sum()


class SavedActivationBytes:
    """Bytes of the activations autograd holds for backward, live now and at their peak: every tensor a forward
    saves, packed into a holder that subtracts its bytes when the graph lets it go (parameters and their views
    are not activations and are left out)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor) -> object:
        return t if t.untyped_storage().data_ptr() in self.params else _Held(t, self)

    @staticmethod
    def unpack(held: object) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held  # type: ignore[return-value]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    def __init__(self, tensor: torch.Tensor, counter: SavedActivationBytes) -> None:
        # detached: an output saved with its grad_fn would hold its own graph in a cycle only the GC frees
        self.tensor, self.counter, self.nbytes = tensor.detach(), counter, tensor.numel() * tensor.element_size()
        counter.live += self.nbytes
        counter.peak = max(counter.peak, counter.live)

    def __del__(self) -> None:
        self.counter.live -= self.nbytes


def _run(schedule_name: str, stages_per_rank: int, num_microbatches: int) -> dict:
    pp, rank = dist.get_world_size(), dist.get_rank()
    spec = get_schedule(schedule_name)
    num_stages = pp * stages_per_rank
    mapping = stage_to_rank(pp, stages_per_rank, spec.placement)
    actions = lower_schedule(spec.generate(pp, stages_per_rank, num_microbatches), mapping, num_microbatches)[rank]
    model = _whole_model(num_stages)
    meta = BoundaryMeta((MB, DIM), torch.float32)
    mine = rank_to_stages(pp, stages_per_rank, spec.placement)[rank]
    stages = [
        PipelineStage(
            _stage_part(model, s), s, num_stages, dist.group.WORLD, mapping, torch.device("cpu"),  # type: ignore[arg-type]
            input_meta=None if s == 0 else meta, output_meta=None if s == num_stages - 1 else meta,
        )
        for s in mine
    ]  # fmt: skip
    inputs, targets = _microbatches(num_microbatches)
    runner = PipelineSchedule(stages, [a for a in actions if a is not None], _loss)
    saved = SavedActivationBytes(list(model.parameters()))
    with saved.hooks():  # one microbatch through this rank's stages (and the loss): what one microbatch holds
        held = [_stage_part(model, s)(torch.randn(MB, DIM, requires_grad=True)) for s in mine]
        held += [_loss(held[-1], targets[0])] if num_stages - 1 in mine else []
        per_microbatch = saved.live
        held.clear()  # frees that microbatch's graph
        saved.peak = 0
        result = runner.step(inputs if 0 in mine else None, targets if num_stages - 1 in mine else None)
    grads = {
        f"{s}.{name}": p.grad.clone()
        for s in mine
        for name, p in _stage_part(model, s).named_parameters()
        if p.grad is not None
    }
    # the reference: the whole model, every microbatch, on this process
    reference = _whole_model(num_stages)
    sum(_loss(reference(x), y) for x, y in zip(inputs, targets)).backward()  # type: ignore[union-attr]
    expected = {f"{s}.{n}": p.grad for s in mine for n, p in _stage_part(reference, s).named_parameters()}
    ref_losses = [_loss(reference(x), y).detach() for x, y in zip(inputs, targets)]
    p2p = [a is not None and a.kind.value.startswith(("SEND", "RECV")) for a in actions]
    runs = sum(1 for i, is_p2p in enumerate(p2p) if is_p2p and (i == 0 or not p2p[i - 1]))
    return {
        "grads": grads, "expected": expected, "losses": result.losses, "ref_losses": ref_losses,
        "peaks": result.peak_live_microbatches, "last": num_stages - 1 in mine,
        "saved_bytes": (saved.peak, per_microbatch, saved.live),
        "batches": (result.p2p_batches, runs, sum(p2p)),
    }  # fmt: skip


@pytest.mark.parametrize(
    "schedule, stages_per_rank, world, microbatches",
    [
        ("GPipe", 1, 2, 4),
        ("1F1B", 1, 2, 4),
        ("1F1B", 1, 4, 8),
        ("Interleaved1F1B", 2, 2, 4),
        ("Interleaved1F1B", 2, 4, 8),
        ("LoopedBFS", 2, 2, 4),
        ("InterleavedZeroBubble", 2, 2, 4),  # split backward: I first, W later
        ("InterleavedZeroBubble", 2, 4, 8),
        ("ZBVZeroBubble", 2, 2, 4),  # V placement: rank r holds stages r and 2 pp - 1 - r
        ("ZBVZeroBubble", 2, 4, 8),
        ("DualPipeV", 2, 2, 4),  # V placement, F next to B, full and split backwards mixed
        ("DualPipeV", 2, 4, 9),
    ],
)
def test_schedules_give_the_gradients_of_one_process(
    schedule: str, stages_per_rank: int, world: int, microbatches: int
) -> None:
    for rank, got in enumerate(run_world(_run, world, schedule, stages_per_rank, microbatches)):
        assert got["grads"].keys() == got["expected"].keys(), rank
        batches, runs, transfers = got["batches"]  # one batch_isend_irecv per run of consecutive transfers
        assert batches == runs, (batches, runs)
        if schedule == "1F1B" and 0 < rank < world - 1:  # a middle stage's SEND_F goes with its next RECV_F
            assert runs < transfers, (runs, transfers)
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, got["expected"][name], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
        if got["last"]:
            torch.testing.assert_close(torch.stack(got["losses"]), torch.stack(got["ref_losses"]))
        peak, per_microbatch, left = got["saved_bytes"]  # bytes autograd saved for backward, measured
        assert per_microbatch > 0 and left == 0, got["saved_bytes"]  # all freed by the step's end
        if schedule == "1F1B":  # activations freed as soon as the backward ran: at most pp microbatches
            assert all(n <= world for n in got["peaks"].values()), got["peaks"]
            assert peak == (world - rank) * per_microbatch, (rank, got["saved_bytes"])  # rank r warms up pp - r
        if schedule == "GPipe":
            assert all(n == microbatches for n in got["peaks"].values()), got["peaks"]
            assert peak == microbatches * per_microbatch, (rank, got["saved_bytes"])  # grows with microbatches


def test_a_list_whose_reduce_grad_is_missing_or_early_is_refused() -> None:
    spec = get_schedule("1F1B")
    mapping = stage_to_rank(2, 1, spec.placement)
    actions = [a for a in lower_schedule(spec.generate(2, 1, 4), mapping, 4, reduce_grad=True)[0] if a is not None]
    reduce = next(a for a in actions if a.kind.value == "REDUCE_GRAD")
    meta = BoundaryMeta((MB, DIM), torch.float32)
    stages = [PipelineStage(nn.Linear(DIM, DIM), 0, 2, None, mapping, torch.device("cpu"), None, meta)]  # type: ignore[arg-type]
    early = [reduce, *[a for a in actions if a is not reduce]]
    for wrong in (early, [*actions, reduce]):
        with pytest.raises(ValueError, match=r"REDUCE_GRAD must come once per stage, after .* stages \[0\]"):
            PipelineSchedule(stages, wrong, _loss)


def _data_parallel_stage_step(
    schedule_name: str, stages_per_rank: int, dp: str, sync_grads: bool = True, reshard_after_forward: bool = False,
    fsdp_actions: bool = False,
) -> dict:  # fmt: skip
    """PP(2) x FSDP(2) / DDP(2) on 4 ranks (or PP(2) x HSDP(2, 2) on 8), 4 microbatches: the collectives of
    one step and whether each stage's gradients equal the whole model's (the same data on every dp rank, so
    the dp average is the gradient of one of them). `fsdp_actions`: the list lowered with UNSHARD, RESHARD
    and REDUCE_GRAD (torch's lowering), which then say when to gather, free and reduce."""
    from parallelisms.data_parallel import replicate
    from parallelisms.dtensor import init_device_mesh
    from parallelisms.dtensor.debug import CommDebugMode
    from parallelisms.fsdp import fully_shard

    if dp == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
        dp_mesh = mesh["dp_replicate", "dp_shard"]
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        dp_mesh = mesh["dp"]
    pp_rank, m, pp = mesh.get_local_rank("pp"), 4, 2
    spec = get_schedule(schedule_name)
    num_stages = pp * stages_per_rank
    mapping = stage_to_rank(pp, stages_per_rank, spec.placement)
    mine = rank_to_stages(pp, stages_per_rank, spec.placement)[pp_rank]
    model = _whole_model(num_stages)
    meta = BoundaryMeta((MB, DIM), torch.float32)
    parts, stages = {}, []
    for s in mine:
        part = _stage_part(model, s)
        if dp == "ddp":
            parts[s] = replicate(part, dp_mesh)
        else:  # the trainer's choice under PP: parameters stay gathered between forward and backward
            parts[s] = fully_shard(part, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
        stages.append(PipelineStage(parts[s], s, num_stages, mesh["pp"].get_group(), mapping, torch.device("cpu"),
                                    None if s == 0 else meta, None if s == num_stages - 1 else meta))  # fmt: skip
    lowered = lower_schedule(spec.generate(pp, stages_per_rank, m), mapping, m, unshard_reshard=fsdp_actions,
                             reduce_grad=fsdp_actions)  # fmt: skip
    actions = [a for a in lowered[pp_rank] if a is not None]
    inputs, targets = _microbatches(m)
    with CommDebugMode() as comm:
        PipelineSchedule(stages, actions, _loss).step(
            inputs if 0 in mine else None, targets if num_stages - 1 in mine else None, sync_grads=sync_grads
        )
    counts = {name: v for k, v in comm.get_comm_counts().items() if (name := str(k).split(".")[-1]) not in _P2P}
    reference = _whole_model(num_stages)
    sum(_loss(reference(x), y) for x, y in zip(inputs, targets)).backward()  # type: ignore[union-attr]
    same = True
    for s in mine if sync_grads else ():
        for got, expected in zip(parts[s].parameters(), _stage_part(reference, s).parameters()):
            grad = got.grad.full_tensor() if dp != "ddp" else got.grad
            same = same and torch.allclose(grad, expected.grad, rtol=1e-5, atol=1e-6)
    sharded = all(p.grad is not None and p.grad._local_tensor.numel() < p.numel() for s in mine
                  for p in parts[s].parameters()) if dp != "ddp" and sync_grads else None  # fmt: skip
    return {"counts": counts, "same": same if sync_grads else None, "stages": len(mine), "sharded": sharded}


_P2P = {"send", "recv_"}  # the pipeline's own transfers
_SCHEDULES = [("1F1B", 1), ("Interleaved1F1B", 2), ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2)]


@pytest.mark.parametrize("fsdp_actions", [False, True], ids=["hooks", "fsdp_actions"])
@pytest.mark.parametrize("schedule, stages_per_rank", _SCHEDULES)
def test_fsdp_inside_stages_gathers_and_reduces_once_per_step(
    schedule: str, stages_per_rank: int, fsdp_actions: bool
) -> None:
    """4 microbatches, one FSDP group per stage: one all-gather (the parameters stay unsharded across the
    microbatches) and one reduce-scatter per stage and step, also when W comes after I (zero bubble); the
    same whether the module's hooks decide or the lowered UNSHARD / RESHARD / REDUCE_GRAD actions do."""
    for got in run_world(_data_parallel_stage_step, 4, schedule, stages_per_rank, "fsdp", True, False, fsdp_actions):
        n = got["stages"]
        assert got["counts"] == {"all_gather_into_tensor": n, "reduce_scatter_tensor": n}, got
        assert got["same"] and got["sharded"], got


def test_fsdp_resharding_after_forward_inside_zero_bubble_stages_is_refused_at_the_first_input_backward() -> None:
    """reshard_after_forward=True swaps the gathered parameters out before W needs them: a named error at the
    first I, not a silent zero weight gradient."""
    with pytest.raises(WorldError, match="split backward: none of the stage's parameters.*reshard_after_forward"):
        run_world(_data_parallel_stage_step, 4, "ZBVZeroBubble", 2, "fsdp", True, True)


def test_fsdp_inside_a_stage_accumulating_across_steps_reduces_nothing() -> None:
    for got in run_world(_data_parallel_stage_step, 4, "InterleavedZeroBubble", 2, "fsdp", False):
        assert got["counts"] == {"all_gather_into_tensor": 2}, got  # gathered once; nothing reduced yet


@pytest.mark.parametrize("fsdp_actions", [False, True], ids=["hooks", "fsdp_actions"])
@pytest.mark.parametrize("schedule, stages_per_rank", [("1F1B", 1), ("ZBVZeroBubble", 2)])
def test_ddp_inside_stages_all_reduces_once_per_step(schedule: str, stages_per_rank: int, fsdp_actions: bool) -> None:
    """DDP stages: UNSHARD and RESHARD do nothing, REDUCE_GRAD all-reduces the buckets once."""
    for got in run_world(_data_parallel_stage_step, 4, schedule, stages_per_rank, "ddp", True, False, fsdp_actions):
        n = got["stages"]  # one bucket per (small) stage; the first synced step also agrees its bucket order
        assert got["counts"] == {"all_reduce": n, "broadcast": n}, got
        assert got["same"], got


def test_hsdp_inside_a_stage_reduce_scatters_and_all_reduces_once_per_step() -> None:
    for got in run_world(_data_parallel_stage_step, 8, "1F1B", 1, "hsdp"):
        assert got["counts"] == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1, "all_reduce": 1}, got
        assert got["same"], got
