"""Sharding rules: the matmul family (mm, bmm, addmm, baddbmm, addbmm, dot, mv, addmv, float8 `_scaled_mm`),
written once.

Every op here is an einsum `"mk,kn->mn"` over its product operands, plus (for the `add*` ops) an
additive operand broadcast to the output: `addmm(bias, a, b) = beta * bias + alpha * a @ b`.
One mesh dim at a time, the legal layouts are:

    all Replicate                      R,    R    -> R
    shard an output letter (m, n, b)   S(m), R    -> S(m)      every operand holding m is split on m
    shard a contracted letter (k)      S(k), S(k) -> P(sum)    local a @ b is one term of the sum
    carry a linear Partial             P,    R    -> P         (a1 + a2) @ b = a1 @ b + a2 @ b

With a Partial output the additive operand must be Partial too (`bias + sum_r t_r` is
`sum_r (bias / n + t_r)`): a Replicate bias is partitioned locally (bias / n), never summed n times.
A letter may also be split as a `_StridedShard` of a view's flattened dim (`(B, H, T, D)` with heads
sharded, viewed as `(B * H, T, D)`, is `_S(0, B)`): its entries are independent like any other
letter's, so `_S(b, sf) x _S(b, sf) -> _S(b, sf)` as torch's bmm does, and the view back restores
`S(1)` (views.py). A rule offers the product of the per-mesh-dim layouts and the dispatcher keeps the
cheapest. S(k) x S(k) is offered only where it needs no collective (each operand already S(k) or
Replicate): the dispatcher prices input moves only, and a Partial output defers a reduction of the
whole output. A plain 0-d bias (not a DTensor) rules out Partial outputs; in-place (`addmm_`) and
out= calls keep the written tensor's placements.

Uneven shards need nothing special: every operand holding a letter is split on it by the same mesh
dims in the same order, so their `torch.chunk` pieces line up (an empty k piece contributes zeros).
`aten.linear` and `aten.matmul` decompose before dispatch into t / view / mm / addmm / bmm /
_unsafe_view, so they need no rules of their own (the views live in views.py).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch._ops import OpOverloadPacket
from torch.ops import aten

from ..placements import Partial, Placement, Replicate, Shard, _StridedShard
from ..spec import DTensorSpec
from .registry import OpCall, Placements, Sharding, register

# Partial reduce ops a matmul carries through: it is linear in each operand, so sum and avg pass.
LINEAR_REDUCE_OPS = ("sum", "avg")


@dataclass(frozen=True, slots=True)
class Einsum:
    """`"mk,kn->mn"` parsed: one letter string per product operand and the output's letters."""

    operands: tuple[str, ...]
    output: str

    @staticmethod
    def parse(equation: str) -> Einsum:
        lhs, output = equation.split("->")
        return Einsum(tuple(lhs.split(",")), output)

    @property
    def contracted(self) -> tuple[str, ...]:
        """Letters summed over: in some operand, not in the output (k of mm, b and k of addbmm)."""
        seen = dict.fromkeys("".join(self.operands))
        return tuple(x for x in seen if x not in self.output)


# op -> (einsum, whether arg 0 is an additive operand broadcast to the output)
EINSUMS: dict[OpOverloadPacket, tuple[Einsum, bool]] = {
    aten.mm: (Einsum.parse("mk,kn->mn"), False),
    aten.bmm: (Einsum.parse("bmk,bkn->bmn"), False),
    aten.dot: (Einsum.parse("k,k->"), False),
    aten.mv: (Einsum.parse("mk,k->m"), False),
    aten.addmm: (Einsum.parse("mk,kn->mn"), True),
    aten.addmm_: (Einsum.parse("mk,kn->mn"), True),
    aten.baddbmm: (Einsum.parse("bmk,bkn->bmn"), True),
    aten.baddbmm_: (Einsum.parse("bmk,bkn->bmn"), True),
    aten.addbmm: (Einsum.parse("bmk,bkn->mn"), True),
    aten.addmv: (Einsum.parse("mk,k->m"), True),
}


# --------------------------------------------------------------------------------------------------
# pure planning: letters -> per-mesh-dim layouts -> Shardings
# --------------------------------------------------------------------------------------------------

Letters = tuple[str | None, ...]  # one letter per tensor dim; None: a broadcast dim that cannot shard


