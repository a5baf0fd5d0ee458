"""Tensor-op rules (ops/tensor_ops.py, ops/indexing.py): copies and casts, factories, cat/stack,
index_select, gather/scatter/index_add, advanced indexing, tril/triu, repeat/roll/flip, sort/topk,
item/equal.

Pure tests call the rules on hand-built specs (a fake mesh: rules only read shapes and placements).
Rank tests run every op under (sampled) placements of each input, Partial included where the rule
keeps it, on meshes (2,), (4,) and (2, 2) with uneven shapes (5, 7, 3 on 4 ranks leave empty
shards), and compare outputs and input gradients with the single-device run; the gradients cover
the backward ops (index_add, scatter_add, scatter, index_put, new_zeros, _to_copy, tril, roll, flip).
They also count collectives for layouts that need none and compare with torch's own DTensor.
"""

from __future__ import annotations

import pytest
import torch
from torch.ops import aten

from parallelisms.dtensor import Partial, Replicate, Shard, distribute_tensor
from parallelisms.dtensor.ops.indexing import index, index_put
from parallelisms.dtensor.ops.registry import OpCall, Sharding
from parallelisms.dtensor.ops.tensor_ops import cat, copy, reachable, sort_topk, to_copy, tril_triu
from tests.dtensor.harness import MESHES, check_op, expect_error, get_mesh, make_spec, placements_and_collectives
from tests.world import run_world

R, P = Replicate(), Partial()


# --------------------------------------------------------------------------------------------------
# pure rule tests (no ranks)
# --------------------------------------------------------------------------------------------------


def outputs(candidates: Sharding | list[Sharding]) -> set[tuple]:
    if isinstance(candidates, Sharding):
        candidates = [candidates]
    return {c.outputs for c in candidates}


def test_cat_along_sharded_dim_never_keeps_that_shard() -> None:
    a, b = make_spec((5, 7), Shard(0)), make_spec((3, 7), Shard(0))
    outs = outputs(cat(OpCall(aten.cat.default, ((a, b), 0), {})))
    assert ((Shard(0),),) not in outs and ((R,),) in outs and ((Shard(1),),) in outs


def test_cat_legacy_empty_input_stays_replicated() -> None:
    a, empty = make_spec((5, 7), Shard(1)), make_spec((0,), R)
    for c in cat(OpCall(aten.cat.default, ((a, empty), 0), {})):
        assert c.inputs[1] == (R,)


def test_tril_never_shards_the_last_two_dims() -> None:
    x = make_spec((3, 5, 7), Shard(2), Shard(1))
    for c in tril_triu(OpCall(aten.tril.default, (x,), {})):
        assert all(not p.is_shard(1) and not p.is_shard(2) for p in c.outputs[0])


def test_sort_drops_partial_and_the_sorted_dim() -> None:
    x = make_spec((5, 7), P)
    for c in sort_topk(OpCall(aten.sort.default, (x, 1), {})):
        assert c.outputs[0] == c.outputs[1] and c.outputs[0] in ((R,), (Shard(0),))


def test_to_copy_keeps_partial_except_through_integer_or_bool_casts() -> None:
    x = make_spec((5, 7), P, Shard(0))
    assert to_copy(OpCall(aten._to_copy.default, (x,), {"dtype": torch.float64})).outputs == ((P, Shard(0)),)
    assert to_copy(OpCall(aten._to_copy.default, (x,), {"dtype": torch.int64})).outputs == ((R, Shard(0)),)
    mx = make_spec((5, 7), Partial("max"))  # trunc is monotone: max commutes with it
    assert to_copy(OpCall(aten._to_copy.default, (mx,), {"dtype": torch.int32})).outputs == ((Partial("max"),),)
    assert to_copy(OpCall(aten._to_copy.default, (mx,), {"dtype": torch.bool})).outputs == ((R,),)


def test_inplace_copy_moves_src_to_self_and_refuses_shard_to_partial() -> None:
    self, src = make_spec((5, 7), Shard(1)), make_spec((7,), R)  # src broadcasts along dim 0
    (only,) = copy(OpCall(aten.copy_.default, (self, src), {}))
    assert only.inputs == ((Shard(1),), (Shard(0),)) and only.outputs == ((Shard(1),),)
    with pytest.raises(NotImplementedError, match="in-place target"):
        copy(OpCall(aten.copy_.default, (make_spec((5, 7), P), make_spec((5, 7), Shard(0))), {}))


