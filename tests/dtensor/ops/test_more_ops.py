"""Rules and dispatch paths added together: histc (reductions.py), eigh / svd (linalg.py),
constant_pad_nd (tensor_ops.py), the upsample family (upsample.py), multinomial (random.py), fill_
into a Partial tensor (pointwise.py), in-place squeeze_ and the decomposition of ops without a rule
(decompositions.py, linear / matmul under inference_mode among them), and foreach ops whose lists
span several meshes (foreach.py).

Pure tests call the rules on hand-built specs. Rank tests compare every op with the single-device
run over sampled placements (Partial included where the rule keeps it) on meshes (2,), (4,) and
(2, 2) with uneven shapes (3 and 5 on 4 ranks leave short and empty shards), gradients included,
and with torch's own DTensor: same values and no more collectives.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.ops import aten

from parallelisms.dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from parallelisms.dtensor.debug import CommDebugMode
from parallelisms.dtensor.ops import decompositions
from parallelisms.dtensor.ops.linalg import batched_factorization
from parallelisms.dtensor.ops.pointwise import pointwise_rule
from parallelisms.dtensor.ops.random import multinomial
from parallelisms.dtensor.ops.reductions import histc_rule
from parallelisms.dtensor.ops.registry import LOCAL_SHAPE, OpCall, Sharding
from parallelisms.dtensor.ops.tensor_ops import constant_pad_nd
from parallelisms.dtensor.ops.upsample import upsample_rule
from tests.dtensor.harness import (
    MESHES,
    FakeMesh,
    as_partial,
    assert_no_failures,
    check_op,
    expect_error,
    get_mesh,
    get_torch_mesh,
    make_spec,
    placements_and_collectives,
    run_ours_and_torch,
    to_torch_placements,
)
from tests.world import run_world

R, P = Replicate(), Partial()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)


def outputs(candidates: Sharding | list[Sharding]) -> set[tuple]:
    return {c.outputs for c in ([candidates] if isinstance(candidates, Sharding) else candidates)}


# --------------------------------------------------------------------------------------------------
# pure rule tests (no ranks)
# --------------------------------------------------------------------------------------------------


def test_histc_shard_becomes_partial_sum_unless_the_range_comes_from_the_data() -> None:
    x = make_spec((6, 4), S1)
    assert outputs(histc_rule(OpCall(aten.histc.default, (x, 5, -1.0, 1.0), {}))) == {((P,),), ((R,),)}
    assert outputs(histc_rule(OpCall(aten.histc.default, (x, 5), {}))) == {((R,),)}  # min == max: data range
    assert outputs(histc_rule(OpCall(aten.histc.default, (make_spec((6,), P), 5, 0.0, 1.0), {}))) == {((R,),)}


def test_eigh_and_svd_keep_batch_shards_and_gather_the_matrix_dims() -> None:
    a = make_spec((3, 4, 4), S0, S2)
    got = outputs(batched_factorization(OpCall(aten._linalg_eigh.default, (a,), {})))
    assert ((S0, R), (S0, R)) in got and ((S0, S0), (S0, S0)) in got  # S(2) moves to the batch dim or gathers
    assert not any(Shard(d) in out for c in got for out in c for d in (1, 2))
    values_only = outputs(batched_factorization(OpCall(aten._linalg_eigh.default, (a, "L", False), {})))
    assert ((S0, R), (R, R)) in values_only  # the (0,)-shaped eigenvectors are Replicate
    svd = outputs(batched_factorization(OpCall(aten._linalg_svd.default, (make_spec((3, 4, 5), P),), {})))
    assert svd == {((R,),) * 3, ((S0,),) * 3}  # not linear: Partial reduces first


def test_constant_pad_keeps_unpadded_shards_and_partial_only_where_the_fill_allows() -> None:
    x = make_spec((5, 7), S0)
    pad = outputs(constant_pad_nd(OpCall(aten.constant_pad_nd.default, (x, [1, 2]), {})))
    assert ((S0,),) in pad and ((S1,),) not in pad
    assert ((S1,),) not in outputs(
        constant_pad_nd(OpCall(aten.constant_pad_nd.default, (make_spec((5, 7), S1), [1, 2]), {}))
    )
    p = make_spec((5, 7), P)
    assert ((P,),) in outputs(constant_pad_nd(OpCall(aten.constant_pad_nd.default, (p, [1, 2]), {})))
    assert ((P,),) not in outputs(constant_pad_nd(OpCall(aten.constant_pad_nd.default, (p, [1, 2], 1.5), {})))
    pmax = make_spec((5, 7), Partial("max"))
    assert ((Partial("max"),),) in outputs(
        constant_pad_nd(OpCall(aten.constant_pad_nd.default, (pmax, [1, 2], 1.5), {}))
    )
    assert ((P,),) in outputs(constant_pad_nd(OpCall(aten.constant_pad_nd.default, (p, [-1, 0], 1.5), {})))  # a crop


def test_upsample_keeps_batch_and_channel_shards_and_linear_partials() -> None:
    x = make_spec((2, 3, 4, 5), S1, P, mesh=FakeMesh((2, 2)))
    got = outputs(upsample_rule(OpCall(aten.upsample_bilinear2d.vec, (x, None, False, [2.0, 2.0]), {})))
    assert ((S1, P),) in got and not any(Shard(d) in c[0] for c in got for d in (2, 3))
    pmax = make_spec((2, 3, 4, 5), Partial("max"))
    assert ((Partial("max"),),) not in outputs(
        upsample_rule(OpCall(aten.upsample_bilinear2d.default, (pmax, [8, 10], False), {}))
    )
    assert ((Partial("max"),),) in outputs(upsample_rule(OpCall(aten.upsample_nearest2d.default, (pmax, [8, 10]), {})))


def test_upsample_backward_with_sharded_grad_input_runs_with_the_local_input_size() -> None:
    g = make_spec((2, 3, 8, 10), S0)
    call = OpCall(aten.upsample_bilinear2d_backward.default, (g, [8, 10], [2, 3, 4, 5], False), {})
    (sharded,) = [c for c in upsample_rule(call) if c.outputs == ((S0,),)]
    assert sharded.local_args == (g, [8, 10], LOCAL_SHAPE, False)
    (replicated,) = [c for c in upsample_rule(call) if c.outputs == ((R,),)]
    assert replicated.local_args is None


def test_multinomial_keeps_row_shards_only() -> None:
    probs = make_spec((4, 6), S0, S1, mesh=FakeMesh((2, 2)))
    assert multinomial(OpCall(aten.multinomial.default, (probs, 2), {})).outputs == ((S0, R),)
    assert multinomial(OpCall(aten.multinomial.default, (make_spec((6,), S0), 2), {})).outputs == ((R,),)


def test_fill_into_partial_sum_writes_the_value_on_the_first_rank_only() -> None:
    (plan,) = pointwise_rule(OpCall(aten.fill_.Scalar, (make_spec((4,), P), 2.0), {}))
    assert plan.outputs == ((P,),) and plan.local_impl is not None
    (copies,) = pointwise_rule(OpCall(aten.fill_.Scalar, (make_spec((4,), Partial("max")), 2.0), {}))
    assert copies.local_impl is None  # a max of copies of v is v: every rank writes it
    value = make_spec((), P)
    (pieces,) = pointwise_rule(OpCall(aten.fill_.Tensor, (make_spec((4,), P), value), {}))
    assert pieces.inputs == (None, (P,)) and pieces.local_impl is None  # each rank writes its piece of v
    (norm,) = pointwise_rule(OpCall(aten.fill_.Scalar, (make_spec((4,), Partial("norm2")), 2.0), {}))
    assert norm.local_impl is not None  # the norm of (2, 0, ..., 0) is 2
    for placement, v in ((Partial("norm2"), -1.0), (Partial("prod"), 2.0)):  # no pieces reduce to v
        with pytest.raises(RuntimeError, match="Replicate first"):
            pointwise_rule(OpCall(aten.fill_.Scalar, (make_spec((4,), placement), v), {}))


def test_find_decomposition_prefers_ours_then_the_composite_kernel_then_torchs_table() -> None:
    assert decompositions.find_decomposition(aten.squeeze_.dim).args[1] is decompositions.squeeze_
    assert decompositions.find_decomposition(aten.linear.default).args[1] == aten.linear.default.decompose
    assert decompositions.find_decomposition(aten.mse_loss.default) is not None
    assert decompositions.find_decomposition(aten.linalg_cholesky_ex.default) is None


# --------------------------------------------------------------------------------------------------
# rank tests: against the single-device run
# --------------------------------------------------------------------------------------------------


def rule_cases(gen: torch.Generator) -> list[tuple]:
    """(name, fn, inputs, partial, grad): uneven batch (3) and channel sizes throughout."""

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    x, batch, img = r(5, 7), r(3, 4, 4), r(3, 2, 4, 5)
    return [
        ("histc", lambda a: torch.histc(a, 6, -2.0, 2.0), [x], False, False),
        ("histc_data_range", lambda a: torch.histc(a, 4), [x], False, False),
        ("eigh", lambda a: torch.linalg.eigh(a + a.mT), [batch], True, True),
        ("eigvalsh_upper", lambda a: torch.linalg.eigvalsh(a, UPLO="U"), [batch], False, True),
        ("svd", lambda a: torch.linalg.svd(a, full_matrices=False), [r(3, 4, 5)], True, True),
        ("svdvals", lambda a: torch.linalg.svdvals(a), [r(3, 5, 4)], False, True),
        ("pad_last", lambda a: F.pad(a, (1, 2)), [x], True, True),
        ("pad_first_value", lambda a: F.pad(a, (0, 0, 2, 1), value=1.5), [x], True, True),
        ("pad_crop", lambda a: F.pad(a, (-1, 2)), [x], True, True),
        ("bilinear", lambda a: F.interpolate(a, scale_factor=2, mode="bilinear"), [img], True, True),
        (
            "bilinear_size",
            lambda a: F.interpolate(a, size=(5, 7), mode="bilinear", align_corners=True),
            [img],
            False,
            True,
        ),
        ("nearest", lambda a: F.interpolate(a, scale_factor=2, mode="nearest"), [img], True, True),
    ]


def _check_rules(mesh_shape: tuple[int, ...], max_combos: int) -> int:
    mesh = get_mesh(mesh_shape)
    combos = 0
    for name, fn, inputs, with_partial, grad in rule_cases(torch.Generator().manual_seed(0)):
        try:
            combos += check_op(
                fn, inputs, mesh, partial=with_partial, grad=grad, max_combos=max_combos, atol=1e-4, rtol=1e-4
            )
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from e
    return combos


@pytest.mark.parametrize("mesh_shape,world_size", MESHES)
def test_new_rules_match_single_device(mesh_shape, world_size) -> None:
    assert run_world(_check_rules, world_size, mesh_shape, 6 if world_size == 2 else 4)[0] > 0


def _local_layouts(mesh_shape: tuple[int, ...]) -> list[tuple]:
    """(output placements, collectives) of layouts the rules keep without moving data."""
    mesh, n = get_mesh(mesh_shape), len(mesh_shape)
    gen = torch.Generator().manual_seed(1)
    x, batch, img = (
        torch.randn(5, 7, generator=gen),
        torch.randn(3, 4, 4, generator=gen),
        torch.randn(3, 2, 4, 5, generator=gen),
    )
    cases = [
        (lambda a: torch.histc(a, 6, -2.0, 2.0), x, (S1,) * n),
        (lambda a: torch.linalg.eigvalsh(a), batch, (S0,) * n),
        (lambda a: F.pad(a, (1, 2)), x, (S0,) * n),
        (lambda a: F.pad(a, (1, 2)), x, (P,) * n),
        (lambda a: F.interpolate(a, scale_factor=2, mode="bilinear"), img, (S1,) * n),
        (lambda a: F.interpolate(a, scale_factor=2, mode="bilinear"), img, (P,) * n),
    ]
    return [
        placements_and_collectives(fn, [distribute_tensor(t, mesh, p)], fn(t), atol=1e-5, rtol=1e-5)
        for fn, t, p in cases
    ]


@pytest.mark.parametrize("mesh_shape,world_size", [((4,), 4), ((2, 2), 4)])
def test_sharded_layouts_issue_no_collectives(mesh_shape, world_size) -> None:
    n = len(mesh_shape)
    s0, s1, p = ("S(0)",) * n, ("S(1)",) * n, ("P(sum)",) * n
    assert run_world(_local_layouts, world_size, mesh_shape)[0] == [(p, 0), (s0, 0), (s0, 0), (p, 0), (s1, 0), (p, 0)]


def _versus_torch(mesh_shape: tuple[int, ...]) -> list[str]:
    """Ops where torch's DTensor issues fewer collectives than ours."""
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    mesh, tmesh, n = get_mesh(mesh_shape), get_torch_mesh(mesh_shape), len(mesh_shape)
    gen = torch.Generator().manual_seed(2)
    x, batch, img = (
        torch.randn(6, 8, generator=gen),
        torch.randn(4, 4, 4, generator=gen),
        torch.randn(4, 2, 4, 4, generator=gen),
    )
    cases = {
        "histc": (lambda a: torch.histc(a, 5, -2.0, 2.0), x),
        "eigvalsh": (lambda a: torch.linalg.eigvalsh(a), batch),
        "svdvals": (lambda a: torch.linalg.svdvals(a), batch),
        "pad": (lambda a: F.pad(a, (1, 2)), x),
        "bilinear": (lambda a: F.interpolate(a, scale_factor=2, mode="bilinear"), img),
    }
    worse = []
    for name, (fn, t) in cases.items():
        for placements in [(S0,) * n, (S1,) * n, (R,) * n, (S0, S1)[:n], (S1, R)[:n]]:
            _, _, ours, theirs = run_ours_and_torch(
                fn,
                [distribute_tensor(t, mesh, placements)],
                [torch_distribute(t, tmesh, to_torch_placements(placements))],
            )
            if ours.get_total_counts() > theirs.get_total_counts():
                worse.append(f"{name} {placements}: {ours.get_comm_counts()} vs {theirs.get_comm_counts()}")
    return worse