def additive_letters(shape: Sequence[int], output: str, output_shape: Sequence[int]) -> Letters:
    """Letters of an operand broadcast to the output (right-aligned); size-1 broadcast dims get None."""
    offset = len(output) - len(shape)
    if offset < 0:
        raise ValueError(f"additive operand of shape {tuple(shape)} does not broadcast to output letters {output!r}")
    return tuple(
        None if size == 1 and output_shape[offset + i] != 1 else output[offset + i] for i, size in enumerate(shape)
    )


def _shard_on(letters: Letters, x: str, split_factor: int | None = None) -> Placement:
    """Shard the dim of letter `x` (a `_StridedShard` with `split_factor`), Replicate without it."""
    if x not in letters:
        return Replicate()
    return Shard(letters.index(x)) if split_factor is None else _StridedShard(letters.index(x), split_factor)


def _shard_kinds(current: Sequence[Placement]) -> list[int | None]:
    """How a letter may be split on this mesh dim: Shard (None), and each split factor of a strided
    input (a view's flattened batch or rows: `_S(0, B)` x `_S(0, B)` -> `_S(0, B)`; every operand holding
    the letter gets the same one, so their pieces line up)."""
    return [None, *sorted({p.split_factor for p in current if isinstance(p, _StridedShard)})]


def product_layouts(
    operands: Sequence[Letters], einsum: Einsum, current: Sequence[Placement]
) -> list[tuple[list[Placement], Placement]]:
    """(operand placements, output placement) of the product alone on one mesh dim; `current` is
    each product operand's placement now (it decides which Partials are worth offering)."""
    r = Replicate()
    layouts: list[tuple[list[Placement], Placement]] = [([r] * len(operands), r)]  # R x R -> R
    for sf in _shard_kinds(current):
        for x in einsum.output:  # S(x) x R -> S(x)
            layouts.append(([_shard_on(lt, x, sf) for lt in operands], _shard_on(tuple(einsum.output), x, sf)))
        for x in einsum.contracted:  # S(k) x S(k) -> P(sum); an operand without k is replicated
            contract = [_shard_on(lt, x, sf) for lt in operands]
            # only where no operand needs a collective to get there: a Partial output defers a reduction
            # of the whole output, which the dispatcher's input-bytes cost cannot see
            if all(want == now or isinstance(now, Replicate) for want, now in zip(contract, current)):
                layouts.append((contract, Partial("sum")))
    return layouts


def mesh_dim_layouts(
    operands: Sequence[Letters],
    additive: Letters | None,
    einsum: Einsum,
    current: Sequence[Placement],
) -> list[tuple[Placements, Placement]]:
    """Legal (input placements, output placement) on one mesh dim.

    `operands` are the product operands' letters, `additive` the additive operand's (placed first in
    the returned inputs when present), `current` every input's placement now, in that same order.
    """
    now_operands = current[1:] if additive is not None else current
    layouts = product_layouts(operands, einsum, now_operands)
    partial_ops = {p.reduce_op for p in current if isinstance(p, Partial) and p.reduce_op in LINEAR_REDUCE_OPS}
    for reduce_op in sorted(partial_ops):  # P x R -> P: linear in each product operand
        for i in range(len(operands)):
            carry: list[Placement] = [Replicate()] * len(operands)
            carry[i] = Partial(reduce_op)
            layouts.append((carry, Partial(reduce_op)))
    out: list[tuple[Placements, Placement]] = []
    for placements, out_p in layouts:
        if additive is not None:
            # the additive operand follows the output: sharded on the same letter, Partial with a Partial output
            add_p: Placement = out_p
            if isinstance(out_p, (Shard, _StridedShard)):
                sf = out_p.split_factor if isinstance(out_p, _StridedShard) else None
                add_p = _shard_on(additive, einsum.output[out_p.dim], sf)
            placements = [add_p, *placements]
        if all(_reachable(now, want) for now, want in zip(current, placements)):
            out.append((tuple(placements), out_p))
    return out


def _reachable(now: Placement, want: Placement) -> bool:
    """Only Replicate (a local partition) or the same Partial can become Partial."""
    return not isinstance(want, Partial) or now == want or isinstance(now, Replicate)


def _mixes_partials(placements: Iterable[Placement]) -> bool:
    return len({p.reduce_op for p in placements if isinstance(p, Partial)}) > 1


