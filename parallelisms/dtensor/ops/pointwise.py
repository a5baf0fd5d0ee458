"""Sharding rules: the pointwise family — every elementwise aten op with its in-place and out= forms.

An elementwise op computes each output element from the matching (broadcast) input elements, so on
one mesh dim it runs on shards whenever every input holds the slice of the output it needs:

    output S(d)   <- every input S(its dim aligned with d), or R where that input broadcasts along d
    output R      <- every input R
    output P(r)   <- one of the op's Partial patterns below; every other input R

Partial patterns: `f` runs on each rank's piece and the results are reduced by r.
    linear groups  f jointly linear in a group of operands (add: self+other; mul: self, or other;
                   div: self): P(sum) needs EVERY member of the group P(sum) — a Replicate or scalar
                   term would be added n times (P(sum) + R is not P(sum)); P(avg) takes any members
                   P(avg) because an average also commutes with adding constants.
    monotone       f non-decreasing in an operand (relu, exp, clamp, maximum, add's self):
                   max_i f(a_i) = f(max_i a_i), so P(max) -> P(max) and P(min) -> P(min).
    flip           neg: P(max) <-> P(min).
    identity       positive/zero_ (and _foreach_copy_): every P(r) passes (values copied or zero).
A Replicate input becomes P(r) locally where a pattern needs it (R -> P partitions it, no traffic).
Candidates follow each input's placement on each mesh dim; the dispatcher keeps the cheapest. In-place
and out= forms only get candidates whose output placements are those of the tensor they write.
fill_ into a Partial tensor has its own table (`fill_partial`): into P(sum) only the first rank writes.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch._ops import OpOverload

from ..placements import Partial, Placement, Replicate, Shard
from ..spec import DTensorSpec
from .registry import LocalComm, OpCall, Placements, Role, Sharding, register

aten = torch.ops.aten

# (reduce op r of a Partial input, names of the DTensor operands, static args by name)
#   -> [(output reduce op, operands that must be P(r) -- every other operand Replicate)]
PartialRule = Callable[[str, frozenset[str], Mapping[str, Any]], list[tuple[str, frozenset[str]]]]
Option = tuple[Placement, tuple[Placement, ...]]  # one mesh dim: (output, required per input)

ORDER_OPS = ("max", "min")


# --------------------------------------------------------------------------------------------------
# Partial patterns
# --------------------------------------------------------------------------------------------------


def linear(*groups: tuple[str, ...]) -> PartialRule:
    """f jointly linear in each group: P(sum) needs the whole group; P(avg) any non-empty part."""

    def rule(r: str, present: frozenset[str], static: Mapping[str, Any]) -> list[tuple[str, frozenset[str]]]:
        out = []
        for group in groups:
            if r == "sum" and set(group) <= present:
                out.append(("sum", frozenset(group)))
            elif r == "avg":
                members = [n for n in group if n in present]
                for k in range(1, len(members) + 1):
                    out += [("avg", frozenset(c)) for c in itertools.combinations(members, k)]
        return out

    return rule


def monotone(*names: str, joint: tuple[str, ...] = ()) -> PartialRule:
    """f non-decreasing in each of `names`: P(max)/P(min) through one of them, the rest Replicate;
    `joint` reduce ops may also hold all of them at once (maximum: max of maxes is the max)."""

    def rule(r: str, present: frozenset[str], static: Mapping[str, Any]) -> list[tuple[str, frozenset[str]]]:
        if r not in ORDER_OPS:
            return []
        here = [n for n in names if n in present]
        out = [(r, frozenset({n})) for n in here]
        if r in joint and len(here) > 1:
            out.append((r, frozenset(here)))
        return out

    return rule


def flip(name: str) -> PartialRule:
    """f non-increasing in `name` (neg): P(max) -> P(min) and P(min) -> P(max)."""
    return lambda r, present, static: [({"max": "min", "min": "max"}[r], frozenset({name}))] if r in ORDER_OPS else []


def identity(name: str) -> PartialRule:
    """The output is `name`'s values (copy_, positive): every reduce op passes."""
    return lambda r, present, static: [(r, frozenset({name}))] if name in present else []


def fills(name: str | None, value: str | None = "value") -> PartialRule:
    """Elements set to a constant v on every rank (fill_, masked_fill; zero_ when `value` is None):
    avg/max/min of v are v, and sum/p-norms only hold when v == 0 (n copies of v sum to n*v)."""

    def rule(r: str, present: frozenset[str], static: Mapping[str, Any]) -> list[tuple[str, frozenset[str]]]:
        if r not in ("avg", *ORDER_OPS) and value is not None and not is_zero(static.get(value)):
            return []
        return [(r, frozenset({name} if name in present else ()))]

    return rule


