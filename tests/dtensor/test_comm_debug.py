"""CommDebugMode: counts and bytes for direct c10d calls, torch's functional collectives, our
DTensor (redistribute, backward, implicit redistribution in ops) and torch's DTensor, checked
against torch's own CommDebugMode running around the same calls."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.tensor as tdt
from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

from parallelisms.dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from parallelisms.dtensor.debug import CommDebugMode
from tests.dtensor.harness import get_mesh, get_torch_mesh, to_torch_placements
from tests.world import run_world

F = "c10d_functional."
# torch's CommDebugMode keeps direct c10d calls under their c10d names; ours files them under the
# functional key of the same collective (so our c10d-based DTensor reads like torch's DTensor).
C10D_TO_FUNCTIONAL = {
    "c10d.allreduce_": F + "all_reduce",
    "c10d._allgather_base_": F + "all_gather_into_tensor",
    "c10d.allgather_": F + "all_gather_into_tensor",
    "c10d._reduce_scatter_base_": F + "reduce_scatter_tensor",
    "c10d.reduce_scatter_": F + "reduce_scatter_tensor",
    "c10d.alltoall_base_": F + "all_to_all_single",
    "c10d.broadcast_": F + "broadcast",
    "c10d.scatter_": "c10d.scatter_",
    "c10d.reduce_": "c10d.reduce_",
    "c10d.gather_": "c10d.gather_",
}


def keyed(counts) -> dict[str, int]:
    return {str(k): v for k, v in counts.items()}


def both_modes():
    """Ours inside torch's: both see every collective issued inside."""
    return TorchCommDebugMode(), CommDebugMode()


# --------------------------------------------------------------------------------------------------
# direct c10d calls
# --------------------------------------------------------------------------------------------------


def direct_c10d_calls() -> tuple[dict, dict, dict]:
    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.arange(12, dtype=torch.float32) + rank  # 48 bytes
    theirs, ours = both_modes()
    with theirs, ours:
        dist.all_reduce(x.clone())
        dist.all_gather_into_tensor(torch.empty(12 * n), x)
        dist.all_gather([torch.empty(12) for _ in range(n)], x)
        dist.reduce_scatter_tensor(torch.empty(3), x)
        dist.all_to_all_single(torch.empty(12), x)
        dist.broadcast(x.clone(), src=0)
        dist.scatter(torch.empty(3), list(x.chunk(n)) if rank == 0 else None, src=0)
        dist.reduce(x.clone(), dst=0)
    return keyed(ours.get_comm_counts()), keyed(ours.get_comm_bytes()), keyed(theirs.get_comm_counts())


def test_comm_debug_mode_counts_direct_c10d_calls_like_torch():
    for rank, (counts, nbytes, torch_counts) in enumerate(run_world(direct_c10d_calls, 4)):
        assert counts == {
            F + "all_reduce": 1,
            F + "all_gather_into_tensor": 2,
            F + "reduce_scatter_tensor": 1,
            F + "all_to_all_single": 1,
            F + "broadcast": 1,
            "c10d.scatter_": 1,
            "c10d.reduce_": 1,
        }, counts
        mapped: dict[str, int] = {}
        for key, count in torch_counts.items():
            mapped[C10D_TO_FUNCTIONAL[key]] = mapped.get(C10D_TO_FUNCTIONAL[key], 0) + count
        assert mapped == counts, (torch_counts, counts)
        assert nbytes == {
            F + "all_reduce": 48,
            F + "all_gather_into_tensor": 96,
            F + "reduce_scatter_tensor": 48,
            F + "all_to_all_single": 48,
            F + "broadcast": 48,
            "c10d.scatter_": 48 if rank == 0 else 0,  # only the source hands over chunks
            "c10d.reduce_": 48,
        }, nbytes


# --------------------------------------------------------------------------------------------------
# functional collectives
# --------------------------------------------------------------------------------------------------


def functional_calls() -> tuple[dict, dict, dict]:
    group = dist.group.WORLD
    x = torch.ones(8, 2)  # 64 bytes
    theirs, ours = both_modes()
    with theirs, ours:
        outs = [
            funcol.all_reduce(x, "sum", group),
            funcol.all_gather_tensor(x, 0, group),
            funcol.reduce_scatter_tensor(x, "sum", 0, group),
            funcol.all_to_all_single(x, None, None, group),
            funcol.broadcast(x, 0, group),
        ]
        outs = [funcol.wait_tensor(o) if isinstance(o, funcol.AsyncCollectiveTensor) else o for o in outs]
    assert torch.equal(outs[0], x * 4) and outs[1].shape == (32, 2) and torch.equal(outs[2], x[:2] * 4)
    return keyed(ours.get_comm_counts()), keyed(ours.get_comm_bytes()), keyed(theirs.get_comm_counts())


