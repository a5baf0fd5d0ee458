"""Rules for the indexing family: index_select, gather, scatter/scatter_add, index_add, and
advanced indexing (index.Tensor, index_put/index_put_).

The rules are written per mesh dim as `Row`s and combined by `expand` (tensor_ops.py). Why the rows
are right, in one line each:
  - an op that works independently along tensor dim d (gather with index sharded alike, index_select
    along another dim) runs on shards of d, even uneven or nested ones, as long as every operand that
    spans d is chunked the same way (same size on d, same placements);
  - an op that selects values (index, index_select, gather) is linear and monotone, so
    P(r) x R-indices -> P(r) for every reduce op r;
  - an op that adds into a zero-or-self buffer (index_add, scatter_add, index_put(accumulate)) may
    split its index: each rank adds its part, P(sum) self x S index -> P(sum).
Boolean-mask indexing has a data-dependent shape and is refused with advice.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..placements import Partial, Placement, Shard
from ..spec import DTensorSpec
from .registry import OpCall, Sharding, register
from .tensor_ops import R, Row, expand, norm_dim, partials, same_dim_rows

aten = torch.ops.aten

# --------------------------------------------------------------------------------------------------
# index_select, gather, scatter, index_add
# --------------------------------------------------------------------------------------------------


@register(aten.index_select.default)
def index_select(call: OpCall) -> list[Sharding]:
    """self S(d != dim) x index R -> S(d); self R x index S(0) -> S(dim); P(r) x R -> P(r)."""
    self, index = call.bound["self"], call.bound["index"]
    dim = norm_dim(call.bound["dim"], self.ndim)
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
    self, index = call.bound["self"], call.bound["index"]
    dim = norm_dim(call.bound["dim"], self.ndim)
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


@register(
    aten.scatter.src,
    aten.scatter_.src,
    aten.scatter.value,
    aten.scatter_.value,
    aten.scatter.reduce,
    aten.scatter_.reduce,
    aten.scatter.value_reduce,
    aten.scatter_.value_reduce,
    aten.scatter_reduce.two,
    aten.scatter_reduce_.two,
)
def scatter(call: OpCall) -> list[Sharding]:
    """Writes along dim, so dim stays unsharded; other dims shard when self, index, src agree in size.

    P(r) self x P(r) src -> P(r) for the plain `.src` overload: every position takes either self's
    or src's partial value, so the reduction commutes.
    """
    self, index, src = call.bound["self"], call.bound["index"], call.bound.get("src")
    dim = norm_dim(call.bound["dim"], self.ndim)
    names = ["self", "index", "src"]
    rows = [Row({n: R for n in names}, (R,))]
    rows += [Row({n: Shard(d) for n in names}, (Shard(d),)) for d in _aligned_dims(dim, self, index, src)]
    if isinstance(src, DTensorSpec) and call.op in (aten.scatter.src, aten.scatter_.src):
        rows += [Row({"self": p, "index": R, "src": p}, (p,)) for p in partials(call)]
    return expand(call, rows)


@register(aten.scatter_add.default, aten.scatter_add_.default)
def scatter_add(call: OpCall) -> list[Sharding]:
    """Like scatter, plus: linear in (self, src) -> P(sum|avg); and index/src S(dim) against a P(sum)
    self (each rank adds its part of the updates) -> P(sum): the backward of a gather with sharded index."""
    self, index, src = call.bound["self"], call.bound["index"], call.bound["src"]
    dim = norm_dim(call.bound["dim"], self.ndim)
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
    self, index, source = call.bound["self"], call.bound["index"], call.bound["source"]
    dim = norm_dim(call.bound["dim"], self.ndim)
    rows = [Row({"self": R, "index": R, "source": R}, (R,))]
    rows += [
        Row({"self": Shard(d), "index": R, "source": Shard(d)}, (Shard(d),)) for d in _aligned_dims(dim, self, source)
    ]
    if not isinstance(source, DTensorSpec):  # a plain scalar source would be added once per rank
        return expand(call, rows)
    rows += [Row({"self": p, "index": R, "source": p}, (p,)) for p in partials(call, ("sum", "avg"))]
    if isinstance(index, DTensorSpec) and index.ndim == 1 and source.ndim == self.ndim:
        rows.append(Row({"self": Partial(), "index": Shard(0), "source": Shard(dim)}, (Partial(),)))
    return expand(call, rows)


@register(aten.index_reduce.default, aten.index_reduce_.default)
def index_reduce(call: OpCall) -> list[Sharding]:
    """self[index[i]] = reduce(self[index[i]], source[i]) along dim (prod, mean, amax, amin): rows are
    independent across the other dims, so S(d != dim) on self and source; no Partial (not linear)."""
    self, source = call.bound["self"], call.bound["source"]
    dim = norm_dim(call.bound["dim"], self.ndim)
    rows = [Row({"self": R, "index": R, "source": R}, (R,))]
    rows += [
        Row({"self": Shard(d), "index": R, "source": Shard(d)}, (Shard(d),)) for d in _aligned_dims(dim, self, source)
    ]
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
    self, indices = call.bound["self"], call.bound["indices"]
    layout = index_layout(call, indices)
    rows = [Row({"self": R, "indices": R}, (R,))]
    rows += [
        Row({"self": Shard(d), "indices": R}, (Shard(layout.out_dim(d)),))
        for d in range(self.ndim)
        if d not in layout.indexed
    ]
    rows += [
        Row({"self": R, "indices": _index_shard(indices, layout, bd)}, (Shard(layout.insert + bd),))
        for bd, size in enumerate(layout.broadcast)
        if size > 1
    ]
    rows += [Row({"self": p, "indices": R}, (p,)) for p in partials(call)]
    return expand(call, rows)


@register(aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
def index_put(call: OpCall) -> list[Sharding]:
    """self[indices] = values (or += with accumulate).

    self S(d) on a non-indexed d, values S on the matching dim (R where it broadcasts) -> S(d).
    P(r) self x P(r) values -> P(r): assignment selects (any r), accumulation adds (sum, avg).
    With accumulate, index tensors and values may shard a broadcast dim into a P(sum) self.
    """
    self, indices, values = call.bound["self"], call.bound["indices"], call.bound["values"]
    accumulate = bool(call.bound["accumulate"])
    layout = index_layout(call, indices)
    result_ndim = len(layout.broadcast) + self.ndim - len(layout.indexed)

    def values_at(out_dim: int) -> Placement:  # values broadcast against the result of self[indices]
        vd = out_dim - (result_ndim - values.ndim) if isinstance(values, DTensorSpec) else -1
        return Shard(vd) if vd >= 0 and values.shape[vd] > 1 else R

    rows = [Row({"self": R, "indices": R, "values": R}, (R,))]
    rows += [
        Row({"self": Shard(d), "indices": R, "values": values_at(layout.out_dim(d))}, (Shard(d),))
        for d in range(self.ndim)
        if d not in layout.indexed
    ]
    if isinstance(values, DTensorSpec):
        ops = ("sum", "avg") if accumulate else ("sum", "avg", "max", "min")
        rows += [Row({"self": p, "indices": R, "values": p}, (p,)) for p in partials(call, ops)]
    if accumulate:
        rows += [
            Row(
                {
                    "self": Partial(),
                    "indices": _index_shard(indices, layout, bd),
                    "values": values_at(layout.insert + bd),
                },
                (Partial(),),
            )
            for bd, size in enumerate(layout.broadcast)
            if size > 1
        ]
    return expand(call, rows)
