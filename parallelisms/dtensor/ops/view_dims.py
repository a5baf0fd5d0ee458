"""Dim maps of the view family: where each output dim of a view comes from, and where shards go.

An op becomes a *dim map*, one DimSpec per output dim saying where that dim comes from (an input
dim, a piece of a flattened group of input dims, a new or broadcast dim). `propagate` then decides,
per mesh dim in mesh order, where a Shard(d) or _StridedShard(d) input goes:

    S(d) -> S(k)         output dim k is input dim d whole (maybe moved), or d is the outermost dim of
                         a group whose torch.chunk shards line up with those of output dim k;
    S(d) -> _S(k, sf)    d is a later dim of a flatten into k (`(B, H) -> (B * H)` with H sharded:
                         sf = B), as torch's view rule, when the rank's pieces line up;
    _S(d, sf) -> S(j)    the flatten undone: d split into pieces whose outer ones multiply to sf
                         (`_S(j, sf / outer)` when they divide it);
    S/_S(d) -> R         otherwise (the input is gathered on that mesh dim first).
    P(op) -> P(op) always: a view moves values without changing them.

Shard checks use the global sizes and every rank's chunk (nested mesh dims included), so the result
is the same on every rank. Everything here is pure shape and placement math: no ops, no registry.
The rules that use it live in views.py.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..placements import (
    Placement,
    Replicate,
    Shard,
    _StridedShard,
    chunk_sizes,
    local_shape_and_offset,
    nested_chunk_sizes,
    splits_later_pieces,
    strided_pieces,
)
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


def group_shards_align(group: Group, mesh_sizes: Sequence[int]) -> bool:
    """Does sharding the group's outermost input dim shard its first output dim the same way?

    Rank r's shard covers flat elements [offset_r * inner_in, (offset_r + chunk_r) * inner_in) of
    the group; it is the torch.chunk shard of the output dim iff every shard length matches:
      (8, 6) -> (48,) on 4 ranks: [2, 2, 2, 2] * 6 == [12, 12, 12, 12]   -> S(0) stays S(0)
      (5, 6) -> (30,) on 2 ranks: [3, 2] * 6 = [18, 12] != [15, 15]      -> gather first
    """
    inner_in = math.prod(group.in_sizes[1:])
    inner_out = math.prod(group.out_sizes[1:])
    shards_in = [c * inner_in for c in nested_chunk_sizes(group.in_sizes[0], mesh_sizes)]
    return shards_in == [c * inner_out for c in nested_chunk_sizes(group.out_sizes[0], mesh_sizes)]


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

    One mesh dim at a time, in mesh order (the order its split applies, see placements.py):

      whole dim (maybe moved)            S(d) -> S(k), _S(d, sf) -> _S(k, sf)
      dim of a flatten (one output k)    the rank's local pieces of the flattened dims, as they stand at
                                         that mesh dim, must chunk the same way as the flat dim: the
                                         first dim -> S(k); a later one (or a strided first one) ->
                                         _S(k, sf), sf = the local size of the dims before it times
                                         its own split factor (torch's view rule)
      split of a dim (one input d)       the rank's local piece of d, as the outputs stand at that mesh
                                         dim, is cut into sf pieces (1 for a Shard): S(j) on the output j
                                         whose outer local sizes multiply to sf (the flatten undone,
                                         `_S(0, B)` of `(B * H)` -> `S(1)` of `(B, H)`), `_S(j, sf / outer)`
                                         when they divide it, if its chunks line up
      outermost dim of another group     S(d) -> S(first output) when torch.chunk shards line up

    Everything else is gathered first (Replicate), and so is every inner mesh dim on a dim an outer
    one gathered. FSDP's strided dims (placements.splits_later_pieces) only cross whole dims.
    """
    carried = carriers(dim_map)
    flattened = flatten_members(dim_map)
    splits = {spec.dims[0]: spec for spec in dim_map if isinstance(spec, Group) and len(spec.dims) == 1}
    splits = {d: g for d, g in splits.items() if len(g.out_sizes) > 1}
    keep = _plain_keeps(dim_map, placements, mesh_shape)
    required, output = list(placements), list(placements)
    gathered: set[int] = set()  # tensor dims an outer mesh dim had to gather
    for m, p in enumerate(placements):
        if not isinstance(p, (Shard, _StridedShard)):
            continue
        d = p.dim
        k, group = carried.get(d, (None, None))
        out: Placement | None = None
        if d in gathered:
            out = None
        elif k is not None and group is None:
            out = Shard(k) if isinstance(p, Shard) else _StridedShard(k, p.split_factor)
        elif splits_later_pieces(placements, mesh_shape, m):
            required[m] = output[m] = Replicate()  # FSDP's strided dim: its plain dims stay as they are
            continue
        elif d in flattened:
            out = _flattened_shard(flattened[d], d, m, p, placements, required, mesh_shape)
        elif d in splits:
            out = _split_shard(dim_map, splits[d], m, placements, output, mesh_shape)
        elif isinstance(p, Shard) and k is not None and m in keep:
            out = Shard(k)
        if out is None:
            required[m] = output[m] = Replicate()
            gathered.add(d)
        else:
            output[m] = out
    return tuple(required), tuple(output)


