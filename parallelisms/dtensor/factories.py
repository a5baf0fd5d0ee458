"""DTensor factories that allocate only the local shard: zeros, ones, empty, full, rand, randn.

`rand`/`randn` make the same global tensor whatever the mesh and placements: the global tensor is
cut, in row-major order, into fixed blocks of `BLOCK` elements and block b is drawn from a generator
seeded by (base seed, b). A rank draws only the blocks that hold its shard, one group of rows at a
time, so memory stays at its shard plus a block. The base seed comes from torch's default CPU
generator, so every rank must be seeded alike (`torch.manual_seed(s)` everywhere), as torchtitan does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import torch

from .device_mesh import DeviceMesh, current_mesh
from .dtensor import DTensor
from .placements import Placement, Replicate, normalize_placements
from .spec import DTensorSpec, TensorMeta, contiguous_stride

BLOCK = 1 << 16  # elements per independently seeded block
_ROWS_BUDGET = 1 << 20  # elements of global rows materialized at once while slicing out the shard
_GOLDEN = 0x9E3779B97F4A7C15


def _size(size: tuple) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        return tuple(size[0])
    return tuple(size)


def _build(
    fill: Callable[[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device, tuple[int, ...]], torch.Tensor],
    size: tuple,
    dtype: torch.dtype | None,
    requires_grad: bool,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement] | None,
) -> DTensor:
    if device_mesh is None:
        device_mesh = current_mesh()
    if device_mesh is None:
        raise ValueError(
            "DTensor factories need device_mesh=; pass one built with init_device_mesh(...), or call them "
            "inside `with mesh:`"
        )
    shape = _size(size)
    dtype = dtype or torch.get_default_dtype()
    placements = normalize_placements(placements or [Replicate()] * device_mesh.ndim, len(shape), device_mesh.ndim)
    spec = DTensorSpec(device_mesh, placements, TensorMeta(torch.Size(shape), contiguous_stride(shape), dtype))
    local_shape, offset = spec.local_shape_and_offset()
    if device_mesh.get_coordinate() is None:  # off the mesh: an empty shard, as torch
        local = torch.empty(0, dtype=dtype, device=device_mesh.device_type)
    else:
        local = fill(local_shape, offset, dtype, torch.device(device_mesh.device_type), shape)
    return DTensor(local.requires_grad_(requires_grad), spec, requires_grad=requires_grad)


LocalFill = Callable[[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device, tuple[int, ...]], torch.Tensor]


def _factory(name: str, make_fill: Callable[[], LocalFill], doc: str) -> Callable[..., DTensor]:
    """A torch-style factory `name(*size, dtype=, requires_grad=, device_mesh=, placements=)`.

    `make_fill()` runs once per call (rand/randn draw their base seed there) and returns the
    function that fills this rank's shard given (local shape, global offset, dtype, device, global shape).
    """

    def factory(
        *size: int | Sequence[int],
        dtype: torch.dtype | None = None,
        requires_grad: bool = False,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
    ) -> DTensor:
        return _build(make_fill(), size, dtype, requires_grad, device_mesh, placements)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = doc
    return factory


zeros = _factory("zeros", lambda: lambda s, o, d, dev, g: torch.zeros(s, dtype=d, device=dev), "Zeros.")
ones = _factory("ones", lambda: lambda s, o, d, dev, g: torch.ones(s, dtype=d, device=dev), "Ones.")
empty = _factory("empty", lambda: lambda s, o, d, dev, g: torch.empty(s, dtype=d, device=dev), "Uninitialized.")
rand = _factory(
    "rand",
    lambda: partial(_blocked, torch.rand, _base_seed()),
    "Uniform [0, 1) values; the same global tensor on any mesh and placements.",
)
randn = _factory(
    "randn",
    lambda: partial(_blocked, torch.randn, _base_seed()),
    "Standard normal values; the same global tensor on any mesh and placements.",
)


def full(
    size: Sequence[int],
    fill_value: float,
    *,
    dtype: torch.dtype | None = None,
    requires_grad: bool = False,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    return _build(
        lambda s, o, d, dev, g: torch.full(s, fill_value, dtype=d, device=dev),
        (size,),
        dtype,
        requires_grad,
        device_mesh,
        placements,
    )


def _base_seed() -> int:
    return int(torch.randint(0, 2**62, (1,)).item())


def _blocked(
    draw, base: int, local_shape, offset, dtype, device, global_shape, *, out=None, transform=None
) -> torch.Tensor:
    """This rank's slice of the blocked global random tensor (see module doc), written into `out`
    (default: a new tensor) one group of rows at a time, each passed through `transform` first,
    so memory stays at the shard plus one group of rows."""
    out = torch.empty(local_shape, dtype=dtype, device=device) if out is None else out
    transform = transform or (lambda v: v)
    if out.numel() == 0:
        return out
    if len(global_shape) == 0:
        return out.copy_(transform(_draw_range(draw, base, 0, 1, dtype, device)).view(()))
    row = math.prod(global_shape[1:])  # elements per global dim-0 row
    rows_at_once = max(1, _ROWS_BUDGET // max(row, 1))
    inner = tuple(slice(o, o + s) for o, s in zip(offset[1:], local_shape[1:]))
    for start in range(0, local_shape[0], rows_at_once):
        count = min(rows_at_once, local_shape[0] - start)
        first_row = offset[0] + start
        values = _draw_range(draw, base, first_row * row, (first_row + count) * row, dtype, device)
        out[start : start + count] = transform(values.view(count, *global_shape[1:])[(slice(None), *inner)])
    return out


def _draw_range(draw, base: int, begin: int, end: int, dtype, device) -> torch.Tensor:
    """Flat elements [begin, end) of the blocked stream."""
    first, last = begin // BLOCK, (end - 1) // BLOCK
    gen = torch.Generator(device=device)
    blocks = []
    for b in range(first, last + 1):
        gen.manual_seed((base ^ (b * _GOLDEN)) & (2**63 - 1))
        blocks.append(draw(BLOCK, generator=gen, dtype=dtype, device=device))
    flat = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
    return flat[begin - first * BLOCK : end - first * BLOCK]
