"""Resharding math: which pieces of the saved chunks of a tensor fill one wanted shard.

A tensor is saved as chunks, each a box of the global tensor (offset, shape), whatever parallelism
wrote it; a loading rank wants another box (its shard under the new layout, e.g. from
`DTensorSpec.local_shape_and_offset`, `_StridedShard` included). Boxes are rectangular in every
layout meshtrain produces, so each overlap is one box too: the read plan is, per overlapping
chunk, the slices to read from the chunk and where they land in the shard. Pure functions, no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from parallelisms.dtensor.placements import Placement, local_shape_and_offset


@dataclass(frozen=True, slots=True)
class Chunk:
    """A box of the global tensor: `shape` elements per dim starting at `offset`."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReadStep:
    """Copy `source[chunk_index][src]` into `shard[dst]` (slices per dim)."""

    chunk_index: int
    src: tuple[slice, ...]
    dst: tuple[slice, ...]


def read_plan(saved: Sequence[Chunk], wanted: Chunk) -> list[ReadStep]:
    """The reads that assemble `wanted` from `saved`; raises if the saved chunks leave a hole (a
    truncated checkpoint) or overlap inside it (two writers of one element)."""
    want = _numel(wanted.shape)
    if not want:  # an empty shard (uneven sharding) reads nothing
        return []
    steps, covered = [], 0
    for i, chunk in enumerate(saved):
        if len(chunk.offset) != len(wanted.offset):
            raise ValueError(f"saved chunk {i} has {len(chunk.offset)} dims, the wanted shard {len(wanted.offset)}")
        lo = [max(a, b) for a, b in zip(chunk.offset, wanted.offset)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(chunk.offset, chunk.shape, wanted.offset, wanted.shape)]
        if any(h <= low for low, h in zip(lo, hi)):
            continue
        src = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, chunk.offset))
        dst = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, wanted.offset))
        steps.append(ReadStep(i, src, dst))
        covered += _numel([h - low for low, h in zip(lo, hi)])
    if covered != want:
        problem = "leave elements unread (a chunk is missing)" if covered < want else "overlap (elements saved twice)"
        raise ValueError(
            f"saved chunks {list(saved)} {problem}: they cover {covered} of the {want} elements of {wanted}"
        )
    return steps


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---------------------------------------------------------------------------------- saving
@dataclass(frozen=True, slots=True)
class Holding:
    """Rank `rank` holds the box `chunk` of a tensor (its local shard)."""

    rank: int
    chunk: Chunk


def holdings(global_shape: Sequence[int], mesh_ranks: torch.Tensor, placements: Sequence[Placement]) -> list[Holding]:
    """The box every rank of the mesh (`mesh_ranks`: global rank per coordinate) holds, in rank order."""
    out = []
    for coordinate in itertools.product(*(range(n) for n in mesh_ranks.shape)):
        shape, offset = local_shape_and_offset(global_shape, mesh_ranks.shape, coordinate, placements)
        out.append(Holding(int(mesh_ranks[coordinate]), Chunk(tuple(offset), tuple(shape))))
    return sorted(out, key=lambda h: h.rank)


def assign_owners(tensors: dict[str, tuple[int, list[Holding]]]) -> dict[str, list[Holding]]:
    """Who writes which chunk: every distinct non-empty box of each tensor exactly once, by one of
    the ranks holding it. `tensors` maps a key to (bytes per element, its holdings).

    Replicated boxes go to the holder with the fewest bytes so far (ties: the lowest rank), largest
    boxes first, so the writers' bytes balance (greedy longest-first). Pure and deterministic:
    every rank computes the same owners without communicating."""
    boxes: list[tuple[int, str, Chunk, list[int]]] = []
    for key, (itemsize, held) in tensors.items():
        holders: dict[Chunk, list[int]] = {}
        for h in held:
            if _numel(h.chunk.shape):
                holders.setdefault(h.chunk, []).append(h.rank)
        boxes += [(_numel(c.shape) * itemsize, key, c, ranks) for c, ranks in holders.items()]
    load: dict[int, int] = {}
    owners: dict[str, list[Holding]] = {key: [] for key in tensors}
    for nbytes, key, chunk, ranks in sorted(boxes, key=lambda b: (-b[0], b[1], b[2].offset)):
        owner = min(ranks, key=lambda r: (load.get(r, 0), r))
        load[owner] = load.get(owner, 0) + nbytes
        owners[key].append(Holding(owner, chunk))
    for held in owners.values():
        held.sort(key=lambda h: h.chunk.offset)
    return owners
