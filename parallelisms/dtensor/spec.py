"""TensorMeta and DTensorSpec: the global metadata of a DTensor, hashable so it can key caches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from .placements import Partial, Placement, Shard, local_shape_and_offset

if TYPE_CHECKING:
    from .device_mesh import DeviceMesh


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Global shape, stride and dtype of the logical tensor."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    # the stride is exactly the contiguous one of the shape, which wrappers get without being told
    # (passing strides costs _make_wrapper_subclass half its time)
    contiguous: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "contiguous", tuple(self.stride) == contiguous_stride(self.shape))


@dataclass(frozen=True, slots=True, eq=False)
class DTensorSpec:
    """Where a global tensor lives: mesh, one placement per mesh dim, and its global metadata.

    Equality and hash cover (mesh, placements, meta); the hash is computed once because specs key
    the sharding-propagation cache on every op.
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    tensor_meta: TensorMeta
    _hash: int = field(init=False, repr=False, compare=False)
    _partial: bool = field(init=False, repr=False, compare=False)  # has_partial(), for the hot path

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.mesh, self.placements, self.tensor_meta)))
        object.__setattr__(self, "_partial", any(isinstance(p, Partial) for p in self.placements))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, DTensorSpec)
            and self._hash == other._hash
            and self.mesh == other.mesh
            and self.placements == other.placements
            and self.tensor_meta == other.tensor_meta
        )

    @property
    def shape(self) -> torch.Size:
        return self.tensor_meta.shape

    @property
    def stride(self) -> tuple[int, ...]:
        return self.tensor_meta.stride

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor_meta.dtype

    @property
    def ndim(self) -> int:
        return len(self.tensor_meta.shape)

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.mesh

    def with_placements(self, placements: tuple[Placement, ...]) -> DTensorSpec:
        return DTensorSpec(self.mesh, placements, self.tensor_meta)

    def is_replicated(self) -> bool:
        return all(p.is_replicate() for p in self.placements)

    def has_partial(self) -> bool:
        return self._partial

    def shard_mesh_dims(self, tensor_dim: int) -> list[int]:
        """Mesh dims that shard `tensor_dim`, in nesting order."""
        return [i for i, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == tensor_dim]

    def local_shape_and_offset(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """This rank's shard shape and global offset (empty shape/offset off the mesh)."""
        coordinate = self.mesh.get_coordinate()
        if coordinate is None:
            return (0,) * self.ndim, (0,) * self.ndim
        return local_shape_and_offset(self.shape, self.mesh.shape, coordinate, self.placements)

    def __str__(self) -> str:
        return f"Spec({'|'.join(map(str, self.placements))} on {tuple(self.shape)})"


def stride_order(shape: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    """The dims of size > 1 from outermost to innermost in memory (ties keep dim order)."""
    dims = [d for d in range(len(shape)) if shape[d] > 1]
    return tuple(sorted(dims, key=lambda d: -stride[d]))


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """torch.empty(shape).stride(): row-major, a size-0 dim counted as 1."""
    out = [0] * len(shape)
    acc = 1
    for d in range(len(shape) - 1, -1, -1):
        out[d] = acc
        acc *= max(shape[d], 1)
    return tuple(out)


@lru_cache(maxsize=4096)
def is_contiguous_stride(shape: torch.Size, stride: tuple[int, ...]) -> bool:
    """Whether `stride` is row-major for `shape`, size-1 dims aside (torch's is_contiguous)."""
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


def dense_stride_like(stride: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """Dense strides of `shape` laid out in the dim order of `stride` (a shard of a dense tensor)."""
    order = sorted(range(len(shape)), key=lambda d: (-stride[d], d))
    out = [0] * len(shape)
    acc = 1
    for d in reversed(order):
        out[d] = acc
        acc *= max(shape[d], 1)
    return tuple(out)


def is_dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Non-overlapping and dense: each dim's stride is the product of the sizes laid out inside it."""
    dense = dense_stride_like(stride, shape)
    return all(shape[d] <= 1 or stride[d] == dense[d] for d in range(len(shape)))
