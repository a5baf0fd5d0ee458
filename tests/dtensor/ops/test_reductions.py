"""Reduction rules (ops/reductions.py): sum, mean, amax/amin, max/min (full and .dim), var/std
(and *_mean), all/any, argmax/argmin, prod, logsumexp, nansum, and the scans cumsum / cumprod /
logcumsumexp.

Pure tests call the rule functions without ranks. Rank tests run every op under every placement of
its input (Partial included) on meshes (2,), (4,) and (2, 2), with dims, keepdim and full
reductions on even and uneven shapes (5 and 7 on 4 ranks leave short and empty shards), compare
outputs and gradients with the single-device run, count collectives where the rule promises none,
and compare sum with torch's own DTensor.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # the first meta run of an op imports it: import it once, before ranks fork
from torch.ops import aten

from parallelisms.dtensor import Partial, Replicate, Shard, distribute_tensor
from parallelisms.dtensor.ops.reductions import (
    GATHER,
    LINEAR_SCAN,
    MAX,
    MEAN,
    SUM,
    output_dim,
    reduced_dims,
    reduction_shardings,
)
from parallelisms.dtensor.ops.registry import OpCall
from parallelisms.dtensor.placements import nested_chunk_sizes
from tests.dtensor.harness import MESHES, check_op, get_mesh, get_torch_mesh, placements_and_collectives
from tests.world import run_world

R, P = Replicate(), Partial()


# --------------------------------------------------------------------------------------------------
# pure rule tests (no ranks)
# --------------------------------------------------------------------------------------------------


def outputs(kind, shape, placements, mesh_shape, dims, keepdim=False) -> set:
    return {s.outputs[0] for s in reduction_shardings(kind, shape, placements, mesh_shape, dims, keepdim, 1)}


def test_reduced_dims_read_dim_and_keepdim_by_name() -> None:
    assert reduced_dims(OpCall(aten.sum.dim_IntList, (None, (-1,), True), {}), 3) == ((2,), True)
    assert reduced_dims(OpCall(aten.sum.default, (None,), {}), 3) == ((0, 1, 2), False)
    assert reduced_dims(OpCall(aten.amax.default, (None, ()), {}), 2) == ((0, 1), False)  # [] = all dims
    assert reduced_dims(OpCall(aten.any.dims, (None, ()), {}), 2) == ((), False)  # [] = no dims
    assert reduced_dims(OpCall(aten.var.correction, (None, None), {"keepdim": True}), 2) == ((0, 1), True)
    assert reduced_dims(OpCall(aten.cumsum.default, (None, 1), {}), 2) == ((1,), True)  # scans keep dims


def test_output_dim_shifts_past_dropped_dims() -> None:
    assert output_dim(2, (0, 1), keepdim=False) == 0
    assert output_dim(2, (0, 1), keepdim=True) == 2
    assert output_dim(0, (1,), keepdim=False) == 0


def test_nested_chunk_sizes_nest_like_torch_chunk() -> None:
    assert nested_chunk_sizes(5, [4]) == [2, 2, 1, 0]
    assert nested_chunk_sizes(5, [2, 2]) == [2, 1, 1, 1]
    assert nested_chunk_sizes(3, [2, 2]) == [1, 1, 1, 0]


def test_sum_over_sharded_dim_is_partial_sum() -> None:
    assert (P,) in outputs(SUM, (5, 7), (Shard(0),), (4,), (0,))  # empty shards sum to 0: fine
    assert outputs(SUM, (5, 7), (Shard(1),), (4,), (0,)) == {(Shard(0),)}  # kept dim shifts left
    assert outputs(SUM, (5, 7), (Shard(1),), (4,), (0,), keepdim=True) == {(Shard(1),)}
    assert outputs(SUM, (5, 7), (P,), (4,), (0,)) == {(P,)}  # linear: P(sum) passes


def test_mean_is_partial_avg_only_on_equal_shards() -> None:
    assert (Partial("avg"),) in outputs(MEAN, (8, 3), (Shard(0),), (4,), (0,))
    uneven = outputs(MEAN, (5, 3), (Shard(0),), (4,), (0,))
    assert uneven == {(R,)}  # gathered; as torch's, never moved to the kept dim


def test_amax_is_partial_max_only_on_nonempty_shards() -> None:
    assert (Partial("max"),) in outputs(MAX, (5, 3), (Shard(0),), (2,), (0,))
    assert (Partial("max"),) not in outputs(MAX, (5, 3), (Shard(0),), (4,), (0,))  # a shard of 0 rows
    assert outputs(MAX, (5, 3), (Partial("max"),), (2,), (0,)) == {(Partial("max"),)}
    assert (P,) not in outputs(MAX, (5, 3), (P,), (2,), (0,))  # max does not commute with sum


def test_gather_reductions_never_go_partial() -> None:
    assert outputs(GATHER, (5, 3), (Shard(0),), (2,), (0,)) == {(R,)}
    assert outputs(GATHER, (5, 3), (P,), (2,), (1,)) == {(R,)}  # reduced first, as torch (no reduce_scatter)


def test_partial_and_sharded_reductions_never_mix_reduce_ops() -> None:
    # mean over an evenly sharded dim is P(avg); with a P(sum) input on another mesh dim it cannot be both
    for out in outputs(MEAN, (8, 3), (Shard(0), P), (2, 2), (0,)):
        assert len({p.reduce_op for p in out if isinstance(p, Partial)}) <= 1


def test_cumsum_keeps_dims_and_passes_partial_sum() -> None:
    assert outputs(LINEAR_SCAN, (5, 3), (P,), (2,), (1,), keepdim=True) == {(P,)}
    assert outputs(LINEAR_SCAN, (5, 3), (Shard(1),), (2,), (1,), keepdim=True) == {(R,)}


# --------------------------------------------------------------------------------------------------
# rank tests
# --------------------------------------------------------------------------------------------------


UNEVEN, EVEN, CUBE = (5, 7), (4, 6), (3, 5, 2)  # 5 and 7 on 4 ranks leave short and empty shards


def reduction_cases() -> list[tuple]:
    """(fn, input shape, grad): every op with dims, keepdim and full reductions."""
    return [
        (lambda x: x.sum(), UNEVEN, True),
        (lambda x: x.sum(0), UNEVEN, True),
        (lambda x: x.sum(0), EVEN, True),
        (lambda x: x.sum(-1, keepdim=True), UNEVEN, True),
        (lambda x: x.sum((0, 2), dtype=torch.float64), CUBE, True),
        (lambda x: x.mean(0), UNEVEN, True),  # uneven: no P(avg), the rule moves the shard
        (lambda x: x.mean(0), EVEN, True),  # even: P(avg)
        (lambda x: x.mean(), UNEVEN, True),
        (lambda x: x.mean(1, keepdim=True), CUBE, True),
        (lambda x: x.amax(0), UNEVEN, True),  # empty shards on 4 ranks: no P(max)
        (lambda x: x.amax(0), EVEN, True),
        (lambda x: x.amin((0, 2), keepdim=True), CUBE, True),
        (lambda x: x.max(), UNEVEN, True),
        (lambda x: x.min(), EVEN, True),
        (lambda x: x.max(0), UNEVEN, True),  # values and indices
        (lambda x: x.min(-1, keepdim=True), UNEVEN, True),
        (lambda x: x.var(0), UNEVEN, True),
        (lambda x: x.var(1), CUBE, True),
        (lambda x: x.std(-1, correction=0, keepdim=True), UNEVEN, True),
        (lambda x: torch.var_mean(x, 0), UNEVEN, True),
        (lambda x: (x > 0).all(0), UNEVEN, False),
        (lambda x: (x > 0).any(), UNEVEN, False),
        (lambda x: x.argmax(0), UNEVEN, False),
        (lambda x: x.argmin(), UNEVEN, False),
        (lambda x: x.argmax(1, keepdim=True), CUBE, False),
        (lambda x: x.prod(0), UNEVEN, False),  # backward cats a plain `ones` with DTensors (torch autograd)
        (lambda x: x.logsumexp(-1), UNEVEN, True),
        (lambda x: x.median(), UNEVEN, True),
        (lambda x: x.median(0), UNEVEN, True),  # values and indices
        (lambda x: x.nanmedian(-1, keepdim=True), CUBE, True),
        (lambda x: x.round().mode(0), UNEVEN, False),
        (lambda x: x.nansum(0), UNEVEN, True),
        (lambda x: x.cumsum(0), UNEVEN, True),
        (lambda x: x.cumsum(1), CUBE, True),
        (lambda x: x.cumprod(0), UNEVEN, False),
    ]


def _check_reductions(mesh_shape: tuple[int, ...], max_combos: int) -> int:
    mesh = get_mesh(mesh_shape)
    gen = torch.Generator().manual_seed(0)
    combos = 0
    for i, (fn, shape, grad) in enumerate(reduction_cases()):
        fn.__name__ = f"reduction case {i} on {shape}"
        x = torch.randn(*shape, generator=gen)
        combos += check_op(fn, [x], mesh, partial=True, grad=grad, max_combos=max_combos, seed=i, atol=1e-5, rtol=1e-4)
    return combos


@pytest.mark.parametrize("mesh_shape,world_size", MESHES)
def test_reductions_match_single_device(mesh_shape, world_size) -> None:
    # every placement on 1-D meshes (R, S(d), P); a sample of the 16-25 pairs on (2, 2)
    assert run_world(_check_reductions, world_size, mesh_shape, 5 if len(mesh_shape) == 1 else 6)[0] > 0


def _local_reductions(mesh_shape: tuple[int, ...]) -> list[tuple]:
    """(output placements, collectives) of reductions the rule runs without communication."""
    mesh = get_mesh(mesh_shape)
    n = len(mesh_shape)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    cases = [
        ((Shard(0),) * n, lambda t: t.sum(0)),  # S(0) summed over dim 0 -> P(sum)
        ((Shard(1),) * n, lambda t: t.sum(0)),  # S(1) -> S(0): the kept dim shifts
        ((Shard(0),) * n, lambda t: t.mean(0)),  # even shards -> P(avg)
        ((Shard(0),) * n, lambda t: t.amax(0)),  # -> P(max)
        ((P,) * n, lambda t: t.sum(-1)),  # linear: P(sum) passes
        ((Shard(0),) * n, lambda t: t.var(-1)),  # unsharded dim: shard kept
        ((Partial("max"),) * n, lambda t: t.amax(0)),  # P(max) passes
    ]
    results = []
    for placements, fn in cases:
        dx = distribute_tensor(x, mesh, placements)
        results.append(placements_and_collectives(fn, (dx,), fn(x), atol=1e-5, rtol=1e-5))
    return results


@pytest.mark.parametrize("mesh_shape,world_size", [((4,), 4), ((2, 2), 4)])
def test_local_reductions_issue_no_collectives(mesh_shape, world_size) -> None:
    n = len(mesh_shape)
    assert run_world(_local_reductions, world_size, mesh_shape)[0] == [
        (("P(sum)",) * n, 0),
        (("S(0)",) * n, 0),
        (("P(avg)",) * n, 0),
        (("P(max)",) * n, 0),
        (("P(sum)",) * n, 0),
        (("S(0)",) * n, 0),
        (("P(max)",) * n, 0),
    ]


def _sum_versus_torch(mesh_shape: tuple[int, ...]) -> list[str]:
    """sum over each dim (and all) under every placement: cases where we communicate more than torch
    or end with other placements."""
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    from tests.dtensor.harness import placement_choices, run_ours_and_torch, to_torch_placements

    mesh, tmesh = get_mesh(mesh_shape), get_torch_mesh(mesh_shape)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    worse = []
    for placements in placement_choices(2, len(mesh_shape), partial=True):
        dx = distribute_tensor(x, mesh, placements)
        tx = torch_distribute(x, tmesh, to_torch_placements(placements))
        for dims in ((0,), (1,), (0, 1)):
            out, tout, ours, theirs = run_ours_and_torch(torch.sum, (dx, dims), (tx, dims), atol=1e-5, rtol=1e-5)
            same = tuple(map(str, out.placements)) == tuple(map(str, tout.placements))
            if ours.get_total_counts() > theirs.get_total_counts() or not same:
                worse.append(
                    f"{placements} sum{dims}: ours {out.placements} {ours.get_comm_counts()}, "
                    f"torch {tout.placements} {theirs.get_comm_counts()}"
                )
    return worse


@pytest.mark.parametrize("mesh_shape,world_size", [((2,), 2), ((2, 2), 4)])
def test_sum_matches_torch_dtensor_placements_and_collectives(mesh_shape, world_size) -> None:
    assert run_world(_sum_versus_torch, world_size, mesh_shape)[0] == []
