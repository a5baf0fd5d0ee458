"""DeviceMesh: an N-D grid of ranks with named dims, one process group per mesh dim.

A root mesh (from `init_device_mesh`) creates every process group once. Slices (`mesh["tp"]`,
`mesh["dp", "tp"]`) and flattened submeshes (`mesh.flatten("dp")`) are views of the root: they
remember which root dims each of their dims covers and reuse the root's groups, so slicing never
creates a group and a flattened group is created once, cached on the root under its name.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

DEVICE_TYPES = ("cpu", "cuda")
BACKEND_FOR_DEVICE = {"cpu": "gloo", "cuda": "nccl"}


class DeviceMesh:
    """N-D mesh of ranks. Mirrors torch's DeviceMesh.

    Build the root with `init_device_mesh` (or `DeviceMesh(device_type, ranks, mesh_dim_names=...)`,
    which every rank must call in the same order since it creates process groups).
    """

    def __init__(
        self,
        device_type: str,
        mesh: torch.Tensor | Sequence,
        *,
        mesh_dim_names: Sequence[str] | None = None,
        _root: DeviceMesh | None = None,
        _root_dims: tuple[tuple[int, ...], ...] | None = None,
        _groups: list[ProcessGroup | None] | None = None,
    ) -> None:
        _check_device_type(device_type)
        ranks = (
            mesh.detach().to("cpu", torch.int64)
            if isinstance(mesh, torch.Tensor)
            else torch.tensor(mesh, dtype=torch.int64)
        )
        self.device_type = device_type
        self.mesh = ranks
        self.mesh_dim_names = _check_dim_names(mesh_dim_names, ranks.ndim)
        self._root = self if _root is None else _root
        self._root_dims = _root_dims if _root_dims is not None else tuple((i,) for i in range(ranks.ndim))
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        hits = (ranks == self._rank).nonzero()
        self._coordinate: tuple[int, ...] | None = tuple(hits[0].tolist()) if len(hits) else None
        self._shape = tuple(ranks.shape)
        self._hash = hash((device_type, self._shape, tuple(ranks.flatten().tolist()), self.mesh_dim_names))
        if _root is None:
            if len(set(ranks.flatten().tolist())) != ranks.numel():
                raise ValueError(f"mesh {ranks.tolist()} repeats a rank; each rank may appear once")
            self._flattened: dict[str, DeviceMesh] = {}
            self._flat_groups: dict[tuple[int, ...], ProcessGroup | None] = {}
            _groups = [_create_line_groups(ranks, (d,)) for d in range(ranks.ndim)]
        assert _groups is not None and len(_groups) == ranks.ndim
        self._groups = _groups

    # ---------------------------------------------------------------------------------- properties
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def size(self, mesh_dim: int | str | None = None) -> int:
        if mesh_dim is None:
            return math.prod(self._shape)
        return self._shape[self._dim_index(mesh_dim)]

    def get_rank(self) -> int:
        return self._rank

    def get_coordinate(self) -> list[int] | None:
        """This rank's index along every mesh dim, or None if it is not part of the mesh."""
        return list(self._coordinate) if self._coordinate is not None else None

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        if mesh_dim is None and self.ndim != 1:
            raise ValueError(f"get_local_rank() needs a mesh_dim on a {self.ndim}-D mesh {self.mesh_dim_names}")
        if self._coordinate is None:
            raise RuntimeError(f"rank {self._rank} is not part of {self}")
        return self._coordinate[self._dim_index(mesh_dim or 0)]

    def get_group(self, mesh_dim: int | str | None = None) -> ProcessGroup:
        if mesh_dim is None and self.ndim != 1:
            raise ValueError(f"get_group() needs a mesh_dim on a {self.ndim}-D mesh {self.mesh_dim_names}")
        group = self._groups[self._dim_index(mesh_dim or 0)]
        if group is None:
            raise RuntimeError(f"rank {self._rank} is not part of {self}")
        return group

    def get_all_groups(self) -> list[ProcessGroup]:
        return [self.get_group(i) for i in range(self.ndim)]

    # ----------------------------------------------------------------------------- slicing, flatten
    def __getitem__(self, names: str | Sequence[str]) -> DeviceMesh:
        """Submesh over the named dims, in the order given; flattened names of the root work too."""
        names = (names,) if isinstance(names, str) else tuple(names)
        if not names:
            raise ValueError("slice a DeviceMesh with at least one dim name")
        if len(names) == 1 and self.mesh_dim_names == names:
            return self
        if len(set(names)) != len(names):
            raise ValueError(f"mesh dim names {names} repeat a name")
        root_dims, groups = [], []
        for name in names:
            dims, group = self._resolve_name(name)
            root_dims.append(dims)
            groups.append(group)
        used = [d for dims in root_dims for d in dims]
        if len(set(used)) != len(used):
            raise ValueError(f"mesh dims {names} overlap in the root mesh {self._root.mesh_dim_names}")
        return self._root._view(tuple(root_dims), names, groups)

    def flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """1-D submesh over all dims of this mesh (row-major), cached on the root by name."""
        if self.mesh_dim_names is None:
            raise ValueError("flatten() needs a mesh with mesh_dim_names")
        name = mesh_dim_name or "_".join(self.mesh_dim_names)
        dims = tuple(d for group in self._root_dims for d in group)
        root = self._root
        if root.mesh_dim_names is not None and name in root.mesh_dim_names:
            if self.ndim == 1 and self.mesh_dim_names == (name,):
                return self
            raise ValueError(f"flatten name {name!r} already names a dim of the root mesh {root.mesh_dim_names}")
        cached = root._flattened.get(name)
        if cached is not None:
            if cached._root_dims != (dims,):
                raise ValueError(
                    f"flatten name {name!r} already names root dims {cached._root_dims[0]}, not {dims}; "
                    f"pick another name"
                )
            return cached
        if dims not in root._flat_groups:
            root._flat_groups[dims] = _create_line_groups(root.mesh, dims)
        flat = root._view((dims,), (name,), [root._flat_groups[dims]])
        root._flattened[name] = flat
        return flat

    _flatten = flatten

    def _resolve_name(self, name: str) -> tuple[tuple[int, ...], ProcessGroup | None]:
        if self.mesh_dim_names is not None and name in self.mesh_dim_names:
            i = self.mesh_dim_names.index(name)
            return self._root_dims[i], self._groups[i]
        flat = self._root._flattened.get(name)
        if flat is not None:
            return flat._root_dims[0], flat._groups[0]
        known = list(self.mesh_dim_names or ()) + list(self._root._flattened)
        raise KeyError(f"mesh has no dim named {name!r}; known dims: {known}")

    def _view(self, root_dims: tuple[tuple[int, ...], ...], names: Sequence[str], groups: list) -> DeviceMesh:
        """Submesh of this root holding this rank, over `root_dims` (each possibly flattened)."""
        assert self._root is self
        used = [d for dims in root_dims for d in dims]
        rest = [d for d in range(self.ndim) if d not in used]
        coord = self._coordinate or (0,) * self.ndim
        ranks = (
            self.mesh.permute(*used, *rest)[(...,) + tuple(coord[d] for d in rest)]
            if rest
            else self.mesh.permute(*used)
        )
        shape = [math.prod(self._shape[d] for d in dims) for dims in root_dims]
        return DeviceMesh(
            self.device_type,
            ranks.reshape(shape),
            mesh_dim_names=names,
            _root=self,
            _root_dims=root_dims,
            _groups=groups,
        )

    def _dim_index(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, str):
            if self.mesh_dim_names is None or mesh_dim not in self.mesh_dim_names:
                raise KeyError(f"mesh has no dim named {mesh_dim!r}; known dims: {self.mesh_dim_names}")
            return self.mesh_dim_names.index(mesh_dim)
        if not -self.ndim <= mesh_dim < self.ndim:
            raise IndexError(f"mesh dim {mesh_dim} is out of range for a {self.ndim}-D mesh")
        return mesh_dim % self.ndim

    # --------------------------------------------------------------------------------- identity
    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, DeviceMesh)
            and self._hash == other._hash
            and self.device_type == other.device_type
            and self._shape == other._shape
            and self.mesh_dim_names == other.mesh_dim_names
            and torch.equal(self.mesh, other.mesh)
        )

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})"


