"""Random ops on DTensors (ops/random.py): placements, and the seeding guarantees of its docstring.

Replicas draw identical values, shards draw independent ones, each op consumes exactly one draw of
the default generator on every rank, and dropout's forward and backward agree. Masks are compared
across ranks in the test process from each rank's local tensors.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.ops import aten

from parallelisms.dtensor import Partial, Replicate, Shard, distribute_tensor
from parallelisms.dtensor.debug import CommDebugMode
from parallelisms.dtensor.ops.random import mix_seed, random_fill_, random_from_input, random_like, shard_index
from parallelisms.dtensor.ops.registry import OpCall
from tests.dtensor.harness import FakeMesh, get_mesh, make_spec
from tests.world import run_world

R, P = Replicate(), Partial()
P_DROP = 0.3


# --------------------------------------------------------------------------------------------------
# pure tests
# --------------------------------------------------------------------------------------------------


def test_shard_index_ignores_replicate_mesh_dims() -> None:
    coordinates = [(0, 0), (1, 0), (0, 2), (1, 2)]
    index = {c: shard_index(make_spec((8, 8), R, Shard(0), mesh=FakeMesh((2, 3), c))) for c in coordinates}
    assert index[(0, 0)] == index[(1, 0)] == 0 and index[(0, 2)] == index[(1, 2)] == 2


def test_shard_index_is_linear_over_sharding_mesh_dims() -> None:
    meshes = [FakeMesh((2, 3), (i, j)) for i in range(2) for j in range(3)]
    got = sorted(shard_index(make_spec((8, 8), Shard(0), Shard(1), mesh=mesh)) for mesh in meshes)
    assert got == list(range(6))


def test_mix_seed_separates_neighbouring_shards_and_bases() -> None:
    seeds = {mix_seed(b, i) for b in range(50) for i in range(50)}
    assert len(seeds) == 2500 and all(0 <= s < 2**63 for s in seeds)


def test_rules_keep_placements_but_turn_partial_into_replicate() -> None:
    mesh = FakeMesh((2, 2), (0, 0))
    x = make_spec((8, 8), P, Shard(0), mesh=mesh)
    dropout = random_from_input(OpCall(aten.native_dropout.default, (x, 0.5, True), {}))
    assert dropout.inputs == ((R, Shard(0)),) and dropout.outputs == ((R, Shard(0)),) * 2
    like = random_like(OpCall(aten.rand_like.default, (x,), {}))
    assert like.inputs == (None,) and like.outputs == ((R, Shard(0)),)  # the input is not read: no all_reduce
    with pytest.raises(NotImplementedError, match="cannot be Partial"):
        random_fill_(OpCall(aten.uniform_.default, (x,), {}))
    target = make_spec((8, 8), R, Shard(1), mesh=mesh)
    assert random_fill_(OpCall(aten.uniform_.default, (target,), {})).outputs == ((R, Shard(1)),)


def test_rule_for_broadcast_probabilities_shards_them_with_self() -> None:
    mesh = FakeMesh((2,), (0,))
    self, p_row = make_spec((8, 8), Shard(1), mesh=mesh), make_spec((8,), R, mesh=mesh)
    got = random_from_input(OpCall(aten.bernoulli_.Tensor, (self, p_row), {}))
    assert got.inputs == ((Shard(1),), (Shard(0),)) and got.outputs == ((Shard(1),),)


# --------------------------------------------------------------------------------------------------
# rank tests
# --------------------------------------------------------------------------------------------------


def _dropout_locals(mesh_shape: tuple[int, ...], placements: tuple, shape: tuple[int, ...]) -> dict:
    """This rank's dropout mask, coordinate and RNG state after the op (every rank seeded alike)."""
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(1234)
    x = distribute_tensor(torch.ones(shape), mesh, placements)
    out, mask = aten.native_dropout(x, P_DROP, True)
    return {
        "coordinate": tuple(mesh.get_coordinate()),
        "mask": mask._local_tensor.clone(),
        "out": out._local_tensor.clone(),
        "placements": tuple(map(str, out.placements)),
        "full_mask": mask.full_tensor() if P not in placements else None,
        "rng": torch.get_rng_state(),
    }


def test_dropout_on_replicate_gives_identical_masks_on_all_ranks() -> None:
    ranks = run_world(_dropout_locals, 4, (4,), (R,), (16, 32))
    assert all(torch.equal(r["mask"], ranks[0]["mask"]) for r in ranks)
    assert 0 < ranks[0]["mask"].float().mean() < 1


def test_dropout_on_shards_differs_between_shards_and_keeps_one_minus_p() -> None:
    ranks = run_world(_dropout_locals, 4, (4,), (Shard(0),), (64, 64))
    masks = [r["mask"] for r in ranks]
    assert all(not torch.equal(masks[i], masks[j]) for i in range(4) for j in range(i + 1, 4))
    keep = torch.cat(masks).float().mean().item()
    assert abs(keep - (1 - P_DROP)) < 0.03  # 4096 draws: 3 sigma is about 0.021
    full = ranks[0]["full_mask"]
    assert full.shape == (64, 64) and torch.equal(full, torch.cat(masks))
    scaled = ranks[0]["out"][masks[0]]
    torch.testing.assert_close(scaled, torch.full_like(scaled, 1 / (1 - P_DROP)))


