"""_StridedShard as FSDP makes it: the dim-0 split inside TP's (shard order against mesh order), exact on
uneven sizes. (Its interleaved form, a view's flattened dim, is tested in test_strided_views.py.)

Every program compares with the global tensor on one process: local shards at their global
offsets, full_tensor, redistribution to and from every kind of placement, order-free ops running on
the shards, other ops gathering first, and the errors.
"""

from __future__ import annotations

import pytest
import torch

from parallelisms.dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from parallelisms.dtensor.placements import _StridedShard, local_shape_and_offset
from tests.dtensor.harness import get_mesh
from tests.world import run_world

ROWS = (1, 3, 7, 8, 13)  # uneven, tiny (empty shards) and even


@pytest.mark.parametrize("rows", [1, 3, 5, 7, 8, 13, 30])
@pytest.mark.parametrize("mesh_shape", [(2, 2), (3, 2), (2, 3), (2, 2, 2)])
def test_offsets_are_chunk_of_chunk(rows: int, mesh_shape: tuple[int, ...]) -> None:
    """Rank (d, t) holds chunk d of TP chunk t: one contiguous range, at its exact offset."""
    global_rows = torch.arange(rows)
    tp = mesh_shape[-1]
    placements = (*(Replicate(),) * (len(mesh_shape) - 2), _StridedShard(0, split_factor=tp), Shard(0))
    covered = []
    for coord in torch.cartesian_prod(*(torch.arange(n) for n in mesh_shape)).view(-1, len(mesh_shape)).tolist():
        d, t = coord[-2], coord[-1]
        tp_chunks = torch.chunk(global_rows, tp)
        tp_piece = tp_chunks[t] if t < len(tp_chunks) else global_rows[:0]
        dp_chunks = torch.chunk(tp_piece, mesh_shape[-2]) if len(tp_piece) else ()
        want = dp_chunks[d] if d < len(dp_chunks) else global_rows[:0]
        (size,), (offset,) = local_shape_and_offset((rows,), mesh_shape, coord, placements)
        assert size == len(want)
        if size:
            assert offset == want[0].item()
            if coord[0] == 0 or len(mesh_shape) == 2:
                covered.extend(range(offset, offset + size))
    assert sorted(covered) == list(range(rows))  # every row exactly once per replica


def _program(mesh_shape: tuple[int, ...]) -> int:
    names = ("dp_replicate", "dp", "tp")[-len(mesh_shape) :]
    mesh = get_mesh(mesh_shape, names)
    lead = (Replicate(),) * (len(mesh_shape) - 2)
    strided = (*lead, _StridedShard(0, split_factor=mesh_shape[-1]), Shard(0))
    checked = 0
    torch.manual_seed(0)
    for rows in ROWS:
        g = torch.randn(rows, 5)
        d = distribute_tensor(g, mesh, strided)
        shape, offset = d._spec.local_shape_and_offset()
        assert torch.equal(d.to_local(), g[offset[0] : offset[0] + shape[0]])
        assert torch.equal(d.full_tensor(), g)
        for target in (
            (*lead, Shard(0), Shard(0)),
            (*lead, Replicate(), Shard(1)),
            (*lead, Shard(1), Shard(0)),
            (*lead, Shard(1), Replicate()),
            strided,
        ):
            moved = d.redistribute(placements=target)
            assert torch.equal(moved.full_tensor(), g), target
            back = moved.redistribute(placements=strided)  # into the strided layout from anywhere
            assert torch.equal(back.to_local(), d.to_local()), target
        # order-free ops run on the shards and keep the layout
        e = d * 2 + 1
        assert e.placements == d.placements and torch.equal(e.full_tensor(), g * 2 + 1)
        norm = torch.linalg.vector_norm(d)
        assert all(isinstance(p, Partial) for p in norm.placements[-2:])
        torch.testing.assert_close(norm.full_tensor(), torch.linalg.vector_norm(g))
        z = torch.zeros_like(d)
        z.copy_(d)
        assert z.placements == d.placements and torch.equal(z.full_tensor(), g)
        items = [d.clone(), d.clone() * 3, distribute_tensor(torch.ones(rows), mesh, (*lead, Shard(0), Replicate()))]
        torch._foreach_mul_(items, 0.5)
        assert torch.equal(items[1].full_tensor(), g * 1.5) and items[1].placements == d.placements
        assert torch.equal(items[2].full_tensor(), torch.full((rows,), 0.5))
        # a strided and a plain shard hold other rows: mixing them must not run on the shards
        plain = distribute_tensor(g, mesh, (*lead, Shard(0), Shard(0)))
        torch.testing.assert_close((d + plain).full_tensor(), 2 * g)
        # ops that move elements gather the strided dim first
        torch.testing.assert_close(d.sum(dim=1).full_tensor(), g.sum(1))
        ones = distribute_tensor(torch.ones(5, 3), mesh, (*lead, Replicate(), Replicate()))
        torch.testing.assert_close(torch.mm(d, ones).full_tensor(), g @ torch.ones(5, 3))
        torch.testing.assert_close(d.t().contiguous().full_tensor(), g.t())
        with pytest.raises(NotImplementedError, match="writes into"):
            d.clone().unsqueeze_(0)
        checked += 1
    # other split factors are torch's interleaved layouts (tests/dtensor/test_strided_views.py); 0 is none
    with pytest.raises(ValueError, match="positive int"):
        distribute_tensor(torch.ones(4, 4), mesh, (*lead, _StridedShard(0, split_factor=0), Shard(0)))
    assert isinstance(d, DTensor)
    return checked


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 2, 2)])
def test_strided_shard_behaves_like_the_global_tensor(mesh_shape: tuple[int, ...]) -> None:
    world = 1
    for n in mesh_shape:
        world *= n
    assert run_world(_program, world, mesh_shape) == [len(ROWS)] * world
