"""Pointwise rules (ops/pointwise.py): every checked op runs on DTensors under (sampled) placements of
its inputs and must give the single-device outputs and input gradients (tests/dtensor/harness.py),
on meshes (2,), (4,), (2, 2), with even and uneven shapes (3 rows on 4 ranks leaves an empty shard).
Partial inputs are built with `from_local` from rank-dependent pieces, so a wrongly propagated
Partial shows up as a wrong value, and CommDebugMode shows which cases move nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch._dynamo  # the first meta run of an op imports it: import it once, before ranks fork
import torch.distributed as dist
import torch.nn.functional as F

from parallelisms.dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from parallelisms.dtensor.debug import CommDebugMode
from parallelisms.dtensor.ops import RULES, OpCall, pointwise
from tests.dtensor.harness import assert_no_failures, check_op, get_mesh, make_spec, run_on_meshes
from tests.world import run_world

aten = torch.ops.aten


def _pos(x):
    return x.abs() + 0.5


UNARY = {  # name -> fn; every one differentiable except the integer/bool-valued ones
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "log": lambda x: torch.log(_pos(x)),
    "sqrt": lambda x: torch.sqrt(_pos(x)), "rsqrt": lambda x: torch.rsqrt(_pos(x)),
    "reciprocal": lambda x: torch.reciprocal(_pos(x)), "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "relu": torch.relu, "silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "clamp": lambda x: torch.clamp(x, -0.5, 0.7), "clamp_min": lambda x: torch.clamp_min(x, 0.1),
    "clamp_max": lambda x: torch.clamp_max(x, 0.1), "pow": lambda x: x**3, "square": torch.square,
    "scalar_arith": lambda x: (2.5 * x + 1) / 3 - 0.5, "rsub": lambda x: 1 - x, "erf": torch.erf,
    "nan_to_num": lambda x: torch.nan_to_num(torch.log(x), nan=0.0, neginf=-5.0),
    "leaky_relu": F.leaky_relu, "hardtanh": F.hardtanh, "softplus": F.softplus, "mish": F.mish,
    "threshold": lambda x: F.threshold(x, 0.1, -1.0), "sign": torch.sign, "floor": torch.floor,
}  # fmt: skip
NOT_DIFFERENTIABLE = {"sign", "floor"}
BOOL_UNARY = {  # outputs bool: checked without gradients
    "logical_not": lambda x: torch.logical_not(x > 0), "isnan": lambda x: torch.isnan(torch.log(x)),
}  # fmt: skip
BINARY = {
    "add": torch.add, "add_alpha": lambda x, y: torch.add(x, y, alpha=-2), "sub": torch.sub, "mul": torch.mul,
    "div": torch.div, "rsub": torch.rsub, "pow": lambda x, y: torch.pow(_pos(x), y), "maximum": torch.maximum,
    "minimum": torch.minimum, "atan2": torch.atan2,
    "div_floor": lambda x, y: torch.div(x, _pos(y), rounding_mode="floor"),
}  # fmt: skip
COMPARE = {
    "eq": lambda x, y: torch.eq(x.round(), y.round()), "ne": torch.ne, "lt": torch.lt, "le": torch.le,
    "gt": torch.gt, "ge": torch.ge, "logical_and": lambda x, y: torch.logical_and(x > 0, y > 0),
    "logical_or": lambda x, y: torch.logical_or(x > 0, y > 0), "logical_xor": lambda x, y: (x > 0) ^ (y > 0),
}  # fmt: skip
TERNARY = {
    "where": lambda c, x, y: torch.where(c > 0, x, y), "addcmul": lambda x, y, z: torch.addcmul(x, y, z, value=0.5),
    "addcdiv": lambda x, y, z: torch.addcdiv(x, y, _pos(z), value=-0.5), "lerp_tensor": torch.lerp,
    "lerp_scalar": lambda x, y, z: torch.lerp(x, y, 0.3) + z,
    "masked_fill": lambda m, x, y: x.masked_fill(m > 0, 1.5) * y,
    "clamp_tensor": lambda x, lo, hi: torch.clamp(x, lo, torch.maximum(lo, hi)),
}  # fmt: skip
# (a, b) and (a, b, c) shapes: same shape, right-aligned lower rank, size-1 broadcast both ways, a 0-d
# DTensor, and uneven (5 and 7 and 3 on 2 or 4 ranks)
BINARY_SHAPES = (((5, 7), (7,)), ((5, 1), (1, 7)), ((4, 6), (4, 6)), ((3, 5), ()))
TERNARY_SHAPES = (((5, 7), (7,), (5, 1)), ((3, 4), (3, 4), ()))


def _randn(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# the (2,) world is cheap, so it sweeps every op; the 4-rank meshes (empty shards, nested sharding)
# run a representative subset, keeping the suite fast on small machines
SUBSET = {"neg", "sqrt", "exp", "relu", "silu", "gelu", "clamp", "tanh", "add", "mul", "div", "maximum", "lt",
          "where", "addcmul", "lerp_tensor", "masked_fill"}  # fmt: skip


def _pick(table: dict, mesh_shape) -> dict:
    return table if mesh_shape == (2,) else {k: v for k, v in table.items() if k in SUBSET}


def check_unary(mesh_shape) -> int:
    mesh, n = get_mesh(mesh_shape), 0
    shapes = ((5, 7), (3,)) if mesh_shape != (2, 2) else ((5, 7),)
    for i, shape in enumerate(shapes):
        x = _randn(*shape, seed=i)
        for j, (name, fn) in enumerate(_pick(UNARY, mesh_shape).items()):
            n += check_op(fn, [x], mesh, grad=name not in NOT_DIFFERENTIABLE, max_combos=4, seed=j)
        for fn in _pick(BOOL_UNARY, mesh_shape).values():
            n += check_op(fn, [x], mesh, grad=False, max_combos=4)
    # bf16 where cheap: the same shards, the same rounding
    n += check_op(torch.tanh, [_randn(5, 7, seed=9).bfloat16()], mesh, grad=False, atol=1e-2, rtol=1e-2)
    n += check_op(lambda x, y: x * y + x, [_randn(5, 7, seed=9).bfloat16(), _randn(7, seed=1).bfloat16()], mesh,
                  grad=False, atol=1e-2, rtol=1e-2, max_combos=4)  # fmt: skip
    return n


def check_binary(mesh_shape) -> int:
    mesh, n = get_mesh(mesh_shape), 0
    shapes = BINARY_SHAPES if mesh_shape == (2,) else BINARY_SHAPES[:2]
    for i, (a, b) in enumerate(shapes):
        x, y = _randn(*a, seed=i), _randn(*b, seed=10 + i)
        for j, (name, fn) in enumerate(_pick(BINARY, mesh_shape).items()):
            every = name in ("add", "mul") and mesh_shape == (2,)  # all 9 combos for two of them
            n += check_op(fn, [x, y], mesh, grad=name != "div_floor", max_combos=9 if every else 3, seed=i + j)
        for j, fn in enumerate(_pick(COMPARE, mesh_shape).values()):
            n += check_op(fn, [x, y], mesh, grad=False, max_combos=2, seed=i + j)
    return n


def check_ternary(mesh_shape) -> int:
    mesh, n = get_mesh(mesh_shape), 0
    for i, shapes in enumerate(TERNARY_SHAPES):
        inputs = [_randn(*s, seed=20 + i + j) for j, s in enumerate(shapes)]
        for j, (name, fn) in enumerate(_pick(TERNARY, mesh_shape).items()):
            n += check_op(fn, inputs, mesh, max_combos=6 if name == "where" else 3, seed=i + j)
    return n


def check_linear_with_partial_inputs(mesh_shape) -> int:
    """check_op with P(sum) among the choices: linear ops keep it, the others must reduce first."""
    mesh, n = get_mesh(mesh_shape), 0
    x, y, g = _randn(5, 7, seed=1), _randn(7, seed=2), _randn(5, 7, seed=3)
    cases = [
        (lambda a, b: a + b, [x, y]), (lambda a, b: a - 2 * b, [x, g]), (lambda a, b: a * b, [x, y]),
        (lambda a, b: a / _pos(b), [x, y]), (lambda a: -a * 2.5, [x]), (lambda a, b: torch.where(b > 0, a, b), [x, g]),
        (torch.relu, [x]), (lambda a, b, c: torch.addcmul(a, b, c), [x, g, y]),
        (lambda a, b: torch.lerp(a, b, 0.25), [x, g]), (lambda a: a.masked_fill(a > 0.5, 0.0), [x]),
        (lambda d, b: aten.silu_backward(d, b), [g, x]), (lambda d, b: aten.gelu_backward(d, b), [g, x]),
        (lambda d, b: aten.threshold_backward(d, b, 0.0), [g, x]),
        (lambda d, b: aten.sigmoid_backward(d, torch.sigmoid(b)), [g, x]),
        (lambda d, b: aten.tanh_backward(d, torch.tanh(b)), [g, x]),
    ]  # fmt: skip
    for i, (fn, inputs) in enumerate(cases[: None if mesh_shape == (2,) else 6]):
        grad = i < 10  # the activation backward ops have no derivative themselves
        n += check_op(fn, inputs, mesh, partial=True, grad=grad, max_combos=8 if mesh_shape == (2,) else 4, seed=i)
    return n


def check_in_place_and_out(mesh_shape) -> int:
    """In-place ops keep the written tensor's placements (other inputs move); out= writes into `out`."""
    mesh, n = get_mesh(mesh_shape), 0
    x, y, z = _randn(5, 7, seed=1), _randn(7, seed=2), _randn(5, 7, seed=3)

    def add_(a, b):
        return a.clone().add_(b, alpha=0.5)

    def mul_(a, b):
        return a.clone().mul_(b).mul_(2.0)

    def addcmul_(a, b, c):
        return a.clone().addcmul_(b, c, value=-1.5).addcdiv_(c, _pos(b))

    def lerp_clamp_(a, b):
        return a.clone().lerp_(b, 0.9).clamp_(-0.3, 0.3)

    def masked_fill_(a, b):
        return a.clone().masked_fill_(b > 0, -2.0)

    def out_(a, b):
        out = torch.empty_like(a)
        torch.add(a, b, out=out)
        torch.maximum(out, a, out=out)
        return out

    def zero_fill_(a):
        return a.clone().zero_() + a.clone().fill_(3.0)

    for fn, inputs, grad in ((add_, [x, y], True), (mul_, [x, z], True), (addcmul_, [x, y, z], True),
                             (lerp_clamp_, [x, z], True), (masked_fill_, [x, y], True),
                             (out_, [x, y], False), (zero_fill_, [x], True)):  # fmt: skip
        n += check_op(fn, inputs, mesh, grad=grad, max_combos=9 if mesh_shape == (2,) else 3)
    return n


