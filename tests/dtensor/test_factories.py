"""DTensor factories: only the local shard is allocated, and rand/randn give one global tensor
whatever the mesh and placements."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.distributed.tensor as tdt

import parallelisms.dtensor as md
from parallelisms.dtensor import DTensor, Replicate, Shard
from parallelisms.dtensor.debug import CommDebugMode
from tests.dtensor.harness import chunk_local, get_mesh, get_torch_mesh, to_torch_placements
from tests.world import run_world


def chunk_shape(shape, mesh_shape, coordinate, placements) -> tuple[int, ...]:
    """Local shape from torch.chunk per sharding mesh dim, in mesh order."""
    return tuple(chunk_local(torch.empty(shape), mesh_shape, coordinate, placements).shape)


def placements_for(mesh_ndim: int) -> list[tuple]:
    per_dim = [Replicate(), Shard(0), Shard(1)]
    return list(itertools.product(per_dim, repeat=mesh_ndim))


# --------------------------------------------------------------------------------------------------
# zeros / ones / empty / full
# --------------------------------------------------------------------------------------------------


def constant_factories() -> None:
    for mesh_shape in ((4,), (2, 2)):
        mesh, tmesh = get_mesh(mesh_shape), get_torch_mesh(mesh_shape)
        coordinate = tmesh.get_coordinate()
        for shape, placements in itertools.product(((5, 3), (3, 2), (8, 4), (2, 9)), placements_for(len(mesh_shape))):
            local_shape = chunk_shape(shape, mesh_shape, coordinate, placements)
            torch_local = tdt.zeros(*shape, device_mesh=tmesh, placements=to_torch_placements(placements))._local_tensor
            assert local_shape == tuple(torch_local.shape)
            with CommDebugMode() as mode:
                made = {
                    "zeros": md.zeros(*shape, device_mesh=mesh, placements=placements),
                    "ones": md.ones(shape, device_mesh=mesh, placements=placements, dtype=torch.bfloat16),
                    "empty": md.empty(torch.Size(shape), device_mesh=mesh, placements=placements),
                    "full": md.full(shape, 2.5, device_mesh=mesh, placements=placements, requires_grad=True),
                }
            assert mode.get_total_counts() == 0, "factories allocate locally"
            for name, d in made.items():
                what = (name, shape, mesh_shape, placements)
                assert isinstance(d, DTensor) and d.placements == placements, what
                assert d.shape == shape and d.stride() == torch.empty(shape).stride(), what
                assert tuple(d._local_tensor.shape) == local_shape, what
            assert made["zeros"]._local_tensor.eq(0).all() and made["zeros"].dtype == torch.get_default_dtype()
            assert made["ones"]._local_tensor.eq(1).all() and made["ones"]._local_tensor.dtype == torch.bfloat16
            assert made["full"]._local_tensor.eq(2.5).all() and made["full"].requires_grad and made["full"].is_leaf
            assert torch.equal(made["full"].full_tensor(), torch.full(shape, 2.5))


def test_constant_factories_allocate_only_the_local_shard():
    run_world(constant_factories, 4)


def default_placements_and_errors() -> list[str]:
    mesh = get_mesh((2, 2))
    d = md.ones(3, 3, device_mesh=mesh)
    assert d.placements == (Replicate(), Replicate()) and d._local_tensor.shape == (3, 3)
    errors = []
    for fn in (
        lambda: md.zeros(3, 3),
        lambda: md.ones(3, 3, device_mesh=mesh, placements=[Shard(0)]),
        lambda: md.rand(3, device_mesh=mesh, placements=[Shard(1), Replicate()]),
    ):
        try:
            fn()
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_factories_default_to_replicate_and_reject_bad_arguments():
    for errors in run_world(default_placements_and_errors, 4):
        assert len(errors) == 3 and "device_mesh" in errors[0], errors


# --------------------------------------------------------------------------------------------------
# rand / randn
# --------------------------------------------------------------------------------------------------

RANDOM_MESHES = {2: ((2,),), 4: ((4,), (2, 2)), 8: ((4, 2),)}
RANDOM_PLACEMENTS = {
    1: ((Replicate(),), (Shard(0),), (Shard(1),)),
    2: ((Shard(0), Shard(1)), (Shard(1), Shard(0)), (Shard(0), Shard(0)), (Replicate(), Shard(1))),
}
RANDOM_SHAPES = ((5, 7), (3, 2), (6, 3, 4), (300, 250))  # the last spans several 2**16-element blocks


def random_globals() -> dict[tuple, torch.Tensor]:
    """Full tensors of rand/randn for every mesh of this world, placement, shape, dtype and seed."""
    out = {}
    rank = dist.get_rank()
    for mesh_shape in RANDOM_MESHES[dist.get_world_size()]:
        mesh = get_mesh(mesh_shape)
        coordinate = get_torch_mesh(mesh_shape).get_coordinate()
        for placements, shape, fn, dtype, seed in itertools.product(
            RANDOM_PLACEMENTS[len(mesh_shape)],
            RANDOM_SHAPES,
            ("rand", "randn"),
            (torch.float32, torch.bfloat16),
            (0, 1),
        ):
            if dtype == torch.bfloat16 and shape != (5, 7):
                continue
            torch.manual_seed(seed)
            d = getattr(md, fn)(*shape, device_mesh=mesh, placements=placements, dtype=dtype)
            what = (mesh_shape, placements, shape, fn, dtype, seed)
            assert d.placements == placements and d.dtype == dtype and d.shape == shape, what
            assert tuple(d._local_tensor.shape) == chunk_shape(shape, mesh_shape, coordinate, placements), what
            full = d.full_tensor()
            if rank == 0:
                out[(fn, shape, str(dtype), seed, mesh_shape, tuple(map(str, placements)))] = full
    return out


def test_rand_and_randn_give_one_global_tensor_for_any_mesh_and_placements():
    fulls: dict[tuple, torch.Tensor] = {}
    for world_size in (2, 4, 8):
        fulls.update(run_world(random_globals, world_size)[0])
    groups: dict[tuple, list] = {}
    for key, full in fulls.items():
        groups.setdefault(key[:4], []).append((key[4:], full))
    assert len(groups) == 2 * 2 * (len(RANDOM_SHAPES) + 1)
    for (fn, shape, dtype, seed), members in groups.items():
        assert len(members) == 3 * 2 + 4 * 2  # (2,), (4,) with 3 placements; (2, 2), (4, 2) with 4
        first_where, first = members[0]
        for where, full in members[1:]:
            assert torch.equal(full, first), f"{fn}{shape} {dtype} seed {seed}: {where} differs from {first_where}"
        other = groups[(fn, shape, dtype, 1 - seed)][0][1]
        assert not torch.equal(first, other), f"{fn}{shape} {dtype}: seeds 0 and 1 give the same tensor"
        values = first.float()
        if fn == "rand":
            assert values.min() >= 0 and values.max() < 1
        if shape == (300, 250):
            assert abs(values.mean() - (0.5 if fn == "rand" else 0.0)) < 0.02
            assert abs(values.std() - ((1 / 12) ** 0.5 if fn == "rand" else 1.0)) < 0.02
            assert values.unique().numel() > 70000, "blocks must not repeat"


def random_needs_same_seed_everywhere() -> list[bool]:
    mesh = get_mesh((2,))
    torch.manual_seed(3)
    a = md.randn(4, 4, device_mesh=mesh, placements=[Shard(0)]).full_tensor()
    b = md.randn(4, 4, device_mesh=mesh, placements=[Shard(0)]).full_tensor()
    torch.manual_seed(3)
    c = md.randn(4, 4, device_mesh=mesh, placements=[Replicate()])._local_tensor
    return [not torch.equal(a, b), torch.equal(a, c)]


def test_randn_draws_fresh_values_per_call_and_repeats_per_seed():
    for flags in run_world(random_needs_same_seed_everywhere, 2):
        assert all(flags), flags
