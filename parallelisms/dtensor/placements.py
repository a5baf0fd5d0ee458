"""Placements (how a global tensor is laid out on one mesh dim) and the pure chunk math behind them.

`Shard(dim)` follows `torch.chunk`: a dim of size `n` split over `k` ranks gives chunks of
`ceil(n / k)` elements, so uneven shapes leave a short last shard and possibly empty trailing ones.
Several mesh dims may shard the same tensor dim; they nest in mesh order (the first mesh dim splits
the whole dim, the next splits each piece). `_StridedShard` chunks `split_factor` pieces of a dim
at once (a view's flattened dim), or splits the pieces the later mesh dims made (FSDP sharding a
TP-sharded parameter); see its doc. Nothing here touches a process group.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, fields

import torch

REDUCE_OPS = ("sum", "avg", "prod", "min", "max")  # plus "norm<p>" (p-norm partials, see norm_order)


class Placement:
    """Base of Shard / Replicate / Partial; mirrors torch's DTensor Placement."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False

    def __fx_repr__(self) -> tuple[str, dict[str, type]]:
        """A constructor call that rebuilds this placement, and the names it needs: torch.compile writes
        placements into its graphs as constants (traceable.py)."""
        cls = type(self)
        args = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))  # type: ignore[arg-type]
        return f"{cls.__name__}({args})", {cls.__name__: cls}


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """The tensor is split along `dim` with `torch.chunk` semantics across the mesh dim."""

    dim: int

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __str__(self) -> str:
        return f"S({self.dim})"

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    @staticmethod
    def local_shard_size_and_offset(size: int, num_chunks: int, index: int) -> tuple[int, int]:
        return chunk_size_and_offset(size, num_chunks, index)

    def _split_tensor(
        self, tensor: torch.Tensor, num_chunks: int, *, with_padding: bool = True, contiguous: bool = True
    ) -> tuple[list[torch.Tensor], list[int]]:
        """Every rank's shard of `tensor` (torch.chunk, empty trailing shards filled in) and, with
        `with_padding`, each padded at its end to the first shard's length with the pad sizes.

        Named as torch's Shard helper, which ported code and torch's tests call directly.
        """
        import torch.nn.functional as F

        full = tensor.size(self.dim)
        shards, pads = [], []
        for index in range(num_chunks):
            length, offset = chunk_size_and_offset(full, num_chunks, index)
            shard = tensor.narrow(self.dim, offset, length)
            if with_padding:
                pad = (full + num_chunks - 1) // num_chunks - length
                if pad:
                    widths = [0, 0] * (tensor.ndim - 1 - self.dim) + [0, pad]
                    shard = F.pad(shard, widths)
                pads.append(pad)
            shards.append(shard.contiguous() if contiguous else shard)
        return shards, pads


