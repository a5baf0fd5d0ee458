"""Pooling and edge padding on DTensors against one device: max / avg / adaptive pools (1-D to 3-D, with indices),
max_unpool, reflection and replication padding, every placement of the input on 1-D and 2-D meshes (uneven sizes,
empty shards and unbatched inputs included), values and gradients; a batch or channel shard stays sharded with no
collective."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dtensor.harness import MESHES, check_op, get_mesh
from tests.world import run_world


def _unpool(x: torch.Tensor) -> torch.Tensor:
    return F.max_unpool2d(*F.max_pool2d(x, 2, return_indices=True), 2)


def _cases(gen: torch.Generator) -> list[tuple]:
    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return [
        (lambda x: F.max_pool2d(x, 3, stride=2, padding=1), [r(2, 3, 7, 6)]),
        (lambda x: F.max_pool1d(x, 2, return_indices=True)[0], [r(3, 5, 8)]),
        (lambda x: F.avg_pool2d(x, 2, ceil_mode=True), [r(3, 2, 5, 6)]),
        (lambda x: F.avg_pool1d(x, 3, stride=1, padding=1), [r(5, 7)]),  # unbatched (C, L)
        (lambda x: F.adaptive_avg_pool2d(x, (2, 3)), [r(2, 3, 5, 7)]),
        (lambda x: F.adaptive_max_pool1d(x, 3), [r(2, 3, 7)]),
        (lambda x: F.max_pool3d(x, 2), [r(1, 3, 4, 4, 4)]),
        (_unpool, [r(2, 3, 4, 6)]),
        (lambda x: F.pad(x, (1, 2, 2, 1), mode="reflect"), [r(2, 3, 4, 5)]),
        (lambda x: F.pad(x, (2, 1), mode="replicate"), [r(3, 2, 5)]),
    ]


def _check(mesh_shape: tuple[int, ...]) -> int:
    mesh = get_mesh(mesh_shape)
    return sum(check_op(fn, inputs, mesh, partial=True, max_combos=16)
               for fn, inputs in _cases(torch.Generator().manual_seed(0)))  # fmt: skip


@pytest.mark.parametrize("mesh_shape,world_size", MESHES)
def test_pooling_matches_single_device(mesh_shape: tuple[int, ...], world_size: int) -> None:
    assert all(n > 0 for n in run_world(_check, world_size, mesh_shape))


def _channel_sharded() -> tuple:
    from parallelisms.dtensor import Shard, distribute_tensor
    from parallelisms.dtensor.debug import CommDebugMode

    x = distribute_tensor(torch.randn(2, 4, 6, 6), get_mesh((2,)), [Shard(1)]).requires_grad_()
    with CommDebugMode() as comm:
        y = F.max_pool2d(x, 2)
        y.sum().backward()
    return y.placements, x.grad.placements, comm.get_total_counts()


def test_a_channel_shard_stays_sharded_without_collectives() -> None:
    from parallelisms.dtensor import Shard

    placements, grad_placements, collectives = run_world(_channel_sharded, 2)[0]
    assert placements == grad_placements == (Shard(1),) and collectives == 0


def _versus_torch() -> list[str]:
    """Forward pools on our DTensor and torch's: the same placements out, no more collectives."""
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    from parallelisms.dtensor import Partial, Replicate, Shard, distribute_tensor
    from tests.dtensor.harness import get_torch_mesh, run_ours_and_torch, to_torch_placements

    mesh, tmesh = get_mesh((2,)), get_torch_mesh((2,))
    x = torch.randn(4, 6, 8, 8, generator=torch.Generator().manual_seed(0))
    cases = {
        "avg_pool2d": lambda a: F.avg_pool2d(a, 2),
        "max_pool2d": lambda a: F.max_pool2d(a, 3, stride=2, padding=1),
        "adaptive_avg_pool2d": lambda a: F.adaptive_avg_pool2d(a, (3, 2)),
    }
    differ = []
    for name, fn in cases.items():
        for placement in (Replicate(), Shard(0), Shard(1), Shard(2), Partial()):
            ours_in = distribute_tensor(x, mesh, [placement])
            theirs_in = torch_distribute(x, tmesh, to_torch_placements([placement]))
            out, tout, ours, theirs = run_ours_and_torch(fn, [ours_in], [theirs_in])
            same = tuple(to_torch_placements(out.placements)) == tuple(tout.placements)
            if not same or ours.get_total_counts() > theirs.get_total_counts():
                differ.append(f"{name} {placement}: {out.placements} {dict(ours.get_comm_counts())} vs "
                              f"{tout.placements} {dict(theirs.get_comm_counts())}")  # fmt: skip
    return differ


def test_pools_place_and_communicate_as_torch_dtensor() -> None:
    assert run_world(_versus_torch, 2)[0] == []
