"""Resharding math: which pieces of the saved chunks of a tensor fill one wanted shard.

A tensor is saved as chunks, each a box of the global tensor (offset, shape), whatever parallelism
wrote it; a loading rank wants another box (its shard under the new layout, e.g. from
`DTensorSpec.local_shape_and_offset`, `_StridedShard` included). Boxes are rectangular in every
layout meshtrain produces, so each overlap is one box too: the read plan is, per overlapping
chunk, the slices to read from the chunk and where they land in the shard. Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
