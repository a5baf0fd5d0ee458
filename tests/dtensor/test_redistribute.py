"""Redistribution and its gradients against torch's own DTensor, rank by rank.

Every case builds the same global tensor with our DTensor and with `torch.distributed.tensor`
(Partial sources come from identical local tensors via `from_local` on both), redistributes with
both, and compares the local shard on every rank, `full_tensor()`, the number of collectives and
the bytes sent (both measured by our CommDebugMode, which counts c10d and functional collectives
from any source; torch's count is cross-checked with torch's own CommDebugMode).

Inputs hold small integers so that every sum, split and partition is exact in fp32 and bf16, and
results can be compared with `torch.equal`.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.distributed.tensor as tdt
from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

from parallelisms.dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from parallelisms.dtensor.debug import CommDebugMode
from tests.dtensor.harness import (
    as_partial,
    assert_no_failures,
    chunk_local,
    get_mesh,
    get_torch_mesh,
    to_torch_placements,
)
from tests.world import run_world

PLACEMENTS = (Replicate(), Shard(0), Shard(1), Partial())
SHAPES = ((8, 16), (5, 7), (3, 2))
MESHES_BY_WORLD = {2: ((2,),), 4: ((4,), (2, 2)), 8: ((8,), (2, 4), (4, 2))}
ALL_TO_ALL = "c10d_functional.all_to_all_single"
ALL_GATHER = "c10d_functional.all_gather_into_tensor"


# --------------------------------------------------------------------------------------------------
# oracles built from torch only
# --------------------------------------------------------------------------------------------------


def from_torch(placements) -> tuple:
    """torch placements as ours (for comparing gradient placements)."""
    out = []
    for p in placements:
        if p.is_shard():
            out.append(Shard(p.dim))
        elif p.is_partial():
            out.append(Partial(p.reduce_op))
        else:
            out.append(Replicate())
    return tuple(out)


def torch_coordinate(mesh_shape) -> list[int]:
    """This rank's coordinate on a row-major mesh, from torch's own DeviceMesh."""
    return get_torch_mesh(mesh_shape).get_coordinate()


def int_tensor(shape, seed: int, dtype=torch.float32, low: int = -4, high: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, tuple(shape), generator=g).to(dtype)


def partial_contribution(global_t: torch.Tensor, mesh_shape, coordinate, placements, seed: int) -> torch.Tensor:
    """This rank's addend of `global_t` over the Partial mesh dims (the addends sum to `global_t`).

    Every Partial coordinate k but the last gets a random integer tensor X_k; the last gets
    `global_t - sum(X_k)`. Every rank can compute every X_k, so the sum is exact and known.
    """
    p_dims = [m for m, p in enumerate(placements) if isinstance(p, Partial)]
    if not p_dims:
        return global_t
    keys = list(itertools.product(*(range(mesh_shape[m]) for m in p_dims)))
    mine = tuple(coordinate[m] for m in p_dims)
    others = [int_tensor(global_t.shape, seed + 1000 + i, global_t.dtype) for i in range(len(keys) - 1)]
    if mine != keys[-1]:
        return others[keys.index(mine)]
    return global_t - sum(others, torch.zeros_like(global_t))


def build_pair(global_t: torch.Tensor, mesh_shape, placements, seed: int):
    """(ours, torch's) DTensor of `global_t` with `placements`, built alike on both sides."""
    mesh, tmesh = get_mesh(mesh_shape), get_torch_mesh(mesh_shape)
    if not any(isinstance(p, Partial) for p in placements):
        return (
            distribute_tensor(global_t, mesh, placements),
            tdt.distribute_tensor(global_t, tmesh, to_torch_placements(placements)),
        )
    coordinate = torch_coordinate(mesh_shape)
    addend = partial_contribution(global_t, mesh_shape, coordinate, placements, seed)
    local = chunk_local(addend, mesh_shape, coordinate, placements)
    shape, stride = global_t.shape, global_t.stride()
    ours = DTensor.from_local(local.clone(), mesh, placements, shape=shape, stride=stride)
    theirs = tdt.DTensor.from_local(local.clone(), tmesh, to_torch_placements(placements), shape=shape, stride=stride)
    return ours, theirs


def torch_redistribute(t: tdt.DTensor, tmesh, placements) -> tdt.DTensor:
    """torch's redistribute; R -> P (refused by torch's public API as internal-only) goes through the
    autograd Function that the public API itself calls."""
    from torch.distributed.tensor._redistribute import Redistribute as TorchRedistribute

    placements = tuple(to_torch_placements(placements))
    if all(not p.is_partial() or p == q for p, q in zip(placements, t.placements)):
        return t.redistribute(tmesh, placements)
    dtype = t._local_tensor.dtype
    config = {"op_dtype": dtype, "out_dtype": dtype, "backward_options": {"op_dtype": dtype, "out_dtype": dtype}}
    return TorchRedistribute.apply(t, tmesh, placements, False, config)


def ours_redistribute(t: DTensor, mesh, placements) -> DTensor:
    """Our redistribute; R -> P (refused by the public API, as torch's) through the autograd Function
    that the public API itself calls, as `torch_redistribute` does for torch."""
    if all(not isinstance(p, Partial) or p == q for p, q in zip(placements, t.placements)):
        return t.redistribute(mesh, placements)
    return as_partial(t, placements)


def is_legal(src, dst) -> bool:
    """Only a Replicate (or the same Partial) mesh dim may become Partial."""
    return all(not isinstance(d, Partial) or isinstance(s, (Replicate, Partial)) for s, d in zip(src, dst))


def names(placements) -> str:
    return "(" + ",".join(map(str, placements)) + ")"


def total_bytes(mode) -> int:
    return sum(mode.get_comm_bytes().values())


def keyed(counts) -> dict[str, int]:
    return {str(k): v for k, v in counts.items()}


# --------------------------------------------------------------------------------------------------
# the forward matrix
# --------------------------------------------------------------------------------------------------


def check_case(mesh_shape, global_t, src, dst, ours_src, torch_src, coordinate, failures, costs) -> None:
    """One src -> dst case on this rank; appends failure strings (never raises mid-loop) and, for
    legal cases, (case, our count, torch's count, our bytes, torch's bytes, our keys, torch's keys)."""
    mesh, tmesh = get_mesh(mesh_shape), get_torch_mesh(mesh_shape)
    what = f"mesh {mesh_shape} {tuple(global_t.shape)} {global_t.dtype} {names(src)}->{names(dst)}"
    if not is_legal(src, dst):
        try:
            ours_src.redistribute(mesh, dst)
        except ValueError:
            return
        failures.append(f"{what}: expected ValueError")
        return
    with CommDebugMode() as ours_mode:
        ours = ours_redistribute(ours_src, mesh, dst)
    with TorchCommDebugMode() as torch_native_mode, CommDebugMode() as torch_mode:
        theirs = torch_redistribute(torch_src, tmesh, dst)
    if not ours._local_tensor.is_contiguous():
        failures.append(f"{what}: local shard is not contiguous (torch's always are)")
    if tuple(ours.placements) != tuple(dst) or ours.shape != global_t.shape:
        failures.append(f"{what}: got placements {ours.placements} shape {tuple(ours.shape)}")
    if not torch.equal(ours._local_tensor, theirs._local_tensor):
        failures.append(f"{what}: local {ours._local_tensor.tolist()} != torch's {theirs._local_tensor.tolist()}")
    if not any(isinstance(p, Partial) for p in dst):
        expected = chunk_local(global_t, mesh_shape, coordinate, dst)
        if not torch.equal(theirs._local_tensor, expected):  # the oracle itself
            failures.append(f"{what}: torch's local differs from torch.chunk")
    full = ours.full_tensor()
    if not torch.equal(full, global_t):
        failures.append(f"{what}: full_tensor differs from the global tensor")
    torch_count = torch_mode.get_total_counts()
    if torch_native_mode.get_total_counts() != torch_count:
        failures.append(
            f"{what}: our CommDebugMode saw {torch_count} torch collectives, torch's saw "
            f"{torch_native_mode.get_total_counts()}"
        )
    costs.append(
        (
            what,
            ours_mode.get_total_counts(),
            torch_count,
            total_bytes(ours_mode),
            total_bytes(torch_mode),
            keyed(ours_mode.get_comm_counts()),
            keyed(torch_mode.get_comm_counts()),
        )
    )
    changed = [m for m in range(len(src)) if src[m] != dst[m]]
    if len(changed) == 1 and isinstance(src[changed[0]], Shard) and isinstance(dst[changed[0]], Shard):
        dims = (src[changed[0]].dim, dst[changed[0]].dim)
        nested = any(isinstance(p, Shard) and p.dim in dims for m, p in enumerate(src) if m != changed[0])
        counts = keyed(ours_mode.get_comm_counts())
        if not nested and mesh.size(changed[0]) > 1 and (ALL_TO_ALL not in counts or ALL_GATHER in counts):
            failures.append(f"{what}: S(i)->S(j) should be one all_to_all, got {counts}")


def redistribute_matrix(dtype_name: str, stride: int) -> tuple[list[str], list[tuple]]:
    """Every (src, dst) pair on every mesh of this world and every shape; `stride` samples pairs."""
    dtype = getattr(torch, dtype_name)
    failures: list[str] = []
    costs: list[tuple] = []
    for mesh_shape in MESHES_BY_WORLD[dist.get_world_size()]:
        coordinate = torch_coordinate(mesh_shape)
        choices = list(itertools.product(PLACEMENTS, repeat=len(mesh_shape)))
        for shape_index, shape in enumerate(SHAPES):
            global_t = int_tensor(shape, 7 + shape_index, dtype)
            for src_index, src in enumerate(choices):
                pairs = [
                    dst
                    for dst_index, dst in enumerate(choices)
                    if dst != src and (src_index * len(choices) + dst_index + shape_index) % stride == 0
                ]
                if not pairs:
                    continue
                ours_src, torch_src = build_pair(global_t, mesh_shape, src, seed=src_index)
                for dst in pairs:
                    check_case(mesh_shape, global_t, src, dst, ours_src, torch_src, coordinate, failures, costs)
    return failures, costs


def _run_matrix(world_size: int, dtype_name: str, stride: int) -> None:
    """Run the matrix; collectives compare per rank, bytes summed over ranks (uneven shards make
    per-rank bytes differ, and the planner minimizes what all ranks send together)."""
    results = run_world(redistribute_matrix, world_size, dtype_name, stride)
    failures = [f"rank {r}: {f}" for r, (fs, _) in enumerate(results) for f in fs]
    cheaper = []
    for per_rank in zip(*(costs for _, costs in results)):
        what, _, _, _, _, ours_keys, torch_keys = per_rank[0]
        ours_count, torch_count = max(c[1] for c in per_rank), max(c[2] for c in per_rank)
        ours_bytes, torch_bytes = sum(c[3] for c in per_rank), sum(c[4] for c in per_rank)
        line = f"{what}: ours {ours_keys} {ours_bytes} B, torch {torch_keys} {torch_bytes} B (all ranks)"
        if ours_count > torch_count or ours_bytes > torch_bytes:
            failures.append("more communication than torch: " + line)
        elif ours_count < torch_count or ours_bytes < torch_bytes:
            cheaper.append(line)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])
    print(
        f"world {world_size} {dtype_name}: {len(results[0][1])} legal cases; ours cheaper than torch in {len(cheaper)}"
    )
    for line in cheaper:
        print("  cheaper:", line)


