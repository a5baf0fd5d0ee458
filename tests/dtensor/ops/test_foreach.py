"""Foreach / fused-optimizer / norm rules (ops/foreach.py) and the p-norm Partial they produce.

Optimizers (AdamW foreach / for-loop / fused, amsgrad off and on; SGD with momentum, nesterov,
dampening, weight decay) step DTensor parameters sharded S(0), S(1), R, nested, uneven and empty on
the meshes (2,), (4,), (2, 2), and must match the single-device optimizer bit for bit.
clip_grad_norm_ on sharded grads must match the single-device total norm and clipped grads while
moving nothing but scalars.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo  # the first meta run of an op imports it: import it once, before ranks fork
import torch.distributed as dist

from parallelisms.dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from parallelisms.dtensor.debug import CommDebugMode
from parallelisms.dtensor.ops import foreach, reductions
from parallelisms.dtensor.placements import norm_order, norm_reduce_op, partition_divisor
from tests.dtensor.harness import FakeMesh, assert_no_failures, expect_error, get_mesh, make_spec, run_on_meshes
from tests.world import run_world

aten = torch.ops.aten
S0, S1, R = Shard(0), Shard(1), Replicate()
# per mesh: (global shape, placements) of each parameter: even, uneven, empty shards, nested, mixed
LAYOUTS = {
    (2,): [((5, 3), (S0,)), ((7,), (S0,)), ((4, 6), (S1,)), ((3, 5), (R,))],
    (4,): [((5, 3), (S0,)), ((3,), (S0,)), ((4, 6), (S1,)), ((2, 5), (R,))],
    (2, 2): [((5, 3), (S0, S1)), ((7,), (S0, S0)), ((4, 6), (R, S1)), ((3, 5), (S1, R))],
}
OPTIMIZERS = {
    "adamw_foreach": ("AdamW", {"lr": 0.1, "weight_decay": 0.1, "foreach": True}),
    "adamw_loop": ("AdamW", {"lr": 0.1, "weight_decay": 0.1, "foreach": False}),
    "adamw_foreach_amsgrad": ("AdamW", {"lr": 0.1, "amsgrad": True, "foreach": True}),
    "adamw_loop_amsgrad": ("AdamW", {"lr": 0.1, "amsgrad": True, "foreach": False}),
    "adamw_fused": ("AdamW", {"lr": 0.1, "weight_decay": 0.1, "fused": True}),
    "sgd_foreach_nesterov": (
        "SGD",
        {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1, "foreach": True},
    ),
    "sgd_loop_nesterov": ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1, "foreach": False}),
    "sgd_loop_dampening": ("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.3, "foreach": False}),
}
FOUR_RANK_SUBSET = ("adamw_foreach", "adamw_loop_amsgrad", "adamw_fused", "sgd_foreach_nesterov")


def _randn(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def step_optimizers(mesh_shape) -> list[str]:
    mesh = get_mesh(mesh_shape)
    layout = LAYOUTS[mesh_shape]
    names = OPTIMIZERS if mesh_shape == (2,) else FOUR_RANK_SUBSET
    failures = []
    for name in names:
        cls, kwargs = OPTIMIZERS[name]
        full = [_randn(*shape, seed=i) for i, (shape, _) in enumerate(layout)]
        ref = [torch.nn.Parameter(t.clone()) for t in full]
        ours = [torch.nn.Parameter(distribute_tensor(t, mesh, p)) for t, (_, p) in zip(full, layout)]
        ref_opt, our_opt = getattr(torch.optim, cls)(ref, **kwargs), getattr(torch.optim, cls)(ours, **kwargs)
        for step in range(3):
            for i, (p, d) in enumerate(zip(ref, ours)):
                g = _randn(*p.shape, seed=100 * step + i)
                p.grad, d.grad = g.clone(), distribute_tensor(g, mesh, d.placements)
            ref_opt.step()
            our_opt.step()
        for i, (p, d) in enumerate(zip(ref, ours)):
            if d.placements != layout[i][1]:
                failures.append(f"{name}: param {i} moved to {d.placements}")
            elif not torch.allclose(d.full_tensor(), p.detach(), rtol=0, atol=1e-6):
                failures.append(f"{name}: param {i} differs by {(d.full_tensor() - p).abs().max().item():.3g}")
    return failures


def test_optimizers_match_single_device_all_meshes():
    assert_no_failures(run_on_meshes(step_optimizers))


def grads_placed_unlike_params() -> list[str]:
    """Replicated grads of sharded params: the foreach update slices them locally (no collectives)."""
    mesh = get_mesh((2,))
    failures = []
    for foreach_ in (True, False):
        ref = [torch.nn.Parameter(_randn(5, 3, seed=0)), torch.nn.Parameter(_randn(6, seed=1))]
        ours = [torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [S0])) for p in ref]
        grads = [_randn(5, 3, seed=2), _randn(6, seed=3)]
        for p, d, g in zip(ref, ours, grads):
            p.grad, d.grad = g.clone(), distribute_tensor(g, mesh, [R])
        ref_opt = torch.optim.AdamW(ref, lr=0.1, foreach=foreach_)
        our_opt = torch.optim.AdamW(ours, lr=0.1, foreach=foreach_)
        ref_opt.step()
        with CommDebugMode() as comm:
            our_opt.step()
        if comm.get_total_counts() or any(not torch.allclose(d.full_tensor(), p, atol=1e-6) for p, d in zip(ref, ours)):
            failures.append(f"foreach={foreach_}: {comm.get_comm_counts()}")
    # the fused kernel writes grads and states in place: they must be laid out like the params
    failures += expect_error(
        "fused AdamW with R grads of S(0) params",
        lambda: torch.optim.AdamW(ours, lr=0.1, fused=True).step(),
        ValueError,
        "laid out alike",
    )
    return failures


def test_optimizer_slices_replicated_grads_and_fused_needs_matching_placements():
    assert_no_failures(run_world(grads_placed_unlike_params, 2))


# --------------------------------------------------------------------------------------------------
# clip_grad_norm_: exact norm, scalars only
# --------------------------------------------------------------------------------------------------


def clip_grads(mesh_shape) -> list[str]:
    import torch.distributed.tensor as tdt
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    from tests.dtensor.harness import get_torch_mesh, to_torch_placements

    mesh, tmesh = get_mesh(mesh_shape), get_torch_mesh(mesh_shape)
    layout = LAYOUTS[mesh_shape]
    failures = []
    norm_types = (2.0, 1.0, math.inf, 3.0) if mesh_shape == (2,) else (2.0,)
    for norm_type in norm_types:
        for foreach_ in (True, False):
            grads = [_randn(*shape, seed=i) * 3 for i, (shape, _) in enumerate(layout)]
            ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
            ours = [
                torch.nn.Parameter(distribute_tensor(torch.zeros_like(g), mesh, p)) for g, (_, p) in zip(grads, layout)
            ]
            theirs = [
                torch.nn.Parameter(tdt.distribute_tensor(torch.zeros_like(g), tmesh, to_torch_placements(p)))
                for g, (_, p) in zip(grads, layout)
            ]
            for g, p, d, t in zip(grads, ref, ours, theirs):
                p.grad = g.clone()
                d.grad = distribute_tensor(g, mesh, d.placements)
                t.grad = tdt.distribute_tensor(g, tmesh, t.placements)
            want = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type=norm_type, foreach=foreach_)
            with CommDebugMode() as comm:
                got = torch.nn.utils.clip_grad_norm_(ours, 1.0, norm_type=norm_type, foreach=foreach_)
            with TorchCommDebugMode() as torch_comm:
                torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type=norm_type, foreach=foreach_)
            what = f"{mesh_shape} p={norm_type} foreach={foreach_}"
            counts, sent = comm.get_comm_counts(), comm.get_comm_bytes()
            if set(counts) - {torch.ops.c10d_functional.all_reduce}:
                failures.append(f"{what}: collectives other than all_reduce: {counts}")
            elif sum(sent.values()) > 4 * len(grads) * sum(counts.values()):
                failures.append(f"{what}: an all_reduce moved more than one float32 per gradient: {sent}")
            # one scalar all_reduce per sharded grad at most (torch's DTensor stacks its norm partials
            # and issues one; our stack rule in tensor_ops.py reduces P(norm<p>) before stacking)
            if comm.get_total_counts() > max(torch_comm.get_total_counts(), len(grads) * mesh.ndim):
                failures.append(f"{what}: {comm.get_total_counts()} collectives, torch {torch_comm.get_total_counts()}")
            if not torch.allclose(got.full_tensor(), want, rtol=1e-6, atol=0):
                failures.append(f"{what}: total norm {got.full_tensor().item()} != {want.item()}")
            for i, (p, d) in enumerate(zip(ref, ours)):
                if d.grad.placements != layout[i][1] or not torch.allclose(d.grad.full_tensor(), p.grad, atol=1e-6):
                    failures.append(f"{what}: grad {i} wrong ({d.grad.placements})")
    return failures


def test_clip_grad_norm_matches_single_device_moving_only_scalars():
    assert_no_failures(run_on_meshes(clip_grads))


# --------------------------------------------------------------------------------------------------
# foreach ops one by one: per-index placements, values
# --------------------------------------------------------------------------------------------------


def _lists(mesh, seed):
    """Three tensors with different placements (and one replicated), as DTensors and as tensors."""
    layout = [((5, 3), (S0,)), ((7,), (R,)), ((4, 6), (S1,))]
    full = [_randn(*shape, seed=seed + i) for i, (shape, _) in enumerate(layout)]
    return [distribute_tensor(t, mesh, p) for t, (_, p) in zip(full, layout)], full


FOREACH_CASES = {  # name -> fn(xs, ys, zs) returning the lists to compare (in-place results included)
    "add_list": lambda x, y, z: torch._foreach_add(x, y, alpha=0.5),
    "add_scalar_": lambda x, y, z: (torch._foreach_add_(x, 2.0), x)[1],
    "add_scalarlist": lambda x, y, z: torch._foreach_add(x, [1.0, 2.0, 3.0]),
    "sub_": lambda x, y, z: (torch._foreach_sub_(x, y, alpha=2), x)[1],
    "mul_tensor_": lambda x, y, z: (torch._foreach_mul_(x, _zero_d(x[0], 1.5)), x)[1],
    "mul_list": lambda x, y, z: torch._foreach_mul(x, y),
    "div_scalarlist_": lambda x, y, z: (torch._foreach_div_(x, [2.0, 3.0, 4.0]), x)[1],
    "addcmul_": lambda x, y, z: (torch._foreach_addcmul_(x, y, z, value=0.5), x)[1],
    "addcdiv_scalarlist_": lambda x, y, z: (
        torch._foreach_addcdiv_(x, y, torch._foreach_add(torch._foreach_abs(z), 1.0), [0.1, 0.2, 0.3]),
        x,
    )[1],
    "lerp_": lambda x, y, z: (torch._foreach_lerp_(x, y, 0.25), x)[1],
    "lerp_list_": lambda x, y, z: (torch._foreach_lerp_(x, y, torch._foreach_sigmoid(z)), x)[1],
    "maximum_": lambda x, y, z: (torch._foreach_maximum_(x, y), x)[1],
    "clamp_min_": lambda x, y, z: (torch._foreach_clamp_min_(x, 0.1), x)[1],
    "sqrt": lambda x, y, z: torch._foreach_sqrt(torch._foreach_abs(x)),
    "neg_exp": lambda x, y, z: torch._foreach_exp(torch._foreach_neg(x)),
    "pow": lambda x, y, z: torch._foreach_pow(x, 2.0) + torch._foreach_pow(torch._foreach_abs(x), y),
    "reciprocal_sign_": lambda x, y, z: (torch._foreach_reciprocal_(x), torch._foreach_sign(x))[1],
    "copy_": lambda x, y, z: (torch._foreach_copy_(x, y), x)[1],
    "zero_": lambda x, y, z: (torch._foreach_zero_(x), x)[1],
    "norm": lambda x, y, z: [*torch._foreach_norm(x), *torch._foreach_norm(y, 1), *torch._foreach_norm(z, math.inf)],
    "norm3_max": lambda x, y, z: [*torch._foreach_norm(x, 3), *torch._foreach_max(y)],
}


def _zero_d(like, value):
    if isinstance(like, DTensor):
        return distribute_tensor(torch.tensor(value), like.device_mesh, [R] * like.device_mesh.ndim)
    return torch.tensor(value)


def foreach_ops(mesh_shape) -> list[str]:
    mesh = get_mesh(mesh_shape)
    failures = []
    for name, fn in FOREACH_CASES.items():
        (x, xf), (y, yf), (z, zf) = _lists(mesh, 0), _lists(mesh, 10), _lists(mesh, 20)
        before = [t.placements for t in x]
        got, want = fn(x, y, z), fn(xf, yf, zf)
        if [t.placements for t in x] != before:
            failures.append(f"{name}: an in-place list changed placements")
        for i, (g, w) in enumerate(zip(got, want)):
            if not torch.allclose(g.full_tensor(), w, atol=1e-5, rtol=1e-5):
                failures.append(f"{name}[{i}]: values differ")
    return failures


def test_foreach_ops_match_per_tensor_ops_all_meshes():
    assert_no_failures(run_on_meshes(foreach_ops, (((2,), 2), ((4,), 4))))  # (2, 2) runs them via the optimizers


# --------------------------------------------------------------------------------------------------
# norms of sharded tensors and the p-norm Partial
# --------------------------------------------------------------------------------------------------


def norms_of_shards(mesh_shape) -> list[str]:
    mesh = get_mesh(mesh_shape)
    failures = []
    t = _randn(8, 6, seed=0)  # 6 columns on 4 ranks leave an empty shard
    ndim = mesh.ndim
    for placements, ord, dim, expect in (
        ((S0,) * ndim, 2, None, "P(norm2)"), ((S1,) * ndim, 3, None, "P(norm3)"), ((S0,) * ndim, 1, None, "P(sum)"),
        ((S0,) * ndim, math.inf, None, "P(max)"), ((S0,) * ndim, 2, 1, "S(0)"), ((R,) * ndim, 2, None, "R"),
    ):  # fmt: skip
        d = distribute_tensor(t, mesh, placements)
        with CommDebugMode() as comm:
            out = torch.linalg.vector_norm(d, ord, dim=dim)
        got = ",".join(sorted({str(p) for p in out.placements}))
        want = torch.linalg.vector_norm(t, ord, dim=dim)
        if got != expect or comm.get_total_counts():
            failures.append(f"norm {ord} dim={dim} of {placements}: {got} with {comm.get_comm_counts()}")
        if not torch.allclose(out.full_tensor(), want, rtol=1e-6):
            failures.append(f"norm {ord} dim={dim} of {placements}: wrong value")
    # the inf-norm of a tensor with an empty shard gathers instead (max() of nothing raises)
    tiny = distribute_tensor(_randn(3, seed=1), mesh, (S0,) * ndim)
    if not torch.allclose(torch.linalg.vector_norm(tiny, math.inf).full_tensor(), _randn(3, seed=1).abs().max()):
        failures.append("inf-norm with an empty shard")
    # the norm of a vector of P(norm2) norms (clip_grad_norm_'s total norm) is reduced once, as
    # torch's: Replicate, so its clip coefficient and its log read it without another collective
    (norm,) = torch._foreach_norm([distribute_tensor(t, mesh, (S0,) * ndim)])
    norms = DTensor.from_local(norm.to_local().expand(2).contiguous(), mesh, norm.placements, shape=(2,), stride=(1,))
    with CommDebugMode() as comm:
        total = torch.linalg.vector_norm(norms)
        value = (1.0 / (total + 1e-6), total.full_tensor())[1]
    reduced_once = total.placements == (R,) * ndim and comm.get_total_counts() == ndim
    if not reduced_once or not torch.allclose(value, t.norm() * 2**0.5):
        failures.append(f"norm of P(norm2) norms: {total.placements}, {comm.get_total_counts()} collectives")
    return failures


def test_norms_of_shards_are_norm_partials_without_communication():
    assert_no_failures(run_on_meshes(norms_of_shards))


def norm_partial_redistributes() -> list[str]:
    mesh = get_mesh((4,))
    failures = []
    pieces = [_randn(6, 3, seed=r).abs() for r in range(4)]  # local 3-norms of disjoint pieces
    want = torch.stack(pieces).pow(3).sum(0).pow(1 / 3)
    local = pieces[dist.get_rank()]
    p = DTensor.from_local(local, mesh, [Partial("norm3")])
    if str(p.placements[0]) != "P(norm3)":
        failures.append(str(p.placements[0]))
    if not torch.allclose(p.redistribute(mesh, [R]).to_local(), want, rtol=1e-5):
        failures.append("P(norm3) -> R")
    if not torch.allclose(p.redistribute(mesh, [S0]).full_tensor(), want, rtol=1e-5):  # reduce_scatter
        failures.append("P(norm3) -> S(0)")
    t = _randn(6, 3, seed=9).abs()
    for op in ("norm2", "norm3"):  # R -> P partitions so that the reduce gives the value back
        if not torch.allclose(distribute_tensor(t, mesh, [Partial(op)]).full_tensor(), t, rtol=1e-5):
            failures.append(f"R -> P({op}) -> R")
    return failures


def test_norm_partial_reduces_and_partitions():
    assert_no_failures(run_world(norm_partial_redistributes, 4))


# --------------------------------------------------------------------------------------------------
# pure tests: no ranks
# --------------------------------------------------------------------------------------------------


def test_norm_partial_names_orders_and_partition_divisors():
    assert str(Partial("norm2")) == "P(norm2)" and norm_reduce_op(1.5) == "norm1.5" and norm_reduce_op(2) == "norm2"
    assert norm_order("norm2") == 2.0 and norm_order("sum") is None and norm_order("normx") is None
    assert partition_divisor("sum", 4) == 4 and partition_divisor("norm2", 4) == 2 and partition_divisor("max", 4) == 1
    for bad in ("norm0", "norm-1", "norminf", "l2"):
        with pytest.raises(ValueError):
            Partial(bad)
    assert reductions.norm_partial(2) == "norm2"
    assert reductions.norm_partial(1) == "sum" and reductions.norm_partial(0) == "sum"
    assert reductions.norm_partial(math.inf) == "max" and reductions.norm_partial(-1) is None


def test_norm_rule_keeps_kept_dims_sharded_and_gathers_empty_inf_pieces():
    mesh = FakeMesh((4,))
    spec = make_spec((8, 6), S0, mesh=mesh)
    assert ((Shard(0),), ((S0,),)) in reductions.vector_norm_candidates(spec, 2, (1,), False)
    assert (((Partial("norm2"),), ((S0,),))) in reductions.vector_norm_candidates(spec, 2, None, False)
    empty = make_spec((3, 6), S0, mesh=mesh)  # 3 rows on 4 ranks: the last shard is empty
    assert reductions.vector_norm_candidates(empty, math.inf, None, False) == [((R,), ((R,),))]
    partial = make_spec((8,), Partial(), mesh=mesh)
    assert reductions.vector_norm_candidates(partial, 2, None, False) == [((R,), ((R,),))]


def test_registered_foreach_ops_cover_the_optimizers():
    ops = set(foreach.FOREACH_OPS)
    for op in (aten._foreach_add_.List, aten._foreach_add_.Scalar, aten._foreach_mul_.Tensor,
               aten._foreach_lerp_.Scalar, aten._foreach_addcmul_.Scalar, aten._foreach_addcdiv_.ScalarList,
               aten._foreach_div_.ScalarList, aten._foreach_sqrt.default, aten._foreach_maximum_.List,
               aten._foreach_norm.Scalar, aten._foreach_add.List, aten._foreach_copy_.default,
               aten._foreach_zero_.default, aten._fused_adamw_.default):  # fmt: skip
        assert op in ops, op
    assert aten._foreach_mm.default not in ops


def _adamw_steps_plan_once(foreach: bool) -> tuple[list[int], bool]:
    from parallelisms.dtensor import dispatch

    mesh = get_mesh((2,))
    torch.manual_seed(0)
    ws = [torch.randn(8, 4), torch.randn(5)]
    ps = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in ws]
    qs = [torch.nn.Parameter(w.clone()) for w in ws]
    ours, ref = torch.optim.AdamW(ps, lr=1e-2, foreach=foreach), torch.optim.AdamW(qs, lr=1e-2, foreach=foreach)
    new_plans = []
    for _ in range(4):
        grads = [torch.randn_like(w) for w in ws]
        for p, q, g in zip(ps, qs, grads):
            p.grad, q.grad = distribute_tensor(g, mesh, [Shard(0)]), g.clone()
        before = len(dispatch.PLANS)
        ours.step()
        ref.step()
        new_plans.append(len(dispatch.PLANS) - before)
    return new_plans[1:], all(torch.equal(p.full_tensor(), q) for p, q in zip(ps, qs))


@pytest.mark.parametrize("foreach", [True, False])
def test_adamw_changing_scalars_plan_once(foreach: bool):
    """AdamW's bias corrections change every step (a scalar list with foreach, float args without):
    plans are keyed by the scalars' presence, not their values (no replanning, no cache growing by
    plans per step), and the new values are used."""
    for later_plans, equal in run_world(_adamw_steps_plan_once, 2, foreach):
        assert later_plans == [0, 0, 0] and equal