@pytest.mark.parametrize("mesh_shape,world_size", [((2,), 2), ((2, 2), 4)])
def test_new_rules_match_torch_dtensor_with_no_more_collectives(mesh_shape, world_size) -> None:
    assert run_world(_versus_torch, world_size, mesh_shape)[0] == []


# --------------------------------------------------------------------------------------------------
# multinomial, squeeze_, fill_
# --------------------------------------------------------------------------------------------------


def _multinomial(mesh_shape: tuple[int, ...]) -> dict:
    mesh, n = get_mesh(mesh_shape), len(mesh_shape)
    torch.manual_seed(5)  # every rank alike, as SPMD programs seed
    rows = torch.tensor([3, 0, 4, 1, 2])
    one_hot = F.one_hot(rows, 6).float()  # (5, 6): each row can only draw its own category
    placements = (S0,) + (R,) * (n - 1)
    sure = torch.multinomial(distribute_tensor(one_hot, mesh, placements), 3, replacement=True)
    probs = torch.rand(5, 6, generator=torch.Generator().manual_seed(6)) + 0.1
    drawn = torch.multinomial(distribute_tensor(probs, mesh, placements), 4)
    full = drawn.full_tensor()
    return {
        "sure": torch.equal(sure.full_tensor(), rows[:, None].expand(5, 3)),
        "placements": (sure.placements, drawn.placements),
        "distinct": all(len(set(row.tolist())) == 4 for row in full),
        "local": drawn.to_local(),
        "rng": torch.get_rng_state(),
    }