def test_redistribute_matches_torch_fp32_world2():
    _run_matrix(2, "float32", 1)


def test_redistribute_matches_torch_fp32_world4():
    _run_matrix(4, "float32", 1)


def test_redistribute_matches_torch_fp32_world8():
    # every mesh and shape of 8 ranks, half of the (src, dst) pairs (the other half in turn per
    # shape): the full matrix takes 70 s of 8 processes on 2 cores
    _run_matrix(8, "float32", 2)


def test_redistribute_matches_torch_bf16_world4():
    _run_matrix(4, "bfloat16", 3)


def test_redistribute_matches_torch_bf16_world8():
    _run_matrix(8, "bfloat16", 11)


# --------------------------------------------------------------------------------------------------
# special cases
# --------------------------------------------------------------------------------------------------


def shard_to_shard_is_all_to_all() -> list[dict[str, int]]:
    mesh = get_mesh((4,))
    out = []
    for shape, src, dst in (((8, 16), 0, 1), ((5, 7), 1, 0), ((3, 2), 0, 1), ((4, 6, 9), 2, 0)):
        global_t = int_tensor(shape, 3)
        x = distribute_tensor(global_t, mesh, [Shard(src)])
        with CommDebugMode() as mode:
            y = x.redistribute(mesh, [Shard(dst)])
        assert torch.equal(y._local_tensor, chunk_local(global_t, (4,), torch_coordinate((4,)), [Shard(dst)]))
        out.append(keyed(mode.get_comm_counts()))
    return out