def test_comm_debug_mode_keys_functional_collectives_exactly_like_torch():
    for counts, nbytes, torch_counts in run_world(functional_calls, 4):
        expected = {
            F + k: 1
            for k in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast")
        }
        assert counts == torch_counts == expected, (counts, torch_counts)
        assert nbytes == {key: 64 for key in expected}, nbytes


# --------------------------------------------------------------------------------------------------
# DTensor redistribute (ours and torch's)
# --------------------------------------------------------------------------------------------------


def dtensor_redistribute_counts() -> list[tuple]:
    mesh, tmesh = get_mesh((4,)), get_torch_mesh((4,))
    t = torch.arange(40, dtype=torch.float32).view(10, 4)  # uneven: rows 3, 3, 3, 1
    rows = [3, 3, 3, 1][dist.get_rank()]
    out = []
    for src, dst in (
        ([Shard(0)], [Replicate()]),
        ([Partial()], [Replicate()]),
        ([Partial()], [Shard(0)]),
        ([Shard(0)], [Shard(1)]),
        ([Replicate()], [Shard(1)]),
    ):
        if isinstance(src[0], Partial):
            x = DTensor.from_local(t.clone(), mesh, src)
            tx = tdt.DTensor.from_local(t.clone(), tmesh, to_torch_placements(src))
        else:
            x, tx = distribute_tensor(t, mesh, src), tdt.distribute_tensor(t, tmesh, to_torch_placements(src))
        theirs, ours = both_modes()
        with theirs, ours:
            x.redistribute(mesh, dst)
        torch_theirs, torch_ours = both_modes()
        with torch_theirs, torch_ours:
            tx.redistribute(tmesh, to_torch_placements(dst))
        out.append(
            (
                str(src[0]),
                str(dst[0]),
                rows,
                keyed(ours.get_comm_counts()),
                keyed(ours.get_comm_bytes()),
                keyed(theirs.get_comm_counts()),
                keyed(torch_ours.get_comm_counts()),
                keyed(torch_theirs.get_comm_counts()),
            )
        )
    return out


def test_comm_debug_mode_counts_dtensor_redistribute_under_torch_keys():
    for per_case in run_world(dtensor_redistribute_counts, 4):
        for src, dst, rows, counts, nbytes, torch_sees_ours, ours_sees_torch, torch_sees_torch in per_case:
            case = f"{src}->{dst}"
            assert ours_sees_torch == torch_sees_torch, (case, ours_sees_torch, torch_sees_torch)
            mapped = {C10D_TO_FUNCTIONAL[k]: v for k, v in torch_sees_ours.items()}
            if (src, dst) == ("P(sum)", "S(0)"):
                # gloo's reduce_scatter runs as an all_to_all and a local sum (collectives._reduce_scatter_single):
                # torch's mode sees the all_to_all, ours counts the reduce_scatter it stands for
                assert mapped == {F + "all_to_all_single": 1}, mapped
                mapped = {F + "reduce_scatter_tensor": 1}
            assert mapped == counts, (case, torch_sees_ours, counts)
            if (src, dst) == ("S(0)", "S(1)"):
                # ours: one all_to_all of the unpadded shard; torch on gloo falls back to all_gather
                assert counts == {F + "all_to_all_single": 1}, counts
                assert nbytes == {F + "all_to_all_single": rows * 4 * 4}, nbytes
                assert torch_sees_torch == {F + "all_gather_into_tensor": 1}, torch_sees_torch
                continue
            assert counts == torch_sees_torch, (case, counts, torch_sees_torch)
            expected_bytes = {
                ("S(0)", "R"): {F + "all_gather_into_tensor": 3 * 4 * 4},  # padded to the largest shard
                ("P(sum)", "R"): {F + "all_reduce": 40 * 4},
                ("P(sum)", "S(0)"): {F + "reduce_scatter_tensor": 12 * 4 * 4},  # 10 rows padded to 12
                ("R", "S(1)"): {},
            }[(src, dst)]
            assert nbytes == expected_bytes, (case, nbytes)


