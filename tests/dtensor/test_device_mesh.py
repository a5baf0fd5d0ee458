"""DeviceMesh: groups per mesh dim, slicing, flatten and errors, against torch's DeviceMesh."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

from parallelisms.dtensor import DeviceMesh, init_device_mesh
from tests.dtensor.harness import get_mesh, get_torch_mesh
from tests.world import run_world

NAMES = {(2, 2): ("dp", "tp"), (2, 2, 2): ("dp_replicate", "dp_shard", "tp")}


def group_ranks(mesh, dim) -> list[int]:
    return dist.get_process_group_ranks(mesh.get_group(dim))


def expected_submesh(root: torch.Tensor, dims: list[int], coordinate: list[int]) -> torch.Tensor:
    """Ranks of the submesh over root `dims` (in that order) that holds this rank, from torch only."""
    rest = [d for d in range(root.ndim) if d not in dims]
    return root.permute(*dims, *rest)[(...,) + tuple(coordinate[d] for d in rest)]


def pg_count() -> int:
    return len(_world.pg_map)


def same_as_torch(ours, theirs) -> None:
    """Every per-rank fact of two meshes agrees."""
    assert ours.mesh.tolist() == theirs.mesh.tolist()
    assert ours.shape == tuple(theirs.shape) and ours.ndim == theirs.ndim
    assert ours.size() == theirs.size() and ours.mesh_dim_names == theirs.mesh_dim_names
    assert ours.get_coordinate() == list(theirs.get_coordinate())
    for d in range(ours.ndim):
        assert ours.size(d) == theirs.size(d)
        assert ours.get_local_rank(d) == theirs.get_local_rank(d)
        assert group_ranks(ours, d) == dist.get_process_group_ranks(theirs.get_group(d)), d
        name = ours.mesh_dim_names[d] if ours.mesh_dim_names else None
        if name is not None:
            assert ours.get_local_rank(name) == ours.get_local_rank(d) and ours.size(name) == ours.size(d)
            assert group_ranks(ours, name) == group_ranks(ours, d)


# --------------------------------------------------------------------------------------------------
# root meshes and slices
# --------------------------------------------------------------------------------------------------


def root_and_slices(shape) -> None:
    names = NAMES[shape]
    mesh, tmesh = get_mesh(shape, names), get_torch_mesh(shape, names)
    rank = dist.get_rank()
    ranks = torch.arange(dist.get_world_size()).view(shape)
    coordinate = [int(c) for c in (ranks == rank).nonzero()[0]]
    assert mesh.device_type == "cpu" and mesh.get_rank() == rank
    same_as_torch(mesh, tmesh)
    assert mesh.get_coordinate() == coordinate
    for d in range(len(shape)):  # the ranks sharing a group differ from us only along that dim
        line = expected_submesh(ranks, [d], coordinate).tolist()
        assert group_ranks(mesh, d) == line
    before = pg_count()
    for name in names:  # 1-D slices reuse the root's groups
        same_as_torch(mesh[name], tmesh[name])
        assert mesh[name].get_group() is mesh.get_group(name)
        assert mesh[name].get_local_rank() == mesh.get_local_rank(name)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            same_as_torch(mesh[a, b], tmesh[a, b])
            # reversed order: torch refuses it; ours keeps the order given
            swapped = mesh[b, a]
            want = expected_submesh(ranks, [names.index(b), names.index(a)], coordinate)
            assert swapped.mesh.tolist() == want.tolist() and swapped.mesh_dim_names == (b, a)
            assert swapped.get_group(0) is mesh.get_group(b) and swapped.get_group(a) is mesh.get_group(a)
            assert swapped.get_coordinate() == [mesh.get_local_rank(b), mesh.get_local_rank(a)]
    assert mesh[list(names)] == mesh
    inner = mesh[names[-1]]
    assert inner[names[-1]] is inner
    assert pg_count() == before, "slicing must not create process groups"


def test_init_device_mesh_groups_and_slices_match_torch_on_2x2():
    run_world(root_and_slices, 4, (2, 2))


def test_init_device_mesh_groups_and_slices_match_torch_on_2x2x2():
    run_world(root_and_slices, 8, (2, 2, 2))


def one_dim_mesh() -> None:
    mesh, tmesh = get_mesh((4,)), get_torch_mesh((4,))
    same_as_torch(mesh, tmesh)
    assert mesh.get_local_rank() == dist.get_rank() and group_ranks(mesh, None) == [0, 1, 2, 3]
    assert mesh.mesh_dim_names is None and mesh.size() == 4


def test_one_dim_mesh_needs_no_dim_argument():
    run_world(one_dim_mesh, 4)


# --------------------------------------------------------------------------------------------------
# flatten
# --------------------------------------------------------------------------------------------------


def flatten_cases() -> None:
    shape, names = (2, 2, 2), NAMES[(2, 2, 2)]
    mesh, tmesh = get_mesh(shape, names), get_torch_mesh(shape, names)
    rank = dist.get_rank()
    ranks = torch.arange(8).view(shape)
    coordinate = [int(c) for c in (ranks == rank).nonzero()[0]]
    dp = mesh["dp_replicate", "dp_shard"].flatten("dp")
    tdp = tmesh["dp_replicate", "dp_shard"]._flatten("dp")
    same_as_torch(dp, tdp)
    assert group_ranks(dp, 0) == expected_submesh(ranks, [0, 1], coordinate).reshape(-1).tolist()
    before = pg_count()
    assert mesh["dp"] == dp and mesh["dp"].get_group() is dp.get_group(), "flattened dims are reachable by name"
    assert (
        mesh["dp_replicate", "dp_shard"].flatten("dp") is dp and mesh["dp_replicate", "dp_shard"]._flatten("dp") is dp
    )
    same_as_torch(mesh["dp", "tp"], tmesh["dp", "tp"])
    assert mesh["dp", "tp"].get_group("dp") is dp.get_group()
    assert mesh["dp"].size() == 4 and mesh["dp"].get_local_rank() == coordinate[0] * 2 + coordinate[1]
    # flattening the dims of another slice; its name defaults to the joined dim names
    shard_cp = mesh["dp_shard", "tp"].flatten()
    assert shard_cp.mesh_dim_names == ("dp_shard_tp",) and mesh["dp_shard_tp"] == shard_cp
    assert group_ranks(shard_cp, 0) == expected_submesh(ranks, [1, 2], coordinate).reshape(-1).tolist()
    created = pg_count() - before
    assert created == 1, f"flattening creates only the one group holding this rank, got {created}"
    after = pg_count()
    mesh["dp_shard", "tp"].flatten()  # cached: no new groups
    mesh["dp_shard_tp"]
    assert pg_count() == after
    # a whole-world flatten reuses the default group
    everything = mesh.flatten("world")
    assert everything.get_group() is dist.group.WORLD and group_ranks(everything, 0) == list(range(8))
    errors = []
    for bad in (lambda: mesh["dp_replicate", "tp"].flatten("dp"), lambda: mesh["tp"].flatten("dp_shard")):
        try:
            bad()
        except ValueError as e:
            errors.append(str(e))
    assert len(errors) == 2 and "dp" in errors[0] and "dp_shard" in errors[1], errors


def test_flatten_is_cached_on_root_and_matches_torch():
    run_world(flatten_cases, 8)


# --------------------------------------------------------------------------------------------------
# block groups (fully_shard's reshard_after_forward=k)
# --------------------------------------------------------------------------------------------------


def block_group_cases() -> dict:
    rank = dist.get_rank()
    root = DeviceMesh("cpu", torch.arange(8).view(2, 4), mesh_dim_names=("dp_replicate", "dp_shard"))
    before = pg_count()
    pairs = root["dp_shard"].block_group(0, 2)
    created = pg_count() - before
    quads = root.flatten("dp").block_group("dp", 4)  # blocks of a flattened dim, in its row-major order
    cached_before = pg_count()
    same = root.block_group("dp_shard", 2) is pairs and root["dp"].block_group(0, 4) is quads
    out = {
        "pairs": dist.get_process_group_ranks(pairs),
        "quads": dist.get_process_group_ranks(quads),
        "created": created,
        "cached": same and pg_count() == cached_before,
        "keys": sorted(root._block_groups),
        "weak": all(isinstance(r, weakref.ref) for r in root._block_groups.values()),
        "whole_dim": root.block_group("dp_shard", 4) is root.get_group("dp_shard"),
        "index": root.get_local_rank("dp_shard") % 2 == dist.get_process_group_ranks(pairs).index(rank),
    }
    try:
        root.block_group("dp_shard", 3)
    except ValueError as e:
        out["error"] = str(e)
    alive = weakref.ref(root)
    del root, pairs, quads
    gc.collect()
    out["freed"] = alive() is None
    return out


def test_block_groups_are_cached_on_the_root_and_freed_with_it():
    for rank, r in enumerate(run_world(block_group_cases, 8)):
        start = rank // 2 * 2
        assert r["pairs"] == [start, start + 1] and r["quads"] == list(range(rank // 4 * 4, rank // 4 * 4 + 4)), r
        assert r["created"] == 1, r  # c10d maps only the group holding this rank
        assert r["cached"] and r["weak"] and r["whole_dim"] and r["index"], r
        assert r["keys"] == [((0, 1), 4), ((1,), 2)], r
        assert "block_size 3 must divide the size 4 of mesh dim 'dp_shard'" in r["error"], r
        assert r["freed"], r


# --------------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------------


def mesh_errors() -> dict[str, str]:
    out = {}

    def catch(key, fn):
        try:
            fn()
        except (ValueError, KeyError) as e:
            out[key] = f"{type(e).__name__}: {e}"

    mesh = get_mesh((2, 2), ("dp", "tp"))
    catch("product", lambda: init_device_mesh("cpu", (3, 2), mesh_dim_names=("dp", "tp")))
    catch("product_unnamed", lambda: init_device_mesh("cpu", (8,)))
    catch("duplicate", lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "dp")))
    catch("name_count", lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp",)))
    catch("unknown", lambda: mesh["pp"])
    catch("unknown_dim", lambda: mesh.get_group("pp"))
    catch("slice_repeat", lambda: mesh["dp", "dp"])
    catch("cuda_index", lambda: init_device_mesh("cuda:0", (4,)))
    catch("device", lambda: init_device_mesh("tpu", (4,)))
    catch("needs_dim", lambda: mesh.get_group())
    catch("repeat_rank", lambda: DeviceMesh("cpu", [[0, 1], [1, 0]]))
    return out


def test_mesh_errors_say_what_was_expected():
    for out in run_world(mesh_errors, 4):
        assert set(out) == {
            "product",
            "product_unnamed",
            "duplicate",
            "name_count",
            "unknown",
            "unknown_dim",
            "slice_repeat",
            "cuda_index",
            "device",
            "needs_dim",
            "repeat_rank",
        }, out
        assert out["product"].startswith("ValueError") and "dp(3) * tp(2) = 6 != world_size(4)" in out["product"]
        assert "8 != world_size(4)" in out["product_unnamed"]
        assert out["duplicate"].startswith("ValueError") and "repeat" in out["duplicate"]
        assert out["unknown"].startswith("KeyError") and "'pp'" in out["unknown"]
        assert "dp" in out["unknown"] and "tp" in out["unknown"], "KeyError should list the known names"
        assert out["unknown_dim"].startswith("KeyError")
        assert out["cuda_index"].startswith("ValueError") and "'cuda'" in out["cuda_index"], out["cuda_index"]
        assert out["device"].startswith("ValueError") and "tpu" in out["device"]
        assert out["needs_dim"].startswith("ValueError")
        assert out["repeat_rank"].startswith("ValueError")


def mesh_identity() -> None:
    a, b = get_mesh((2, 2), ("dp", "tp")), get_mesh((2, 2), ("dp", "tp"))
    assert a is b and hash(a) == hash(b)
    unnamed = get_mesh((2, 2))
    assert unnamed != a, "meshes with other dim names differ"
    assert {a: 1}[a["dp", "tp"]] == 1, "a full slice equals its root (same ranks, names)"
    assert "DeviceMesh" in repr(a) and "dp" in repr(a)


def test_mesh_equality_and_hash_follow_ranks_and_names():
    run_world(mesh_identity, 4)