def test_dropout_on_2d_mesh_matches_replicas_along_replicate_dim() -> None:
    """(R, S(0)) on a (2, 2) mesh: ranks sharing a coordinate on mesh dim 1 hold the same shard."""
    ranks = run_world(_dropout_locals, 4, (2, 2), (R, Shard(0)), (16, 32))
    by_coord = {r["coordinate"]: r["mask"] for r in ranks}
    for j in range(2):
        assert torch.equal(by_coord[(0, j)], by_coord[(1, j)])
    assert not torch.equal(by_coord[(0, 0)], by_coord[(0, 1)])


def test_dropout_uneven_shards_with_empty_ones_still_agree_on_replicas() -> None:
    ranks = run_world(_dropout_locals, 4, (2, 2), (Shard(1), Shard(0)), (3, 5))  # 3 rows on 2: (2, 1)
    assert ranks[0]["full_mask"].shape == (3, 5)
    assert all(torch.equal(r["full_mask"], ranks[0]["full_mask"]) for r in ranks)


def test_dropout_same_shards_on_another_mesh_shape_give_the_same_mask() -> None:
    flat = run_world(_dropout_locals, 4, (4,), (Shard(0),), (8, 16))[0]["full_mask"]
    nested = run_world(_dropout_locals, 4, (2, 2), (Shard(0), Shard(0)), (8, 16))[0]["full_mask"]
    assert torch.equal(flat, nested)


def test_dropout_leaves_rng_state_identical_and_one_draw_ahead() -> None:
    torch.manual_seed(1234)
    torch.randint(0, 2**62, (1,))  # the one draw a random op consumes
    want = torch.get_rng_state()
    for mesh_shape, placements in [((4,), (Shard(0),)), ((2, 2), (R, Shard(1))), ((4,), (P,))]:
        ranks = run_world(_dropout_locals, 4, mesh_shape, placements, (5, 7))
        assert all(torch.equal(r["rng"], want) for r in ranks), placements


def test_dropout_of_partial_input_is_replicated_first() -> None:
    ranks = run_world(_dropout_locals, 4, (4,), (P,), (8, 8))
    assert ranks[0]["placements"] == ("R",)
    assert all(torch.equal(r["mask"], ranks[0]["mask"]) for r in ranks)


def _dropout_forward_backward(mesh_shape: tuple[int, ...]) -> list[str]:
    """grad = mask * scale * grad_out, forward out = mask * scale * x, for several layouts."""
    mesh = get_mesh(mesh_shape)
    n = len(mesh_shape)
    gen = torch.Generator().manual_seed(5)
    x, g = torch.randn(5, 7, generator=gen), torch.randn(5, 7, generator=gen)
    problems = []
    for placements in [(R,) * n, (Shard(0),) * n, (Shard(1),) + (R,) * (n - 1), (P,) * n]:
        d = distribute_tensor(x, mesh, placements).requires_grad_()
        out, mask = aten.native_dropout(d, P_DROP, True)
        dg = distribute_tensor(g, mesh, out.placements)
        with CommDebugMode() as comm:
            (grad,) = torch.autograd.grad(out, d, dg)
        full_mask = mask.full_tensor().float()
        scale = 1 / (1 - P_DROP)
        ok = torch.allclose(out.full_tensor(), x * full_mask * scale, atol=1e-6)
        ok &= torch.allclose(grad.full_tensor(), g * full_mask * scale, atol=1e-6)
        ok &= comm.get_total_counts() == 0 or P in placements  # the backward itself is local
        if not ok:
            problems.append(str(placements))
    return problems


@pytest.mark.parametrize("mesh_shape,world_size", [((2,), 2), ((2, 2), 4)])
def test_dropout_forward_and_backward_agree(mesh_shape, world_size) -> None:
    assert run_world(_dropout_forward_backward, world_size, mesh_shape)[0] == []


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dropout = nn.Dropout(P_DROP)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(x) * 2.0


def _module_dropout(mesh_shape: tuple[int, ...], placements: tuple) -> dict:
    """nn.Dropout in training on a DTensor: shape, placements, scale, gradient, and replica agreement."""
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(7)
    block = _Block().train()
    x = distribute_tensor(torch.ones(16, 8), mesh, placements).requires_grad_()
    out = block(x)
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
    full = out.full_tensor()
    eval_out = block.eval()(x).full_tensor()
    return {
        "coordinate": tuple(mesh.get_coordinate()),
        "placements": tuple(map(str, out.placements)),
        "full": full,
        "grad": grad.full_tensor(),
        "local": out._local_tensor.clone(),
        "eval": eval_out,
    }