@pytest.mark.parametrize("check", [check_unary, check_binary, check_ternary, check_in_place_and_out])
def test_pointwise_matches_single_device_all_meshes(check):
    assert all(n > 0 for n in run_on_meshes(check))


def test_partial_inputs_match_single_device_all_meshes():
    assert all(n > 0 for n in run_on_meshes(check_linear_with_partial_inputs))


# --------------------------------------------------------------------------------------------------
# Partial propagation: output placements and communication
# --------------------------------------------------------------------------------------------------


def _pieces(mesh, shape, reduce_op, seed):
    """A P(reduce_op) DTensor from rank-dependent pieces, and the global value it stands for."""
    pieces = [_randn(*shape, seed=seed + r) for r in range(dist.get_world_size())]
    whole = {"sum": lambda t: t.sum(0), "max": lambda t: t.amax(0), "min": lambda t: t.amin(0)}[reduce_op]
    local = pieces[dist.get_rank()]
    return DTensor.from_local(local, mesh, [Partial(reduce_op)] * mesh.ndim), whole(torch.stack(pieces))


def _replicated(mesh, shape, seed):
    t = _randn(*shape, seed=seed)
    return distribute_tensor(t, mesh, [Replicate()] * mesh.ndim), t


@dataclass(frozen=True)
class Expect:
    placement: str  # e.g. "P(sum)"
    collectives: int


