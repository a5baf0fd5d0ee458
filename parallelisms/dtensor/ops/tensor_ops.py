"""Rules for tensor ops: copies and casts, factories, cat/stack, indexing, scatter/gather, sort.

Most rules here are written per mesh dim as a short list of `Row`s ("on one mesh dim: self S(d),
index R -> out S(d)"); `expand` combines one row per mesh dim into whole-mesh candidates and drops
those that would need an impossible move (only Replicate can become Partial) or that change the
placements of a tensor written in place. The dispatcher then picks the cheapest candidate. The
all-Replicate row is always offered, so every rule has a legal fallback.

Why the rows are right, in one line each:
  - an op that works independently along tensor dim d (sort on another dim, cat along another dim,
    gather with index sharded alike) runs on shards of d, even uneven or nested ones, as long as
    every operand that spans d is chunked the same way (same size on d, same placements);
  - an op that selects, copies or masks values (index, gather, tril, repeat, cat) is linear and
    monotone, so P(r) x R-indices -> P(r) for every reduce op r;
  - an op that adds into a zero-or-self buffer (index_add, scatter_add, index_put(accumulate)) may
    split its index: each rank adds its part, P(sum) self x S index -> P(sum).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ..placements import Partial, Placement, Replicate, Shard
from ..spec import DTensorSpec
from .registry import LOCAL_SHAPE, OpCall, Sharding, register

aten = torch.ops.aten

R = Replicate()
ArgPlacement = Placement | tuple[Placement, ...]  # a list arg takes one placement for all, or one each


class Row(NamedTuple):
    """One mesh dim's plan: a placement per tensor arg (by schema name) and one per output."""

    inputs: dict[str, ArgPlacement]
    outputs: tuple[Placement | None, ...]


# --------------------------------------------------------------------------------------------------
# helpers: args by name, rows -> candidates
# --------------------------------------------------------------------------------------------------


def arg(call: OpCall, name: str, default: Any = None) -> Any:
    """The value of the op's argument `name` (positional or keyword), else `default`."""
    for i, a in enumerate(call.op._schema.arguments):
        if a.name == name:
            if i < len(call.args) and not a.kwarg_only:
                return call.args[i]
            return call.kwargs.get(name, default)
    raise KeyError(f"{call.op} has no argument {name!r}")


def flat_inputs(call: OpCall, by_name: dict[str, ArgPlacement]) -> tuple[Placement | None, ...]:
    """Placements in `call.specs` order from placements given per argument name."""
    names = [a.name for a in call.op._schema.arguments]
    out: list[Placement | None] = []
    for name, value in [*zip(names, call.args), *call.kwargs.items()]:
        want = by_name.get(name)
        if isinstance(value, DTensorSpec):
            out.append(want if not isinstance(want, tuple) else None)
        elif isinstance(value, tuple):
            for j, x in enumerate(value):
                if isinstance(x, DTensorSpec):
                    out.append(want[j] if isinstance(want, tuple) else want)
    return tuple(out)


def reachable(src: Placement, dst: Placement) -> bool:
    """Whether redistribution can take `src` to `dst` on one mesh dim (only R becomes Partial)."""
    return not isinstance(dst, Partial) or src == dst or isinstance(src, Replicate)


def partials(call: OpCall, reduce_ops: Sequence[str] | None = None) -> list[Partial]:
    """The Partial placements some input has, restricted to `reduce_ops` when given.

    Ops that only move or select elements keep any elementwise reduce op (sum, avg, max, min and
    the p-norms of clip_grad_norm_); ops that add elements restrict it.
    """
    found = {p for s in call.specs for p in s.placements if isinstance(p, Partial)}
    return sorted((p for p in found if reduce_ops is None or p.reduce_op in reduce_ops), key=str)