def test_shard_to_shard_uses_one_all_to_all_on_uneven_shapes():
    for counts in run_world(shard_to_shard_is_all_to_all, 4):
        assert counts == [{ALL_TO_ALL: 1}] * 4, counts


def same_and_invalid_targets() -> list[str]:
    mesh = get_mesh((2, 2))
    x = distribute_tensor(int_tensor((4, 4), 0), mesh, [Shard(0), Replicate()])
    seen = []
    with CommDebugMode() as mode:
        same = x.redistribute(mesh, [Shard(-2), Replicate()])
    assert same is x and mode.get_total_counts() == 0
    p = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0), Partial("sum")])
    for src, bad in ((x, [Partial(), Replicate()]), (p, [Shard(0), Partial("max")]), (p, [Partial(), Partial()])):
        try:
            src.redistribute(mesh, bad)
        except ValueError as e:
            seen.append(str(e))
    return seen


def test_redistribute_rejects_non_replicate_to_partial_on_every_rank():
    for messages in run_world(same_and_invalid_targets, 4):
        assert len(messages) == 3, messages
        assert "Partial" in messages[0] or "P(" in messages[0]


def partial_reduce_ops() -> list[str]:
    """P(avg/min/max) -> R and -> S(0) against torch, with rank-dependent locals."""
    failures = []
    for mesh_shape in ((4,), (2, 2)):
        mesh, tmesh = get_mesh(mesh_shape), get_torch_mesh(mesh_shape)
        for op in ("avg", "min", "max"):
            for shape in ((8, 4), (5, 3), (3, 1)):
                local = int_tensor(shape, dist.get_rank() * 31 + 5) * 4
                src = [Partial(op)] * len(mesh_shape)
                for dst in (
                    [Replicate()] * len(mesh_shape),
                    [Shard(0)] + [Replicate()] * (len(mesh_shape) - 1),
                    [Partial(op)] + [Shard(1)] * (len(mesh_shape) - 1),
                ):
                    ours = ours_redistribute(DTensor.from_local(local.clone(), mesh, src), mesh, dst)
                    theirs = torch_redistribute(
                        tdt.DTensor.from_local(local.clone(), tmesh, to_torch_placements(src)), tmesh, dst
                    )
                    if not torch.equal(ours._local_tensor, theirs._local_tensor):
                        failures.append(f"{mesh_shape} {shape} P({op})->{names(dst)}")
    return failures


