"""FFT ops on DTensors against one device: every placement of the input on 1-D and 2-D meshes (uneven sizes
included), values and gradients; a shard of an untransformed dim stays sharded with no collective, as torch's."""

from __future__ import annotations

import pytest
import torch

from tests.dtensor.harness import MESHES, check_op, get_mesh
from tests.world import run_world


def _cases(gen: torch.Generator) -> list[tuple]:
    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    def c(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.complex64)

    return [
        (lambda x: torch.fft.fft(x), [c(4, 6)]),  # c2c along the last dim
        (lambda x: torch.fft.rfft(x, dim=0), [r(6, 5)]),  # r2c along dim 0
        (lambda x: torch.fft.irfft(x, n=8), [c(5, 5)]),  # c2r
        (lambda x: torch.fft.fftn(x, dim=(1, 2)), [c(3, 4, 6)]),
        (lambda x: torch.fft.ifft(x, dim=1, norm="ortho"), [c(4, 6, 2)]),
        (lambda x: torch.fft.rfft2(x), [r(3, 4, 6)]),
    ]


def _check(mesh_shape: tuple[int, ...]) -> int:
    mesh = get_mesh(mesh_shape)
    return sum(check_op(fn, inputs, mesh, partial=True, atol=1e-4, rtol=1e-4)
               for fn, inputs in _cases(torch.Generator().manual_seed(0)))  # fmt: skip


@pytest.mark.parametrize("mesh_shape,world_size", MESHES)
def test_fft_matches_single_device(mesh_shape: tuple[int, ...], world_size: int) -> None:
    assert all(n > 0 for n in run_world(_check, world_size, mesh_shape))


def _batch_sharded() -> tuple:
    from parallelisms.dtensor import Shard, distribute_tensor
    from parallelisms.dtensor.debug import CommDebugMode

    mesh = get_mesh((2,))
    x = distribute_tensor(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), mesh, [Shard(0)])
    with CommDebugMode() as comm:
        y = torch.fft.rfft(x)
    return y.placements, comm.get_total_counts()


def test_a_batch_shard_stays_without_collectives() -> None:
    from parallelisms.dtensor import Shard

    placements, collectives = run_world(_batch_sharded, 2)[0]
    assert placements == (Shard(0),) and collectives == 0
