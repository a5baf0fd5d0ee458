"""_StridedShard as views make it: a sharded dim flattened into the dims before it (torch's view rule),
bmm/mm running on it, and the view back restoring the Shard.

Tier (a), pure: the interleaved layout against torch's own `_StridedShard._split_tensor`, the view
rule against torch's (`propagate_shape_and_sharding`, strict view) and against real local views on
simulated ranks, the matmul rule. Tier (b), ranks: programs on our DTensor and torch's with the same
inputs (outputs, gradients, placements, collectives), and redistribution to and from strided layouts.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest
import torch

from parallelisms.dtensor import Partial, Replicate, Shard
from parallelisms.dtensor.ops.matmul import EINSUMS, einsum_shardings
from parallelisms.dtensor.ops.view_dims import propagate, view_groups
from parallelisms.dtensor.placements import _StridedShard, interleaved_lengths, local_shape_and_offset
from tests.dtensor.harness import FakeMesh, make_spec
from tests.world import run_world

S, R, SS = Shard, Replicate(), _StridedShard
aten = torch.ops.aten


def _torch_placement(p: Any) -> Any:
    from torch.distributed.tensor import Partial as TP
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS
    from torch.distributed.tensor.placement_types import _StridedShard as TSS

    if isinstance(p, Shard):
        return TS(p.dim)
    if isinstance(p, _StridedShard):
        return TSS(p.dim, split_factor=p.split_factor)
    return TP(p.reduce_op) if isinstance(p, Partial) else TR()


def _ours(p: Any) -> Any:
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS
    from torch.distributed.tensor.placement_types import _StridedShard as TSS

    if isinstance(p, TSS):
        return _StridedShard(p.dim, p.split_factor)
    if isinstance(p, TS):
        return Shard(p.dim)
    return Replicate() if isinstance(p, TR) else Partial(p.reduce_op)


def torch_shard(t: torch.Tensor, mesh_shape, coordinate, placements) -> torch.Tensor:
    """The shard at `coordinate` as torch's DTensor lays it out: each mesh dim in mesh order splits
    the tensor with torch's own `_split_tensor` (the oracle of every layout here)."""
    for m, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            t = _torch_placement(p)._split_tensor(t, mesh_shape[m], with_padding=False)[0][coordinate[m]]
    return t


def _random_view(rng: random.Random) -> tuple[list[int], list[int]]:
    in_shape = [rng.choice([1, 2, 3, 4, 5, 6, 8]) for _ in range(rng.randint(1, 4))]
    rest, out_shape = math.prod(in_shape), []
    while rest > 1 and len(out_shape) < 4:
        factor = rng.choice([d for d in range(1, rest + 1) if rest % d == 0])
        out_shape.append(factor)
        rest //= factor
    out_shape.append(rest)
    return in_shape, out_shape


def _matches_local_views(in_shape, out_shape, mesh_shape, required, output) -> bool:
    """Viewing every rank's input shard (as torch lays it out) gives its output shard."""
    x = torch.arange(math.prod(in_shape)).view(in_shape)
    y = x.view(out_shape)
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        local_in = torch_shard(x, mesh_shape, coordinate, required)
        local_out = torch_shard(y, mesh_shape, coordinate, output)
        if local_in.numel() != local_out.numel() or not torch.equal(local_in.reshape(local_out.shape), local_out):
            return False
        ours_shape, _ = local_shape_and_offset(y.shape, mesh_shape, coordinate, output)
        if ours_shape != tuple(local_out.shape):
            return False
    return True