def strict_view_error(dim_map: DimMap, placements: Placements, mesh_shape: Sequence[int]) -> str | None:
    """torch's refusal of a `view` (not a `reshape`) that would have to gather a plain Shard first, or None.

    As torch's view rule (`strict_view`): a Shard on a flattened dim other than the group's last whose size
    the mesh dim does not divide ("Cannot flatten"), or a Shard of a split dim whose first piece it does not
    divide ("Cannot unflatten"). Both need a redistribution that a view, which never copies, cannot make.
    """

    def plain_shard(d: int) -> int | None:
        return next((m for m, p in enumerate(placements) if isinstance(p, Shard) and p.dim == d), None)

    for spec in dim_map:
        if not isinstance(spec, Group) or spec.index != 0:
            continue
        sharded = []
        for pos, (d, size) in enumerate(zip(spec.dims, spec.in_sizes)):
            m = plain_shard(d)
            if m is None:
                continue
            if pos < len(spec.dims) - 1 and size % mesh_shape[m]:
                return (
                    f"Cannot flatten unevenly sharded tensor: dimension {d} (size {size}) is not evenly divisible "
                    f"by mesh dimension {m} (size {mesh_shape[m]}). Please redistribute the tensor before this "
                    f"operation."
                )
            sharded.append(d)
        m = plain_shard(sharded[0] if sharded else spec.dims[0])
        if len(spec.out_sizes) > 1 and m is not None and spec.out_sizes[0] % mesh_shape[m]:
            return (
                f"Cannot unflatten unevenly sharded tensor: output dimension 0 (size {spec.out_sizes[0]}) is not "
                f"evenly divisible by mesh dimension {m} (size {mesh_shape[m]}). Please redistribute the tensor "
                f"before this operation."
            )
    return None


def flatten_members(dim_map: DimMap) -> dict[int, tuple[int, Group]]:
    """input dim -> (output dim, group) for every input dim of a group with one output (a flatten)."""
    return {
        d: (k, spec)
        for k, spec in enumerate(dim_map)
        if isinstance(spec, Group) and len(spec.out_sizes) == 1 and len(spec.dims) > 1
        for d in spec.dims
    }


def _plain_keeps(dim_map: DimMap, placements: Placements, mesh_shape: Sequence[int]) -> set[int]:
    """Mesh dims whose Shard of the outermost dim of a group of several input and output dims may stay: the
    longest outer run of the mesh dims sharding that dim whose nested chunks align (dropping an
    inner split never changes what the outer ones hold). A dim some strided placement also splits
    keeps nothing."""
    out: set[int] = set()
    for d, (_, group) in carriers(dim_map).items():
        mesh_dims = [m for m, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard)) and p.dim == d]
        if group is None or len(group.out_sizes) == 1 or len(group.dims) == 1 or not mesh_dims:
            continue  # whole dims, flattens and splits are decided per mesh dim (propagate)
        if any(isinstance(placements[m], _StridedShard) for m in mesh_dims):
            continue
        out.update(mesh_dims[: aligned_prefix(group, [mesh_shape[m] for m in mesh_dims])])
    return out