@pytest.mark.parametrize(
    "mesh_shape,world_size,placements",
    [
        ((2,), 2, (Shard(0),)),
        ((4,), 4, (R,)),
        ((2, 2), 4, (R, Shard(1))),
    ],
)
def test_nn_dropout_in_module_trains_on_dtensor(mesh_shape, world_size, placements) -> None:
    ranks = run_world(_module_dropout, world_size, mesh_shape, placements)
    full = ranks[0]["full"]
    scale = 2.0 / (1 - P_DROP)
    kept = full[full != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, scale))
    assert 0 < kept.numel() < full.numel()
    assert torch.allclose(ranks[0]["grad"], full)  # d(2 * x * m * s)/dx = 2 * m * s = out at x = 1
    assert all(torch.equal(r["full"], full) for r in ranks)
    assert torch.equal(ranks[0]["eval"], torch.full((16, 8), 2.0))
    assert ranks[0]["placements"] == tuple(map(str, placements))


def _like_row(t, row: torch.Tensor):
    """`row` as a replicated DTensor on t's mesh (a (6,) operand that broadcasts over t's rows)."""
    return distribute_tensor(row, t.device_mesh, (R,) * t.device_mesh.ndim)


def _random_fills(mesh_shape: tuple[int, ...]) -> dict:
    """In-place fills and *_like samples: placements kept (Partial -> R), replicas agree, values in range."""
    mesh = get_mesh(mesh_shape)
    n = len(mesh_shape)
    torch.manual_seed(11)
    base = torch.zeros(9, 6)
    results = {}
    for name, fn in {
        "uniform_": lambda t: t.uniform_(2.0, 3.0),
        "normal_": lambda t: t.normal_(5.0, 0.1),
        "bernoulli_": lambda t: t.bernoulli_(0.5),
        "exponential_": lambda t: t.exponential_(),
        "random_": lambda t: t.random_(0, 10),
        "rand_like": lambda t: torch.rand_like(t),
        "randn_like": lambda t: torch.randn_like(t),
        "randint_like": lambda t: torch.randint_like(t, 3, 9),
        "bernoulli": lambda t: torch.bernoulli(t.uniform_(0.0, 1.0)),
        "bernoulli_p_row": lambda t: t.bernoulli_(_like_row(t, torch.linspace(0.2, 0.8, 6))),  # p broadcasts
        "normal_mean": lambda t: torch.normal(t.uniform_(2.0, 3.0), 0.01),
    }.items():
        for placements in [(Shard(0),) * n, (R,) * n, (Shard(1),) + (R,) * (n - 1)]:
            out = fn(distribute_tensor(base, mesh, placements))
            results[(name, placements)] = (tuple(map(str, out.placements)), out.full_tensor())
    d = distribute_tensor(base, mesh, (P,) * n)
    results[("rand_like", "P")] = (tuple(map(str, torch.rand_like(d).placements)), None)
    try:
        d.uniform_()
        results["uniform_ P"] = "no error"
    except NotImplementedError as e:
        results["uniform_ P"] = str(e)
    results["rng"] = torch.get_rng_state()
    return results


@pytest.mark.parametrize("mesh_shape,world_size", [((2,), 2), ((2, 2), 4)])
def test_random_fills_keep_placements_and_agree_across_replicas(mesh_shape, world_size) -> None:
    ranks = run_world(_random_fills, world_size, mesh_shape)
    n = len(mesh_shape)
    ranges = {
        "uniform_": (2, 3),
        "normal_": (4, 6),
        "bernoulli_": (0, 1),
        "exponential_": (0, 100),
        "random_": (0, 9),
        "rand_like": (0, 1),
        "randn_like": (-10, 10),
        "randint_like": (3, 8),
        "bernoulli": (0, 1),
        "bernoulli_p_row": (0, 1),
        "normal_mean": (1.9, 3.1),
    }
    for key, value in ranks[0].items():
        if not isinstance(key, tuple) or value[1] is None:
            continue
        (name, placements), (got_placements, full) = key, value
        assert got_placements == tuple(map(str, placements)), key
        low, high = ranges[name]
        assert full.min() >= low and full.max() <= high and full.unique().numel() > 1, key
        assert all(torch.equal(r[key][1], full) for r in ranks), key  # full tensors agree everywhere
    assert ranks[0][("rand_like", "P")][0] == ("R",) * n
    assert "cannot be Partial" in ranks[0]["uniform_ P"]
    assert all(torch.equal(r["rng"], ranks[0]["rng"]) for r in ranks)


def _generator_kwarg(mesh_shape: tuple[int, ...]) -> tuple:
    """A caller's generator= is advanced by one draw and the default generator is untouched."""
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    gen = torch.Generator().manual_seed(99)
    d = distribute_tensor(torch.zeros(6, 4), mesh, (Shard(0),))
    d.uniform_(generator=gen)
    ref = torch.Generator().manual_seed(99)
    torch.randint(0, 2**62, (1,), generator=ref)
    return torch.equal(torch.get_rng_state(), before), torch.equal(gen.get_state(), ref.get_state()), d.full_tensor()


def test_generator_kwarg_advances_only_that_generator() -> None:
    ranks = run_world(_generator_kwarg, 2, (2,))
    assert all(r[0] and r[1] for r in ranks)
    assert torch.equal(ranks[0][2], ranks[1][2])
