"""read_plan against the global tensor: any saved layout -> any wanted shard, uneven and strided."""

from __future__ import annotations

import itertools

import pytest
import torch

from checkpoint import Chunk, read_plan
from parallelisms.dtensor import Replicate, Shard
from parallelisms.dtensor.placements import _StridedShard, local_shape_and_offset

SHAPE = (13, 6)
LAYOUTS = [  # (mesh shape, placements)
    ((1,), (Replicate(),)),
    ((4,), (Shard(0),)),
    ((3,), (Shard(1),)),
    ((2, 2), (Shard(0), Shard(1))),
    ((2, 3), (Shard(0), Shard(0))),
    ((2, 2), (_StridedShard(0, split_factor=2), Shard(0))),  # FSDP x TP
    ((2, 2), (Replicate(), Shard(0))),  # HSDP: the replica on coordinate 0 is saved
]


def _boxes(mesh_shape, placements) -> list[Chunk]:
    """The distinct boxes a layout's ranks hold (each replicated box once, empty ones dropped)."""
    boxes = []
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        shape, offset = local_shape_and_offset(SHAPE, mesh_shape, coord, placements)
        box = Chunk(tuple(offset), tuple(shape))
        if all(shape) and box not in boxes:
            boxes.append(box)
    return boxes


@pytest.mark.parametrize("saved_layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("wanted_layout", LAYOUTS, ids=str)
def test_any_layout_loads_into_any_layout(saved_layout, wanted_layout) -> None:
    full = torch.arange(13 * 6).view(SHAPE)
    saved = _boxes(*saved_layout)
    chunks = [full[tuple(slice(o, o + n) for o, n in zip(c.offset, c.shape))] for c in saved]
    for wanted in _boxes(*wanted_layout):
        shard = torch.full(wanted.shape, -1)
        for step in read_plan(saved, wanted):
            shard[step.dst] = chunks[step.chunk_index][step.src]
        expected = full[tuple(slice(o, o + n) for o, n in zip(wanted.offset, wanted.shape))]
        assert torch.equal(shard, expected), (saved_layout, wanted_layout, wanted)


def test_missing_and_doubled_chunks_are_refused() -> None:
    saved = _boxes((4,), (Shard(0),))
    with pytest.raises(ValueError, match="unread"):
        read_plan(saved[:-1], Chunk((0, 0), SHAPE))
    with pytest.raises(ValueError, match="saved twice"):
        read_plan([*saved, saved[0]], Chunk((0, 0), SHAPE))


def test_an_empty_shard_reads_nothing() -> None:
    assert read_plan(_boxes((4,), (Shard(0),)), Chunk((13, 0), (0, 6))) == []