def init_device_mesh(
    device_type: str, mesh_shape: Sequence[int], *, mesh_dim_names: Sequence[str] | None = None
) -> DeviceMesh:
    """Root mesh of `mesh_shape` over all ranks (row-major), creating one process group per line.

    Initializes the default process group from torchrun's environment when none exists
    ("gloo" for cpu, "nccl" for cuda; a single process without torchrun gets a world of 1).
    """
    _check_device_type(device_type)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    _check_dim_names(mesh_dim_names, len(mesh_shape))
    if not dist.is_initialized():
        init_default_process_group(device_type)
    world_size = dist.get_world_size()
    if math.prod(mesh_shape) != world_size:
        names = mesh_dim_names or [f"dim{i}" for i in range(len(mesh_shape))]
        product = " * ".join(f"{n}({s})" for n, s in zip(names, mesh_shape))
        raise ValueError(
            f"mesh shape {product} = {math.prod(mesh_shape)} != world_size({world_size}); "
            f"make the dims multiply to the number of ranks"
        )
    return DeviceMesh(device_type, torch.arange(world_size).view(mesh_shape), mesh_dim_names=mesh_dim_names)


def init_default_process_group(device_type: str) -> None:
    """Default process group from torchrun's env (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    backend = BACKEND_FOR_DEVICE[device_type]
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:  # a plain `python script.py`: a world of one process
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _create_line_groups(ranks: torch.Tensor, dims: tuple[int, ...]) -> ProcessGroup | None:
    """Create one group per line of `ranks` along `dims` (flattened); return the one holding us.

    Every rank must call this with the same arguments: `new_group` is collective over the world.
    A line covering the whole world in rank order reuses the default group.
    """
    rest = [d for d in range(ranks.ndim) if d not in dims]
    lines = ranks.permute(*rest, *dims).reshape(-1, math.prod(ranks.shape[d] for d in dims)).tolist()
    me = dist.get_rank()
    world = dist.get_world_size()
    mine: ProcessGroup | None = None
    for line in lines:
        if line != sorted(line):
            raise ValueError(
                f"mesh line {line} along dims {dims} is not in ascending rank order; collectives order "
                f"ranks ascending, so build the mesh from ascending ranks (e.g. torch.arange(n).view(...))"
            )
        if line == list(range(world)):
            group = dist.group.WORLD
        else:
            group = dist.new_group(line)
        if me in line:
            mine = group
    return mine


def _check_device_type(device_type: str) -> None:
    if device_type not in DEVICE_TYPES:
        hint = (
            f"; pass {device_type.split(':')[0]!r}: the device index comes from LOCAL_RANK"
            if ":" in device_type
            else ""
        )
        raise ValueError(f"device_type {device_type!r} is not supported, use one of {DEVICE_TYPES}{hint}")


def _check_dim_names(names: Sequence[str] | None, ndim: int) -> tuple[str, ...] | None:
    if names is None:
        return None
    names = tuple(names)
    if len(names) != ndim:
        raise ValueError(f"mesh_dim_names {names} has {len(names)} names for a {ndim}-D mesh; give one per dim")
    if len(set(names)) != len(names):
        raise ValueError(f"mesh_dim_names {names} repeat a name; names must be unique")
    return names