# --------------------------------------------------------------------------------------------------
# tier (a): pure
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 5, 6, 9, 12, 24])
@pytest.mark.parametrize("split_factor", [1, 2, 3])
@pytest.mark.parametrize("num_chunks", [2, 3, 4])
def test_interleaved_layout_is_torchs(size: int, split_factor: int, num_chunks: int) -> None:
    """Local sizes of `_StridedShard(0, sf)` on a 1-D mesh: torch's split (uneven pieces included)."""
    x = torch.arange(size)
    for r in range(num_chunks):
        want = torch_shard(x, (num_chunks,), (r,), (SS(0, split_factor),))
        (local,), (offset,) = local_shape_and_offset((size,), (num_chunks,), (r,), (SS(0, split_factor),))
        assert local == len(want) == sum(interleaved_lengths(size, split_factor, num_chunks)[r])
        assert offset == (want[0].item() if len(want) else size)  # its first element's, as torch


def test_view_flattens_heads_into_a_strided_batch_and_back() -> None:
    B, H, T, hd = 2, 4, 8, 8
    flat = view_groups((B, H, T, hd), (B * H, T, hd))
    assert propagate(flat, (S(1),), (2,)) == ((S(1),), (SS(0, B),))
    assert propagate(view_groups((B, 3, T), (B * 3, T)), (S(1),), (2,)) == ((S(1),), (SS(0, B),))  # uneven heads
    back = view_groups((B * H, T, T), (B, H, T, T))
    assert propagate(back, (SS(0, B),), (2,)) == ((SS(0, B),), (S(1),))
    assert propagate(back, (SS(0, 4),), (2,)) == ((SS(0, 4),), (SS(1, 2),))  # 4 pieces: 2 in each batch row
    assert propagate(back, (SS(0, 3),), (2,)) == ((R,), (R,))  # pieces across batch rows: gather
    # batch on dp, heads on tp: the heads split the dp shard's rows (torch's split factor B / dp)
    assert propagate(flat, (S(0), S(1)), (2, 2)) == ((S(0), S(1)), (S(0), SS(0, B // 2)))
    assert propagate(flat, (S(1), S(0)), (2, 2)) == ((S(1), S(0)), (SS(0, B), S(0)))
    # FSDP's strided dim is not a view's: it crosses whole dims only
    fsdp = (SS(0, 2), S(0))
    assert propagate(view_groups((8, 4), (32,)), fsdp, (2, 2)) == ((R, S(0)), (R, S(0)))
    assert propagate(view_groups((8, 4), (8, 2, 2)), fsdp, (2, 2)) == (fsdp, fsdp)


def test_view_rule_agrees_with_torchs_strict_view() -> None:
    """Where torch's strict view rule answers, ours gives the same placements, or torch's answer
    is not the layout of the local views (nested uneven shards, which ours gathers instead)."""
    from torch.distributed.tensor._ops._view_ops import propagate_shape_and_sharding
    from torch.distributed.tensor._ops._view_ops import view_groups as torch_view_groups

    rng = random.Random(0)
    same = differ = 0
    for _ in range(600):
        in_shape, out_shape = _random_view(rng)
        mesh_shape = rng.choice([(2,), (3,), (4,), (2, 2), (2, 3)])
        choices = [R, Partial()] + [S(d) for d in range(len(in_shape))]
        placements = tuple(rng.choice(choices) for _ in mesh_shape)
        required, output = propagate(view_groups(in_shape, out_shape), placements, mesh_shape)
        assert _matches_local_views(in_shape, out_shape, mesh_shape, required, output)
        try:
            theirs = propagate_shape_and_sharding(
                [_torch_placement(p) for p in placements],
                tuple(in_shape),
                torch_view_groups(in_shape, out_shape),
                mesh_shape,
                strict_view=True,
            )
        except RuntimeError:  # torch refuses the view: ours gathers what it must
            continue
        t_required, t_output = (tuple(map(_ours, ps)) for ps in theirs)
        if (t_required, t_output) == (required, output):
            same += 1
        else:
            assert not _matches_local_views(in_shape, out_shape, mesh_shape, t_required, t_output), (
                in_shape,
                out_shape,
                mesh_shape,
                placements,
                output,
                t_output,
            )
            differ += 1
    assert same > 400 and differ < 10, (same, differ)


def test_view_rule_on_strided_inputs_matches_local_views() -> None:
    rng = random.Random(1)
    kept = 0
    for _ in range(500):
        in_shape, out_shape = _random_view(rng)
        mesh_shape = rng.choice([(2,), (3,), (4,), (2, 2), (2, 3)])
        choices = [R] + [S(d) for d in range(len(in_shape))]
        choices += [SS(d, sf) for d, n in enumerate(in_shape) for sf in range(2, n + 1) if n % sf == 0] * 2
        placements = tuple(rng.choice(choices) for _ in mesh_shape)
        required, output = propagate(view_groups(in_shape, out_shape), placements, mesh_shape)
        assert all(r == p or r == R for r, p in zip(required, placements))
        assert _matches_local_views(in_shape, out_shape, mesh_shape, required, output), (
            in_shape,
            out_shape,
            mesh_shape,
            placements,
            output,
        )
        kept += any(isinstance(p, _StridedShard) for p in required)
    assert kept > 50


def test_batched_matmul_keeps_a_strided_batch() -> None:
    """bmm / baddbmm offer `_S(b, sf)` on the batch letter of every operand, with no move."""
    mesh = FakeMesh((2,))
    a, b = make_spec((8, 4, 3), SS(0, 2), mesh=mesh), make_spec((8, 3, 5), SS(0, 2), mesh=mesh)
    bmm, _ = EINSUMS[aten.bmm]
    candidates = einsum_shardings(bmm, [a, b], None, (8, 4, 5), 1)
    assert any(s.inputs == ((SS(0, 2),), (SS(0, 2),)) and s.outputs == ((SS(0, 2),),) for s in candidates)
    bias = make_spec((8, 4, 5), SS(0, 2), mesh=mesh)
    baddbmm, _ = EINSUMS[aten.baddbmm]
    candidates = einsum_shardings(baddbmm, [a, b], bias, (8, 4, 5), 1)
    assert any(s.inputs == ((SS(0, 2),),) * 3 and s.outputs == ((SS(0, 2),),) for s in candidates)


# --------------------------------------------------------------------------------------------------
# tier (b): ranks, against torch's DTensor
# --------------------------------------------------------------------------------------------------

# (name, world size, mesh shape, global shape of q, placements of q)
PROGRAMS = [
    ("heads", 2, (2,), (2, 4, 8, 8), (S(1),)),
    ("uneven_heads", 2, (2,), (2, 3, 8, 8), (S(1),)),
    ("uneven_heads_4", 4, (4,), (3, 5, 4, 4), (S(1),)),
]


def _attention_math(q, k, v, bias):
    scores = torch.matmul(q, k.transpose(-2, -1)) + bias  # (B, H, T, T)
    return torch.matmul(scores.softmax(-1), v)  # (B, H, T, hd)


def _baddbmm_flat(q, k, v, bias):
    B, H, T, hd = q.shape
    flat = [t.reshape(B * H, T, hd) for t in (q, k, v)]  # (B*H, T, hd) _S(0, B)
    scores = torch.baddbmm(bias.expand(B, H, T, T).reshape(B * H, T, T), flat[0], flat[1].transpose(1, 2))
    return torch.bmm(scores, flat[2]).view(B, H, T, hd)


def _run_program(mesh_shape, shape, placements, fn_name: str, with_torch: bool = True) -> dict[str, Any]:
    """`fn_name` on q, k, v placed `placements` and a replicated bias, on ours and torch's DTensor."""
    import torch.distributed.tensor as tdt

    import parallelisms.dtensor as odt
    from parallelisms.dtensor.debug import CommDebugMode
    from tests.dtensor.harness import get_mesh, get_torch_mesh

    fn = {"attention": _attention_math, "baddbmm": _baddbmm_flat}[fn_name]
    globals_, bias = _inputs(shape)
    results = {}
    impls = [(odt, get_mesh(mesh_shape), placements)]
    if with_torch:
        impls.append((tdt, get_torch_mesh(mesh_shape), [_torch_placement(p) for p in placements]))
    for impl, mesh, ps in impls:
        q, k, v = (impl.distribute_tensor(t, mesh, ps).requires_grad_() for t in globals_)
        b = impl.distribute_tensor(bias, mesh, [impl.Replicate()] * len(mesh_shape))
        with CommDebugMode() as comm:
            out = fn(q, k, v, b)
            forward = comm.get_total_counts()
            out.sum().backward()
        results["ours" if impl is odt else "torch"] = {
            "out": out.full_tensor(),
            "grads": [t.grad.full_tensor() for t in (q, k, v)],
            "placements": tuple(map(str, out.placements)),
            "forward": forward,
            "collectives": comm.get_total_counts(),
            "bytes": sum(comm.get_comm_bytes().values()),
        }
    return results


def _inputs(shape) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g) for _ in range(3)], torch.randn(shape[-2], shape[-2], generator=g)


def _reference(fn_name: str, shape) -> tuple[torch.Tensor, list[torch.Tensor]]:
    globals_, bias = _inputs(shape)
    ts = [t.requires_grad_() for t in globals_]
    out = {"attention": _attention_math, "baddbmm": _baddbmm_flat}[fn_name](*ts, bias)
    out.sum().backward()
    return out.detach(), [t.grad for t in ts]


@pytest.mark.parametrize(
    ("name", "world_size", "mesh_shape", "shape", "placements"), PROGRAMS, ids=[p[0] for p in PROGRAMS]
)
@pytest.mark.parametrize("fn_name", ["attention", "baddbmm"])
def test_strided_batch_matmul_matches_torch(name, world_size, mesh_shape, shape, placements, fn_name) -> None:
    """Math attention (matmul's decomposition) and explicit baddbmm/bmm on flattened heads: the
    values and gradients of one device, torch's output placement (or a sharded one where torch's is
    Replicate), no collective in the forward and no more collectives or bytes than torch's DTensor."""
    result = run_world(_run_program, world_size, mesh_shape, shape, placements, fn_name)[0]
    want, want_grads = _reference(fn_name, shape)
    ours, theirs = result["ours"], result["torch"]
    for got in (ours, theirs):
        torch.testing.assert_close(got["out"], want, rtol=1e-5, atol=1e-5)
        for grad, want_grad in zip(got["grads"], want_grads):
            torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-5)
    # the same placements, or sharded where torch's are Replicate (its baddbmm gathers the flat batch)
    assert all(a == b or b == "R" for a, b in zip(ours["placements"], theirs["placements"])), (ours, theirs)
    assert ours["forward"] == 0 and ours["collectives"] <= theirs["collectives"], (ours, theirs)
    assert ours["bytes"] <= theirs["bytes"]