def test_index_keeps_non_indexed_shards_and_maps_their_dims() -> None:
    x, i = make_spec((5, 7, 3), Shard(2)), make_spec((4,), R, dtype=torch.int64)
    outs = outputs(index(OpCall(aten.index.Tensor, (x, (None, i)), {})))
    assert ((Shard(2),),) in outs  # out (5, 4, 3): dim 2 stays dim 2
    x0 = make_spec((5, 7, 3), Shard(1))
    outs = outputs(index(OpCall(aten.index.Tensor, (x0, (i, None, i)), {})))  # non-consecutive: out (4, 7)
    assert ((Shard(1),),) in outs


def test_index_rejects_boolean_masks_with_advice() -> None:
    x, mask = make_spec((5, 7), R), make_spec((5, 7), R, dtype=torch.bool)
    with pytest.raises(NotImplementedError, match="boolean-mask"):
        index(OpCall(aten.index.Tensor, (x, (mask,)), {}))


def test_index_put_accumulate_offers_sharded_indices_into_partial() -> None:
    x, i, v = make_spec((5, 7), R), make_spec((4,), Shard(0), dtype=torch.int64), make_spec((4, 7), Shard(0))
    got = {(c.inputs, c.outputs) for c in index_put(OpCall(aten.index_put.default, (x, (i,), v, True), {}))}
    assert (((P,), (Shard(0),), (Shard(0),)), ((P,),)) in got
    plain = {c.outputs for c in index_put(OpCall(aten.index_put.default, (x, (i,), v, False), {}))}
    assert ((P,),) not in plain  # assignment is not additive: no split index


def test_reachable_only_lets_replicate_become_partial() -> None:
    assert reachable(R, P) and reachable(P, P) and reachable(Shard(0), R)
    assert not reachable(Shard(0), P) and not reachable(Partial("max"), P)


# --------------------------------------------------------------------------------------------------
# rank tests: every op against the single-device run
# --------------------------------------------------------------------------------------------------