def expand(call: OpCall, rows: list[Row]) -> list[Sharding]:
    """Every combination of one legal row per mesh dim, as whole-mesh candidates.

    A row is legal on mesh dim m when each input can move to its placement there, and, for an
    in-place op, when it leaves the written tensor (the first arg) as it is.
    """
    specs = call.specs
    flat = [(flat_inputs(call, row.inputs), row.outputs) for row in rows]
    inplace = _writes_first_arg(call)
    per_dim = []
    for m in range(call.mesh_ndim):
        current = [s.placements[m] for s in specs]
        legal = [
            (ins, outs)
            for ins, outs in flat
            if all(t is None or reachable(c, t) for c, t in zip(current, ins))
            and (not inplace or ins[0] in (None, current[0]))
        ]
        if not legal:
            raise NotImplementedError(
                f"{call.op} cannot run with placements "
                f"{[tuple(map(str, s.placements)) for s in specs]}: on mesh dim {m} no sharding keeps the "
                f"in-place target at {current[0]}; run it out of place or redistribute the target first"
            )
        per_dim.append(legal)
    return [_combine(combo, len(specs)) for combo in itertools.product(*per_dim)]


def _combine(combo: tuple, num_inputs: int) -> Sharding:
    """Per-mesh-dim rows -> one Sharding (None in any mesh dim means: keep that input / not a tensor)."""
    inputs = tuple(
        None if any(ins[i] is None for ins, _ in combo) else tuple(ins[i] for ins, _ in combo)
        for i in range(num_inputs)
    )
    num_outputs = len(combo[0][1])
    outputs = tuple(
        None if any(outs[i] is None for _, outs in combo) else tuple(outs[i] for _, outs in combo)
        for i in range(num_outputs)
    )
    return Sharding(inputs, outputs)


def _writes_first_arg(call: OpCall) -> bool:
    first = call.op._schema.arguments[0]
    return first.alias_info is not None and first.alias_info.is_write


def norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def same_dim_rows(call: OpCall, ndim: int, names: Sequence[str], skip: set[int], num_outputs: int = 1,
                  reduce_ops: Sequence[str] | None = None) -> list[Row]:
    """R; S(d) for every dim d not in `skip` on all `names` and outputs; P(r) likewise."""
    rows = [Row({n: R for n in names}, (R,) * num_outputs)]
    rows += [Row({n: Shard(d) for n in names}, (Shard(d),) * num_outputs) for d in range(ndim) if d not in skip]
    rows += [Row({n: p for n in names}, (p,) * num_outputs) for p in partials(call, reduce_ops)]
    return rows


# --------------------------------------------------------------------------------------------------
# copies, casts, factories
# --------------------------------------------------------------------------------------------------


@register(aten.detach.default, aten.alias.default, aten.clone.default, aten.contiguous.default,
          aten.lift_fresh.default, aten.lift_fresh_copy.default)
def follow_input(call: OpCall) -> Sharding:
    """Output has the input's placements (Partial stays Partial: these ops are the identity)."""
    (spec,) = call.specs
    return Sharding((None,), (spec.placements,))


@register(aten._to_copy.default)
def to_copy(call: OpCall) -> Sharding:
    """Casts keep placements; P stays P unless the cast breaks the reduction.

    Rounding makes P(sum) through a float cast inexact by an ulp (as torch allows); a cast to bool or
    float -> integer of P(sum|avg) is not linear at all (trunc(a) + trunc(b) != trunc(a + b)), and no
    reduce commutes with bool(), so those gather to Replicate first.
    """
    (spec,) = call.specs
    target = arg(call, "dtype")
    placements = tuple(R if isinstance(p, Partial) and _cast_breaks(p, spec.dtype, target) else p
                       for p in spec.placements)
    return Sharding((placements,), (placements,))


def _cast_breaks(p: Partial, src: torch.dtype, dst: torch.dtype | None) -> bool:
    if dst is None or dst == src:
        return False
    if dst == torch.bool:
        return True
    return p.reduce_op in ("sum", "avg") and src.is_floating_point and not dst.is_floating_point


@register(aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default)
def like(call: OpCall) -> Sharding:
    """A fresh tensor with the input's layout; a Partial input gives Replicate (values are not partial)."""
    spec = call.specs[0]
    placements = tuple(R if isinstance(p, Partial) else p for p in spec.placements)
    return Sharding((None,) * len(call.specs), (placements,))


@register(aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
          aten.new_empty_strided.default)
