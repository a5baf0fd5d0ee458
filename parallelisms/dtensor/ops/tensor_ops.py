"""Rules for tensor ops: copies and casts, factories, cat/stack, tril/repeat/roll/flip, constant_pad_nd,
sort, and the `Row` helpers that these rules and the indexing family (indexing.py) are written with.

Most rules here are written per mesh dim as a short list of `Row`s ("on one mesh dim: self S(d),
index R -> out S(d)"); `expand` combines one row per mesh dim into whole-mesh candidates and drops
those that would need an impossible move (only Replicate can become Partial) or that change the
placements of a tensor written in place. The dispatcher then picks the cheapest candidate. The
all-Replicate row is always offered, so every rule has a legal fallback.

Why the rows are right, in one line each:
  - an op that works independently along tensor dim d (sort on another dim, cat along another dim)
    runs on shards of d, even uneven or nested ones, as long as every operand that spans d is
    chunked the same way (same size on d, same placements);
  - an op that copies or masks values (copy, tril, repeat, cat) is linear and monotone, so
    P(r) -> P(r) for every reduce op r.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch._ops import OpOverload

from ..placements import Partial, Placement, Replicate, Shard, shards
from ..spec import DTensorSpec, is_dense
from .registry import (
    LOCAL_SHAPE,
    LOCAL_STRIDE,
    WORLD_LOCAL_IMPLS,
    LocalComm,
    LocalImpl,
    OpCall,
    Placements,
    Role,
    Sharding,
    argument_role,
    register,
)

aten = torch.ops.aten

R = Replicate()
ArgPlacement = Placement | tuple[Placement, ...]  # a list arg takes one placement for all, or one each


class Row(NamedTuple):
    """One mesh dim's plan: a placement per tensor arg (by schema name) and one per output."""

    inputs: dict[str, ArgPlacement]
    outputs: tuple[Placement | None, ...]


# --------------------------------------------------------------------------------------------------
# helpers: rows -> candidates (args by name: OpCall.bound)
# --------------------------------------------------------------------------------------------------


def flat_inputs(call: OpCall, by_name: dict[str, ArgPlacement]) -> tuple[Placement | None, ...]:
    """Placements in `call.specs` order from placements given per argument name."""
    out: list[Placement | None] = []
    for slot in call.bound.slots:
        if slot.spec_index is None:
            continue
        want = by_name.get(slot.argument.name)
        if slot.item is None:
            out.append(want if not isinstance(want, tuple) else None)
        else:
            out.append(want[slot.item] if isinstance(want, tuple) else want)
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


