"""Rules for the view family: view/reshape, flatten/unflatten, transpose/permute/t, squeeze/unsqueeze,
expand, view_as_complex/real, split/chunk/unbind/narrow/slice/select (and their backward ops),
as_strided.

Each view op becomes a dim map (view_dims.py: one DimSpec per output dim) and `propagate` decides
where each Shard goes: it follows its dim when the dim survives whole, or when it is the outermost
dim of a reshaped group whose torch.chunk shards line up; a later dim of a flatten becomes a
`_StridedShard` of the flat dim (torch's rule: `(B, H, T, D) -> (B * H, T, D)` with heads sharded is
`_S(0, B)`, which bmm runs on) and splitting it back gives the Shard again; otherwise it is gathered
first. The movement and reshape rules here read strided placements (`register(..., strided=True)`);
the selection rules do not, and planning gathers strided dims before them. Partial always stays
Partial: a view moves values without changing them.

Size args of the local call (view sizes, expand sizes, backward input_sizes) are global; rules pass
LOCAL_SHAPE instead so the op stays a view of the local shard.
"""

from __future__ import annotations

import torch
from torch.ops import aten

from ..errors import ShardingError
from ..placements import Partial, Replicate, Shard, _StridedShard
from ..spec import DTensorSpec
from .registry import LOCAL_SHAPE, OpCall, Placements, Sharding, register
from .view_dims import (
    DimMap,
    InputDim,
    NewDim,
    dim_expand,
    dim_permute,
    dim_transpose,
    dim_unsqueeze,
    propagate,
    squeezed_dims,
    strict_view_error,
    view_groups,
)


def _has_shard(placements: Placements) -> bool:
    return any(isinstance(p, (Shard, _StridedShard)) for p in placements)


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


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default, strided=True)
def view_rule(call: OpCall) -> Sharding:
    """view/reshape/view_copy: S(d) follows d through `view_groups`; sizes become the local shape. A view (not a
    reshape or a view_copy) that would gather an unevenly sharded dim raises as torch's (`strict_view_error`)."""
    spec = call.specs[0]
    dim_map = view_groups(spec.shape, call.args[1])
    strict = call.op in _STRICT_VIEWS and spec.shape.numel() > 0  # an empty tensor has nothing to redistribute
    if strict and (error := strict_view_error(dim_map, spec.placements, spec.mesh.shape)):
        raise RuntimeError(error)
    return _view_sharding(call, dim_map, sized=True)


_STRICT_VIEWS = (aten.view.default, aten._unsafe_view.default)


# Composites (flatten, view_as, movedim, expand_as, chunk, narrow, ...) reach the dispatcher only
# under torch.inference_mode; with autograd on they decompose into the ops above.
@register(
    aten._reshape_alias.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
    aten.view_as,
    aten.reshape_as,
    strided=True,
)
def view_like_rule(call: OpCall) -> Sharding:
    """Ops that are a view to some shape: run as `view(local shape)` on the shard."""
    spec = call.specs[0]
    out_shape = _meta_output(call).shape
    local_op = aten.reshape.default if call.op is aten.reshape_as.default else aten.view.default
    return _view_sharding(call, view_groups(spec.shape, out_shape), local_op=local_op, sized=True)


@register(aten.transpose.int, aten.swapaxes.default, aten.swapdims.default, strided=True)
def transpose_rule(call: OpCall) -> Sharding:
    """S(d0) <-> S(d1): dims swap, shards follow."""
    return _view_sharding(call, dim_transpose(call.specs[0].ndim, call.args[1], call.args[2]))


@register(aten.permute.default, strided=True)
def permute_rule(call: OpCall) -> Sharding:
    """S(dims[k]) -> S(k)."""
    return _view_sharding(call, dim_permute(call.specs[0].ndim, call.args[1]))


@register(aten.movedim.int, aten.movedim.intlist, strided=True)
def movedim_rule(call: OpCall) -> Sharding:
    """movedim(source, destination): a permute; the local call is unchanged."""
    ndim = call.specs[0].ndim
    src, dst = ([a] if isinstance(a, int) else list(a) for a in call.args[1:3])
    order: list[int | None] = [None] * ndim
    for s, d in zip(src, dst):
        order[d % ndim] = s % ndim
    rest = iter(i for i in range(ndim) if i not in {s % ndim for s in src})
    return _view_sharding(call, dim_permute(ndim, [o if o is not None else next(rest) for o in order]))