def when(condition: Callable[[Mapping[str, Any]], bool], rule: PartialRule) -> PartialRule:
    """`rule` only where the static args satisfy `condition` (e.g. threshold's value <= threshold)."""
    return lambda r, present, static: rule(r, present, static) if condition(static) else []


def combine(*rules: PartialRule) -> PartialRule:
    return lambda r, present, static: [p for rule in rules for p in rule(r, present, static)]


def is_zero(v: Any) -> bool:
    return isinstance(v, (int, float, bool)) and v == 0


def _number(static: Mapping[str, Any], name: str, default: float) -> float:
    v = static.get(name, default)
    return float(v) if isinstance(v, (int, float, bool)) else float("nan")


NON_DECREASING = (  # on their whole domain (sqrt/log are not: P(max) pieces may fall outside it)
    "relu", "relu6", "exp", "exp2", "expm1", "sigmoid", "tanh", "sign", "sgn", "ceil", "floor", "trunc",
    "round", "atan", "asinh", "erf", "sinh", "deg2rad", "rad2deg", "nan_to_num", "hardtanh", "hardsigmoid",
    "hardshrink", "softshrink", "clamp", "clip", "positive",
)  # fmt: skip
LINEAR_IN_GRAD = (  # activation backward ops: grad_output * f'(x), linear in grad_output
    "sigmoid_backward", "tanh_backward", "silu_backward", "gelu_backward", "threshold_backward",
    "logit_backward", "hardtanh_backward", "leaky_relu_backward", "elu_backward",
    "softplus_backward", "hardsigmoid_backward", "hardswish_backward", "mish_backward",
)  # fmt: skip

PARTIAL_RULES: dict[str, PartialRule] = {
    "add": combine(linear(("self", "other")), monotone("self"),
                   when(lambda s: _number(s, "alpha", 1) >= 0, monotone("other"))),
    "sub": combine(linear(("self", "other")), monotone("self")),
    "rsub": combine(linear(("self", "other")), monotone("other")),  # other - alpha * self
    "mul": linear(("self",), ("other",)),
    "div": when(lambda s: s.get("rounding_mode") is None, linear(("self",))),
    "true_divide": linear(("self",)),
    "neg": combine(linear(("self",)), flip("self")),
    "where": combine(linear(("self", "other")), monotone("self", "other", joint=ORDER_OPS)),
    "masked_fill": fills("self"),
    "lerp": linear(("self", "end")),
    "addcmul": linear(("self", "tensor1"), ("self", "tensor2")),
    "addcdiv": linear(("self", "tensor1")),
    "maximum": monotone("self", "other", joint=("max",)),
    "fmax": monotone("self", "other", joint=("max",)),
    "max": monotone("self", "other", joint=("max",)),
    "clamp_min": monotone("self", "min", joint=("max",)),
    "minimum": monotone("self", "other", joint=("min",)),
    "fmin": monotone("self", "other", joint=("min",)),
    "min": monotone("self", "other", joint=("min",)),
    "clamp_max": monotone("self", "max", joint=("min",)),
    "threshold": when(lambda s: _number(s, "value", 0) <= _number(s, "threshold", 0), monotone("self")),
    "leaky_relu": when(lambda s: _number(s, "negative_slope", 0.01) >= 0, monotone("self")),
    "copy": identity("src"),
    "zero": fills(None, value=None),
    "fill": fills(None),
    **{name: monotone("self") for name in NON_DECREASING if name != "positive"},
    "positive": identity("self"),
    **{name: linear(("grad_output",)) for name in LINEAR_IN_GRAD},
}  # fmt: skip

WRITE_ONLY = ("copy", "fill", "zero")  # in-place ops that never read the tensor they overwrite


def overwritten(role: Role, base: str) -> bool:
    """Whether the op writes an argument without reading it: an out= tensor, or copy_/fill_/zero_'s self."""
    return role is Role.OUT or (role is Role.KEEP and base in WRITE_ONLY)


# ("copy" serves _foreach_copy_: copy_ itself is tensor_ops.py's)


def partial_rule_for(base: str) -> PartialRule:
    """The Partial patterns of an op named `base` (no trailing `_`); none: Partial inputs reduce."""
    return PARTIAL_RULES.get(base, lambda r, present, static: [])


# --------------------------------------------------------------------------------------------------
# the planner, shared with foreach.py
# --------------------------------------------------------------------------------------------------