def partial_cases(mesh_shape) -> list[str]:
    mesh = get_mesh(mesh_shape)
    ps, s = _pieces(mesh, (4, 3), "sum", 0)
    ps2, s2 = _pieces(mesh, (4, 3), "sum", 10)
    pmax, mx = _pieces(mesh, (4, 3), "max", 20)
    pmin, mn = _pieces(mesh, (4, 3), "min", 30)
    r, rv = _replicated(mesh, (4, 3), 40)
    cases = {  # name: (dtensor fn, reference, expected output placement, collectives issued)
        "P+P": (lambda: ps + ps2, s + s2, Expect("P(sum)", 0)),
        "P*R": (lambda: ps * r, s * rv, Expect("P(sum)", 0)),
        "R*P": (lambda: r * ps, rv * s, Expect("P(sum)", 0)),
        "P/R": (lambda: ps / r, s / rv, Expect("P(sum)", 0)),
        "R/P": (lambda: r / ps, rv / s, Expect("R", 1)),
        "P*P": (lambda: ps * ps2, s * s2, Expect("P(sum)", 1)),
        "-P": (lambda: -ps, -s, Expect("P(sum)", 0)),
        "P*2.5": (lambda: ps * 2.5, s * 2.5, Expect("P(sum)", 0)),
        "P+1": (lambda: ps + 1, s + 1, Expect("R", 1)),  # a constant would be added n times
        # torch partitions R (0 now, its P output owes the reduction); ours prices the partition as
        # the all-reduce it defers (transitions.transition_seconds) and reduces the P at once
        "P+R": (lambda: ps + r, s + rv, Expect("R", 1)),
        "relu(P)": (lambda: torch.relu(ps), torch.relu(s), Expect("R", 1)),
        "relu(Pmax)": (lambda: torch.relu(pmax), torch.relu(mx), Expect("P(max)", 0)),
        "exp(Pmin)": (lambda: torch.exp(pmin), torch.exp(mn), Expect("P(min)", 0)),
        "-Pmax": (lambda: -pmax, -mx, Expect("P(min)", 0)),
        "Pmax+R": (lambda: pmax + r, mx + rv, Expect("P(max)", 0)),
        "sqrt(Pmax)": (lambda: torch.sqrt(pmax.abs()), torch.sqrt(mx.abs()), Expect("R", 1)),  # abs is not monotone
        "max(Pmax,Pmax)": (lambda: torch.maximum(pmax, pmax + 1.0), torch.maximum(mx, mx + 1.0), Expect("P(max)", 0)),
        "where(R,P,P)": (lambda: torch.where(r > 0, ps, ps2), torch.where(rv > 0, s, s2), Expect("P(sum)", 0)),
        "silu_bw(P,R)": (lambda: aten.silu_backward(ps, r), aten.silu_backward(s, rv), Expect("P(sum)", 0)),
        "clamp(Pmax)": (lambda: pmax.clamp(-0.2, 0.4), mx.clamp(-0.2, 0.4), Expect("P(max)", 0)),
    }
    failures = []
    for name, (fn, want, expect) in cases.items():
        with CommDebugMode() as comm:
            got = fn()
        placement = ",".join(sorted({str(p) for p in got.placements}))
        if placement != expect.placement or comm.get_total_counts() != expect.collectives * mesh.ndim:
            failures.append(f"{name}: {placement} with {comm.get_total_counts()} collectives, expected {expect}")
        elif not torch.allclose(got.full_tensor(), want, atol=1e-4, rtol=1e-4):
            failures.append(f"{name}: wrong values")
    return failures