def tensor_op_cases(gen: torch.Generator) -> list[tuple]:
    """(name, fn, inputs, partial, grad): uneven shapes throughout (5, 7, 3 on 4 ranks)."""

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    def ints(high, *shape):
        return torch.randint(0, high, shape, generator=gen)

    perm = torch.stack([torch.randperm(5, generator=gen) for _ in range(7)], 1)  # (5, 7), no repeats per column
    x, y, idx = r(5, 7), r(3, 7), torch.tensor([4, 0, 2, 2])
    return [
        ("clone", lambda a: a.clone(), [x], True, True),
        ("contiguous", lambda a: a.t().contiguous(), [x], True, True),
        ("to_float64", lambda a: a.to(torch.float64), [x], True, True),
        ("to_bf16", lambda a: a.to(torch.bfloat16).float(), [x], True, True),
        ("to_int", lambda a: a.to(torch.int64), [x * 4], True, False),
        ("lift_fresh_copy", lambda a: aten.lift_fresh_copy(a), [x], True, False),
        ("copy_", lambda a, b: a.clone().copy_(b), [x, r(5, 7)], False, True),
        ("copy_broadcast", lambda a, b: a.clone().copy_(b), [x, r(7)], False, True),
        ("copy", lambda a, b: aten.copy(a, b), [x, r(5, 7)], True, False),  # no derivative in torch
        ("zeros_like", lambda a: torch.zeros_like(a), [x], True, False),
        ("full_like", lambda a: torch.full_like(a, 3.0), [x], True, False),
        ("new_zeros_same", lambda a: a.new_zeros(a.shape), [x], True, False),
        ("new_ones_other", lambda a: a.new_ones(2, 3), [x], True, False),
        ("new_full_same", lambda a: a.new_full(a.shape, 2.0), [x], True, False),
        ("cat0", lambda a, b: torch.cat([a, b]), [x, y], True, True),
        ("cat1_three", lambda a, b, c: torch.cat([a, b, c], 1), [x, r(5, 3), r(5, 1)], True, True),
        ("cat_legacy_empty", lambda a, b: torch.cat([a, b]), [x, torch.empty(0)], False, True),
        ("stack1", lambda a, b: torch.stack([a, b], 1), [x, r(5, 7)], True, True),
        ("stack_last", lambda a, b: torch.stack([a, b], -1), [x, r(5, 7)], False, True),
        ("index_select0", lambda a, i: a.index_select(0, i), [x, idx], True, True),
        ("index_select1", lambda a, i: a.index_select(1, i), [x, idx], True, True),
        ("index_add", lambda a, i, s: a.index_add(1, i, s), [x, idx, r(5, 4)], True, True),
        ("index_add_alpha", lambda a, i, s: a.index_add(0, i, s, alpha=2.0), [x, idx, r(4, 7)], True, True),
        ("gather0", lambda a, i: a.gather(0, i), [x, ints(5, 5, 7)], True, True),
        ("gather1_small", lambda a, i: a.gather(1, i), [x, ints(7, 3, 7)], True, True),
        ("scatter_src", lambda a, i, s: a.scatter(0, i, s), [x, perm, r(5, 7)], True, True),
        ("scatter_value", lambda a, i: a.scatter(0, i, 1.5), [x, perm], False, True),
        ("scatter_add", lambda a, i, s: a.scatter_add(0, i, s), [x, ints(5, 5, 7), r(5, 7)], True, True),
        ("scatter_add_small", lambda a, i, s: a.scatter_add(1, i, s), [x, ints(7, 5, 3), r(5, 3)], True, True),
        (
            "scatter_reduce_amax",
            lambda a, i, s: a.scatter_reduce(0, i, s, "amax"),
            [x, ints(5, 5, 7), r(5, 7)],
            False,
            True,
        ),
        (
            "scatter_reduce_mean",
            lambda a, i, s: a.scatter_reduce(1, i, s, "mean", include_self=False),
            [x, ints(7, 5, 3), r(5, 3)],
            False,
            True,
        ),  # fmt: skip
        ("index_reduce_prod", lambda a, i, s: a.index_reduce(1, i, s, "prod"), [x, idx, r(5, 4)], False, False),
        ("searchsorted_1d", lambda q, v: torch.searchsorted(q, v), [torch.arange(-2.0, 2.0, 0.3), x], True, False),
        (
            "searchsorted_rows",
            lambda q, v: torch.searchsorted(q.sort(-1).values, v, right=True),
            [r(5, 6), x],
            True,
            False,
        ),  # fmt: skip
        ("kthvalue", lambda a: a.kthvalue(2, 0), [x], False, True),
        # their backward w.r.t. self scatters a plain `zeros` of src's shape into the grad (torch autograd): forward
        ("slice_scatter", lambda a, b: torch.slice_scatter(a, b, 1, 1, 7, 2), [x, r(5, 3)], True, False),
        ("select_scatter", lambda a, b: torch.select_scatter(a, b, 0, 3), [x, r(7)], True, False),
        ("index_rows", lambda a, i: a[i], [x, idx], True, True),
        ("index_cols", lambda a, i: a[:, i], [x, idx], True, True),
        ("index_2d_index", lambda a, i: a[i], [x, ints(5, 3, 2)], False, True),
        ("index_two", lambda a, i, j: a[i, j], [x, idx, ints(7, 4)], False, True),
        ("index_gap", lambda a, i, j: a[i, :, j], [r(5, 7, 3), idx, ints(3, 4)], False, True),
        ("index_put_acc", lambda a, i, v: a.index_put((i,), v, accumulate=True), [x, idx, r(4, 7)], True, True),
        ("index_put_bcast", lambda a, i, v: aten.index_put(a, [None, i], v, True), [x, idx, r(4)], True, True),
        # index_put backward w.r.t. self builds a plain `zeros` of values' shape, which DTensor
        # dispatch refuses to mix with DTensors (as torch's DTensor does): forward only.
        ("index_put", lambda a, i, v: a.index_put((i,), v), [x, torch.tensor([4, 0, 2]), r(3, 7)], True, False),
        ("tril", lambda a: a.tril(), [x], True, True),
        ("triu_batched", lambda a: a.triu(1), [r(3, 5, 7)], True, True),
        ("repeat", lambda a: a.repeat(1, 2, 1), [x], True, True),
        ("roll", lambda a: a.roll(2, 1), [x], True, True),
        ("roll_flat", lambda a: a.roll(3), [x], False, True),
        ("flip", lambda a: a.flip(0), [x], True, True),
        ("sort", lambda a: a.sort(1), [x], False, True),
        ("sort_stable", lambda a: a.sort(dim=0, stable=True, descending=True), [x], False, True),
        ("topk", lambda a: a.topk(2, 0), [x], False, True),
    ]


def _check_tensor_ops(mesh_shape: tuple[int, ...], max_combos: int) -> int:
    mesh = get_mesh(mesh_shape)
    combos = 0
    for name, fn, inputs, partial, grad in tensor_op_cases(torch.Generator().manual_seed(0)):
        try:
            combos += check_op(fn, inputs, mesh, partial=partial, grad=grad, max_combos=max_combos)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from e
    return combos