def aligned_dim(spec: DTensorSpec, out_shape: Sequence[int], d: int) -> int | None:
    """The dim of `spec` that output dim `d` reads (right-aligned), None where it broadcasts."""
    k = d - (len(out_shape) - spec.ndim)
    if k < 0 or spec.shape[k] != out_shape[d]:
        return None
    return k


def can_become(current: Placement, required: Placement, dtype: torch.dtype) -> bool:
    """Whether redistribution can reach `required` (only R or the same P can become a Partial;
    R -> P(sum) divides, which needs a floating dtype)."""
    if not isinstance(required, Partial) or current == required:
        return True
    if not isinstance(current, Replicate):
        return False
    return required.reduce_op in ("avg", *ORDER_OPS) or dtype.is_floating_point or dtype.is_complex


def mesh_dim_options(
    m: int,
    inputs: Sequence[DTensorSpec],
    names: Sequence[str],
    out_shape: Sequence[int],
    rule: PartialRule,
    static: Mapping[str, Any],
    fixed: Placement | None,
    keep: Iterable[int],
) -> list[Option]:
    """(output, required input placements) choices on mesh dim `m`: follow each input's shard, all
    Replicate, or a Partial pattern; `fixed` pins the output, `keep` inputs must not move."""
    current = [s.placements[m] for s in inputs]
    replicate = tuple(Replicate() for _ in inputs)

    def shard(d: int) -> Option:
        dims = (aligned_dim(s, out_shape, d) for s in inputs)
        return Shard(d), tuple(Replicate() if k is None else Shard(k) for k in dims)

    options: list[Option] = [(Replicate(), replicate)]
    if isinstance(fixed, Shard):
        options.append(shard(fixed.dim))
    for spec, p in zip(inputs, current):
        if isinstance(p, Shard) and aligned_dim(spec, out_shape, p.dim + len(out_shape) - spec.ndim) == p.dim:
            options.append(shard(p.dim + len(out_shape) - spec.ndim))
    reduce_ops = {p.reduce_op for p in current if isinstance(p, Partial)}
    if isinstance(fixed, Partial):
        reduce_ops.add(fixed.reduce_op)
    for r in sorted(reduce_ops):
        for out_op, need in rule(r, frozenset(names), static):
            required = tuple(Partial(r) if n in need else Replicate() for n in names)
            if not all(can_become(c, q, s.dtype) for c, q, s in zip(current, required, inputs)):
                continue
            if fixed is None and Partial(r) not in [c for c, n in zip(current, names) if n in need]:
                continue  # nothing Partial to carry: partitioning Replicate inputs buys nothing
            options.append((Partial(out_op), required))
    keep = tuple(keep)
    options = [o for o in options if (fixed is None or o[0] == fixed) and all(o[1][j] == current[j] for j in keep)]
    return list(dict.fromkeys(options))


def mixes_reduce_ops(placements: Iterable[Placement]) -> bool:
    return len({p.reduce_op for p in placements if isinstance(p, Partial)}) > 1


def elementwise_candidates(
    inputs: Sequence[DTensorSpec],
    names: Sequence[str],
    rule: PartialRule,
    static: Mapping[str, Any],
    *,
    mesh_ndim: int,
    out_shape: Sequence[int],
    fixed: Placements | None = None,
    keep: Iterable[int] = (),
) -> list[tuple[Placements, tuple[Placements, ...]]]:
    """Every (output placements, required placements per input) combination over the mesh dims."""
    keep = tuple(keep)
    per_dim = [
        mesh_dim_options(m, inputs, names, out_shape, rule, static, None if fixed is None else fixed[m], keep)
        for m in range(mesh_ndim)
    ]
    out = []
    for combo in itertools.product(*per_dim):
        output = tuple(o for o, _ in combo)
        required = tuple(tuple(c[1][j] for c in combo) for j in range(len(inputs)))
        if mixes_reduce_ops(output) or any(mixes_reduce_ops(r) for r in required):
            continue
        out.append((output, required))
    return out


def broadcast_shape(specs: Iterable[DTensorSpec]) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(*(s.shape for s in specs)))


def placements_str(placements: Iterable[Placement]) -> str:
    return "(" + ", ".join(map(str, placements)) + ")"


# --------------------------------------------------------------------------------------------------
# the rule
# --------------------------------------------------------------------------------------------------


def base_name(op: OpOverload) -> str:
    """`aten.add_.Tensor` -> "add"."""
    return op._schema.name.split("::")[-1].rstrip("_")