def test_partial_propagates_only_where_valid():
    assert_no_failures(run_on_meshes(partial_cases, (((2,), 2), ((2, 2), 4))))


def _reads_after_one_rank_writes(impl: str) -> tuple[list[int], list[float]]:
    """A Partial read, then rank 0 alone writes into its shard, then read twice more."""
    if impl == "torch":
        from torch.distributed.tensor import DTensor as D
        from torch.distributed.tensor import Partial as P
        from torch.distributed.tensor import init_device_mesh
        from torch.distributed.tensor.debug import CommDebugMode as Comm
    else:
        from parallelisms.dtensor import DTensor as D  # type: ignore[assignment]
        from parallelisms.dtensor import Partial as P
        from parallelisms.dtensor import init_device_mesh
        from parallelisms.dtensor.debug import CommDebugMode as Comm  # type: ignore[assignment]
    mesh = init_device_mesh("cpu", (2,))
    local = torch.full((3,), float(dist.get_rank() + 1))
    ps = D.from_local(local, mesh, [P()])
    counts, values = [], []
    for i in range(3):
        if i == 1 and dist.get_rank() == 0:
            local.add_(10)  # SPMD code may touch one rank's shard (how Partial values are built)
        with Comm() as comm:
            values.append(ps.full_tensor()[0].item())
        counts.append(comm.get_total_counts())
    return counts, values


def _reads_both() -> tuple:
    return _reads_after_one_rank_writes("torch"), _reads_after_one_rank_writes("ours")


def test_partial_reads_reduce_each_time_as_torch():
    """Every read of a Partial value reduces it, as in torch: a remembered reduction would let rank 1
    skip the collective that rank 0 (whose shard changed) issues, and hang the job."""
    results = run_world(_reads_both, 2)
    for theirs, ours in results:
        assert ours == theirs == ([1, 1, 1], [3.0, 13.0, 13.0])