@pytest.mark.parametrize("mesh_shape,world_size", [((4,), 4), ((2, 2), 4)])
def test_multinomial_keeps_row_shards_agrees_across_replicas_and_stays_in_lockstep(mesh_shape, world_size) -> None:
    ranks = run_world(_multinomial, world_size, mesh_shape)
    want = (S0,) + (R,) * (len(mesh_shape) - 1)
    for r in ranks:
        assert r["sure"] and r["distinct"] and r["placements"] == (want, want)
        assert torch.equal(r["rng"], ranks[0]["rng"])  # one draw of the default generator everywhere
    if mesh_shape == (2, 2):  # ranks 0 and 1 differ only on the Replicate mesh dim: same rows, same draws
        assert torch.equal(ranks[0]["local"], ranks[1]["local"]) and torch.equal(ranks[2]["local"], ranks[3]["local"])


def _squeeze_inplace(mesh_shape: tuple[int, ...]) -> list[str]:
    mesh, n = get_mesh(mesh_shape), len(mesh_shape)
    x = torch.randn(5, 1, 7, 1, generator=torch.Generator().manual_seed(3))
    failures = []
    layouts = [(R,) * n, (S0,) * n, (S2,) + (R,) * (n - 1), (P,) * n, (S0, S2)[:n]]
    calls = {"default": lambda t: t.squeeze_(), "dim": lambda t: t.squeeze_(-1), "dims": lambda t: t.squeeze_((1, 2))}
    for placements in layouts:
        for name, fn in calls.items():
            d = distribute_tensor(x, mesh, placements)
            want = fn(x.clone())
            with CommDebugMode() as comm:
                out = fn(d)
            what = f"squeeze_.{name} of {tuple(map(str, placements))}"
            if out is not d or d.shape != want.shape or d.stride() != d._spec.stride or comm.get_total_counts():
                failures.append(f"{what}: shape {tuple(d.shape)} stride {d.stride()} vs spec {d._spec.stride}")
            elif not torch.equal(d.full_tensor(), want):
                failures.append(f"{what}: wrong values")
    d = distribute_tensor(torch.randn(1, 7), mesh, (S0,) * n)  # the size-1 dim is sharded: rank 0 holds it all
    failures += expect_error("squeeze_ of a sharded size-1 dim", lambda: d.squeeze_(0), RuntimeError, "out-of-place")
    return failures