def expand(call: OpCall, rows: list[Row], *, reshard: bool = True) -> list[Sharding]:
    """Every combination of one legal row per mesh dim, as whole-mesh candidates.

    A row is legal on mesh dim m when each input can move to its placement there, and, for an
    in-place op, when it leaves the written tensor (the first arg) as it is. `reshard=False` is
    torch's strategy for ops along a dim (sort, topk, flip, pad, ...): an input keeps its placement
    or is gathered, never moved to another shard dim, so outputs are placed as torch's are.
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
            and (reshard or all(t in (None, c) or isinstance(t, Replicate) for c, t in zip(current, ins)))
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
    return argument_role(call.op._schema.arguments[0]) is Role.KEEP


def norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def same_dim_rows(
    call: OpCall,
    ndim: int,
    names: Sequence[str],
    skip: set[int],
    num_outputs: int = 1,
    reduce_ops: Sequence[str] | None = None,
) -> list[Row]:
    """R; S(d) for every dim d not in `skip` on all `names` and outputs; P(r) likewise."""
    rows = [Row({n: R for n in names}, (R,) * num_outputs)]
    rows += [Row({n: Shard(d) for n in names}, (Shard(d),) * num_outputs) for d in range(ndim) if d not in skip]
    rows += [Row({n: p for n in names}, (p,) * num_outputs) for p in partials(call, reduce_ops)]
    return rows


def skip_empty_shards(candidate: Sharding, local_args: tuple | None, run: LocalImpl) -> Sharding:
    """A candidate with a sharded output runs `run` (and `local_args`, e.g. this rank's input_size for a
    backward), so that a rank whose shard is empty skips the kernel (`skip_empty`)."""
    if not any(o is not None and any(shards(p) for p in o) for o in candidate.outputs):
        return candidate
    return Sharding(candidate.inputs, candidate.outputs, local_args=local_args, local_impl=run)


def skip_empty(
    op: OpOverload, local_args: list, local_kwargs: dict, input_specs: tuple, output_specs: tuple, comm: LocalComm
) -> Any:
    """`op` on this rank's shard of its first arg, or this rank's empty outputs when that shard is empty (the
    kernels of image and FFT ops refuse an empty batch or plane, which an uneven shard can be)."""
    first = local_args[0]
    if first.numel():
        return op(*local_args, **local_kwargs)
    empties = tuple(first.new_empty(s.local_shape_and_offset()[0], dtype=s.dtype) for s in output_specs)
    return empties if len(empties) > 1 else empties[0]


# --------------------------------------------------------------------------------------------------
# copies, casts, factories
# --------------------------------------------------------------------------------------------------


@register(
    aten.detach.default,
    aten.alias.default,
    aten.clone.default,
    aten.contiguous.default,
    aten.lift_fresh.default,
    aten.lift_fresh_copy.default,
    torch.ops.prims.view_of.default,
)
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
    target = call.bound["dtype"]
    placements = tuple(
        R if isinstance(p, Partial) and _cast_breaks(p, spec.dtype, target) else p for p in spec.placements
    )
    return Sharding((placements,), (placements,))


def _cast_breaks(p: Partial, src: torch.dtype, dst: torch.dtype | None) -> bool:
    if dst is None or dst == src:
        return False
    if dst == torch.bool:
        return True
    return p.reduce_op in ("sum", "avg") and src.is_floating_point and not dst.is_floating_point


@register(aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default)
def like(call: OpCall) -> Sharding:
    """A fresh tensor with the input's layout. A Partial input gives Replicate for ones/full (their
    values are not partial) but stays Partial for empty/zeros, which any reduce op leaves as they
    are (so `module.to_empty()` keeps every placement, as torch)."""
    spec = call.specs[0]
    keeps_partial = call.op in (aten.empty_like.default, aten.zeros_like.default)
    placements = tuple(R if isinstance(p, Partial) and not keeps_partial else p for p in spec.placements)
    return Sharding((None,) * len(call.specs), (placements,))


_PARTIAL_SAFE_FACTORIES = (aten.new_empty.default, aten.new_empty_strided.default, aten.new_zeros.default)


@register(
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_empty.default,
    aten.new_full.default,
    aten.new_empty_strided.default,
)
def new_factory(call: OpCall) -> list[Sharding]:
    """`x.new_zeros(size)` makes a new global tensor of `size`: Replicate, or x's placements when
    `size` is x's shape (the local call then gets this rank's shape); x is not read.

    A Partial x passes its placements only to new_empty / new_empty_strided (any values will do)
    and new_zeros (zero pieces reduce to zero under every reduce op), as torch keeps them: the grad
    buffers autograd allocates like a Partial leaf then take a Partial grad without a reduction.
    new_empty_strided keeps the placements only for dense strides: the shard gets dense strides of
    its own shape in the same dim order (as torch), so the DTensor's strides agree with its shard's.
    """
    self, size = call.args[0], tuple(call.args[1])
    keep = (None,) * len(call.specs)
    replicate = Sharding(keep, ((R,) * call.mesh_ndim,))
    if size != tuple(self.shape) or (self.has_partial() and call.op not in _PARTIAL_SAFE_FACTORIES):
        return [replicate]
    if call.op is aten.new_empty_strided.default:
        if not is_dense(size, call.args[2]):
            return [replicate]
        local_args = (self, LOCAL_SHAPE, LOCAL_STRIDE, *call.args[3:])
    else:
        local_args = (self, LOCAL_SHAPE, *call.args[2:])
    # x's placements first: on a tie (a Partial x: same local size) the planner keeps the first
    return [Sharding(keep, (self.placements,), local_args=local_args), replicate]


@register(aten.copy_.default, aten.copy.default)
def copy(call: OpCall) -> list[Sharding]:
    """copy_(self, src): src moves to self's placements (src may broadcast: a broadcast dim of src is R).

    The functional `copy` may also move self (its values are discarded) and take src's layout.
    """
    self, src = call.bound["self"], call.bound["src"]
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
    tensors = call.bound["tensors"]
    live = [isinstance(t, DTensorSpec) and tuple(t.shape) != (0,) for t in tensors]
    ndim = next((t.ndim for t, ok in zip(tensors, live) if ok), 1)
    dim = norm_dim(call.bound["dim"], ndim)

    def each(p: Placement) -> tuple[Placement, ...]:
        return tuple(p if ok else R for ok in live)

    rows = [Row({"tensors": each(R)}, (R,))]
    rows += [Row({"tensors": each(Shard(d))}, (Shard(d),)) for d in range(ndim) if d != dim and any(live)]
    rows += [Row({"tensors": each(p)}, (p,)) for p in partials(call)]
    return expand(call, rows)


@register(aten.stack.default)
def stack(call: OpCall) -> list[Sharding]:
    """stack at dim: S(d) x ... -> S(d if d < dim else d + 1); P(r) -> P(r)."""
    tensors = call.bound["tensors"]
    ndim = tensors[0].ndim if isinstance(tensors[0], DTensorSpec) else 0
    dim = norm_dim(call.bound["dim"], ndim + 1)
    rows = [Row({"tensors": R}, (R,))]
    rows += [Row({"tensors": Shard(d)}, (Shard(d if d < dim else d + 1),)) for d in range(ndim)]
    rows += [Row({"tensors": p}, (p,)) for p in partials(call)]
    return expand(call, rows)


@register(aten._local_scalar_dense.default)
def replicated_scalar(call: OpCall) -> Sharding:
    """`item()`: a Python value that must be the same on every rank -> gather to R."""
    return Sharding(tuple((R,) * call.mesh_ndim for _ in call.specs), ())


@register(aten.equal.default)
def equal(call: OpCall) -> list[Sharding] | Sharding:
    """torch.equal as torch runs it: each rank compares its shards under one shared placement (no
    gather), then the world ANDs the answers (all_ranks_agree). Partial inputs are reduced first.

    Equal local shapes on every rank imply equal global shapes: torch.chunk's sizes sum to the size.
    """
    if len(call.specs) != 2 or not all(isinstance(s, DTensorSpec) for s in call.specs):
        return replicated_scalar(call)
    a, b = call.specs
    r = (R,) * call.mesh_ndim
    options = [p for p in (a.placements, b.placements) if not any(isinstance(x, Partial) for x in p)] + [r]
    return [Sharding((t, t), (), local_impl=_equal_everywhere) for t in dict.fromkeys(options)]


def _equal_everywhere(
    local_args: list, local_kwargs: dict, input_specs: tuple, output_specs: tuple, comm: LocalComm
) -> bool:
    a, b = local_args[0], local_args[1]
    return comm.all_ranks_agree(torch.equal(a, b), a.device)


WORLD_LOCAL_IMPLS.add(_equal_everywhere)


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
# ops that act along some dims: tril/triu, repeat, roll, flip, constant_pad_nd, sort, topk
# --------------------------------------------------------------------------------------------------


@register(aten.tril.default, aten.triu.default, aten.tril_.default, aten.triu_.default)
def tril_triu(call: OpCall) -> list[Sharding]:
    """The mask depends on (row, col) positions: the last two dims stay unsharded; a mask is linear
    and monotone (zeros stay zeros), so P(r) -> P(r)."""
    self = call.bound["self"]
    return expand(call, same_dim_rows(call, self.ndim, ["self"], {self.ndim - 1, self.ndim - 2}), reshard=False)


@register(aten.repeat.default)
def repeat(call: OpCall) -> list[Sharding]:
    """A dim repeated once keeps its shard (shifted by the new leading dims); P(r) -> P(r)."""
    self, repeats = call.bound["self"], call.bound["repeats"]
    lead = len(repeats) - self.ndim
    rows = [Row({"self": R}, (R,))]
    rows += [Row({"self": Shard(d)}, (Shard(d + lead),)) for d in range(self.ndim) if repeats[d + lead] == 1]
    rows += [Row({"self": p}, (p,)) for p in partials(call)]
    return expand(call, rows)


@register(aten.roll.default, aten.flip.default)
def roll_flip(call: OpCall) -> list[Sharding]:
    """Dims not rolled/flipped keep their shards (roll without dims rolls the flat tensor: all dims)."""
    self, dims = call.bound["self"], call.bound["dims"]
    flat_roll = not dims and call.op == aten.roll.default
    active = set(range(self.ndim)) if flat_roll else {norm_dim(d, self.ndim) for d in dims}
    return expand(call, same_dim_rows(call, self.ndim, ["self"], active), reshard=False)


@register(aten.constant_pad_nd.default)
def constant_pad_nd(call: OpCall) -> list[Sharding]:
    """Dims the pad list leaves at (0, 0) keep their shards; a padded (or cropped) dim is gathered.

    Padding writes v on every rank: P(avg|max|min) of copies of v is v, and P(sum) (or a p-norm)
    only holds for v == 0; a crop (negative pads only) selects values, so every Partial passes.
    """
    self, pad = call.bound["self"], call.bound["pad"]
    value = call.bound["value"]
    padded = {self.ndim - 1 - i // 2 for i, p in enumerate(pad) if p != 0}
    adds = any(p > 0 for p in pad) and not (isinstance(value, (int, float, bool)) and value == 0)
    reduce_ops = ("avg", "max", "min") if adds else None
    return expand(call, same_dim_rows(call, self.ndim, ["self"], padded, reduce_ops=reduce_ops), reshard=False)


@register(aten.slice_scatter.default, aten.select_scatter.default)
def slice_select_scatter(call: OpCall) -> list[Sharding]:
    """self with a slice (or one index) along dim replaced by src: every other dim keeps its shards on self and
    src alike (src lacks dim for select_scatter); dim is gathered. Each element is copied from self or from src,
    so a Partial of one reduce op on both passes."""
    self = call.bound["self"]
    dim = norm_dim(call.bound["dim"], self.ndim)
    selects = call.op == aten.select_scatter.default
    rows = [Row({"self": R, "src": R}, (R,))]
    for d in range(self.ndim):
        if d != dim:
            rows.append(Row({"self": Shard(d), "src": Shard(d - (selects and d > dim))}, (Shard(d),)))
    rows += [Row({"self": p, "src": p}, (p,)) for p in partials(call)]
    return expand(call, rows, reshard=False)


@register(aten.sort.default, aten.sort.stable, aten.topk.default)
def sort_topk(call: OpCall) -> list[Sharding]:
    """(values, indices) along dim: other dims keep their shards; not linear, so no Partial."""
    self = call.bound["self"]
    dim = norm_dim(call.bound["dim"], self.ndim)
    return expand(call, same_dim_rows(call, self.ndim, ["self"], {dim}, num_outputs=2, reduce_ops=()), reshard=False)


# --------------------------------------------------------------------------------------------------
# bucketize
# --------------------------------------------------------------------------------------------------


@register(aten.bucketize.Tensor)
def bucketize(call: OpCall) -> list[Sharding]:
    """bucketize(x, boundaries): for each element of x, how many boundaries lie below it (at or
    below with right=True). Per mesh dim:

        x S(d) or R, boundaries R        elementwise in x: x's placement
        x P(max) / P(min), boundaries R  the count is monotone in x, so the max (min) survives
        x R, boundaries S(0)             each rank counts its own boundaries: the counts add, P(sum)

    P(sum)/P(avg) x must be reduced first (a count of a sum is no sum of counts).
    """
    x = call.specs[0]
    rows = [Row({"self": R, "boundaries": R}, (R,))]
    rows += [Row({"self": Shard(d), "boundaries": R}, (Shard(d),)) for d in range(x.ndim)]
    rows += [Row({"self": Partial(op), "boundaries": R}, (Partial(op),)) for op in ("max", "min")]
    rows.append(Row({"self": R, "boundaries": Shard(0)}, (Partial("sum"),)))
    return [s for s in expand(call, rows) if _one_reduce_op(s.outputs[0])]


@register(aten.searchsorted.Tensor)
def searchsorted(call: OpCall) -> list[Sharding]:
    """searchsorted(sorted_sequence, values): each value's insertion index in its row of the sequence (of the
    sequence itself when it is 1-D). Per mesh dim:

        values S(d) or R, sequence R            elementwise in values (1-D sequence)
        values, sequence (and sorter) S(d)      a leading dim d of an N-D sequence: rows are independent
        values P(max) / P(min), sequence R      the index is monotone in the value
        values R, sequence S(last), no sorter   each rank counts its own elements below the value: P(sum)
    """
    seq, values = call.bound["sorted_sequence"], call.bound["self"]
    names = ("sorted_sequence", "self", "sorter")
    rows = [Row(dict.fromkeys(names, R), (R,))]
    if seq.ndim == 1:
        rows += [Row({"sorted_sequence": R, "self": Shard(d), "sorter": R}, (Shard(d),)) for d in range(values.ndim)]
    else:
        rows += [Row(dict.fromkeys(names, Shard(d)), (Shard(d),)) for d in range(seq.ndim - 1)]
    rows += [Row({"sorted_sequence": R, "self": Partial(op), "sorter": R}, (Partial(op),)) for op in ("max", "min")]
    if call.bound.get("sorter") is None:
        rows.append(Row({"sorted_sequence": Shard(seq.ndim - 1), "self": R}, (Partial("sum"),)))
    return [s for s in expand(call, rows) if _one_reduce_op(s.outputs[0])]


def _one_reduce_op(placements: Placements | None) -> bool:
    """A spec holds one kind of Partial (mixed reduce ops have no single reduction order)."""
    ops = {p.reduce_op for p in placements or () if isinstance(p, Partial)}
    return len(ops) <= 1
