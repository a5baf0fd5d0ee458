"""DeviceMesh: an N-D grid of ranks with named dims, one process group per mesh dim.

A root mesh (from `init_device_mesh`) creates every process group once. Slices (`mesh["tp"]`,
`mesh["dp", "tp"]`) and flattened submeshes (`mesh.flatten("dp")`) are views of the root: they
remember which root dims each of their dims covers and reuse the root's groups, so slicing never
creates a group and a flattened group is created once, cached on the root under its name. Block groups
(`mesh.block_group(dim, k)`: consecutive k-rank blocks of a dim, fully_shard's reshard_after_forward=k)
are created once per root, dims and k, and cached on the root the same way.

Groups are held weakly, so `dist.destroy_process_group()` frees them while meshes (and every
DTensor, through its spec) are still alive. That matters at exit: a gloo group freed only during
interpreter finalization can have a worker thread that needs the GIL to free a finished
collective's tensors, and the process aborts ("terminate called without an active exception").
After the groups are destroyed a mesh still answers shape and rank questions; `get_group` raises.

`with mesh:` makes `mesh` this thread's current mesh (`current_mesh()`), which APIs given
`device_mesh=None` use, as torch's. A mesh pickles without its groups, as its root's (device type,
ranks, dim names) and the root dims it covers; unpickling takes the live root mesh with that key in
this process (the same slice or flattened view of it) and so its groups. Without a live root it
comes back detached: the same ranks and names, and `get_group` says how to fix it.
"""

from __future__ import annotations

import importlib
import math
import os
import threading
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