def in_place_partial_cases() -> list[str]:
    mesh = get_mesh((2,))
    failures = []
    ps, s = _pieces(mesh, (4, 3), "sum", 0)
    r, rv = _replicated(mesh, (3,), 1)
    with CommDebugMode() as comm:
        ps.add_(r)  # stays P(sum): r is partitioned (r / 2 per rank), no communication
    if ps.placements != (Partial(),) or comm.get_total_counts() or not torch.allclose(ps.full_tensor(), s + rv):
        failures.append(f"add_: {ps.placements}, {comm.get_total_counts()} collectives")
    ps.mul_(_pieces(mesh, (4, 3), "sum", 5)[0])  # the other operand is reduced, self stays partial
    if ps.placements != (Partial(),):
        failures.append(f"mul_: {ps.placements}")
    pz, _ = _pieces(mesh, (4, 3), "sum", 7)
    if not torch.equal(pz.zero_().full_tensor(), torch.zeros(4, 3)) or pz.placements != (Partial(),):
        failures.append("zero_ on P(sum)")
    pmax, _ = _pieces(mesh, (4, 3), "max", 9)
    if not torch.equal(pmax.fill_(2.0).full_tensor(), torch.full((4, 3), 2.0)):
        failures.append("fill_ on P(max)")
    pi = DTensor.from_local(torch.arange(6).view(2, 3) * (dist.get_rank() + 1), mesh, [Partial()])
    ri = distribute_tensor(torch.ones(2, 3, dtype=torch.int64), mesh, [Replicate()])
    if (pi + ri).placements != (Replicate(),):  # ints cannot be partitioned (v / n): reduce instead
        failures.append("int P(sum) + R was not reduced")
    psum, _ = _pieces(mesh, (4, 3), "sum", 11)  # one rank writes 2.0, the others 0: the sum is 2.0
    if not torch.equal(psum.fill_(2.0).full_tensor(), torch.full((4, 3), 2.0)) or psum.placements != (Partial(),):
        failures.append("fill_ on P(sum)")
    return failures


def test_in_place_keeps_partial_and_fills_partial_sum_to_the_global_value():
    assert_no_failures(run_world(in_place_partial_cases, 2))


# --------------------------------------------------------------------------------------------------
# against torch's DTensor: same placements, no more communication
# --------------------------------------------------------------------------------------------------


def against_torch(mesh_shape) -> list[str]:
    import torch.distributed.tensor as tdt
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    from tests.dtensor.harness import get_torch_mesh, to_torch_placements

    mesh, tmesh = get_mesh(mesh_shape), get_torch_mesh(mesh_shape)
    ours_of = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1), "P": Partial()}
    cases = [
        (torch.add, ((5, 7), (7,)), ("S0", "R")), (torch.add, ((5, 7), (5, 7)), ("S0", "S1")),
        (torch.mul, ((4, 6), (4, 6)), ("P", "R")), (torch.mul, ((4, 6), (6,)), ("S1", "R")),
        (torch.maximum, ((5, 7), (5, 1)), ("S1", "S0")), (torch.sub, ((4, 6), (4, 6)), ("P", "P")),
        (torch.div, ((4, 6), (4, 6)), ("R", "P")), (torch.atan2, ((5, 7), (5, 7)), ("S0", "R")),
    ]  # fmt: skip
    failures = []
    for fn, shapes, names in cases:
        inputs = [_randn(*s, seed=i) for i, s in enumerate(shapes)]
        placements = [[ours_of[p]] * mesh.ndim for p in names]
        ours = [distribute_tensor(t, mesh, p) for t, p in zip(inputs, placements)]
        theirs = [tdt.distribute_tensor(t, tmesh, to_torch_placements(p)) for t, p in zip(inputs, placements)]
        with CommDebugMode() as comm:
            got = fn(*ours)
        with TorchCommDebugMode() as torch_comm:
            want = fn(*theirs)
        if tuple(map(str, got.placements)) != tuple(map(str, want.placements)):
            failures.append(f"{fn.__name__}{names}: ours {got.placements}, torch {want.placements}")
        if comm.get_total_counts() > torch_comm.get_total_counts():
            failures.append(f"{fn.__name__}{names}: {comm.get_total_counts()} > {torch_comm.get_total_counts()}")
        if not torch.allclose(got.full_tensor(), want.full_tensor(), atol=1e-5):
            failures.append(f"{fn.__name__}{names}: values differ")
    return failures


def test_placements_and_communication_match_torch_dtensor():
    assert_no_failures(run_on_meshes(against_torch, (((2,), 2), ((2, 2), 4))))