def num_tensor_outputs(op: OpOverload) -> int:
    return sum("Tensor" in str(r.type) for r in op._schema.returns)


@register(aten.fill.Scalar, aten.fill.Tensor, aten.zero.default)
def fresh_fill(call: OpCall) -> Sharding:
    """fill/zero (out of place) ignore the input's values: its layout, with Partial as Replicate."""
    spec = call.specs[0]
    placements = tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)
    replicate = tuple(Replicate() for _ in placements)
    return Sharding((None,) + tuple(replicate for _ in call.specs[1:]), (placements,))


def pointwise_rule(call: OpCall) -> list[Sharding]:
    """Any elementwise op: the table in the module docstring."""
    base = base_name(call.op)
    if base == "fill" and call.specs[0].has_partial():
        return [fill_partial(call)]
    static = call.bound.values  # the partial patterns read scalars by name (alpha, value, ...)
    inputs, names, written, roles = [], [], [], []
    for slot in call.bound.slots:
        arg, value = slot.argument, slot.value
        if not isinstance(value, DTensorSpec):
            continue
        is_write = slot.role is not Role.IN
        if overwritten(slot.role, base):
            roles.append("out")  # overwritten, never read: it fixes the output placements only
            written.append(value)
            continue
        roles.append("keep" if is_write else "in")
        if is_write:
            written.append(value)
        inputs.append(value)
        names.append(arg.name)
    fixed = _fixed_output(call, written)
    keep = [j for j, role in enumerate(r for r in roles if r != "out") if role == "keep"]
    out_shape = broadcast_shape([*inputs, *written])
    candidates = elementwise_candidates(
        inputs, names, partial_rule_for(base), static,
        mesh_ndim=call.mesh_ndim, out_shape=out_shape, fixed=fixed, keep=keep,
    )  # fmt: skip
    if not candidates:
        raise RuntimeError(_no_candidate_message(call, base, written[0]))
    num_outputs = num_tensor_outputs(call.op)
    shardings = []
    for output, required in candidates:
        it = iter(required)  # one entry per non-"out" operand, in order
        per_spec = tuple(None if role == "out" else _unless_keep(role, next(it)) for role in roles)
        shardings.append(Sharding(per_spec, (output,) * num_outputs))
    return shardings


def fill_partial(call: OpCall) -> Sharding:
    """fill_(self, v) into a Partial self keeps its placements. Per mesh dim where self is P(r):

        v P(r) (a DTensor)        each rank fills its piece of v: the pieces reduce to v
        r in avg, max, min        every rank writes v (an average or max of copies of v is v)
        r = sum, or a p-norm      the first rank (coordinate 0) writes v, the others 0: the pieces
                                  reduce to v (torch 2.13 writes v everywhere: n * v). A p-norm
                                  needs a Python v >= 0 (a norm of pieces is never negative).

    Anything else (P(prod); a tensor v into a p-norm) is refused.
    """
    self, value = call.args[0], call.args[1]
    required: list[Placement] = []
    first_rank: list[int] = []
    for m, p in enumerate(self.placements):
        vp = value.placements[m] if isinstance(value, DTensorSpec) else Replicate()
        if not isinstance(p, Partial) or p == vp or p.reduce_op in ("avg", *ORDER_OPS) or is_zero(value):
            required.append(vp if p == vp else Replicate())
            continue
        required.append(Replicate())
        norm_ok = p.reduce_op.startswith("norm") and isinstance(value, (int, float)) and value >= 0
        if p.reduce_op != "sum" and not norm_ok:
            raise RuntimeError(
                f"{call.op} cannot write {value} into pieces of a {p} DTensor (placements "
                f"{placements_str(self.placements)}); redistribute it to Replicate first"
            )
        first_rank.append(m)
    inputs = (None, tuple(required)) if isinstance(value, DTensorSpec) else (None,)
    if not first_rank:
        return Sharding(inputs, (self.placements,))
    fill = functools.partial(_fill_on_first_rank, call.op, tuple(first_rank))
    return Sharding(inputs, (self.placements,), local_impl=fill)


def _fill_on_first_rank(op: OpOverload, mesh_dims: tuple[int, ...], local_args: list, local_kwargs: dict,
                        input_specs: tuple, output_specs: tuple, comm: LocalComm) -> torch.Tensor:  # fmt: skip
    """fill_ on the ranks at coordinate 0 of every one of `mesh_dims`; zero_ on the others."""
    coordinate = input_specs[0].mesh.get_coordinate()
    if coordinate is not None and all(coordinate[m] == 0 for m in mesh_dims):
        return op(*local_args, **local_kwargs)
    return aten.zero_.default(local_args[0])