def combine_mesh_dims(per_mesh_dim: Sequence[list[tuple[Placements, Placement]]]) -> list[Sharding]:
    """Product of the per-mesh-dim layouts into whole Shardings (operand order as in the layouts).

    Several mesh dims sharding one letter always nest the same way in every operand (each mesh dim
    shards the letter in all operands that hold it), so only mixed Partial reduce ops are rejected.
    """
    shardings = []
    for combo in itertools.product(*per_mesh_dim):
        inputs = tuple(zip(*(placements for placements, _ in combo)))
        output = tuple(out_p for _, out_p in combo)
        if _mixes_partials(output) or any(_mixes_partials(p) for p in inputs):
            continue
        shardings.append(Sharding(inputs, (output,)))
    return shardings


def einsum_shardings(
    einsum: Einsum,
    operand_specs: Sequence[DTensorSpec],
    additive_spec: DTensorSpec | None,
    output_shape: Sequence[int],
    mesh_ndim: int,
) -> list[Sharding]:
    """Every legal Sharding of an einsum op; inputs ordered (additive, *operands)."""
    letters: list[Letters] = [tuple(lt) for lt in einsum.operands]
    specs = list(operand_specs)
    add_letters = None
    if additive_spec is not None:
        add_letters = additive_letters(additive_spec.shape, einsum.output, output_shape)
        specs = [additive_spec, *specs]
    per_mesh_dim = [
        mesh_dim_layouts(letters, add_letters, einsum, [s.placements[m] for s in specs]) for m in range(mesh_ndim)
    ]
    return combine_mesh_dims(per_mesh_dim)


# --------------------------------------------------------------------------------------------------
# the rule
# --------------------------------------------------------------------------------------------------


def _output_shape(einsum: Einsum, operand_specs: Sequence[DTensorSpec]) -> tuple[int, ...]:
    sizes: dict[str, int] = {}
    for letters, spec in zip(einsum.operands, operand_specs):
        sizes.update(zip(letters, spec.shape))
    return tuple(sizes[x] for x in einsum.output)


def spec_keys(call: OpCall) -> list[tuple]:
    """Where each of `call.specs` sits: ("arg", i) / ("kwarg", name), with a list index appended."""
    named: list[tuple[tuple, Any]] = [(("arg", i), a) for i, a in enumerate(call.args)]
    named += [(("kwarg", k), v) for k, v in call.kwargs.items()]
    keys: list[tuple] = []
    for key, a in named:
        if isinstance(a, DTensorSpec):
            keys.append(key)
        elif isinstance(a, (list, tuple)):
            keys += [(*key, j) for j, x in enumerate(a) if isinstance(x, DTensorSpec)]
    return keys


@register(*EINSUMS, strided=True)
def einsum_rule(call: OpCall) -> list[Sharding]:
    """mm / bmm / dot / mv and their add* forms: the einsum layouts above, cheapest chosen by the dispatcher."""
    einsum, has_additive = EINSUMS[call.op.overloadpacket]
    args = [a if isinstance(a, DTensorSpec) else None for a in call.args]
    additive = args[0] if has_additive else None
    first = 1 if has_additive else 0
    operand_specs = args[first : first + len(einsum.operands)]
    if any(s is None for s in operand_specs):
        raise NotImplementedError(f"{call.op}: every matrix operand must be a DTensor, got {call.args}")
    specs = [s for s in operand_specs if s is not None]
    candidates = einsum_shardings(einsum, specs, additive, _output_shape(einsum, specs), call.mesh_ndim)
    if has_additive and additive is None:
        # a plain (scalar) bias is on every rank: a Partial output would add it once per rank
        candidates = [s for s in candidates if not any(isinstance(p, Partial) for p in s.outputs[0] or ())]
    positions = ([0] if additive is not None else []) + list(range(first, first + len(einsum.operands)))
    keys = spec_keys(call)
    candidates = [_in_spec_order(keys, positions, s) for s in candidates]
    return keep_written_layout(call, candidates)