def new_factory(call: OpCall) -> list[Sharding]:
    """`x.new_zeros(size)` makes a new global tensor of `size`: Replicate, or x's shards when `size`
    is x's shape and x is not Partial (the local call then gets this rank's shape); x is not read.

    new_empty_strided stays Replicate: its global strides mean nothing for a shard.
    """
    self, size = call.args[0], tuple(call.args[1])
    keep = (None,) * len(call.specs)
    options = [Sharding(keep, ((R,) * call.mesh_ndim,))]
    if size == tuple(self.shape) and not self.has_partial() and call.op != aten.new_empty_strided.default:
        local_args = (self, LOCAL_SHAPE, *call.args[2:])
        options.append(Sharding(keep, (self.placements,), local_args=local_args))
    return options


@register(aten.copy_.default, aten.copy.default)
def copy(call: OpCall) -> list[Sharding]:
    """copy_(self, src): src moves to self's placements (src may broadcast: a broadcast dim of src is R).

    The functional `copy` may also move self (its values are discarded) and take src's layout.
    """
    self, src = arg(call, "self"), arg(call, "src")
    rows = [Row({"self": R, "src": R}, (R,))]
    for d in range(self.ndim):
        rows.append(Row({"self": Shard(d), "src": broadcast_placement(self, src, d)}, (Shard(d),)))
    if isinstance(src, DTensorSpec):  # a plain scalar src would be counted once per rank
        rows += [Row({"self": p, "src": p}, (p,)) for p in partials(call)]
    return expand(call, rows)


def broadcast_placement(target: DTensorSpec, operand: Any, d: int) -> Placement:
    """S(d') for the dim of `operand` that broadcasts onto dim d of `target`, R if it broadcasts a 1."""
    if not isinstance(operand, DTensorSpec):
        return R
    od = d - (target.ndim - operand.ndim)
    if od < 0 or operand.shape[od] != target.shape[d]:
        return R
    return Shard(od)


# --------------------------------------------------------------------------------------------------
# cat, stack, comparisons, item
# --------------------------------------------------------------------------------------------------


@register(aten.cat.default)
def cat(call: OpCall) -> list[Sharding]:
    """cat along dim: S(d) for d != dim x ... -> S(d); along a sharded dim -> Replicate; P(r) -> P(r).

    Legacy 1-D empty inputs (shape (0,)), which cat skips, stay Replicate.
    """
    tensors = arg(call, "tensors")
    live = [isinstance(t, DTensorSpec) and tuple(t.shape) != (0,) for t in tensors]
    ndim = next((t.ndim for t, ok in zip(tensors, live) if ok), 1)
    dim = norm_dim(arg(call, "dim", 0), ndim)

    def each(p: Placement) -> tuple[Placement, ...]:
        return tuple(p if ok else R for ok in live)

    rows = [Row({"tensors": each(R)}, (R,))]
    rows += [Row({"tensors": each(Shard(d))}, (Shard(d),)) for d in range(ndim) if d != dim and any(live)]
    rows += [Row({"tensors": each(p)}, (p,)) for p in partials(call)]
    return expand(call, rows)


@register(aten.stack.default)
def stack(call: OpCall) -> list[Sharding]:
    """stack at dim: S(d) x ... -> S(d if d < dim else d + 1); P(r) -> P(r)."""
    tensors = arg(call, "tensors")
    ndim = tensors[0].ndim if isinstance(tensors[0], DTensorSpec) else 0
    dim = norm_dim(arg(call, "dim", 0), ndim + 1)
    rows = [Row({"tensors": R}, (R,))]
    rows += [Row({"tensors": Shard(d)}, (Shard(d if d < dim else d + 1),)) for d in range(ndim)]
    rows += [Row({"tensors": p}, (p,)) for p in partials(call)]
    return expand(call, rows)


@register(aten._local_scalar_dense.default, aten.equal.default)
def replicated_scalar(call: OpCall) -> Sharding:
    """`item()` / `torch.equal`: a Python value that must be the same on every rank -> gather to R."""
    return Sharding(tuple((R,) * call.mesh_ndim for _ in call.specs), ())


@register(aten.is_same_size.default)
def is_same_size(call: OpCall) -> list[Sharding]:
    """Compares local sizes, which match the global comparison only under equal placements.

    Equal global shapes: both follow either input; different ones: local shapes of shards could
    still coincide, so compare the replicated (global) shapes.
    """
    a, b = call.specs
    r = (R,) * call.mesh_ndim
    if a.shape != b.shape:
        return [Sharding((r, r), ())]
    options = [r, a.placements, b.placements]
    return [Sharding((t, t), ()) for t in options if all(map(reachable, a.placements + b.placements, t + t))]