# A mesh dim's process group, held weakly (see the module docstring); None where there is none.
GroupRef = weakref.ref[ProcessGroup]

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
        _groups: Sequence[GroupRef | None] | None = None,
        _detached: bool = False,
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
        self._ranks = tuple(ranks.flatten().tolist())  # compared without tensor ops: meshes meet under fake tensors
        self._hash = hash((device_type, self._shape, self._ranks, self.mesh_dim_names))
        if _root is None:
            if len(set(ranks.flatten().tolist())) != ranks.numel():
                raise ValueError(f"mesh {ranks.tolist()} repeats a rank; each rank may appear once")
            self._flattened: dict[str, DeviceMesh] = {}
            self._flat_groups: dict[tuple[int, ...], GroupRef | None] = {}
            self._block_groups: dict[tuple[tuple[int, ...], int], GroupRef | None] = {}  # (dims, k) -> ours
            self._detached = _detached  # unpickled without a live root: no groups at all
            if _detached:
                _groups = [None] * ranks.ndim
            else:
                _groups = [_create_line_groups(ranks, (d,)) for d in range(ranks.ndim)]
                _live_roots.add(self)
        assert _groups is not None and len(_groups) == ranks.ndim
        self._groups = tuple(_groups)

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
        i = self._dim_index(mesh_dim or 0)
        ref = self._groups[i]
        group = ref() if ref is not None else None
        if group is None:
            raise RuntimeError(self._missing_group(i))
        return group

    def get_all_groups(self) -> list[ProcessGroup]:
        return [self.get_group(i) for i in range(self.ndim)]

    def _flattened_group(self, mesh_dims: Sequence[int]) -> ProcessGroup | None:
        """The group of `mesh_dims` (ascending) taken as one dim, if the root flattened exactly
        those dims; None otherwise. Redistribution runs one collective on it where torch's does."""
        key = tuple(d for m in mesh_dims for d in self._root_dims[m])
        ref = self._root._flat_groups.get(key)
        return ref() if ref is not None else None

    def _missing_group(self, i: int) -> str:
        """Why mesh dim `i` has no process group, and the fix."""
        dim = repr(self.mesh_dim_names[i]) if self.mesh_dim_names else str(i)
        root = self._root
        if self._coordinate is None:
            return f"rank {self._rank} is not part of {self}"
        if root._detached:
            return (
                f"{self} was unpickled in a process with no live root mesh {root}; build that mesh "
                f"(init_device_mesh(...)) on every rank before loading, and its groups are reattached"
            )
        if self._groups[i] is None:  # a flattened dim unpickled before the live root flattened it
            return (
                f"mesh dim {dim} of {self} flattens root dims {self._root_dims[i]}, which the live root "
                f"{root} has not flattened; flatten them (root[names].flatten(name)) on every rank before loading"
            )
        return (
            f"the process group of mesh dim {dim} of {self} was destroyed (dist.destroy_process_group()); "
            f"build a new mesh with init_device_mesh(...) after init_process_group()"
        )

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
        if root._detached:
            raise RuntimeError(self._missing_group(0))
        if dims not in root._flat_groups:
            root._flat_groups[dims] = _create_line_groups(root.mesh, dims)
        flat = root._view((dims,), (name,), [root._flat_groups[dims]])
        root._flattened[name] = flat
        return flat

    _flatten = flatten

    def block_group(self, mesh_dim: int | str, block_size: int) -> ProcessGroup:
        """The group of this rank's block of `block_size` consecutive ranks along `mesh_dim`.

        Every line of `mesh_dim` (one per coordinate of the other root dims) is cut into blocks of
        `block_size` ranks; this rank's index in its block is `get_local_rank(mesh_dim) % block_size`.
        fully_shard's reshard_after_forward=k gathers over them. Like a flattened group, a block group
        is created once per root, root dims and size, cached on the root and held weakly, so it lives
        no longer than the root mesh and `dist.destroy_process_group()` frees it. Every rank must call
        this with the same arguments in the same order the first time (`new_group` is collective).
        """
        i = self._dim_index(mesh_dim)
        size = self._shape[i]
        if block_size < 1 or size % block_size:
            dim = repr(self.mesh_dim_names[i]) if self.mesh_dim_names else str(i)
            raise ValueError(f"block_size {block_size} must divide the size {size} of mesh dim {dim} of {self}")
        if block_size == size:
            return self.get_group(i)
        root, key = self._root, (self._root_dims[i], block_size)
        if key not in root._block_groups:
            if root._detached:
                raise RuntimeError(self._missing_group(i))
            root._block_groups[key] = _create_line_groups(root.mesh, key[0], block_size)
        ref = root._block_groups[key]
        group = ref() if ref is not None else None
        if group is None:
            raise RuntimeError(self._missing_group(i))
        return group

    def _resolve_name(self, name: str) -> tuple[tuple[int, ...], GroupRef | None]:
        if self.mesh_dim_names is not None and name in self.mesh_dim_names:
            i = self.mesh_dim_names.index(name)
            return self._root_dims[i], self._groups[i]
        flat = self._root._flattened.get(name)
        if flat is not None:
            return flat._root_dims[0], flat._groups[0]
        known = list(self.mesh_dim_names or ()) + list(self._root._flattened)
        raise KeyError(f"mesh has no dim named {name!r}; known dims: {known}")

    def _view(
        self, root_dims: tuple[tuple[int, ...], ...], names: Sequence[str], groups: Sequence[GroupRef | None]
    ) -> DeviceMesh:
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

    # ------------------------------------------------------------------------- current mesh, pickle
    def __enter__(self) -> DeviceMesh:
        """Make this the current mesh of this thread until the `with` block ends (as torch)."""
        _current.stack.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        popped = _current.stack.pop()
        assert popped is self, f"`with` blocks of meshes exited out of order: left {self}, innermost was {popped}"

    def __reduce__(self) -> tuple:
        """Pickle as (root key, root dims, dim names), never the groups: see `_unpickle_mesh`."""
        root = self._root
        return (
            _unpickle_mesh,
            (root.device_type, root.mesh.tolist(), root.mesh_dim_names, self._root_dims, self.mesh_dim_names),
        )

    def _reslice(self, root_dims: tuple[tuple[int, ...], ...], names: tuple[str, ...] | None) -> DeviceMesh:
        """The view of this root over `root_dims` named `names`, with the groups slicing gave it.

        Creates no group (unpickling must not run collectives): a flattened dim this root has not
        flattened gets none, and `get_group` on it says to flatten first.
        """
        assert self._root is self
        if root_dims == self._root_dims and names == self.mesh_dim_names:
            return self
        assert names is not None, "only named meshes have views"
        if len(root_dims) == 1 and len(root_dims[0]) > 1:
            cached = self._flattened.get(names[0])
            if cached is not None and cached._root_dims == root_dims:
                return cached
        groups = [self._groups[dims[0]] if len(dims) == 1 else self._flat_groups.get(dims) for dims in root_dims]
        return self._view(root_dims, names, groups)

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
            and self._ranks == other._ranks
        )

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})"