@register(aten._scaled_mm)
def scaled_mm_rule(call: OpCall) -> list[Sharding]:
    """`_scaled_mm(a, b, scale_a, scale_b)`: float8 `a @ b` times two scales, tensorwise (one element each,
    Replicate on every rank) or rowwise (`scale_a` (M, 1) per row of `a`, `scale_b` (1, N) per column of `b`,
    each sharded as its operand's rows / columns and whole where the operand splits the contraction dim). The
    product takes mm's layouts, a Partial output included (each scale multiplies every term of its row's or
    column's sum alike) unless the output is itself float8 (a sum of rounded float8 terms is not the float8 of
    the sum). A DTensor bias or result scale is not supported."""
    bound = call.bound
    a, b = call.args[0], call.args[1]
    if not isinstance(a, DTensorSpec) or not isinstance(b, DTensorSpec):
        raise NotImplementedError(f"{call.op}: both float8 operands must be DTensors, got {call.args[:2]}")
    rowwise = _rowwise_scales(call, a, b)
    if isinstance(bound.get("bias"), DTensorSpec) or isinstance(bound.get("scale_result"), DTensorSpec):
        raise NotImplementedError(f"{call.op}: a DTensor bias or scale_result has no sharding rule; add the bias after")
    einsum = EINSUMS[aten.mm][0]
    candidates = einsum_shardings(einsum, [a, b], None, (a.shape[0], b.shape[1]), call.mesh_ndim)
    out_dtype = bound.get("out_dtype")
    if out_dtype is not None and out_dtype.is_floating_point and out_dtype.itemsize == 1:
        candidates = [s for s in candidates if not any(isinstance(p, Partial) for p in s.outputs[0] or ())]
    replicate = (Replicate(),) * call.mesh_ndim
    keys = spec_keys(call)
    names: dict[tuple, str] = {("arg", 2): "scale_a", ("arg", 3): "scale_b"}  # positional or by keyword
    names |= {("kwarg", name): name for name in ("scale_a", "scale_b")}
    shardings = []
    for s in candidates:
        pa, pb = s.inputs[0], s.inputs[1]
        assert pa is not None and pb is not None
        by_name = {
            "scale_a": _scale_placements(pa, 0) if rowwise["scale_a"] else replicate,
            "scale_b": _scale_placements(pb, 1) if rowwise["scale_b"] else replicate,
        }
        by_arg = {("arg", 0): pa, ("arg", 1): pb}
        inputs = tuple(by_arg.get(k) or by_name.get(names.get(k, ""), replicate) for k in keys)
        shardings.append(Sharding(inputs, s.outputs))
    return shardings


def _rowwise_scales(call: OpCall, a: DTensorSpec, b: DTensorSpec) -> dict[str, bool]:
    """Which of `_scaled_mm`'s DTensor scales are rowwise ((M, 1) / (1, N)); another shape is refused."""
    rowwise = {}
    for name, along in (("scale_a", (a.shape[0], 1)), ("scale_b", (1, b.shape[1]))):
        scale = call.bound.get(name)
        rowwise[name] = isinstance(scale, DTensorSpec) and math.prod(scale.shape) != 1
        if isinstance(scale, DTensorSpec) and rowwise[name] and tuple(scale.shape) != along:
            raise NotImplementedError(
                f"{call.op}: {name} of shape {tuple(scale.shape)} is neither one element (tensorwise) nor "
                f"{along} (rowwise) for a {tuple(a.shape)} @ {tuple(b.shape)} product"
            )
    return rowwise


def _scale_placements(operand: Placements, dim: int) -> Placements:
    """A rowwise scale's placements: sharded where its operand shards the scaled dim (`dim`: a's rows, b's
    columns), whole elsewhere (a shard of the contraction dim, Replicate or Partial)."""
    return tuple(p if isinstance(p, Shard) and p.dim == dim else Replicate() for p in operand)


def _in_spec_order(keys: list[tuple], positions: list[int], sharding: Sharding) -> Sharding:
    """Map operand-ordered input placements (operands at args `positions`) to `call.specs` order;
    any other DTensor (an out= tensor) gets None."""
    by_arg: dict[int, Placements | None] = dict(zip(positions, sharding.inputs))
    return Sharding(tuple(by_arg.get(k[1]) if k[0] == "arg" else None for k in keys), sharding.outputs)


def keep_written_layout(call: OpCall, candidates: list[Sharding]) -> list[Sharding]:
    """In-place (`addmm_`) and out= ops write into an existing DTensor whose placements cannot change:
    keep the candidates that leave it as it is and produce exactly its placements."""
    written = call.bound.written()  # in output order
    if not written:
        return candidates
    kept = []
    for s in candidates:
        inputs = list(s.inputs)
        ok = True
        for out_index, w in enumerate(written):
            placements = w.spec.placements
            ok &= inputs[w.spec_index] in (None, placements) and s.outputs[out_index] == placements
            inputs[w.spec_index] = None
        if ok:
            kept.append(Sharding(tuple(inputs), s.outputs))
    if not kept:
        written_str = [tuple(map(str, w.spec.placements)) for w in written]
        raise NotImplementedError(
            f"{call.op} writes into a DTensor with placements {written_str}, which this op cannot produce from "
            f"these inputs; call the out-of-place op and redistribute its result instead"
        )
    return kept