@dataclass(frozen=True, slots=True)
class _StridedShard(Placement):
    """`dim` cut into `split_factor` pieces, each piece chunked over this mesh dim; rank r holds
    chunk r of every piece, concatenated in piece order (torch's `_StridedShard`, same name, arguments
    and layout). Two programs make one:

    * A view that flattens a sharded dim into the dims before it. `(B, H)` with H on `S(1)` viewed
      as `(B * H,)`: every rank holds its heads of each of the B rows, so the flat dim is
      `_StridedShard(0, split_factor=B)`. Batched matmul runs on it as it is (batch entries are
      independent) and the view back to `(B, H)` is `Shard(1)` again (views.py). This is the
      *interleaved* form: it splits the dim as it stands at its mesh dim, in mesh order.
    * FSDP over TP. On a (dp, tp) mesh, TP's ColwiseParallel gives a weight `Shard(0)` on tp; FSDP
      then chunks each TP shard along dim 0 over dp. Rank (d, t) holds chunk d of chunk t of the
      rows: mesh-order `(Shard(0), Shard(0))` would mean chunk t of chunk d, other rows.
      `(_StridedShard(0, split_factor=2), Shard(0))` says so. When the later mesh dims that
      `Shard(dim)` multiply to `split_factor`, this mesh dim *splits their pieces* (it is applied
      after them, `application_order`): the same layout as the interleaved reading whenever the dim
      divides into `split_factor` pieces, and exact (one contiguous range of rows at an exact
      offset, `torch.chunk` twice) when it does not, so a checkpoint can address uneven shards.

    Only the view family and the matmul family read strided placements (their rules keep them on
    batch and row dims); every other op reaches planning.py, where ops that keep every element at
    its index (pointwise, fills, copies, full reductions) run on the shards as they are and the rest
    gather this mesh dim first, so results are always those of the global tensor.
    """

    dim: int
    split_factor: int

    def is_shard(self, dim: int | None = None) -> bool:
        return False  # as torch's: not a plain Shard (`shards` asks whether a placement splits a dim at all)

    def __str__(self) -> str:
        return f"_S({self.dim}, {self.split_factor})"

    def __repr__(self) -> str:
        return f"_StridedShard(dim={self.dim}, sf={self.split_factor})"


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every rank of the mesh dim holds the whole (current) tensor."""

    def is_replicate(self) -> bool:
        return True

    def __str__(self) -> str:
        return "R"

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Every rank holds a partial value; the global tensor is `reduce_op` over the mesh dim."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op == "product":  # c10d's name (torch accepts it); one spelling inside
            object.__setattr__(self, "reduce_op", "prod")
        if self.reduce_op not in REDUCE_OPS and norm_order(self.reduce_op) is None:
            raise ValueError(
                f"Partial(reduce_op={self.reduce_op!r}) is not supported; use one of {REDUCE_OPS} ('product' "
                f"is 'prod') "
                f"or 'norm<p>' (e.g. 'norm2') for a finite p > 0"
            )

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.reduce_op

    def __str__(self) -> str:
        return f"P({self.reduce_op})"

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"


def norm_order(reduce_op: str) -> float | None:
    """p of a p-norm Partial: "norm2" -> 2.0; None for every other reduce op.

    P(norm<p>) holds per-rank p-norms of disjoint pieces; the global value is (sum_r x_r**p)**(1/p),
    reduced as all_reduce(sum) of x**p followed by the p-th root (torch's _NormPartial).
    """
    if not reduce_op.startswith("norm"):
        return None
    try:
        p = float(reduce_op[len("norm") :])
    except ValueError:
        return None
    return p if 0 < p < float("inf") else None


def norm_reduce_op(p: float) -> str:
    """The reduce op name of a p-norm Partial: 2 -> "norm2", 1.5 -> "norm1.5"."""
    return f"norm{float(p):g}"


def partition_divisor(reduce_op: str, num_chunks: int) -> float:
    """R -> P: each rank keeps value / divisor so that reducing the pieces gives the value back.

    ("prod" has no divisor: the first rank keeps the value and the others hold ones, see
    redistribute.partition_value.)"""
    if reduce_op == "sum":
        return float(num_chunks)
    p = norm_order(reduce_op)
    return float(num_chunks) ** (1.0 / p) if p is not None else 1.0  # avg/min/max of n copies is the copy


# --------------------------------------------------------------------------------------------------
# pure chunk math
# --------------------------------------------------------------------------------------------------


def chunk_sizes(size: int, num_chunks: int) -> list[int]:
    """Sizes of `torch.chunk(t, num_chunks)` pieces along a dim of `size`, padded with empty ones."""
    full = -(-size // num_chunks) if size else 0
    return [max(0, min(full, size - i * full)) for i in range(num_chunks)]


def chunk_size_and_offset(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """(length, start) of chunk `index` of `size` split like `torch.chunk` into `num_chunks`."""
    full = -(-size // num_chunks) if size else 0
    start = min(size, index * full)
    return max(0, min(full, size - start)), start


def nested_chunk_sizes(size: int, splits: Sequence[int]) -> list[int]:
    """Shard lengths of a dim of `size` split by nested mesh dims of sizes `splits` (torch.chunk
    within torch.chunk), in global order: (5, [2, 2]) -> [2, 1, 1, 1]."""
    sizes = [size]
    for n in splits:
        sizes = [c for s in sizes for c in chunk_sizes(s, n)]
    return sizes


def local_chunk(whole: torch.Tensor, dim: int, n: int, index: int) -> torch.Tensor:
    """Chunk `index` of `n` of `whole` along `dim` (torch.chunk, empty past the end), as a new
    contiguous tensor: a shard must not keep the whole tensor alive."""
    size, start = chunk_size_and_offset(whole.shape[dim], n, index)
    return whole.narrow(dim, start, size).clone(memory_format=torch.contiguous_format)


def interleaved_chunk(whole: torch.Tensor, dim: int, pieces: int, n: int, index: int) -> torch.Tensor:
    """Replicate -> interleaved `_StridedShard`: chunk `index` of each of the `pieces` pieces of
    `dim`, concatenated (torch's `_StridedShard._split_tensor`, one rank's shard)."""
    out, start = [], 0
    for piece in chunk_sizes(whole.shape[dim], pieces):
        size, at = chunk_size_and_offset(piece, n, index)
        out.append(whole.narrow(dim, start + at, size))
        start += piece
    return torch.cat(out, dim=dim).contiguous()


def normalize_placements(
    placements: Sequence[Placement], ndim: int, mesh_ndim: int, mesh_shape: Sequence[int] | None = None
) -> tuple[Placement, ...]:
    """Validate placements for a tensor of rank `ndim` on a mesh of `mesh_ndim` dims.

    Negative shard dims are normalized; a wrong count, a shard dim out of range or mixed Partial
    reduce ops raise ValueError; so does a `_StridedShard` whose split_factor is not a positive int.
    (`mesh_shape` is accepted for the callers that pass it: every split_factor >= 1 is a layout, as
    in torch.)
    """
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"placements {list(map(str, placements))} must have the same length as the mesh's ndim: "
            f"{len(placements)} placements for a {mesh_ndim}-D mesh; give exactly one placement per mesh dim"
        )
    out: list[Placement] = []
    reduce_ops: set[str] = set()
    for p in placements:
        if isinstance(p, Shard):
            dim = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= dim < ndim:
                raise ValueError(f"Shard(dim={p.dim}) is out of range for a {ndim}-D tensor")
            out.append(p if dim == p.dim else Shard(dim))
        elif isinstance(p, _StridedShard):
            dim = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= dim < ndim:
                raise ValueError(f"{p!r} is out of range for a {ndim}-D tensor")
            out.append(p if dim == p.dim else _StridedShard(dim, p.split_factor))
        elif isinstance(p, Partial):
            reduce_ops.add(p.reduce_op)
            out.append(p)
        elif isinstance(p, Replicate):
            out.append(p)
        else:
            raise TypeError(f"placements must be Shard, Replicate or Partial, got {p!r}")
    _check_split_factors(out)
    if len(reduce_ops) > 1:
        raise ValueError(
            f"placements {[str(p) for p in out]} mix Partial reduce ops {sorted(reduce_ops)}; "
            f"reduce them to Replicate first, one op per tensor"
        )
    return tuple(out)


def _check_split_factors(placements: Sequence[Placement]) -> None:
    for m, p in enumerate(placements):
        if isinstance(p, _StridedShard) and (not isinstance(p.split_factor, int) or p.split_factor < 1):
            raise ValueError(
                f"{p!r} on mesh dim {m} of placements {[str(q) for q in placements]}: split_factor must be a "
                f"positive int (how many pieces of dim {p.dim} this mesh dim chunks at once); use Shard({p.dim}) "
                f"for one piece"
            )


def splits_later_pieces(placements: Sequence[Placement], mesh_shape: Sequence[int], mesh_dim: int) -> bool:
    """Is the `_StridedShard` on `mesh_dim` FSDP's over TP: the later mesh dims that `Shard` its dim
    multiply to its split_factor, so it chunks each of their pieces (applied after them)?"""
    p = placements[mesh_dim]
    if not isinstance(p, _StridedShard):
        return False
    later = [mesh_shape[m] for m in range(mesh_dim + 1, len(placements)) if placements[m] == Shard(p.dim)]
    return bool(later) and math.prod(later) == p.split_factor


def strided_pieces(placements: Sequence[Placement], mesh_shape: Sequence[int], mesh_dim: int) -> int:
    """How many pieces `mesh_dim` chunks at once: the split_factor of an interleaved `_StridedShard`,
    else 1 (a Shard, or FSDP's strided dim, which chunks its one piece whole)."""
    p = placements[mesh_dim]
    if isinstance(p, _StridedShard) and not splits_later_pieces(placements, mesh_shape, mesh_dim):
        return p.split_factor
    return 1


def application_order(placements: Sequence[Placement], mesh_shape: Sequence[int]) -> list[int]:
    """Mesh dims in the order their placements split the tensor: mesh order, FSDP's strided dims
    (`splits_later_pieces`) last."""
    last = [m for m in range(len(placements)) if splits_later_pieces(placements, mesh_shape, m)]
    return [m for m in range(len(placements)) if m not in last] + last


def shards(p: Placement, dim: int | None = None) -> bool:
    """Whether `p` splits tensor dim `dim` (any dim when None), plainly or strided."""
    return isinstance(p, (Shard, _StridedShard)) and (dim is None or p.dim == dim)


def is_strided(placements: Sequence[Placement]) -> bool:
    return any(isinstance(p, _StridedShard) for p in placements)


def interleaved_lengths(size: int, pieces: int, num_chunks: int) -> list[list[int]]:
    """`[rank][piece]` lengths of a dim of `size` cut into `pieces` (torch.chunk) and each piece
    chunked over `num_chunks` ranks: rank r's shard is its chunks of every piece, in piece order.

      (B * H = 2 * 3, pieces B = 2, 2 ranks): [[2, 2], [1, 1]]  (rank 0: heads 0-1 of both rows)
    """
    per_piece = [chunk_sizes(p, num_chunks) for p in chunk_sizes(size, pieces)]
    return [[chunks[r] for chunks in per_piece] for r in range(num_chunks)]


def _interleaved_size_and_offset(size: int, pieces: int, num_chunks: int, index: int) -> tuple[int, int]:
    """(length, start of its first element) of rank `index`'s interleaved shard of a dim of `size`."""
    start = 0
    first = None
    length = 0
    for piece in chunk_sizes(size, pieces):
        n, at = chunk_size_and_offset(piece, num_chunks, index)
        if n and first is None:
            first = start + at
        length += n
        start += piece
    return length, (first if first is not None else size)


def local_shape_and_offset(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    *,
    mesh_dims: Collection[int] | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shard shape and its global offset for the rank at `coordinate` of the mesh.

    Mesh dims that shard the same tensor dim nest in `application_order`. Ranks holding an empty
    shard get size 0 and an offset equal to the dim's size (as torch does), so offsets stay in
    range. An interleaved `_StridedShard` shard is not one range: its offset is that of its first
    element (torch's "first" offset mode), and the dim's offset means nothing after it.
    `mesh_dims`: apply only the splits of these mesh dims, read as in the full `placements` (their
    order and what each strided dim means stay those of the whole layout).
    """
    local = list(global_shape)
    offset = [0] * len(local)
    for mesh_dim in application_order(placements, mesh_shape):
        p = placements[mesh_dim]
        if not isinstance(p, (Shard, _StridedShard)) or (mesh_dims is not None and mesh_dim not in mesh_dims):
            continue
        pieces = strided_pieces(placements, mesh_shape, mesh_dim)
        if pieces == 1:
            size, start = chunk_size_and_offset(local[p.dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
        else:
            size, start = _interleaved_size_and_offset(local[p.dim], pieces, mesh_shape[mesh_dim], coordinate[mesh_dim])
        offset[p.dim] = offset[p.dim] + start if size else global_shape[p.dim]
        local[p.dim] = size
    return tuple(local), tuple(offset)


def logical_shape_before(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    mesh_dim: int,
) -> list[int]:
    """Shape the tensor has on this rank after the mesh dims that split it before `mesh_dim` does
    (`application_order`): the 'whole' that mesh dim splits, which gathering over it restores.
    """
    order = application_order(placements, mesh_shape)
    before = order[: order.index(mesh_dim)]
    return list(local_shape_and_offset(global_shape, mesh_shape, coordinate, placements, mesh_dims=before)[0])