@pytest.mark.parametrize("mesh_shape,world_size", MESHES)
def test_squeeze_inplace_all_overloads_keep_the_shards_of_surviving_dims(mesh_shape, world_size) -> None:
    assert_no_failures(run_world(_squeeze_inplace, world_size, mesh_shape))


def _fill_partial(mesh_shape: tuple[int, ...]) -> list[str]:
    mesh, n = get_mesh(mesh_shape), len(mesh_shape)
    failures = []
    for placements in [(P,)] if n == 1 else [(P, P), (S0, P), (P, S1)]:
        for name, value in {
            "scalar": 3.0,
            "plain_0d": torch.tensor(-2.5),
            "dtensor_R": None,
            "dtensor_P": None,
        }.items():
            d = DTensor.from_local(torch.randn(3, 4) * (dist.get_rank() + 1), mesh, placements)
            if name.startswith("dtensor"):
                v = distribute_tensor(torch.tensor(1.25), mesh, [R] * n)
                value = as_partial(v, [p if p == P else R for p in placements]) if name == "dtensor_P" else v
            with CommDebugMode() as comm:
                d.fill_(value)
            want = torch.full(tuple(d.shape), float(value.full_tensor() if isinstance(value, DTensor) else value))
            if d.placements != placements or not torch.equal(d.full_tensor(), want):
                failures.append(
                    f"fill_ {name} into {tuple(map(str, placements))}: {d.full_tensor()[0, 0]} != {want[0, 0]}"
                )
            if comm.get_total_counts():
                failures.append(f"fill_ {name} into {tuple(map(str, placements))} communicated")
    ints = DTensor.from_local(torch.arange(6).view(2, 3), mesh, [P] * n)
    if not torch.equal(ints.fill_(7).full_tensor(), torch.full((2, 3), 7)):
        failures.append("int fill_ into P(sum)")
    w = DTensor.from_local(torch.ones(2, 3), mesh, [P] * n)
    torch.nn.init.constant_(w, 0.5)
    if not torch.equal(w.full_tensor(), torch.full((2, 3), 0.5)):
        failures.append("nn.init.constant_ into P(sum)")
    return failures