def _flattened_shard(
    target: tuple[int, Group],
    d: int,
    mesh_dim: int,
    p: Shard | _StridedShard,
    placements: Placements,
    required: Sequence[Placement],
    mesh_shape: Sequence[int],
) -> Placement | None:
    """Where mesh dim `mesh_dim`'s split of input dim `d` goes when `d` is flattened with others.

    When that mesh dim splits, every rank holds its local pieces of the group's dims (mesh dims
    before it applied, as `required` keeps them). Cutting `d`'s local size `l` into the placement's
    `q` pieces (1 for a Shard), the flat dim holds `b = prod(sizes before d)` blocks of `q` pieces of
    `(l / q) * a` elements (`a` = prod(sizes after d)); chunking each piece of `d` over the mesh dim
    is chunking each flat piece iff torch.chunk of `(l / q) * a` is that of `l / q` times `a`. Then the
    output is `_S(k, b * q)` (torch's split factor; `S(k)` for a Shard of the first dim), provided
    `b` is the same on every rank.
    """
    k, group = target
    n, pos = mesh_shape[mesh_dim], group.dims.index(d)
    q = strided_pieces(placements, mesh_shape, mesh_dim)
    local_group = tuple(_on_dims(r, group.dims) for r in required)  # the group alone, its dims numbered 0..
    befores: set[int] = set()
    for coordinate in itertools.product(*(range(s) for s in mesh_shape[:mesh_dim])):
        coord = (*coordinate, *(0,) * (len(mesh_shape) - mesh_dim))
        sizes, _ = local_shape_and_offset(group.in_sizes, mesh_shape, coord, local_group, mesh_dims=range(mesh_dim))
        if not _pieces_align(sizes[pos], q, math.prod(sizes[pos + 1 :]), n):
            return None
        befores.add(math.prod(sizes[:pos]))
    if len(befores) != 1:
        return None  # the ranks hold different numbers of blocks: no one split factor
    if pos == 0 and isinstance(p, Shard):
        return Shard(k)
    return _StridedShard(k, befores.pop() * q)


def _on_dims(p: Placement, dims: Sequence[int]) -> Placement:
    """`p` on the tensor of `dims` alone (its dim i is dims[i]); a shard of any other dim is Replicate."""
    if isinstance(p, Shard) and p.dim in dims:
        return Shard(list(dims).index(p.dim))
    if isinstance(p, _StridedShard) and p.dim in dims:
        return _StridedShard(list(dims).index(p.dim), p.split_factor)
    return Replicate() if isinstance(p, (Shard, _StridedShard)) else p


def _split_shard(
    dim_map: DimMap,
    group: Group,
    mesh_dim: int,
    placements: Placements,
    output: Sequence[Placement],
    mesh_shape: Sequence[int],
) -> Placement | None:
    """Where mesh dim `mesh_dim`'s split of input dim `d` goes when `d` is split into `group.out_sizes`.

    When that mesh dim splits, every rank's piece of `d` is the flattening of its local output sizes
    `l` (mesh dims before it applied, as `output` places them). The placement cuts it into `q` pieces
    (1 for a Shard) and chunks each: that is output j chunked in `q / prod(l[:j])` pieces (a Shard when
    that is 1) when prod(l[:j]) divides q, is the same on every rank, and torch.chunk of a piece of
    l[j] times the sizes inside it is that of the piece times them.
    """
    n, q = mesh_shape[mesh_dim], strided_pieces(placements, mesh_shape, mesh_dim)
    pieces_at = [k for k, spec in enumerate(dim_map) if isinstance(spec, Group) and spec.dims == group.dims]
    local_group = tuple(_on_dims(o, pieces_at) for o in output)  # the output pieces alone
    locals_ = [
        local_shape_and_offset(
            group.out_sizes,
            mesh_shape,
            (*coordinate, *(0,) * (len(mesh_shape) - mesh_dim)),
            local_group,
            mesh_dims=range(mesh_dim),
        )[0]
        for coordinate in itertools.product(*(range(s) for s in mesh_shape[:mesh_dim]))
    ]
    for j in range(len(group.out_sizes)):
        outers = {math.prod(sizes[:j]) for sizes in locals_}
        if len(outers) != 1 or q % next(iter(outers)):
            continue
        pieces = q // outers.pop()
        if all(_pieces_align(sizes[j], pieces, math.prod(sizes[j + 1 :]), n) for sizes in locals_):
            return Shard(pieces_at[j]) if pieces == 1 else _StridedShard(pieces_at[j], pieces)
    return None


def _pieces_align(size: int, pieces: int, inner: int, n: int) -> bool:
    """Cutting `size` rows of `inner` elements into `pieces` and chunking each piece over `n` ranks
    chunks whole rows: torch.chunk of a piece's elements is that of its rows, times `inner`."""
    if size % pieces:
        return False
    rows = size // pieces
    return chunk_sizes(rows * inner, n) == [c * inner for c in chunk_sizes(rows, n)]


def aligned_prefix(group: Group | None, mesh_sizes: list[int]) -> int:
    """How many of the (outer to inner) mesh dims sharding a dim can keep sharding its carrier."""
    keep = len(mesh_sizes)
    while keep and group is not None and not group_shards_align(group, mesh_sizes[:keep]):
        keep -= 1
    return keep