# --------------------------------------------------------------------------------------------------
# index_select, gather, scatter, index_add
# --------------------------------------------------------------------------------------------------


@register(aten.index_select.default)
def index_select(call: OpCall) -> list[Sharding]:
    """self S(d != dim) x index R -> S(d); self R x index S(0) -> S(dim); P(r) x R -> P(r)."""
    self, index = arg(call, "self"), arg(call, "index")
    dim = norm_dim(arg(call, "dim"), self.ndim)
    rows = same_dim_rows(call, self.ndim, ["self"], {dim})
    for row in rows:
        row.inputs["index"] = R
    if isinstance(index, DTensorSpec) and index.ndim == 1:
        rows.append(Row({"self": R, "index": Shard(0)}, (Shard(dim),)))
    return expand(call, rows)


@register(aten.gather.default)
def gather(call: OpCall) -> list[Sharding]:
    """out[i][j] = self[index[i][j]][j] (dim 0): shard a dim != dim that self and index share in size,
    or shard index along dim against a replicated self; P(r) self x R index -> P(r)."""
    self, index = arg(call, "self"), arg(call, "index")
    dim = norm_dim(arg(call, "dim"), self.ndim)
    rows = [Row({"self": R, "index": R}, (R,))]
    rows += [Row({"self": Shard(d), "index": Shard(d)}, (Shard(d),)) for d in _aligned_dims(dim, self, index)]
    if isinstance(index, DTensorSpec) and index.ndim:
        rows.append(Row({"self": R, "index": Shard(dim)}, (Shard(dim),)))
    rows += [Row({"self": p, "index": R}, (p,)) for p in partials(call)]
    return expand(call, rows)


def _aligned_dims(dim: int, *specs: Any) -> list[int]:
    """Dims other than `dim` on which every tensor operand has the same size (so chunks line up)."""
    tensors = [s for s in specs if isinstance(s, DTensorSpec)]
    ndim = tensors[0].ndim
    if any(t.ndim != ndim for t in tensors):
        return []
    return [d for d in range(ndim) if d != dim and len({t.shape[d] for t in tensors}) == 1]


@register(aten.scatter.src, aten.scatter_.src, aten.scatter.value, aten.scatter_.value,
          aten.scatter.reduce, aten.scatter_.reduce, aten.scatter.value_reduce, aten.scatter_.value_reduce)
def scatter(call: OpCall) -> list[Sharding]:
    """Writes along dim, so dim stays unsharded; other dims shard when self, index, src agree in size.

    P(r) self x P(r) src -> P(r) for the plain `.src` overload: every position takes either self's
    or src's partial value, so the reduction commutes.
    """
    self, index, src = arg(call, "self"), arg(call, "index"), _maybe(call, "src")
    dim = norm_dim(arg(call, "dim"), self.ndim)
    names = ["self", "index", "src"]
    rows = [Row({n: R for n in names}, (R,))]
    rows += [Row({n: Shard(d) for n in names}, (Shard(d),)) for d in _aligned_dims(dim, self, index, src)]
    if isinstance(src, DTensorSpec) and call.op in (aten.scatter.src, aten.scatter_.src):
        rows += [Row({"self": p, "index": R, "src": p}, (p,)) for p in partials(call)]
    return expand(call, rows)


def _maybe(call: OpCall, name: str) -> Any:
    try:
        return arg(call, name)
    except KeyError:
        return None


@register(aten.scatter_add.default, aten.scatter_add_.default)
def scatter_add(call: OpCall) -> list[Sharding]:
    """Like scatter, plus: linear in (self, src) -> P(sum|avg); and index/src S(dim) against a P(sum)
    self (each rank adds its part of the updates) -> P(sum): the backward of a gather with sharded index."""
    self, index, src = arg(call, "self"), arg(call, "index"), arg(call, "src")
    dim = norm_dim(arg(call, "dim"), self.ndim)
    names = ["self", "index", "src"]
    rows = [Row({n: R for n in names}, (R,))]
    rows += [Row({n: Shard(d) for n in names}, (Shard(d),)) for d in _aligned_dims(dim, self, index, src)]
    if not isinstance(src, DTensorSpec) or not isinstance(index, DTensorSpec):
        return expand(call, rows)
    rows += [Row({"self": p, "index": R, "src": p}, (p,)) for p in partials(call, ("sum", "avg"))]
    if index.ndim and index.shape[dim] == src.shape[dim]:
        rows.append(Row({"self": Partial(), "index": Shard(dim), "src": Shard(dim)}, (Partial(),)))
    return expand(call, rows)