@pytest.mark.parametrize("mesh_shape,world_size", MESHES)
def test_fill_into_partial_reads_the_filled_value_globally(mesh_shape, world_size) -> None:
    assert_no_failures(run_world(_fill_partial, world_size, mesh_shape))


# --------------------------------------------------------------------------------------------------
# ops without a rule: their decomposition; inference_mode composites
# --------------------------------------------------------------------------------------------------


def _no_decomposition(op: object) -> None:
    return None


def _decomposed(mesh_shape: tuple[int, ...]) -> list[str]:
    """mse_loss and glu have no rule but an entry in torch's decomposition table: they fail without
    the decomposition fallback and match the single-device run (gradients included) with it."""
    from parallelisms.dtensor import dispatch, planning

    mesh = get_mesh(mesh_shape)
    gen = torch.Generator().manual_seed(4)
    cases = {
        aten.mse_loss.default: (
            lambda a, b: F.mse_loss(a, b),
            [torch.randn(5, 6, generator=gen), torch.randn(5, 6, generator=gen)],
        ),
        aten.glu.default: (lambda a: F.glu(a, -1), [torch.randn(5, 6, generator=gen)]),
    }
    failures = []
    for op, (fn, inputs) in cases.items():
        for key in [k for k in dispatch.PLANS if k[0] is op]:
            del dispatch.PLANS[key]
        args = [distribute_tensor(t, mesh, [S0] * mesh.ndim) for t in inputs]
        found, planning.find_decomposition = planning.find_decomposition, _no_decomposition
        try:
            failures += expect_error(f"{op} without decompositions", partial(fn, *args), NotImplementedError, str(op))
        finally:
            planning.find_decomposition = found
        check_op(fn, inputs, mesh, max_combos=6)
    return failures


