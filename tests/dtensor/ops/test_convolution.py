"""Convolution on DTensors against one device: conv1d/2d/3d, strided, dilated, grouped and transposed, every
placement of input, weight and bias on 1-D and 2-D meshes (uneven sizes included), values and gradients. A
spatial shard stays sharded through forward and backward with only point-to-point halo exchanges, also when the
halo is wider than a neighbour's shard; torch's own DTensor cannot run that case."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dtensor.harness import MESHES, check_op, get_mesh
from tests.world import run_world


def _cases(gen: torch.Generator) -> list[tuple]:
    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return [
        (lambda x, w, b: F.conv1d(x, w, b, padding=1), [r(3, 4, 10), r(6, 4, 3), r(6)]),
        (lambda x, w, b: F.conv1d(x, w, b, padding=3), [r(2, 3, 8), r(2, 3, 7), r(2)]),  # halo 3 > chunk 2 on 4 ranks
        (lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=2, dilation=2), [r(2, 4, 7, 9), r(4, 4, 3, 3), r(4)]),
        (lambda x, w: F.conv2d(x, w, stride=2), [r(2, 3, 4, 8), r(5, 3, 2, 2)]),  # downsampling: no halo
        (lambda x, w: F.conv2d(x, w, padding=1, groups=2), [r(2, 4, 6, 5), r(6, 2, 3, 3)]),
        (lambda x, w, b: F.conv_transpose1d(x, w, b, stride=2, padding=1), [r(2, 4, 7), r(4, 3, 3), r(3)]),
        (lambda x, w, b: F.conv3d(x, w, b, padding=1), [r(1, 2, 4, 5, 6), r(3, 2, 3, 3, 3), r(3)]),
    ]


def _check(mesh_shape: tuple[int, ...]) -> int:
    mesh = get_mesh(mesh_shape)
    return sum(check_op(fn, inputs, mesh, partial=True, max_combos=16, atol=1e-4, rtol=1e-4)
               for fn, inputs in _cases(torch.Generator().manual_seed(0)))  # fmt: skip


@pytest.mark.parametrize("mesh_shape,world_size", MESHES)
def test_convolution_matches_single_device(mesh_shape: tuple[int, ...], world_size: int) -> None:
    assert all(n > 0 for n in run_world(_check, world_size, mesh_shape))


def _spatial_shard(width: int, kernel: int, padding: int) -> tuple:
    from parallelisms.dtensor import Replicate, Shard, distribute_tensor
    from parallelisms.dtensor.debug import CommDebugMode

    mesh = get_mesh((4,))
    gen = torch.Generator().manual_seed(0)
    x, w, b = (
        torch.randn(2, 3, 5, width, generator=gen),
        torch.randn(4, 3, kernel, kernel, generator=gen),
        torch.randn(4),
    )
    x.requires_grad_()
    want = F.conv2d(x, w, b, padding=padding)
    want.sum().backward()
    dx = distribute_tensor(x.detach(), mesh, [Shard(3)]).requires_grad_()
    dw, db = (distribute_tensor(t, mesh, [Replicate()]) for t in (w, b))
    with CommDebugMode() as comm:
        out = F.conv2d(dx, dw, db, padding=padding)
        out.sum().backward()
    torch.testing.assert_close(out.full_tensor(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx.grad.full_tensor(), x.grad, atol=1e-5, rtol=1e-5)
    kinds = {str(k).rsplit(".", 1)[-1] for k, n in comm.get_comm_counts().items() if n}
    return out.placements, dx.grad.placements, kinds


@pytest.mark.parametrize("width,kernel,padding", [(12, 3, 1), (6, 7, 3)])
def test_a_spatial_shard_stays_sharded_with_halo_exchanges_only(width: int, kernel: int, padding: int) -> None:
    from parallelisms.dtensor import Shard

    for placements, grad_placements, kinds in run_world(_spatial_shard, 4, width, kernel, padding):
        assert placements == grad_placements == (Shard(3),)
        assert not kinds & {"all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor", "all_to_all_single"}, kinds


def _two_spatial_shards() -> list[tuple]:
    from parallelisms.dtensor import Replicate, Shard, distribute_tensor

    mesh = get_mesh((2, 2))
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 3, 7, 9, generator=gen, requires_grad=True), torch.randn(4, 3, 3, 5, generator=gen)
    want = F.conv2d(x, w, padding=(1, 2), dilation=(2, 1))
    want.sum().backward()
    seen = []
    for placements in ((Shard(2), Shard(3)), (Shard(3), Shard(2)), (Shard(0), Shard(3))):
        dx = distribute_tensor(x.detach(), mesh, list(placements)).requires_grad_()
        out = F.conv2d(dx, distribute_tensor(w, mesh, [Replicate(), Replicate()]), padding=(1, 2), dilation=(2, 1))
        out.sum().backward()
        torch.testing.assert_close(out.full_tensor(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dx.grad.full_tensor(), x.grad, atol=1e-5, rtol=1e-5)
        seen.append((placements, out.placements, dx.grad.placements))
    return seen


def test_height_and_width_sharded_on_two_mesh_dims_exchange_halos_and_corners() -> None:
    """A (2, 2) mesh sharding height and width (dilated, asymmetric padding): the halos of both dims and the
    corners between them arrive; output and input gradient keep both shards."""
    for placements, out, grad in run_world(_two_spatial_shards, 4)[0]:
        assert out == grad == placements
