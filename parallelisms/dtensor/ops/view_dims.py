"""Dim maps of the view family: where each output dim of a view comes from, and where shards go.

An op becomes a *dim map*, one DimSpec per output dim saying where that dim comes from (an input
dim, a piece of a flattened group of input dims, a new or broadcast dim). `propagate` then decides,
per mesh dim, where a Shard(d) input goes:

    S(d) -> S(k)   when output dim k is input dim d whole (maybe moved), or d is the outermost dim
                   of a reshaped group and every rank's torch.chunk shard of d, times the inner
                   sizes, is exactly its torch.chunk shard of output dim k (times its inner sizes);
    S(d) -> R      otherwise (the input is gathered on that mesh dim first).
    P(op) -> P(op) always: a view moves values without changing them.

Shard checks use the global sizes and every rank's chunk (nested mesh dims included), so the result
is the same on every rank. Everything here is pure shape and placement math: no ops, no registry.
The rules that use it live in views.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..placements import Replicate, Shard, chunk_sizes
from .registry import Placements

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
        all_dims = tuple(range(len(in_shape)))
        return tuple(Group(all_dims, in_shape, out_shape, k) for k in range(len(out_shape)))
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
            if k is not None and i < keep:  # keep is 0 when no output dim carries d
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