def _unless_keep(role: str, required: Placements) -> Placements | None:
    return None if role == "keep" else required  # a written input never moves


def _fixed_output(call: OpCall, written: list[DTensorSpec]) -> Placements | None:
    if not written:
        return None
    if any(w.placements != written[0].placements for w in written[1:]):
        raise ValueError(
            f"{call.op} writes into several DTensors with different placements "
            f"{[placements_str(w.placements) for w in written]}; give them the same placements"
        )
    return written[0].placements


def _no_candidate_message(call: OpCall, base: str, target: DTensorSpec) -> str:
    why = ""
    if base in ("fill", "masked_fill") and target.has_partial():
        why = (
            " every rank would write the value, so a Partial(sum) tensor would read n times it;"
            " zero_() is fine, other values need a reduced tensor."
        )
    return (  # torch's first sentence, word for word
        f"{call.op}: in-place operations that require placement changes are not supported. It writes into a "
        f"DTensor with placements {placements_str(target.placements)} and no way of running it keeps them "
        f"(inputs {[placements_str(s.placements) for s in call.specs]});{why} redistribute out of place first, "
        f"e.g. x = x.redistribute(placements=[Replicate()] * mesh.ndim)"
    )


# --------------------------------------------------------------------------------------------------
# registration: torch's pointwise tag, plus the in-place/out= siblings the tag misses
# --------------------------------------------------------------------------------------------------

# tensor_ops.py owns clone/_to_copy/copy/equal, random.py native_dropout_backward; fill/zero: fresh_fill
OWNED_ELSEWHERE = ("clone", "_to_copy", "contiguous", "copy", "equal", "native_dropout_backward", "fill", "zero")
EXTRA_BASES = (*LINEAR_IN_GRAD, "hardswish")  # pointwise ops the tag misses
EXTRA_OPS = (aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default)


def _all_aten_names() -> Iterator[tuple[str, str]]:
    for qualified in torch._C._dispatch_get_all_op_names():
        if qualified.startswith("aten::"):
            name, _, overload = qualified[len("aten::") :].partition(".")
            yield name, overload


def _tags(name: str, overload: str) -> list:
    found = torch._C._get_operation_overload(f"aten::{name}", overload)
    return found[2] if found else []


def _is_elementwise_schema(name: str, overload: str) -> bool:
    """Tensor in, Tensor(s) out, no tensor lists: the shape of a pointwise op's signature."""
    schema = torch._C._get_schema(f"aten::{name}", overload)
    types = [a.type for a in schema.arguments]
    tensor = torch.TensorType.get()
    return (
        any(t == tensor or t == torch.OptionalType(tensor) for t in types)
        and bool(schema.returns)
        and all(r.type == tensor for r in schema.returns)
        and not any(isinstance(t, torch.ListType) for t in types)
    )


def discover_pointwise_ops() -> list[OpOverload]:
    """Overloads tagged pointwise, their in-place/out= siblings and EXTRA_BASES, minus random ops,
    reductions (max.dim) and ops other families own."""
    names = list(_all_aten_names())
    bases = {n.rstrip("_") for n, o in names if torch.Tag.pointwise in _tags(n, o)} | set(EXTRA_BASES)
    found = []
    for name, overload in names:
        base = name.rstrip("_")
        if base not in bases or base in OWNED_ELSEWHERE or base.startswith("_foreach"):
            continue
        tags = _tags(name, overload)
        if torch.Tag.nondeterministic_seeded in tags or torch.Tag.reduction in tags:
            continue
        if torch.Tag.pointwise in tags or _is_elementwise_schema(name, overload):
            found.append(getattr(getattr(aten, name), overload or "default"))
    return found


# prims' elementwise ops that decompositions emit (torch's DTensor lists the same ones): they carry no
# pointwise tag to discover them by
PRIMS_POINTWISE = tuple(
    getattr(torch.ops.prims, name).default
    for name in (
        "copy_to", "fmax", "fmin", "bessel_i0e", "bessel_i1", "bessel_i1e", "bessel_j0", "bessel_j1", "div",
        "erfcx", "frexp", "gcd", "ndtri", "ne", "spherical_bessel_j0", "zeta",
    )
    if hasattr(torch.ops.prims, name)
)  # fmt: skip
POINTWISE_OPS = tuple(discover_pointwise_ops()) + EXTRA_OPS + PRIMS_POINTWISE
register(*POINTWISE_OPS)(pointwise_rule)