@pytest.mark.parametrize("mesh_shape,world_size", [((2,), 2), ((2, 2), 4)])
def test_ops_without_a_rule_run_through_their_decomposition(mesh_shape, world_size) -> None:
    assert_no_failures(run_world(_decomposed, world_size, mesh_shape))


def _inference_mode(mesh_shape: tuple[int, ...]) -> list[str]:
    """linear / matmul reach the dispatcher whole under inference_mode (and ran into "no sharding
    rule for aten.linear" before decompositions): same values as torch's DTensor, no more
    collectives, and on a 1-D mesh the same placements."""
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    mesh, tmesh, n = get_mesh(mesh_shape), get_torch_mesh(mesh_shape), len(mesh_shape)
    gen = torch.Generator().manual_seed(7)
    x, w, b = torch.randn(2, 5, 6, generator=gen), torch.randn(8, 6, generator=gen), torch.randn(8, generator=gen)
    cases = {
        "linear_colwise": (lambda a, ww, bb: F.linear(a, ww, bb), [(x, (S0,) * n), (w, (S0,) * n), (b, (S0,) * n)]),
        "linear_rowwise": (lambda a, ww: F.linear(a, ww), [(x, (S2,) * n), (w, (S1,) * n)]),
        "linear_2d": (lambda a, ww, bb: F.linear(a, ww, bb), [(x[0], (S0,) * n), (w, (R,) * n), (b, (R,) * n)]),
        "matmul_3d_2d": (lambda a, ww: torch.matmul(a, ww.mT), [(x, (S0,) * n), (w, (R,) * n)]),
        "matmul_batched": (lambda a, c: a @ c, [(x, (S0,) * n), (x.mT.contiguous(), (S0,) * n)]),
    }
    failures = []
    with torch.inference_mode():
        for name, (fn, args) in cases.items():
            ours = [distribute_tensor(t, mesh, p) for t, p in args]
            theirs = [torch_distribute(t, tmesh, to_torch_placements(p)) for t, p in args]
            out, tout, comm, tcomm = run_ours_and_torch(fn, ours, theirs, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out.full_tensor(), fn(*[t for t, _ in args]), atol=1e-5, rtol=1e-5)
            # on (2, 2) the uneven nesting makes ties where torch and ours keep different (equally cheap)
            # layouts, and ours avoids torch's gathers for batched matmul: compare placements on (2,) only
            other_layout = n == 1 and to_torch_placements(out.placements) != list(tout.placements)
            if other_layout or comm.get_total_counts() > tcomm.get_total_counts():
                theirs_str = f"{tout.placements} {tcomm.get_comm_counts()}"
                failures.append(f"{name}: {out.placements} {comm.get_comm_counts()} vs torch {theirs_str}")
    return failures