@pytest.mark.parametrize(("shape", "placements"), [((2, 4, 8, 8), (S(0), S(1))), ((4, 4, 8, 8), (S(1), S(0)))], ids=str)
def test_strided_batch_on_a_2d_mesh(shape: tuple[int, ...], placements: tuple) -> None:
    """Batch and heads on a (2, 2) mesh: the flat batch is `(S(0), _S(0, B / 2))` or `(_S(0, B), S(0))`
    (torch's placements: tier (a) checks them against its rule; torch's first calls on a 2-D mesh take
    seconds, so only ours runs here), with no collective at all."""
    result = run_world(_run_program, 4, (2, 2), shape, placements, "attention", False)[0]["ours"]
    want, want_grads = _reference("attention", shape)
    torch.testing.assert_close(result["out"], want, rtol=1e-5, atol=1e-5)
    for grad, want_grad in zip(result["grads"], want_grads):
        torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-5)
    assert result["placements"] == tuple(map(str, placements)) and result["collectives"] == 0


def _sequence_matmul() -> dict[str, Any]:
    """(B, T, D) sequence-sharded x (D, E) replicated: matmul folds (B, T), a strided fold."""
    import torch.distributed.tensor as tdt

    import parallelisms.dtensor as odt
    from parallelisms.dtensor.debug import CommDebugMode
    from tests.dtensor.harness import get_mesh, get_torch_mesh

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 6, 8, generator=g), torch.randn(8, 5, generator=g)
    out = {}
    for impl, mesh in ((odt, get_mesh((2,))), (tdt, get_torch_mesh((2,)))):
        xd = impl.distribute_tensor(x, mesh, [impl.Shard(1)]).requires_grad_()
        wd = impl.distribute_tensor(w, mesh, [impl.Replicate()]).requires_grad_()
        with CommDebugMode() as comm:
            y = xd @ wd  # (B, T, E) S(1)
            y.sum().backward()
        out["ours" if impl is odt else "torch"] = (
            y.full_tensor(),
            xd.grad.full_tensor(),
            wd.grad.full_tensor(),
            str(y.placements[0]),
            comm.get_total_counts(),
        )
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (xr @ wr).sum().backward()
    out["want"] = ((xr @ wr).detach(), xr.grad, wr.grad)
    return out


