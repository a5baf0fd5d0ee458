"""Rules for the view family: view/reshape, flatten/unflatten, transpose/permute/t, squeeze/unsqueeze,
expand, view_as_complex/real, split/chunk/unbind/narrow/slice/select (and their backward ops),
as_strided.

The core is pure: an op becomes a *dim map*, one DimSpec per output dim saying where that dim
comes from (an input dim, a piece of a flattened group of input dims, a new or broadcast dim).
`propagate` then decides, per mesh dim, where a Shard(d) input goes:

    S(d) -> S(k)   when output dim k is input dim d whole (maybe moved), or d is the outermost dim
                   of a reshaped group and every rank's torch.chunk shard of d, times the inner
                   sizes, is exactly its torch.chunk shard of output dim k (times its inner sizes);
    S(d) -> R      otherwise (the input is gathered on that mesh dim first).
    P(op) -> P(op) always: a view moves values without changing them.

Shard checks use the global sizes and every rank's chunk (nested mesh dims included), so the rule
is the same on every rank. Size args of the local call (view sizes, expand sizes, backward
input_sizes) are global; rules pass LOCAL_SHAPE instead so the op stays a view of the local shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.ops import aten

from ..placements import Partial, Replicate, Shard, chunk_sizes
from ..spec import DTensorSpec
from .registry import LOCAL_SHAPE, OpCall, Placements, Sharding, register

# --------------------------------------------------------------------------------------------------
# dim specs: where each output dim comes from
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InputDim:
    """Output dim is input dim `dim`, whole."""

    dim: int


@dataclass(frozen=True, slots=True)
class Group:
    """Output dim is piece `index` of input dims `dims` flattened and split into `out_sizes`.

    Flatten is a group with one piece, a split a group of one input dim.
    """

    dims: tuple[int, ...]
    in_sizes: tuple[int, ...]
    out_sizes: tuple[int, ...]
    index: int


@dataclass(frozen=True, slots=True)
class NewDim:
    """A dim that no input dim carries: unsqueeze's 1, expand's new or broadcast dims, view_as_real's 2."""

    size: int


DimSpec = InputDim | Group | NewDim
DimMap = tuple[DimSpec, ...]