@pytest.mark.parametrize("mesh_shape,world_size", MESHES)
def test_tensor_ops_match_single_device(mesh_shape, world_size) -> None:
    max_combos = 12 if world_size == 2 else 6
    assert run_world(_check_tensor_ops, world_size, mesh_shape, max_combos)[0] > 0


def _mesh_and_generator(mesh_shape: tuple[int, ...], seed: int) -> tuple:
    """This rank's mesh, its number of dims, and a generator seeded alike on every rank."""
    return get_mesh(mesh_shape), len(mesh_shape), torch.Generator().manual_seed(seed)


def _check_scalars_and_factories(mesh_shape: tuple[int, ...]) -> list[str]:
    """item / equal / is_same_size give the global answer; empty_like / new_empty get the right layout."""
    mesh, n, gen = _mesh_and_generator(mesh_shape, 1)
    x = torch.randn(5, 7, generator=gen)
    problems = []
    for placements in [(Shard(0),) * n, (Shard(1),) + (R,) * (n - 1), (P,) * n]:
        d = distribute_tensor(x, mesh, placements)
        other = distribute_tensor(x.clone(), mesh, (R,) * n)
        checks = {
            "item": distribute_tensor(x[2:3, 3:4], mesh, placements).item() == pytest.approx(x[2, 3].item()),
            "equal_same": torch.equal(d, other) if P not in placements else True,
            "equal_diff": not torch.equal(d, distribute_tensor(x + 1, mesh, (R,) * n)),
            "is_same_size": d.is_same_size(other)
            and not d.is_same_size(distribute_tensor(torch.randn(6, 7, generator=gen), mesh, placements)),
            # every placement stays, Partial too (as torch: module.to_empty() keeps placements)
            "empty_like": torch.empty_like(d).placements == tuple(placements),
            "ones_like": torch.ones_like(d).placements == tuple(R if p == P else p for p in placements),
            "new_empty": d.new_empty((2, 2)).placements == (R,) * n and d.new_empty((2, 2)).shape == (2, 2),
        }
        problems += [f"{name} on {placements}" for name, ok in checks.items() if not ok]
    return problems


@pytest.mark.parametrize("mesh_shape,world_size", [((4,), 4), ((2, 2), 4)])
def test_item_equal_and_factories_give_global_answers(mesh_shape, world_size) -> None:
    assert run_world(_check_scalars_and_factories, world_size, mesh_shape)[0] == []


def _check_inplace(mesh_shape: tuple[int, ...]) -> list[str]:
    """In-place ops keep the target's placements; an impossible one raises before any data moves."""
    mesh, n, gen = _mesh_and_generator(mesh_shape, 2)
    x, v, i = torch.randn(5, 7, generator=gen), torch.randn(5, 4, generator=gen), torch.tensor([6, 0, 3, 3])
    s0 = (Shard(0),) * n
    d = distribute_tensor(x, mesh, s0)
    aten.index_put_(d, [None, distribute_tensor(i, mesh, (R,) * n)], distribute_tensor(v, mesh, s0), True)
    want = aten.index_put(x, [None, i], v, True)
    problems = [] if d.placements == s0 and torch.allclose(d.full_tensor(), want) else ["index_put_ S(0)"]
    d = distribute_tensor(x, mesh, s0)
    w = torch.randn(7, generator=gen)
    d.copy_(distribute_tensor(w, mesh, (R,) * n))  # src broadcasts along the sharded dim 0
    if d.placements != s0 or not torch.allclose(d.full_tensor(), w.expand(5, 7)):
        problems.append("copy_ S(0)")
    d = distribute_tensor(x, mesh, (Shard(1),) * n)
    problems += expect_error(  # dim 1 is indexed and sharded in place: no legal plan
        "index_put_ into S(1)",
        lambda: aten.index_put_(d, [None, distribute_tensor(i, mesh, (R,) * n)], distribute_tensor(v, mesh, (R,) * n)),
        NotImplementedError,
        "in-place target",
    )
    return problems


@pytest.mark.parametrize("mesh_shape,world_size", [((2,), 2), ((2, 2), 4)])
def test_inplace_index_put_and_copy_keep_target_placements(mesh_shape, world_size) -> None:
    assert run_world(_check_inplace, world_size, mesh_shape)[0] == []