@pytest.mark.parametrize("mesh_shape,world_size", [((2,), 2), ((2, 2), 4)])
def test_linear_and_matmul_under_inference_mode_match_torch(mesh_shape, world_size) -> None:
    assert_no_failures(run_world(_inference_mode, world_size, mesh_shape))


# --------------------------------------------------------------------------------------------------
# foreach over several meshes
# --------------------------------------------------------------------------------------------------


def _foreach_meshes(shapes: tuple[tuple[int, ...], tuple[int, ...]]) -> list[str]:
    """Lists mixing two meshes over the same ranks: each index on its own mesh, values as one device,
    and the norms equal to torch's DTensor's."""
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    (m1, m2), (t1, t2) = (get_mesh(s) for s in shapes), (get_torch_mesh(s) for s in shapes)
    gen = torch.Generator().manual_seed(8)
    tensors = [torch.randn(5, 3, generator=gen), torch.randn(4, 6, generator=gen), torch.randn(7, generator=gen)]
    layouts = [(m1, t1, (S0,) * m1.ndim), (m2, t2, (S1,) * m2.ndim), (m1, t1, (R,) * m1.ndim)]
    ours = [distribute_tensor(t, m, p) for t, (m, _, p) in zip(tensors, layouts)]
    theirs = [torch_distribute(t, tm, to_torch_placements(p)) for t, (_, tm, p) in zip(tensors, layouts)]
    failures = []
    norms, torch_norms = torch._foreach_norm(ours), torch._foreach_norm(theirs)
    for i, (got, tgot, t, d) in enumerate(zip(norms, torch_norms, tensors, ours)):
        if got.device_mesh is not d.device_mesh or not torch.allclose(got.full_tensor(), t.norm()):
            failures.append(f"_foreach_norm index {i}: {got.device_mesh} {got.full_tensor()} vs {t.norm()}")
        if not torch.allclose(got.full_tensor(), tgot.full_tensor()):
            failures.append(f"_foreach_norm index {i} differs from torch's")
    others = [distribute_tensor(t + 1, d.device_mesh, d.placements) for t, d in zip(tensors, ours)]
    torch._foreach_add_(ours, others, alpha=2.0)
    torch._foreach_mul_(ours, torch.tensor(0.5))  # a plain 0-d tensor is a scalar on every mesh
    sums = torch._foreach_add(ours, [1.0, 2.0, 3.0])
    for i, (d, s, t) in enumerate(zip(ours, sums, tensors)):
        want = (t + 2 * (t + 1)) * 0.5
        if (
            d.placements != layouts[i][2]
            or not torch.allclose(d.full_tensor(), want)
            or not torch.allclose(s.full_tensor(), want + i + 1)
        ):
            failures.append(f"_foreach_add_/_mul_/_add index {i}")
    shared = distribute_tensor(torch.tensor(2.0), m1, (R,) * m1.ndim)
    failures += expect_error(
        "a DTensor shared across meshes", lambda: torch._foreach_mul_(ours, shared), ValueError, "shared by every index"
    )
    return failures


@pytest.mark.parametrize("shapes,world_size", [(((2,), (1, 2)), 2), (((4,), (2, 2)), 4)])
def test_foreach_over_several_meshes_runs_each_index_on_its_own_mesh(shapes, world_size) -> None:
    assert_no_failures(run_world(_foreach_meshes, world_size, shapes))