@register(aten.t.default, strided=True)
def t_rule(call: OpCall) -> Sharding:
    """t() of a tensor of at most 2 dims reverses them."""
    ndim = call.specs[0].ndim
    return _view_sharding(call, dim_permute(ndim, range(ndim)[::-1]))


@register(aten.unsqueeze.default, strided=True)
def unsqueeze_rule(call: OpCall) -> Sharding:
    """S(d) -> S(d + 1) for d >= dim."""
    return _view_sharding(call, dim_unsqueeze(call.specs[0].ndim, call.args[1]))


@register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, strided=True)
def squeeze_rule(call: OpCall) -> Sharding:
    """Drop the globally size-1 target dims (a sharded one is gathered: only rank 0 holds its element).

    Runs as `squeeze.dims(those dims)` locally: a shard of local size 1 must not be squeezed.
    """
    spec = call.specs[0]
    dims = None if call.op is aten.squeeze.default else call.args[1]
    dropped = squeezed_dims(spec.shape, (dims,) if isinstance(dims, int) else dims)
    dim_map = tuple(InputDim(i) for i in range(spec.ndim) if i not in dropped)
    return _view_sharding(call, dim_map, local_op=aten.squeeze.dims, local_args=(call.args[0], dropped))


@register(aten.expand.default, aten.expand_as.default, strided=True)
def expand_rule(call: OpCall) -> Sharding:
    """Kept dims keep their shards; a broadcast size-1 dim must be whole (its shard is 1 or 0 long)."""
    spec, sizes = call.specs[0], call.args[1]
    sizes = sizes.shape if isinstance(sizes, DTensorSpec) else sizes
    return _view_sharding(call, dim_expand(spec.shape, sizes), local_op=aten.expand.default, sized=True)


def _complex_partials(placements: Placements) -> Placements:
    """Complex numbers have no order: P(max)/P(min) cannot cross view_as_complex/real."""
    return tuple(Replicate() if isinstance(p, Partial) and p.reduce_op in ("max", "min") else p for p in placements)


@register(aten.view_as_complex.default, aten.view_as_real.default, strided=True)
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


@register(*MATERIALIZED, strided=True)
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

    The identity (the input's own size, strides and offset, as `x.as_strided(x.shape, x.stride())`)
    is an alias of the shard, as torch. Otherwise Partial stays Partial (each output element is one
    input element) and every Shard is gathered; keeping one would need a proof that the strides
    preserve the sharded dim.
    """
    spec = call.specs[0]
    size, stride, offset = call.bound["size"], call.bound["stride"], call.bound["storage_offset"]
    if tuple(size) == tuple(spec.shape) and tuple(stride) == spec.stride and offset in (None, 0):
        return Sharding((spec.placements,), (spec.placements,), local_op=aten.alias.default, local_args=(spec,))
    placements = tuple(Replicate() if isinstance(p, Shard) else p for p in spec.placements)
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
    """Every piece of dim `dim`: along a sharded dim gather first (not for unbind, as torch: its
    outputs are views, and a view cannot gather); otherwise shards stay."""
    spec = call.specs[0]
    dim = call.bound["dim"] % spec.ndim
    required, output = select_placements(spec.placements, dim, drops_dim=call.op is aten.unbind.int)
    if call.op is aten.unbind.int and required != spec.placements:
        raise ShardingError(
            f"unbind along dim {dim}, which placements {tuple(map(str, spec.placements))} shard: it cannot "
            f"be performed without redistribution, which a view op does not do; redistribute dim {dim} to "
            f"Replicate() first (x.redistribute(placements=...)) or unbind another dim"
        )
    return Sharding((required,), (output,) * len(_meta_output(call)))


def _is_whole(size: int, start: int | None, end: int | None, step: int) -> bool:
    return start in (None, 0) and (end is None or end >= size) and step == 1


@register(aten.select.int, aten.slice.Tensor, aten.narrow.default)
def select_rule(call: OpCall) -> Sharding:
    """x[i], x[a:b:s], narrow along `dim`; a slice covering the whole dim (x[:, :]) keeps its shard."""
    spec = call.specs[0]
    dim = call.bound["dim"] % spec.ndim
    if call.op is aten.slice.Tensor:
        whole = _is_whole(spec.shape[dim], call.bound["start"], call.bound["end"], call.bound["step"])
    elif call.op is aten.narrow.default:
        start = call.bound["start"]
        whole = _is_whole(spec.shape[dim], start, start + call.bound["length"], 1)
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