# --------------------------------------------------------------------------------------------------
# pure rule tests: no ranks, a fake mesh
# --------------------------------------------------------------------------------------------------


def _rule(op, *args, **kwargs):
    shardings = RULES[op](OpCall(op, args, kwargs))
    return shardings if isinstance(shardings, list) else [shardings]


def test_rule_follows_the_sharded_input_and_replicates_broadcast_dims():
    x, b = make_spec((4, 8), Shard(0)), make_spec((8,), Replicate())
    options = {(s.inputs, s.outputs) for s in _rule(aten.add.Tensor, x, b)}
    assert (((Shard(0),), (Replicate(),)), ((Shard(0),),)) in options  # b broadcasts along dim 0: R
    y = make_spec((1, 8), Shard(0))  # a size-1 dim that broadcasts: its shard cannot be followed
    outputs = {s.outputs for s in _rule(aten.mul.Tensor, make_spec((4, 8), Replicate()), y)}
    assert ((Shard(0),),) not in outputs and ((Replicate(),),) in outputs


def test_rule_for_in_place_keeps_the_written_placements():
    self, other = make_spec((4, 8), Replicate()), make_spec((4, 8), Shard(1))
    for s in _rule(aten.add_.Tensor, self, other, alpha=2):
        assert s.outputs == ((Replicate(),),) and s.inputs == (None, (Replicate(),))
    for value in (2.0, 0.0):  # P(sum) stays P(sum): the rule's local_impl writes v on one rank, 0 elsewhere
        assert _rule(aten.fill_.Scalar, make_spec((4,), Partial()), value)[0].outputs == ((Partial(),),)


def test_rule_partial_sum_needs_the_whole_linear_group():
    p, r = make_spec((4,), Partial()), make_spec((4,), Replicate())
    add_outputs = {s.outputs[0] for s in _rule(aten.add.Tensor, p, make_spec((4,), Shard(0)))}
    assert (Partial(),) not in add_outputs  # a shard cannot become Partial
    assert {s.outputs[0] for s in _rule(aten.add.Scalar, p, 1.0)} == {(Replicate(),)}
    assert (Partial(),) in {s.outputs[0] for s in _rule(aten.mul.Tensor, r, p)}
    assert {s.outputs[0] for s in _rule(aten.div.Tensor, r, p)} == {(Replicate(),)}
    assert {s.outputs[0] for s in _rule(aten.exp.default, p)} == {(Replicate(),)}
    assert (Partial("max"),) in {s.outputs[0] for s in _rule(aten.exp.default, make_spec((4,), Partial("max")))}


def test_registered_ops_cover_the_family_and_nothing_else():
    required = [
        aten.add.Tensor, aten.add.Scalar, aten.add_.Tensor, aten.add.out, aten.sub.Tensor, aten.mul.Scalar,
        aten.div.Tensor_mode, aten.rsub.Scalar, aten.neg.default, aten.pow.Tensor_Scalar, aten.sqrt.default,
        aten.rsqrt.default, aten.exp.default, aten.log.default, aten.abs_.default, aten.sign.default,
        aten.reciprocal.default, aten.tanh.default, aten.sigmoid.default, aten.lerp.Scalar, aten.lerp_.Tensor,
        aten.addcmul_.default, aten.addcdiv.default, aten.maximum.out, aten.minimum.default, aten.eq.Scalar,
        aten.ge.Tensor, aten.logical_and.default, aten.where.self, aten.masked_fill.Scalar, aten.masked_fill_.Tensor,
        aten.clamp.default, aten.clamp_min.Tensor, aten.clamp_max_.default, aten.silu.default, aten.gelu.default,
        aten.silu_backward.default, aten.gelu_backward.default, aten.threshold_backward.default,
        aten.sigmoid_backward.default, aten.tanh_backward.default, aten.nan_to_num.default, aten.fill_.Scalar,
        aten.zero_.default,
    ]  # fmt: skip
    missing = [str(op) for op in required if RULES.get(op) is not pointwise.pointwise_rule]
    assert not missing, missing
    ops = set(pointwise.POINTWISE_OPS)
    assert not [op for op in ops if torch.Tag.nondeterministic_seeded in op.tags]  # random.py's
    owned_elsewhere = {aten.clone.default, aten._to_copy.default, aten.copy_.default, aten.max.dim, aten.sum.default}
    assert not owned_elsewhere & ops
    assert len(ops) > 600