def infer_size(numel: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """`sizes` with a -1 filled in so the product is `numel` (as view does)."""
    sizes = tuple(sizes)
    if -1 not in sizes:
        return sizes
    known = math.prod(s for s in sizes if s != -1)
    return tuple(numel // known if s == -1 and known else s for s in sizes)


def view_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> DimMap:
    """Dim map of a view from `in_shape` to `out_shape` (after torch's `view_groups`).

    Walks both shapes, growing the smaller running product until they match: each match is a
    group. Size-1 input dims met alone are dropped; size-1 output dims met alone are NewDim(1).
      (4, 6) -> (24,):        (Group((0, 1), (4, 6), (24,), 0),)
      (4, 6) -> (4, 2, 3):    (InputDim(0), Group((1,), (6,), (2, 3), 0), Group((1,), (6,), (2, 3), 1))
    """
    in_shape, out_shape = tuple(in_shape), infer_size(math.prod(in_shape), out_shape)
    if math.prod(in_shape) != math.prod(out_shape) or any(s < 0 for s in out_shape):
        raise RuntimeError(f"shape '{list(out_shape)}' is invalid for input of size {math.prod(in_shape)}")
    if math.prod(in_shape) == 0:  # no element to track: one group, shards kept only if chunks agree
        dims = tuple(range(len(in_shape)))
        return tuple(Group(dims, in_shape, out_shape, k) for k in range(len(out_shape)))
    result: list[DimSpec] = []
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        dims: list[int] = []
        sizes: list[int] = []
        f = t = 1
        if i < len(in_shape):
            f = in_shape[i]
            dims.append(i)
            i += 1
        if j < len(out_shape):
            t = out_shape[j]
            sizes.append(t)
            j += 1
        if f == 1 and t != 1:  # a lone size-1 input dim disappears
            j, sizes, t = j - len(sizes), [], 1
        elif f != 1 and t == 1:  # a lone size-1 output dim appears
            i, dims, f = i - len(dims), [], 1
        while f != t:
            if f < t:
                f *= in_shape[i]
                dims.append(i)
                i += 1
            else:
                t *= out_shape[j]
                sizes.append(out_shape[j])
                j += 1
        if len(dims) == 1 and len(sizes) == 1:
            result.append(InputDim(dims[0]))
        elif not dims:
            result.extend(NewDim(s) for s in sizes)
        else:
            in_sizes = tuple(in_shape[d] for d in dims)
            result.extend(Group(tuple(dims), in_sizes, tuple(sizes), k) for k in range(len(sizes)))
    return tuple(result)


def dim_permute(ndim: int, dims: Sequence[int]) -> DimMap:
    return tuple(InputDim(d % ndim) for d in dims) if ndim else ()


def dim_transpose(ndim: int, dim0: int, dim1: int) -> DimMap:
    order = list(range(ndim))
    if ndim:
        dim0, dim1 = dim0 % ndim, dim1 % ndim
        order[dim0], order[dim1] = order[dim1], order[dim0]
    return dim_permute(ndim, order)


def dim_unsqueeze(ndim: int, dim: int) -> DimMap:
    dim = dim % (ndim + 1)
    kept: list[DimSpec] = [InputDim(i) for i in range(ndim)]
    return tuple(kept[:dim] + [NewDim(1)] + kept[dim:])


def squeezed_dims(shape: Sequence[int], dims: Sequence[int] | None) -> tuple[int, ...]:
    """The dims squeeze removes: the targets of global size 1 (a shard's local size does not count)."""
    ndim = len(shape)
    targets = range(ndim) if dims is None else sorted({d % max(ndim, 1) for d in dims})
    return tuple(d for d in targets if ndim and shape[d] == 1)


def dim_expand(in_shape: Sequence[int], sizes: Sequence[int]) -> DimMap:
    """Leading new dims and size-1 dims broadcast to n are NewDims; the others stay."""
    new = len(sizes) - len(in_shape)
    if new < 0:
        raise ValueError(f"expand: sizes {list(sizes)} have fewer dims than the input shape {list(in_shape)}")
    result: list[DimSpec] = [NewDim(s) for s in sizes[:new]]
    for i, (have, want) in enumerate(zip(in_shape, sizes[new:])):
        result.append(InputDim(i) if want in (-1, have) else NewDim(want))
    return tuple(result)


# --------------------------------------------------------------------------------------------------
# propagation: where each Shard goes
# --------------------------------------------------------------------------------------------------


def nested_chunks(size: int, mesh_sizes: Sequence[int]) -> list[int]:
    """Sizes of all shards of a dim of `size` split over nested mesh dims, in global order."""
    pieces = [size]
    for n in mesh_sizes:
        pieces = [c for p in pieces for c in chunk_sizes(p, n)]
    return pieces


def group_shards_align(group: Group, mesh_sizes: Sequence[int]) -> bool:
    """Does sharding the group's outermost input dim shard its first output dim the same way?

    Rank r's shard covers flat elements [offset_r * inner_in, (offset_r + chunk_r) * inner_in) of
    the group; it is the torch.chunk shard of the output dim iff every shard length matches:
      (8, 6) -> (48,) on 4 ranks: [2, 2, 2, 2] * 6 == [12, 12, 12, 12]   -> S(0) stays S(0)
      (5, 6) -> (30,) on 2 ranks: [3, 2] * 6 = [18, 12] != [15, 15]      -> gather first
    """
    inner_in = math.prod(group.in_sizes[1:])
    inner_out = math.prod(group.out_sizes[1:])
    shards_in = [c * inner_in for c in nested_chunks(group.in_sizes[0], mesh_sizes)]
    return shards_in == [c * inner_out for c in nested_chunks(group.out_sizes[0], mesh_sizes)]


def carriers(dim_map: DimMap) -> dict[int, tuple[int, Group | None]]:
    """input dim -> (output dim that may keep its shard, the group to check or None if whole)."""
    out: dict[int, tuple[int, Group | None]] = {}
    for k, spec in enumerate(dim_map):
        if isinstance(spec, InputDim):
            out[spec.dim] = (k, None)
        elif isinstance(spec, Group) and spec.index == 0:
            out[spec.dims[0]] = (k, spec)
    return out


def propagate(dim_map: DimMap, placements: Placements, mesh_shape: Sequence[int]) -> tuple[Placements, Placements]:
    """(required input placements, output placements) of a view with `dim_map`.

    Mesh dims sharding the same input dim nest in mesh order; the longest outer run of them whose
    nested chunks align keeps its shard, the inner rest is gathered (dropping an inner split never
    changes what the outer ones hold).
    """
    carried = carriers(dim_map)
    required, output = list(placements), list(placements)
    for d in sorted({p.dim for p in placements if isinstance(p, Shard)}):
        mesh_dims = [m for m, p in enumerate(placements) if isinstance(p, Shard) and p.dim == d]
        k, group = carried.get(d, (None, None))
        keep = 0 if k is None else aligned_prefix(group, [mesh_shape[m] for m in mesh_dims])
        for i, m in enumerate(mesh_dims):
            if i < keep:
                output[m] = Shard(k)
            else:
                required[m] = output[m] = Replicate()
    return tuple(required), tuple(output)


def aligned_prefix(group: Group | None, mesh_sizes: list[int]) -> int:
    """How many of the (outer to inner) mesh dims sharding a dim can keep sharding its carrier."""
    keep = len(mesh_sizes)
    while keep and group is not None and not group_shards_align(group, mesh_sizes[:keep]):
        keep -= 1
    return keep


def _has_shard(placements: Placements) -> bool:
    return any(isinstance(p, Shard) for p in placements)


def _view_sharding(
    call: OpCall, dim_map: DimMap, *, local_op=None, local_args: tuple | None = None, sized: bool = False
) -> Sharding:
    """Sharding of a view of input 0 (a second input, view_as's `other`, only gives a shape).

    `sized`: the local call takes LOCAL_SHAPE as its size arg 1. When no local shape differs from
    the global one, the global call runs as is.
    """
    spec = call.specs[0]
    required, output = propagate(dim_map, spec.placements, spec.mesh.shape)
    inputs = (required,) + (None,) * (len(call.specs) - 1)  # view_as(other): `other` gives only a shape
    if not _has_shard(output) and not any(_has_shard(s.placements) for s in call.specs[1:]):
        # every local shape is the global one: the global call works as is
        return Sharding(inputs, (output,))
    if sized:
        local_args = (call.args[0], LOCAL_SHAPE) if local_args is None else local_args
    return Sharding(inputs, (output,), local_op=local_op, local_args=local_args)


def _meta_output(call: OpCall):
    """The op run on a meta tensor of the input's global shape (exact sizes, output count)."""

    def meta(a):
        if not isinstance(a, DTensorSpec):
            return a
        return torch.empty_strided(a.shape, a.stride, dtype=a.dtype, device="meta")

    return call.op(*map(meta, call.args), **call.kwargs)


# --------------------------------------------------------------------------------------------------
# view ops
# --------------------------------------------------------------------------------------------------


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def view_rule(call: OpCall) -> Sharding:
    """view/reshape: S(d) follows d through `view_groups`; sizes become the local shape."""
    spec = call.specs[0]
    return _view_sharding(call, view_groups(spec.shape, call.args[1]), sized=True)


# Composites (flatten, view_as, movedim, expand_as, chunk, narrow, ...) reach the dispatcher only
# under torch.inference_mode; with autograd on they decompose into the ops above.
@register(aten._reshape_alias.default, aten.flatten.using_ints, aten.unflatten.int, aten.view_as, aten.reshape_as)
def view_like_rule(call: OpCall) -> Sharding:
    """Ops that are a view to some shape: run as `view(local shape)` on the shard."""
    spec = call.specs[0]
    out_shape = _meta_output(call).shape
    local_op = aten.reshape.default if call.op is aten.reshape_as.default else aten.view.default
    return _view_sharding(call, view_groups(spec.shape, out_shape), local_op=local_op, sized=True)


@register(aten.transpose.int, aten.swapaxes.default, aten.swapdims.default)
def transpose_rule(call: OpCall) -> Sharding:
    """S(d0) <-> S(d1): dims swap, shards follow."""
    return _view_sharding(call, dim_transpose(call.specs[0].ndim, call.args[1], call.args[2]))


@register(aten.permute.default)
def permute_rule(call: OpCall) -> Sharding:
    """S(dims[k]) -> S(k)."""
    return _view_sharding(call, dim_permute(call.specs[0].ndim, call.args[1]))


@register(aten.movedim.int, aten.movedim.intlist)
def movedim_rule(call: OpCall) -> Sharding:
    """movedim(source, destination): a permute; the local call is unchanged."""
    ndim = call.specs[0].ndim
    src, dst = ([a] if isinstance(a, int) else list(a) for a in call.args[1:3])
    order: list[int | None] = [None] * ndim
    for s, d in zip(src, dst):
        order[d % ndim] = s % ndim
    rest = iter(i for i in range(ndim) if i not in {s % ndim for s in src})
    return _view_sharding(call, dim_permute(ndim, [o if o is not None else next(rest) for o in order]))


@register(aten.t.default)
def t_rule(call: OpCall) -> Sharding:
    """t() of a tensor of at most 2 dims reverses them."""
    ndim = call.specs[0].ndim
    return _view_sharding(call, dim_permute(ndim, range(ndim)[::-1]))


@register(aten.unsqueeze.default)
def unsqueeze_rule(call: OpCall) -> Sharding:
    """S(d) -> S(d + 1) for d >= dim."""
    return _view_sharding(call, dim_unsqueeze(call.specs[0].ndim, call.args[1]))


@register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def squeeze_rule(call: OpCall) -> Sharding:
    """Drop the globally size-1 target dims (a sharded one is gathered: only rank 0 holds its element).

    Runs as `squeeze.dims(those dims)` locally: a shard of local size 1 must not be squeezed.
    """
    spec = call.specs[0]
    dims = None if call.op is aten.squeeze.default else call.args[1]
    dropped = squeezed_dims(spec.shape, (dims,) if isinstance(dims, int) else dims)
    dim_map = tuple(InputDim(i) for i in range(spec.ndim) if i not in dropped)
    return _view_sharding(call, dim_map, local_op=aten.squeeze.dims, local_args=(call.args[0], dropped))


@register(aten.expand.default, aten.expand_as.default)
def expand_rule(call: OpCall) -> Sharding:
    """Kept dims keep their shards; a broadcast size-1 dim must be whole (its shard is 1 or 0 long)."""
    spec, sizes = call.specs[0], call.args[1]
    sizes = sizes.shape if isinstance(sizes, DTensorSpec) else sizes
    return _view_sharding(call, dim_expand(spec.shape, sizes), local_op=aten.expand.default, sized=True)


def _complex_partials(placements: Placements) -> Placements:
    """Complex numbers have no order: P(max)/P(min) cannot cross view_as_complex/real."""
    return tuple(Replicate() if isinstance(p, Partial) and p.reduce_op in ("max", "min") else p for p in placements)


@register(aten.view_as_complex.default, aten.view_as_real.default)
def complex_view_rule(call: OpCall) -> Sharding:
    """(..., D, 2) real <-> (..., D) complex: other shards stay; the pair dim must be whole."""
    spec = call.specs[0]
    if call.op is aten.view_as_complex.default:
        dim_map: DimMap = tuple(InputDim(i) for i in range(spec.ndim - 1))
    else:
        dim_map = tuple(InputDim(i) for i in range(spec.ndim)) + (NewDim(2),)
    required, output = propagate(dim_map, _complex_partials(spec.placements), spec.mesh.shape)
    return Sharding((required,), (output,))


MATERIALIZED = {aten._conj.default: aten.conj_physical.default, aten._neg_view.default: aten.neg.default}


@register(*MATERIALIZED)
def lazy_bit_rule(call: OpCall) -> Sharding:
    """conj/neg bit views (`freqs.conj()` in complex mul's backward): every placement stays.

    Run as conj_physical/neg on the shard: ops inside __torch_dispatch__ ignore a local tensor's
    conj/neg bit and our wrapper does not carry it, so a lazy local bit would be silently dropped.
    """
    placements = _complex_partials(call.specs[0].placements)
    return Sharding((placements,), (placements,), local_op=MATERIALIZED[call.op], local_args=(call.args[0],))


@register(aten.as_strided.default)
def as_strided_rule(call: OpCall) -> Sharding:
    """Arbitrary strides address the whole storage: only unsharded inputs run locally.

    Partial stays Partial (each output element is one input element). Every Shard is gathered;
    keeping one would need a proof that the strides preserve the sharded dim.
    """
    placements = tuple(Replicate() if isinstance(p, Shard) else p for p in call.specs[0].placements)
    return Sharding((placements,), (placements,))


# --------------------------------------------------------------------------------------------------
# selection ops: split, chunk, unbind, narrow, slice, select (and backward)
# --------------------------------------------------------------------------------------------------


def select_placements(
    placements: Placements, dim: int, *, drops_dim: bool, whole: bool = False
) -> tuple[Placements, Placements]:
    """(required, output) for taking part of dim `dim`.

    S(dim) -> R first (a rank's shard holds only part of the selection) unless `whole` (the
    selection is the full dim); S(d) -> S(d - 1) for d > dim when the dim is dropped; P stays.
    """
    required, output = list(placements), list(placements)
    for m, p in enumerate(placements):
        if isinstance(p, Shard) and p.dim == dim and not whole:
            required[m] = output[m] = Replicate()
        elif isinstance(p, Shard) and drops_dim and p.dim > dim:
            output[m] = Shard(p.dim - 1)
    return tuple(required), tuple(output)


def _arg(call: OpCall, index: int, default):
    return call.args[index] if len(call.args) > index else default


@register(
    aten.split.Tensor,
    aten.split.sizes,
    aten.split_with_sizes.default,
    aten.unsafe_split.Tensor,
    aten.unsafe_split_with_sizes.default,
    aten.chunk.default,
    aten.unbind.int,
)
def split_rule(call: OpCall) -> Sharding:
    """Every piece of dim `dim`: along a sharded dim gather first; otherwise shards stay."""
    spec = call.specs[0]
    dim = call.kwargs.get("dim", _arg(call, 1 if call.op is aten.unbind.int else 2, 0)) % spec.ndim
    required, output = select_placements(spec.placements, dim, drops_dim=call.op is aten.unbind.int)
    return Sharding((required,), (output,) * len(_meta_output(call)))


def _is_whole(size: int, start: int | None, end: int | None, step: int) -> bool:
    return start in (None, 0) and (end is None or end >= size) and step == 1


@register(aten.select.int, aten.slice.Tensor, aten.narrow.default)
def select_rule(call: OpCall) -> Sharding:
    """x[i], x[a:b:s], narrow along `dim`; a slice covering the whole dim (x[:, :]) keeps its shard."""
    spec = call.specs[0]
    dim = _arg(call, 1, 0) % spec.ndim
    if call.op is aten.slice.Tensor:
        whole = _is_whole(spec.shape[dim], _arg(call, 2, None), _arg(call, 3, None), _arg(call, 4, 1))
    elif call.op is aten.narrow.default:
        whole = _is_whole(spec.shape[dim], call.args[2], call.args[2] + call.args[3], 1)
    else:
        whole = False
    required, output = select_placements(spec.placements, dim, drops_dim=call.op is aten.select.int, whole=whole)
    return Sharding((required,), (output,))


@register(aten.slice_backward.default)
def slice_backward_rule(call: OpCall) -> Sharding:
    """zeros(input_sizes) with grad written at [start:end:step] of `dim`.

    S(d) stays for d != dim (the zeros are laid out like the grad); S(dim) gathers unless the slice
    was the whole dim. P stays: zeros are zero under every reduce op.
    """
    spec = call.specs[0]
    dim = call.args[2] % spec.ndim
    whole = _is_whole(call.args[1][dim], call.args[3], call.args[4], call.args[5])
    required, output = select_placements(spec.placements, dim, drops_dim=False, whole=whole)
    return _sized(call, required, output)


@register(aten.select_backward.default)
def select_backward_rule(call: OpCall) -> Sharding:
    """zeros(input_sizes) with grad at `index` of the re-inserted `dim`: S(d) -> S(d + 1) for d >= dim."""
    spec = call.specs[0]
    dim = call.args[2] % (spec.ndim + 1)
    output = tuple(Shard(p.dim + 1) if isinstance(p, Shard) and p.dim >= dim else p for p in spec.placements)
    return _sized(call, spec.placements, output)


def _sized(call: OpCall, required: Placements, output: Placements) -> Sharding:
    """A tensor-creating backward op whose arg 1 is the (global) output size: make it local."""
    if not _has_shard(output):
        return Sharding((required,), (output,))
    local_args = (call.args[0], LOCAL_SHAPE, *call.args[2:])
    return Sharding((required,), (output,), local_args=local_args)