def backward_and_op_counts() -> tuple[dict, dict, dict, dict]:
    from parallelisms.dtensor.dispatch import replicate_fallback

    mesh, tmesh = get_mesh((2,)), get_torch_mesh((2,))
    t = torch.arange(8, dtype=torch.float32).view(4, 2)
    x = distribute_tensor(t, mesh, [Shard(0)]).requires_grad_()
    with CommDebugMode() as mode:
        y = x.redistribute(mesh, [Replicate()])
        y.to_local(grad_placements=[Partial()]).sum().backward()  # backward: P -> S(0) reduce_scatter
    backward = keyed(mode.get_comm_counts())
    # collectives issued inside our DTensor's dispatch (implicit redistribution) are counted too
    with CommDebugMode() as mode, replicate_fallback():
        z = torch.cumsum(distribute_tensor(t, mesh, [Shard(0)]), 0)
    assert torch.equal(z.full_tensor(), t.cumsum(0))
    implicit = keyed(mode.get_comm_counts())
    # and inside torch's DTensor dispatch, as torch's own mode counts them
    tx = tdt.distribute_tensor(t, tmesh, [tdt.Shard(0)])
    theirs, ours = both_modes()
    with theirs, ours:
        torch.cumsum(tx, 0) + tx.redistribute(tmesh, [tdt.Replicate()])  # cumsum over S(0) must gather
    return backward, implicit, keyed(ours.get_comm_counts()), keyed(theirs.get_comm_counts())


def test_comm_debug_mode_counts_backward_and_collectives_inside_dtensor_ops():
    for backward, implicit, ours, theirs in run_world(backward_and_op_counts, 2):
        assert backward == {F + "all_gather_into_tensor": 1, F + "reduce_scatter_tensor": 1}, backward
        assert sum(implicit.values()) >= 1, implicit
        assert ours == theirs and sum(ours.values()) >= 2, (ours, theirs)


def mode_resets() -> list[int]:
    mode = CommDebugMode()
    with mode:
        dist.all_reduce(torch.ones(2))
    first = mode.get_total_counts()
    with mode:
        pass
    return [first, mode.get_total_counts(), len(mode.get_comm_bytes())]


def test_comm_debug_mode_resets_on_each_entry():
    for counts in run_world(mode_resets, 2):
        assert counts == [1, 0, 0], counts


# --------------------------------------------------------------------------------------------------
# module tracing: parameters, placements and modules seen (torch's test_comm_mode_features)
# --------------------------------------------------------------------------------------------------


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net1 = torch.nn.Linear(10, 16)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def module_tracing(impl: str) -> dict:
    """An MLP under Colwise / Rowwise TP, forward and backward inside the mode, then an empty re-entry."""
    if impl == "ours":
        from parallelisms.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mode, mesh = CommDebugMode(), get_mesh((2,))
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mode, mesh = TorchCommDebugMode(), get_torch_mesh((2,))
    model = parallelize_module(_MLP(), mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()})
    with mode:
        model(torch.rand(8, 10, generator=torch.Generator().manual_seed(1))).sum().backward()
    tracker = mode.advanced_module_tracker
    out = {
        "parameters": {m: list(p) for m, p in mode.get_parameter_info().items()},
        "sharding": {k: [str(p) for p in v] for k, v in mode.get_sharding_info().items()},
        "helper": {
            m: {k: v for k, v in h.items() if k != "module_type"} for m, h in tracker.module_helper_dict.items()
        },
        "net2_forward": keyed(mode.comm_module_counts["_MLP.net2"]["forward"]),
    }
    with mode:
        out["reset"] = (mode.get_parameter_info(), mode.get_sharding_info(), list(tracker.module_helper_dict))
    return out


def test_module_tracing_records_parameters_and_placements_as_torch():
    for ours, theirs in zip(run_world(module_tracing, 2, "ours"), run_world(module_tracing, 2, "torch")):
        assert ours["parameters"] == theirs["parameters"] == {"_MLP.net1": ["weight", "bias"],
                                                             "_MLP.net2": ["weight", "bias"]}  # fmt: skip
        assert list(ours["sharding"]) == list(theirs["sharding"]) and len(ours["sharding"]) == 4
        assert ours["sharding"]["_MLP.net1.weight"] == ["S(0)"] and theirs["sharding"]["_MLP.net1.weight"] == ["S(0)"]
        assert ours["helper"] == theirs["helper"], (ours["helper"], theirs["helper"])
        assert ours["net2_forward"] == theirs["net2_forward"] == {F + "all_reduce": 1}, (ours, theirs)
        assert ours["reset"] == theirs["reset"] == ({}, {}, ["Global"])
