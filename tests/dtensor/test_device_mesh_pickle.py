"""DeviceMesh and DTensor pickling (pickle, torch.save / torch.load) and `with mesh:`, against torch's."""

from __future__ import annotations

import gc
import io
import pickle
import threading
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing import assert_close

from parallelisms.dtensor import (
    DeviceMesh,
    DTensor,
    Placement,
    Replicate,
    Shard,
    current_mesh,
    distribute_tensor,
    zeros,
)
from tests.dtensor.harness import get_mesh, get_torch_mesh, to_torch_placements
from tests.world import World

NAMES = {(2,): ("dp",), (2, 2): ("dp", "tp")}
# 4 ranks as dp_replicate(2) * dp_shard(1) * tp(2): flattening dp_replicate x dp_shard makes a group of
# its own ([0, 2] / [1, 3]), not the default group a whole-world flatten reuses
SHAPE_3D, NAMES_3D = (2, 1, 2), ("dp_replicate", "dp_shard", "tp")
WorldFactory = Callable[[int], World]


class _NamesSeen(pickle.Unpickler):
    """An unpickler that records every global (class, function) the pickle names."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.names: list[str] = []

    def find_class(self, module: str, name: str) -> object:
        self.names.append(f"{module}.{name}")
        return super().find_class(module, name)


def round_trip(obj):
    """pickle.loads(pickle.dumps(obj)), checking that no process group went into the pickle."""
    unpickler = _NamesSeen(pickle.dumps(obj))
    out = unpickler.load()
    assert not [n for n in unpickler.names if "c10d" in n or "ProcessGroup" in n], unpickler.names
    return out


def group_ranks(mesh: DeviceMesh, dim: int) -> list[int]:
    return dist.get_process_group_ranks(mesh.get_group(dim))


def same_mesh(got: DeviceMesh, want: DeviceMesh) -> None:
    """`got` (unpickled) is `want` on this rank: equal, same ranks and names, the very same groups."""
    assert got == want and hash(got) == hash(want)
    assert got.mesh.tolist() == want.mesh.tolist() and got.mesh_dim_names == want.mesh_dim_names
    assert got.get_coordinate() == want.get_coordinate()
    for d in range(want.ndim):
        assert got.get_group(d) is want.get_group(d), d


# --------------------------------------------------------------------------------------------------
# DeviceMesh
# --------------------------------------------------------------------------------------------------


def root_and_slices_round_trip(shape: tuple[int, ...]) -> None:
    names = NAMES[shape]
    mesh, tmesh = get_mesh(shape, names), get_torch_mesh(shape, names)
    assert round_trip(mesh) is mesh, "a root comes back as the live root itself"
    views = [mesh[n] for n in names] + ([mesh["dp", "tp"], mesh["tp", "dp"]] if len(shape) == 2 else [])
    for view in views:
        same_mesh(round_trip(view), view)
    for name in names:  # torch's unpickled slices hold groups of the same ranks
        theirs = pickle.loads(pickle.dumps(tmesh[name]))
        assert group_ranks(round_trip(mesh[name]), 0) == dist.get_process_group_ranks(theirs.get_group())


@pytest.mark.parametrize("shape", [(2,), (2, 2)])
def test_mesh_and_slices_unpickle_onto_the_live_root_groups(world: WorldFactory, shape: tuple[int, ...]) -> None:
    world(len(shape) * 2).run(root_and_slices_round_trip, shape)


def flattened_round_trip() -> None:
    mesh, tmesh = get_mesh(SHAPE_3D, NAMES_3D), get_torch_mesh(SHAPE_3D, NAMES_3D)
    dp = mesh["dp_replicate", "dp_shard"].flatten("dp")
    assert dp.get_group() is not dist.group.WORLD and len(group_ranks(dp, 0)) == 2
    assert round_trip(dp) is dp, "a flattened mesh comes back as the root's cached one"
    same_mesh(round_trip(mesh["dp", "tp"]), mesh["dp", "tp"])
    same_mesh(round_trip(mesh["tp", "dp"]), mesh["tp", "dp"])
    theirs = pickle.loads(pickle.dumps(tmesh["dp_replicate", "dp_shard"]._flatten("dp")))
    assert group_ranks(dp, 0) == dist.get_process_group_ranks(theirs.get_group())


def test_flattened_mesh_unpickles_as_the_cached_flatten(world: WorldFactory) -> None:
    world(4).run(flattened_round_trip)


def unpickle_another_ranks_slice() -> None:
    """Rank 0's pickle of its tp slice, loaded on every rank: each gets the tp slice holding itself,
    as slicing the live root there would."""
    mesh = get_mesh((2, 2), NAMES[(2, 2)])
    data = [pickle.dumps(mesh["tp"]) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(data, src=0)
    assert isinstance(data[0], bytes)
    same_mesh(pickle.loads(data[0]), mesh["tp"])


def test_slice_pickled_on_one_rank_unpickles_around_each_rank(world: WorldFactory) -> None:
    world(4).run(unpickle_another_ranks_slice)


def detached_until_the_root_exists() -> None:
    ranks = [[0, 1], [2, 3]]
    root = DeviceMesh("cpu", ranks, mesh_dim_names=("a", "b"))
    want_ranks, want_coordinate = root["b"].mesh.tolist(), root["b"].get_coordinate()
    data = pickle.dumps(root["b"])
    del root
    gc.collect()
    detached = pickle.loads(data)  # no live root with this key any more
    assert detached.mesh.tolist() == want_ranks and detached.get_coordinate() == want_coordinate
    assert detached.mesh_dim_names == ("b",) and detached.size() == 2
    with pytest.raises(RuntimeError, match=r"unpickled .* no live root mesh .*init_device_mesh"):
        detached.get_group()
    root = DeviceMesh("cpu", ranks, mesh_dim_names=("a", "b"))
    same_mesh(pickle.loads(data), root["b"])


def test_mesh_without_live_root_unpickles_detached_and_says_how_to_fix(world: WorldFactory) -> None:
    world(4).run(detached_until_the_root_exists)


# --------------------------------------------------------------------------------------------------
# DTensor
# --------------------------------------------------------------------------------------------------

PLACEMENTS: dict[tuple[int, ...], list[list[Placement]]] = {
    (2,): [[Shard(0)], [Shard(1)], [Replicate()]],
    (2, 2): [[Shard(0), Replicate()], [Replicate(), Shard(1)], [Shard(0), Shard(1)], [Shard(1), Shard(1)]],
}


def save_and_load(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def dtensor_state_dict_round_trip(shape: tuple[int, ...]) -> None:
    from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

    names = NAMES[shape]
    mesh, tmesh = get_mesh(shape, names), get_torch_mesh(shape, names)
    torch.manual_seed(0)
    full = torch.randn(5, 6)  # 5 rows: uneven shards over 2
    state: dict[str, torch.Tensor] = {
        f"w{i}": distribute_tensor(full, mesh, p) for i, p in enumerate(PLACEMENTS[shape])
    }
    state["param"] = nn.Parameter(distribute_tensor(full, mesh, PLACEMENTS[shape][0]))
    state["slice"] = distribute_tensor(full, mesh[names[-1]], [Shard(1)])
    state["plain"] = full
    loaded = save_and_load(state)
    assert loaded.keys() == state.keys() and torch.equal(loaded["plain"], full)
    for key, want in state.items():
        got = loaded[key]
        if not isinstance(want, DTensor):
            continue
        assert type(got) is DTensor, (key, type(got))
        assert got.placements == want.placements, key
        same_mesh(got.device_mesh, want.device_mesh)
        assert got._spec == want._spec and hash(got._spec) == hash(want._spec), key
        assert got.shape == want.shape and got.stride() == want.stride(), key
        assert got.requires_grad == want.requires_grad, key
        assert_close(got.to_local(), want.to_local(), rtol=0, atol=0)
        assert_close(got.full_tensor(), full, rtol=0, atol=0)
    param = loaded["param"]
    assert isinstance(param, nn.Parameter) and isinstance(param, DTensor) and param.requires_grad
    (param.full_tensor() * 2).sum().backward()  # the loaded parameter trains: a DTensor grad like it
    assert isinstance(param.grad, DTensor) and param.grad.placements == tuple(PLACEMENTS[shape][0])
    grad = param.grad
    assert_close(grad.full_tensor(), torch.full_like(full, 2.0))
    for i, p in enumerate(PLACEMENTS[shape]):  # torch's DTensor, saved and loaded: the same shards
        theirs = save_and_load({"w": torch_distribute_tensor(full, tmesh, to_torch_placements(p))})["w"]
        assert_close(loaded[f"w{i}"].to_local(), theirs.to_local(), rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(2,), (2, 2)])
def test_dtensor_state_dict_torch_save_load_round_trip(world: WorldFactory, shape: tuple[int, ...]) -> None:
    world(len(shape) * 2).run(dtensor_state_dict_round_trip, shape)


# --------------------------------------------------------------------------------------------------
# with mesh:
# --------------------------------------------------------------------------------------------------


def with_mesh_is_the_default(shape: tuple[int, ...]) -> None:
    from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

    names = NAMES[shape]
    mesh, tmesh = get_mesh(shape, names), get_torch_mesh(shape, names)
    placements = PLACEMENTS[shape][-1]
    full = torch.arange(24.0).view(4, 6)
    assert current_mesh() is None
    with mesh as entered:
        assert entered is mesh and current_mesh() is mesh
        ours = distribute_tensor(full, placements=placements)
        again = DTensor.from_local(ours.to_local(), placements=placements, shape=full.shape, stride=full.stride())
        zero = zeros(4, 6, placements=placements)
        seen_elsewhere: list[DeviceMesh | None] = []
        thread = threading.Thread(target=lambda: seen_elsewhere.append(current_mesh()))
        thread.start()
        thread.join()
        with mesh[names[-1]] as inner:
            assert current_mesh() is inner
            assert distribute_tensor(full, placements=[Shard(0)]).device_mesh is inner
        assert current_mesh() is mesh
    assert current_mesh() is None
    assert seen_elsewhere == [None], "the current mesh is per thread, as torch's"
    for dt in (ours, again, zero):
        assert dt.device_mesh is mesh and dt.placements == tuple(placements)
    assert_close(again.full_tensor(), full)
    assert_close(zero.full_tensor(), torch.zeros(4, 6))
    with tmesh:  # torch's `with mesh:` gives the same shards
        theirs = torch_distribute_tensor(full, placements=to_torch_placements(placements))
    assert_close(ours.to_local(), theirs.to_local(), rtol=0, atol=0)
    with pytest.raises(KeyError), mesh:  # an exception leaves the block, and the mesh with it
        raise KeyError("boom")
    assert current_mesh() is None
    with pytest.raises(ValueError, match="with mesh"):
        distribute_tensor(full, placements=[Shard(0)])


@pytest.mark.parametrize("shape", [(2,), (2, 2)])
def test_with_mesh_makes_it_the_mesh_of_calls_without_device_mesh(world: WorldFactory, shape: tuple[int, ...]) -> None:
    world(len(shape) * 2).run(with_mesh_is_the_default, shape)