@register(aten.index_add.default, aten.index_add_.default)
def index_add(call: OpCall) -> list[Sharding]:
    """self[index[i]] += alpha * source[i] along dim: S(d != dim) on self and source; P(sum|avg) on both;
    index S(0) x source S(dim) into a P(sum) self -> P(sum) (the backward of a sharded-index select)."""
    self, index, source = arg(call, "self"), arg(call, "index"), arg(call, "source")
    dim = norm_dim(arg(call, "dim"), self.ndim)
    rows = [Row({"self": R, "index": R, "source": R}, (R,))]
    rows += [Row({"self": Shard(d), "index": R, "source": Shard(d)}, (Shard(d),))
             for d in _aligned_dims(dim, self, source)]
    if not isinstance(source, DTensorSpec):  # a plain scalar source would be added once per rank
        return expand(call, rows)
    rows += [Row({"self": p, "index": R, "source": p}, (p,)) for p in partials(call, ("sum", "avg"))]
    if isinstance(index, DTensorSpec) and index.ndim == 1 and source.ndim == self.ndim:
        rows.append(Row({"self": Partial(), "index": Shard(0), "source": Shard(dim)}, (Partial(),)))
    return expand(call, rows)


# --------------------------------------------------------------------------------------------------
# advanced indexing: index.Tensor, index_put
# --------------------------------------------------------------------------------------------------


class IndexLayout(NamedTuple):
    """Where `self[indices]` puts things: indexed dims, the broadcast index shape and its position."""

    indexed: list[int]
    broadcast: tuple[int, ...]
    insert: int  # output dim of the first broadcast dim

    def out_dim(self, d: int) -> int:
        """Output dim of a non-indexed self dim d."""
        return d if d < self.insert else d + len(self.broadcast) - sum(i < d for i in self.indexed)


def index_layout(call: OpCall, indices: tuple) -> IndexLayout:
    shapes = []
    for t in indices:
        dtype = t.dtype if isinstance(t, DTensorSpec) else t[1] if isinstance(t, tuple) else None
        if dtype in (torch.bool, torch.uint8):
            raise NotImplementedError(
                f"{call.op}: boolean-mask indexing of a DTensor has a data-dependent shape; use "
                f"torch.where / masked_fill, or index the full_tensor()"
            )
        if t is not None:
            shapes.append(t.shape if isinstance(t, DTensorSpec) else ())
    indexed = [i for i, t in enumerate(indices) if t is not None]
    consecutive = indexed == list(range(indexed[0], indexed[0] + len(indexed))) if indexed else True
    insert = indexed[0] if indexed and consecutive else 0
    return IndexLayout(indexed, tuple(torch.broadcast_shapes(*shapes)) if shapes else (), insert)


def _index_shard(indices: tuple, layout: IndexLayout, bd: int) -> tuple[Placement, ...]:
    """Each index tensor's placement when broadcast dim `bd` is sharded (R where it broadcasts a 1)."""
    out: list[Placement] = []
    for t in indices:
        td = bd - (len(layout.broadcast) - t.ndim) if isinstance(t, DTensorSpec) else -1
        out.append(Shard(td) if td >= 0 and t.shape[td] > 1 else R)
    return tuple(out)


@register(aten.index.Tensor)
def index(call: OpCall) -> list[Sharding]:
    """self[indices]: self S(d) on a non-indexed d -> S(out dim); index tensors S on a broadcast dim
    against a replicated self -> S(that output dim); P(r) self x R indices -> P(r)."""
    self, indices = arg(call, "self"), arg(call, "indices")
    layout = index_layout(call, indices)
    rows = [Row({"self": R, "indices": R}, (R,))]
    rows += [Row({"self": Shard(d), "indices": R}, (Shard(layout.out_dim(d)),))
             for d in range(self.ndim) if d not in layout.indexed]
    rows += [Row({"self": R, "indices": _index_shard(indices, layout, bd)}, (Shard(layout.insert + bd),))
             for bd, size in enumerate(layout.broadcast) if size > 1]
    rows += [Row({"self": p, "indices": R}, (p,)) for p in partials(call)]
    return expand(call, rows)