def test_partial_avg_min_max_match_torch():
    assert_no_failures(run_world(partial_reduce_ops, 4))


def replicate_to_partial_ops() -> list[str]:
    failures = []
    mesh, tmesh = get_mesh((2, 2)), get_torch_mesh((2, 2))
    t = int_tensor((4, 6), 1) * 4
    for op in ("sum", "avg", "min", "max"):
        for src, dst in (
            ([Replicate(), Replicate()], [Partial(op), Replicate()]),
            ([Replicate(), Shard(1)], [Partial(op), Shard(1)]),
            ([Replicate(), Replicate()], [Partial(op), Partial(op)]),
        ):
            ours = ours_redistribute(distribute_tensor(t, mesh, src), mesh, dst)
            theirs = torch_redistribute(tdt.distribute_tensor(t, tmesh, to_torch_placements(src)), tmesh, dst)
            if not torch.equal(ours._local_tensor, theirs._local_tensor) or not torch.equal(ours.full_tensor(), t):
                failures.append(f"{names(src)}->{names(dst)} {op}")
    return failures


def test_replicate_to_partial_partitions_like_torch_for_every_reduce_op():
    assert_no_failures(run_world(replicate_to_partial_ops, 4))


# --------------------------------------------------------------------------------------------------
# gradients
# --------------------------------------------------------------------------------------------------