def _local_layouts(mesh_shape: tuple[int, ...]) -> list[tuple]:
    """(output placements, collectives) of layouts that need no communication."""
    mesh, n, gen = _mesh_and_generator(mesh_shape, 3)
    x, y, idx = torch.randn(5, 7, generator=gen), torch.randn(3, 7, generator=gen), torch.tensor([4, 0, 2, 2])
    s0, s1, rr = (Shard(0),) * n, (Shard(1),) * n, (R,) * n
    cases = [
        (lambda a, b: torch.cat([a, b]), [(x, s1), (y, s1)]),  # cat along an unsharded dim
        (lambda a, b: torch.cat([a, b]), [(x, (P,) * n), (y, (P,) * n)]),  # P x P -> P
        (lambda a, i: a.index_select(1, i), [(x, s0), (idx, rr)]),
        (lambda a, i: a.index_select(0, i), [(x, rr), (idx, s0)]),  # sharded index -> S(0)
        (lambda a, i: a[i], [(x, rr), (idx, s0)]),
        (lambda a, i: a.gather(1, i), [(x, s0), (torch.randint(0, 7, (5, 3), generator=gen), s0)]),
        (lambda a: a.sort(1)[0], [(x, s0)]),
        (lambda a: a.tril(), [(torch.randn(3, 5, 7, generator=gen), s0)]),
        (lambda a: a.new_zeros(a.shape), [(x, s1)]),
    ]
    results = []
    for fn, args in cases:
        dargs = [distribute_tensor(t, mesh, p) for t, p in args]
        results.append(placements_and_collectives(fn, dargs, fn(*[t for t, _ in args])))
    return results


@pytest.mark.parametrize("mesh_shape,world_size", [((4,), 4), ((2, 2), 4)])
def test_local_layouts_issue_no_collectives(mesh_shape, world_size) -> None:
    n = len(mesh_shape)
    got = run_world(_local_layouts, world_size, mesh_shape)[0]
    s0, s1 = ("S(0)",) * n, ("S(1)",) * n
    assert got == [(s1, 0), (("P(sum)",) * n, 0), (s0, 0), (s0, 0), (s0, 0), (s0, 0), (s0, 0), (s0, 0), (s1, 0)]


def _versus_torch(mesh_shape: tuple[int, ...]) -> list[str]:
    """Ops where torch's DTensor issues fewer collectives than ours (or gets other values)."""
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    from tests.dtensor.harness import get_torch_mesh, placement_choices, run_ours_and_torch, to_torch_placements

    mesh, tmesh = get_mesh(mesh_shape), get_torch_mesh(mesh_shape)
    gen = torch.Generator().manual_seed(4)
    x, y, idx = torch.randn(6, 8, generator=gen), torch.randn(2, 8, generator=gen), torch.tensor([5, 0, 2, 3])
    cases = {
        "cat": (lambda a, b: torch.cat([a, b]), [x, y]),
        "stack": (lambda a, b: torch.stack([a, b], 1), [x, x + 1]),
        "index_select": (lambda a, i: a.index_select(1, i), [x, idx]),
        "gather": (lambda a, i: a.gather(0, i), [x, torch.randint(0, 6, (6, 8), generator=gen)]),
        "sort": (lambda a: a.sort(0)[0], [x]),
        "flip": (lambda a: a.flip(1), [x]),
        "tril": (lambda a: a.tril(), [x]),
        "slice_scatter": (lambda a, b: torch.slice_scatter(a, b, 1, 2, 6), [x, torch.randn(6, 4, generator=gen)]),
        "median": (lambda a: a.median(1)[0], [x]),
        "kthvalue": (lambda a: a.kthvalue(2, 0)[0], [x]),
    }
    choices = placement_choices(2, len(mesh_shape), partial=True)
    choices = choices if len(mesh_shape) == 1 else choices[::3]  # a spread sample of the 16 on (2, 2)
    worse = []
    for name, (fn, inputs) in cases.items():
        for combo in choices:
            placements = [combo if t.is_floating_point() else (R,) * len(mesh_shape) for t in inputs]
            ours_in = [distribute_tensor(t, mesh, p) for t, p in zip(inputs, placements)]
            theirs_in = [torch_distribute(t, tmesh, to_torch_placements(p)) for t, p in zip(inputs, placements)]
            _, _, ours, theirs = run_ours_and_torch(fn, ours_in, theirs_in)
            if ours.get_total_counts() > theirs.get_total_counts():
                worse.append(
                    f"{name} {[tuple(map(str, p)) for p in placements]}: {ours.get_comm_counts()} vs "
                    f"{theirs.get_comm_counts()}"
                )
    return worse


@pytest.mark.parametrize("mesh_shape,world_size", [((2,), 2), ((2, 2), 4)])
def test_tensor_ops_match_torch_dtensor_with_no_more_collectives(mesh_shape, world_size) -> None:
    assert run_world(_versus_torch, world_size, mesh_shape)[0] == []
