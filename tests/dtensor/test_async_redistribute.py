"""redistribute(async_op=True): the collective is issued, the call returns at once, and the shard is
waited for on first use, with the values of the synchronous path (ours and torch's)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallelisms.dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from parallelisms.dtensor.async_tensor import PendingTensor
from parallelisms.dtensor.debug import CommDebugMode
from tests.dtensor.harness import get_mesh
from tests.world import run_world


def async_matches_sync() -> list[str]:
    mesh = get_mesh((2,))
    rank = dist.get_rank()
    failures = []
    x = torch.arange(24.0).view(4, 6) * (rank + 1)
    cases = [
        ([Partial()], [Replicate()]),  # all_reduce
        ([Partial("avg")], [Replicate()]),  # all_reduce, then the division on wait
        ([Shard(0)], [Replicate()]),  # all_gather
        ([Partial()], [Shard(0)]),  # reduce_scatter
    ]
    for src, dst in cases:
        shape, stride = ((8, 6), (6, 1)) if src[0].is_shard() else (None, None)
        d = DTensor.from_local(x.clone(), mesh, src, shape=shape, stride=stride)
        want = d.redistribute(mesh, dst).to_local()
        got = d.redistribute(mesh, dst, async_op=True)
        if not isinstance(got._local_tensor, PendingTensor):
            failures.append(f"{src}->{dst}: the shard is not pending")
        view = got.to_local().view(-1)  # a view stays lazy and waits with its base
        if not torch.equal((got + 0).to_local(), want) or not torch.equal(view.wait(), want.view(-1)):
            failures.append(f"{src}->{dst}: values differ from the synchronous redistribute")
    leaf = distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)]).requires_grad_()
    gathered = leaf.redistribute(mesh, [Replicate()], async_op=True)
    (gathered.to_local() * 3).sum().backward()
    if not torch.equal(leaf.grad.full_tensor(), torch.full((4, 6), 3.0)):
        failures.append("gradient through an async redistribute")
    return failures


def test_async_redistribute_matches_sync_and_differentiates() -> None:
    for failures in run_world(async_matches_sync, 2):
        assert failures == []


def returns_before_the_peer_arrives() -> dict[str, float]:
    """Rank 1 joins the all_reduce 0.5 s late: rank 0's async call returns at once and computes
    meanwhile; its first use of the result then waits for the rest."""
    mesh = get_mesh((2,))
    d = DTensor.from_local(torch.ones(1000), mesh, [Partial()])
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(0.5)
    start = time.perf_counter()
    out = d.redistribute(mesh, [Replicate()], async_op=True)
    issued = time.perf_counter() - start
    torch.randn(64, 64) @ torch.randn(64, 64)  # compute while the collective is in flight
    total = out.to_local().sum().item()
    return {"issued_s": issued, "waited_s": time.perf_counter() - start, "sum": total}


def test_async_redistribute_returns_while_the_collective_is_in_flight() -> None:
    rank0 = run_world(returns_before_the_peer_arrives, 2)[0]
    assert rank0["sum"] == 2000.0
    assert rank0["issued_s"] < 0.25 < rank0["waited_s"], rank0


def tp_mlp_forward() -> dict[str, Any]:
    import torch.distributed.tensor.parallel as ttp

    import parallelisms.tensor_parallel as otp
    from tests.dtensor.harness import get_torch_mesh

    out = {}
    for name, tp, mesh in (("ours", otp, get_mesh((2,))), ("torch", ttp, get_torch_mesh((2,)))):
        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
        tp.parallelize_module(mlp, mesh, {"0": tp.ColwiseParallel(), "2": tp.RowwiseParallel()})
        with CommDebugMode() as comm, torch.no_grad():
            y = mlp(torch.randn(4, 8, generator=torch.Generator().manual_seed(1)))
            out[name] = (y + 0, comm.get_total_counts())
    return out


def test_tp_forward_with_async_styles_matches_torch() -> None:
    for r in run_world(tp_mlp_forward, 2):
        torch.testing.assert_close(r["ours"][0], r["torch"][0])
        assert r["ours"][1] == r["torch"][1] == 1