def grad_leaf_pair(global_t, mesh_shape, placements, seed):
    ours, theirs = build_pair(global_t, mesh_shape, placements, seed)
    return ours.detach().requires_grad_(), theirs.detach().requires_grad_()


def compare_grads(what, ours, theirs, failures) -> None:
    if ours is None or theirs is None:
        if (ours is None) != (theirs is None):
            failures.append(f"{what}: grad is {ours!r} vs torch {theirs!r}")
        return
    if tuple(ours.placements) != from_torch(theirs.placements):
        failures.append(
            f"{what}: grad placements {names(ours.placements)} != torch {names(from_torch(theirs.placements))}"
        )
    elif not torch.equal(ours._local_tensor, theirs._local_tensor):
        failures.append(f"{what}: local grad {ours._local_tensor.tolist()} != torch {theirs._local_tensor.tolist()}")


def redistribute_grads(mesh_shape) -> list[str]:
    """x.redistribute(dst).to_local() * w -> x.grad, for every legal pair, vs torch."""
    mesh, tmesh = get_mesh(mesh_shape), get_torch_mesh(mesh_shape)
    failures: list[str] = []
    choices = list(itertools.product(PLACEMENTS, repeat=len(mesh_shape)))
    for shape in ((4, 6), (5, 3)) if len(mesh_shape) == 1 else ((5, 3),):  # (2, 2): uneven only
        global_t = int_tensor(shape, 11)
        for i, src in enumerate(choices):
            ours_src, torch_src = build_pair(global_t, mesh_shape, src, seed=i)
            for dst in choices:
                if not is_legal(src, dst):
                    continue
                x, tx = ours_src.detach().requires_grad_(), torch_src.detach().requires_grad_()
                y, ty = ours_redistribute(x, mesh, dst), torch_redistribute(tx, tmesh, dst)
                w = int_tensor(y._local_tensor.shape, 100 + dist.get_rank())
                (y.to_local() * w).sum().backward()
                (ty.to_local() * w).sum().backward()
                compare_grads(f"{mesh_shape} {shape} {names(src)}->{names(dst)}", x.grad, tx.grad, failures)
    return failures


def test_redistribute_grads_match_torch_mesh2():
    for failures in run_world(redistribute_grads, 2, (2,)):
        assert not failures, "\n".join(failures)


def test_redistribute_grads_match_torch_mesh2x2():
    for failures in run_world(redistribute_grads, 4, (2, 2)):
        assert not failures, "\n".join(failures)