@register(aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
def index_put(call: OpCall) -> list[Sharding]:
    """self[indices] = values (or += with accumulate).

    self S(d) on a non-indexed d, values S on the matching dim (R where it broadcasts) -> S(d).
    P(r) self x P(r) values -> P(r): assignment selects (any r), accumulation adds (sum, avg).
    With accumulate, index tensors and values may shard a broadcast dim into a P(sum) self.
    """
    self, indices, values = arg(call, "self"), arg(call, "indices"), arg(call, "values")
    accumulate = bool(arg(call, "accumulate", False))
    layout = index_layout(call, indices)
    result_ndim = len(layout.broadcast) + self.ndim - len(layout.indexed)

    def values_at(out_dim: int) -> Placement:  # values broadcast against the result of self[indices]
        vd = out_dim - (result_ndim - values.ndim) if isinstance(values, DTensorSpec) else -1
        return Shard(vd) if vd >= 0 and values.shape[vd] > 1 else R

    rows = [Row({"self": R, "indices": R, "values": R}, (R,))]
    rows += [Row({"self": Shard(d), "indices": R, "values": values_at(layout.out_dim(d))}, (Shard(d),))
             for d in range(self.ndim) if d not in layout.indexed]
    if isinstance(values, DTensorSpec):
        ops = ("sum", "avg") if accumulate else ("sum", "avg", "max", "min")
        rows += [Row({"self": p, "indices": R, "values": p}, (p,)) for p in partials(call, ops)]
    if accumulate:
        rows += [Row({"self": Partial(), "indices": _index_shard(indices, layout, bd),
                      "values": values_at(layout.insert + bd)}, (Partial(),))
                 for bd, size in enumerate(layout.broadcast) if size > 1]
    return expand(call, rows)


# --------------------------------------------------------------------------------------------------
# ops that act along some dims: tril/triu, repeat, roll, flip, sort, topk
# --------------------------------------------------------------------------------------------------


@register(aten.tril.default, aten.triu.default, aten.tril_.default, aten.triu_.default)
def tril_triu(call: OpCall) -> list[Sharding]:
    """The mask depends on (row, col) positions: the last two dims stay unsharded; a mask is linear
    and monotone (zeros stay zeros), so P(r) -> P(r)."""
    self = arg(call, "self")
    return expand(call, same_dim_rows(call, self.ndim, ["self"], {self.ndim - 1, self.ndim - 2}))


@register(aten.repeat.default)
def repeat(call: OpCall) -> list[Sharding]:
    """A dim repeated once keeps its shard (shifted by the new leading dims); P(r) -> P(r)."""
    self, repeats = arg(call, "self"), arg(call, "repeats")
    lead = len(repeats) - self.ndim
    rows = [Row({"self": R}, (R,))]
    rows += [Row({"self": Shard(d)}, (Shard(d + lead),)) for d in range(self.ndim) if repeats[d + lead] == 1]
    rows += [Row({"self": p}, (p,)) for p in partials(call)]
    return expand(call, rows)


@register(aten.roll.default, aten.flip.default)
def roll_flip(call: OpCall) -> list[Sharding]:
    """Dims not rolled/flipped keep their shards (roll without dims rolls the flat tensor: all dims)."""
    self, dims = arg(call, "self"), arg(call, "dims", ())
    flat_roll = not dims and call.op == aten.roll.default
    active = set(range(self.ndim)) if flat_roll else {norm_dim(d, self.ndim) for d in dims}
    return expand(call, same_dim_rows(call, self.ndim, ["self"], active))


@register(aten.sort.default, aten.sort.stable, aten.topk.default)
def sort_topk(call: OpCall) -> list[Sharding]:
    """(values, indices) along dim: other dims keep their shards; not linear, so no Partial."""
    self = arg(call, "self")
    dim = norm_dim(arg(call, "dim", -1), self.ndim)
    return expand(call, same_dim_rows(call, self.ndim, ["self"], {dim}, num_outputs=2, reduce_ops=()))