# --------------------------------------------------------------------------------------------------
# process-wide state: torch keeps both too (its _mesh_resources), since `with mesh:` and unpickling
# have no argument to pass a mesh through
# --------------------------------------------------------------------------------------------------


class _MeshStack(threading.local):
    """The meshes entered with `with mesh:` on this thread, innermost last."""

    def __init__(self) -> None:
        self.stack: list[DeviceMesh] = []


class _LiveRoots:
    """The root meshes alive in this process by (device type, shape, ranks, dim names), held weakly
    (the registry keeps no mesh alive); the newest root of a key wins."""

    def __init__(self) -> None:
        self._roots: weakref.WeakValueDictionary[tuple, DeviceMesh] = weakref.WeakValueDictionary()

    @staticmethod
    def key(device_type: str, ranks: torch.Tensor, names: tuple[str, ...] | None) -> tuple:
        return (device_type, tuple(ranks.shape), tuple(ranks.flatten().tolist()), names)

    def add(self, root: DeviceMesh) -> None:
        self._roots[self.key(root.device_type, root.mesh, root.mesh_dim_names)] = root

    def find(self, device_type: str, ranks: torch.Tensor, names: tuple[str, ...] | None) -> DeviceMesh | None:
        return self._roots.get(self.key(device_type, ranks, names))


_current = _MeshStack()
_live_roots = _LiveRoots()


def current_mesh() -> DeviceMesh | None:
    """The innermost mesh entered with `with mesh:` on this thread, or None outside any."""
    return _current.stack[-1] if _current.stack else None


def _unpickle_mesh(
    device_type: str,
    root_ranks: list,
    root_names: tuple[str, ...] | None,
    root_dims: tuple[tuple[int, ...], ...],
    names: tuple[str, ...] | None,
) -> DeviceMesh:
    """A pickled mesh in this process: the same view of the live root mesh with the pickled key, so
    it shares that root's groups (a root comes back as the live root itself). A view is re-sliced
    around this process's rank, as slicing the live root here would. With no live root, a detached
    copy: same ranks and names, no groups."""
    ranks = torch.tensor(root_ranks, dtype=torch.int64)
    root = _live_roots.find(device_type, ranks, root_names)
    if root is None:
        root = DeviceMesh(device_type, ranks, mesh_dim_names=root_names, _detached=True)
    return root._reslice(root_dims, names)


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
    # torch.distributed.nn.functional binds group.WORLD into default arguments when first imported
    # (torch._dynamo imports it lazily, e.g. at an optimizer's first step), which would keep the
    # default group alive until interpreter exit, where gloo can abort; import it while WORLD is None
    importlib.import_module("torch.distributed.nn.functional")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:  # a plain `python script.py`: a world of one process
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _create_line_groups(ranks: torch.Tensor, dims: tuple[int, ...], block_size: int | None = None) -> GroupRef | None:
    """Create one group per line of `ranks` along `dims` (flattened), or per block of `block_size`
    consecutive ranks of each line; return (weakly) the one holding us.

    Every rank must call this with the same arguments: `new_group` is collective over the world.
    A group covering the whole world in rank order reuses the default group. c10d keeps every group
    alive until `destroy_process_group()`; the weak reference lets that call free it.
    """
    rest = [d for d in range(ranks.ndim) if d not in dims]
    n = math.prod(ranks.shape[d] for d in dims)
    lines = ranks.permute(*rest, *dims).reshape(-1, n).tolist()
    me = dist.get_rank()
    world = dist.get_world_size()
    mine: ProcessGroup | None = None
    for line in lines:
        if line != sorted(line):
            raise ValueError(
                f"mesh line {line} along dims {dims} is not in ascending rank order; collectives order "
                f"ranks ascending, so build the mesh from ascending ranks (e.g. torch.arange(n).view(...))"
            )
        step = block_size or n
        for block in (line[start : start + step] for start in range(0, n, step)):
            group = dist.group.WORLD if block == list(range(world)) else dist.new_group(block)
            if me in block:
                mine = group
    return weakref.ref(mine) if mine is not None else None


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