def test_sequence_sharded_matmul_keeps_the_sequence_shard() -> None:
    result = run_world(_sequence_matmul, 2)[0]
    want = result["want"]
    for got in (result["ours"], result["torch"]):
        for tensor, wanted in zip(got[:3], want):
            torch.testing.assert_close(tensor, wanted, rtol=1e-5, atol=1e-5)
    assert result["ours"][3] == result["torch"][3] == "S(1)"
    assert result["ours"][4] <= result["torch"][4], (result["ours"][4], result["torch"][4])


def _redistribute_strided(mesh_shape: tuple[int, ...]) -> list[str]:
    """Every strided layout a view makes, to and from every plain placement and back, as torch."""
    import torch.distributed.tensor as tdt

    import parallelisms.dtensor as odt
    from tests.dtensor.harness import get_mesh, get_torch_mesh

    mesh, tmesh = get_mesh(mesh_shape), get_torch_mesh(mesh_shape)
    failures = []
    layouts = {(2,): [(SS(0, 2),), (SS(0, 3),), (SS(1, 2),)], (4,): [(SS(0, 2),), (SS(0, 3),)]}.get(
        mesh_shape, [(SS(0, 2), S(0)), (S(0), SS(0, 2)), (SS(0, 4), S(0)), (SS(0, 3), S(1)), (R, SS(1, 2))]
    )
    plain = [tuple(p) for p in itertools.product([R, S(0), S(1)], repeat=len(mesh_shape))]
    for rows in (6, 9, 12, 13):
        g = torch.randn(rows, 6, generator=torch.Generator().manual_seed(rows))
        for layout in layouts:
            d = odt.distribute_tensor(g, mesh, layout)
            t = tdt.distribute_tensor(g, tmesh, [_torch_placement(p) for p in layout], src_data_rank=None)
            if not torch.equal(d.to_local(), t.to_local()):
                failures.append(f"{rows} rows {layout}: local shard differs from torch's")
            if not torch.equal(d.full_tensor(), g):
                failures.append(f"{rows} rows {layout}: full_tensor")
            for target in plain:
                moved = d.redistribute(placements=target)
                if not torch.equal(moved.full_tensor(), g):
                    failures.append(f"{rows} rows {layout} -> {target}")
                if not torch.equal(moved.redistribute(placements=layout).to_local(), d.to_local()):
                    failures.append(f"{rows} rows {target} -> {layout}")
    return failures


@pytest.mark.parametrize(("mesh_shape", "world_size"), [((2,), 2), ((4,), 4), ((2, 2), 4)], ids=str)
def test_strided_layouts_redistribute_like_torch(mesh_shape: tuple[int, ...], world_size: int) -> None:
    for failures in run_world(_redistribute_strided, world_size, mesh_shape):
        assert not failures, failures