def local_and_full_grads(mesh_shape) -> list[str]:
    """from_local / to_local(grad_placements) / full_tensor(grad_placements) gradients vs torch."""
    mesh, tmesh = get_mesh(mesh_shape), get_torch_mesh(mesh_shape)
    coordinate = torch_coordinate(mesh_shape)
    failures: list[str] = []
    choices = list(itertools.product(PLACEMENTS, repeat=len(mesh_shape)))
    rank = dist.get_rank()
    for shape in ((4, 6), (5, 3)):
        global_t = int_tensor(shape, 5)
        for src in choices:
            local = chunk_local(global_t, mesh_shape, coordinate, src)
            stride = global_t.stride()
            for grad_placements in [None] + choices:
                # local leaf -> from_local -> to_local(grad_placements) -> local loss
                if grad_placements is not None and any(
                    (isinstance(g, Shard) or isinstance(s, Shard)) and g != s for g, s in zip(grad_placements, src)
                ):
                    continue  # the local grad has this shard's shape: only R <-> P may differ
                a, ta = local.clone().requires_grad_(), local.clone().requires_grad_()
                d = DTensor.from_local(a, mesh, src, shape=global_t.shape, stride=stride)
                td = tdt.DTensor.from_local(ta, tmesh, to_torch_placements(src), shape=global_t.shape, stride=stride)
                gp = None if grad_placements is None else to_torch_placements(grad_placements)
                w = int_tensor(local.shape, 300 + rank)
                (d.to_local(grad_placements=grad_placements) * w).sum().backward()
                (td.to_local(grad_placements=gp) * w).sum().backward()
                what = f"from_local{names(src)}.to_local(grad_placements={grad_placements and names(grad_placements)})"
                if not torch.equal(a.grad, ta.grad):
                    failures.append(f"{mesh_shape} {shape} {what}: {a.grad.tolist()} != torch {ta.grad.tolist()}")
            # from_local(grad_placements=...): the local grad leaves in the given placements
            for from_grad in (src, tuple(Partial() if isinstance(p, Replicate) else p for p in src)):
                a, ta = local.clone().requires_grad_(), local.clone().requires_grad_()
                d = DTensor.from_local(a, mesh, src, shape=global_t.shape, stride=stride, grad_placements=from_grad)
                td = tdt.DTensor.from_local(
                    ta,
                    tmesh,
                    to_torch_placements(src),
                    shape=global_t.shape,
                    stride=stride,
                    grad_placements=to_torch_placements(from_grad),
                )
                w = int_tensor(local.shape, 700 + rank) * 4
                (d.to_local() * w).sum().backward()
                (td.to_local() * w).sum().backward()
                if not torch.equal(a.grad, ta.grad):
                    failures.append(
                        f"{mesh_shape} {shape} from_local{names(src)} grad_placements={names(from_grad)}: "
                        f"{a.grad.tolist()} != torch {ta.grad.tolist()}"
                    )
            for grad_placements in (None, [Partial()] * len(mesh_shape)):
                x, tx = grad_leaf_pair(global_t, mesh_shape, src, seed=1)
                w = int_tensor(shape, 500 + (rank if grad_placements else 0))
                gp = None if grad_placements is None else to_torch_placements(grad_placements)
                (x.full_tensor(grad_placements=grad_placements) * w).sum().backward()
                (tx.full_tensor(grad_placements=gp) * w).sum().backward()
                compare_grads(
                    f"{mesh_shape} {shape} full_tensor{names(src)} grad_placements={gp}", x.grad, tx.grad, failures
                )
    return failures


def test_from_local_to_local_full_tensor_grads_match_torch_mesh2():
    for failures in run_world(local_and_full_grads, 2, (2,)):
        assert not failures, "\n".join(failures[:30])


def test_from_local_to_local_full_tensor_grads_match_torch_mesh2x2():
    for failures in run_world(local_and_full_grads, 4, (2, 2)):
        assert not failures, "\n".join(failures[:30])
