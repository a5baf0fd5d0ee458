"""Pure placement math against torch.chunk and torch's own placement math (no processes)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch.distributed.tensor import Partial as TorchPartial
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from parallelisms.dtensor.placements import (
    Partial,
    Replicate,
    Shard,
    chunk_size_and_offset,
    chunk_sizes,
    local_shape_and_offset,
    normalize_placements,
)
from tests.dtensor.harness import chunk_local, to_torch_placements


def torch_chunk_lengths(size: int, num_chunks: int) -> list[int]:
    """Lengths of torch.chunk's pieces, padded with empty trailing chunks to `num_chunks`."""
    pieces = [c.shape[0] for c in torch.empty(size).chunk(num_chunks)] if size else []
    return pieces + [0] * (num_chunks - len(pieces))


def random_cases(seed: int, count: int):
    """(global shape, mesh shape, placements) with meshes up to 3-D, often nesting one tensor dim."""
    rng = random.Random(seed)
    for _ in range(count):
        ndim = rng.randint(1, 3)
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 7, 8, 9, 12, 13, 16]) for _ in range(ndim))
        mesh_shape = tuple(rng.choice([1, 2, 3, 4]) for _ in range(rng.randint(1, 3)))
        placements = tuple(
            rng.choice([Replicate(), Partial(), *(Shard(d) for d in range(ndim)), Shard(0), Shard(0)])
            for _ in mesh_shape
        )
        yield shape, mesh_shape, placements


# --------------------------------------------------------------------------------------------------
# chunk math
# --------------------------------------------------------------------------------------------------


def test_chunk_sizes_match_torch_chunk_for_all_small_sizes():
    for size in range(40):
        for num_chunks in range(1, 10):
            assert chunk_sizes(size, num_chunks) == torch_chunk_lengths(size, num_chunks), (size, num_chunks)


def test_chunk_size_and_offset_match_torch_chunk_and_torch_shard():
    for size in range(40):
        for num_chunks in range(1, 10):
            lengths = torch_chunk_lengths(size, num_chunks)
            for index in range(num_chunks):
                length, start = chunk_size_and_offset(size, num_chunks, index)
                assert length == lengths[index], (size, num_chunks, index)
                if length:
                    assert start == sum(lengths[:index]), (size, num_chunks, index)
                assert (length, start) == TorchShard.local_shard_size_and_offset(size, num_chunks, index)
                assert Shard.local_shard_size_and_offset(size, num_chunks, index) == (length, start)


def test_chunk_size_and_offset_leave_empty_trailing_shards_in_range():
    # 5 over 4 chunks: torch.chunk gives 2, 2, 1 and one empty piece
    assert [chunk_size_and_offset(5, 4, i) for i in range(4)] == [(2, 0), (2, 2), (1, 4), (0, 5)]
    # 3 over 8: three pieces of 1, five empty ones pinned at the end
    assert chunk_sizes(3, 8) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert all(chunk_size_and_offset(3, 8, i) == (0, 3) for i in range(3, 8))


def test_local_shape_and_offset_match_torch_chunk_for_random_meshes_up_to_3d():
    checked = nested = empty = 0
    for shape, mesh_shape, placements in random_cases(seed=0, count=300):
        global_t = torch.arange(math.prod(shape)).reshape(shape) if shape else torch.tensor(0)
        for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
            local_shape, offset = local_shape_and_offset(shape, mesh_shape, coordinate, placements)
            expected = chunk_local(global_t, mesh_shape, coordinate, placements)
            assert local_shape == tuple(expected.shape), (shape, mesh_shape, placements, coordinate)
            if expected.numel():  # the offset is where the shard's first element sits globally
                first = expected.reshape(-1)[0].item()
                want = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), shape))
                assert offset == want, (shape, mesh_shape, placements, coordinate)
            torch_shape, torch_offset = _compute_local_shape_and_global_offset(
                shape, mesh_shape, list(coordinate), to_torch_placements(placements)
            )
            assert (local_shape, offset) == (tuple(torch_shape), tuple(torch_offset)), (
                shape,
                mesh_shape,
                placements,
                coordinate,
            )
            checked += 1
            empty += expected.numel() == 0
        shard_dims = [p.dim for p in placements if isinstance(p, Shard)]
        nested += len(shard_dims) != len(set(shard_dims))
    assert checked > 1000 and nested > 25 and empty > 50, (checked, nested, empty)


def test_local_shape_and_offset_nest_one_tensor_dim_in_mesh_order():
    # 13 rows sharded by a (2, 3) mesh, both dims on tensor dim 0: first halves of 7 and 6, then thirds
    shape, mesh_shape, placements = (13, 2), (2, 3), (Shard(0), Shard(0))
    rows = torch.arange(13)
    for coordinate in itertools.product(range(2), range(3)):
        local_shape, offset = local_shape_and_offset(shape, mesh_shape, coordinate, placements)
        piece = rows.chunk(2)[coordinate[0]].chunk(3)[coordinate[1]]
        assert local_shape == (len(piece), 2)
        assert offset == (int(piece[0]), 0)
    # S(1), S(0) on a 3-D mesh where the first mesh dim is replicated
    shape = (6, 10)
    t = torch.arange(60).reshape(shape)
    for coordinate in itertools.product(range(2), range(2), range(3)):
        got = local_shape_and_offset(shape, (2, 2, 3), coordinate, (Replicate(), Shard(1), Shard(1)))
        piece = t.chunk(2, dim=1)[coordinate[1]].chunk(3, dim=1)
        piece = piece[coordinate[2]] if coordinate[2] < len(piece) else None
        if piece is None:
            assert got[0] == (6, 0) and got[1] == (0, 10)
        else:
            assert got == (tuple(piece.shape), (0, int(piece[0, 0])))


def test_local_shape_and_offset_give_size_zero_and_end_offset_for_empty_shards():
    # 3 rows on 8 ranks: ranks 3..7 hold nothing; their offset is the dim's size, as in torch
    for i in range(8):
        local_shape, offset = local_shape_and_offset((3, 2), (8,), (i,), (Shard(0),))
        assert local_shape == ((1, 2) if i < 3 else (0, 2))
        assert offset == ((i, 0) if i < 3 else (3, 0))


# --------------------------------------------------------------------------------------------------
# normalize_placements
# --------------------------------------------------------------------------------------------------


def test_normalize_placements_makes_negative_dims_positive():
    assert normalize_placements([Shard(-1), Shard(-3), Replicate()], 3, 3) == (Shard(2), Shard(0), Replicate())
    assert normalize_placements((Partial("max"), Shard(-2)), 2, 2) == (Partial("max"), Shard(0))


def test_normalize_placements_rejects_wrong_count():
    with pytest.raises(ValueError, match="2-D mesh"):
        normalize_placements([Shard(0)], 2, 2)
    with pytest.raises(ValueError, match="1-D mesh"):
        normalize_placements([Shard(0), Replicate()], 2, 1)


def test_normalize_placements_rejects_out_of_range_dim():
    for dim in (2, 5, -3):
        with pytest.raises(ValueError, match="out of range"):
            normalize_placements([Shard(dim)], 2, 1)


def test_normalize_placements_rejects_mixed_partial_ops():
    with pytest.raises(ValueError, match="mix Partial reduce ops"):
        normalize_placements([Partial("sum"), Partial("max")], 2, 2)
    assert normalize_placements([Partial("avg"), Partial("avg")], 1, 2) == (Partial("avg"),) * 2


def test_normalize_placements_rejects_non_placements():
    with pytest.raises(TypeError):
        normalize_placements([TorchShard(0)], 2, 1)


# --------------------------------------------------------------------------------------------------
# the placement values
# --------------------------------------------------------------------------------------------------


def test_placements_are_frozen_and_hashable():
    assert {Shard(0), Shard(0), Replicate(), Replicate(), Partial(), Partial("sum")} == {
        Shard(0),
        Replicate(),
        Partial(),
    }
    assert Shard(0) != Shard(1) and Partial("sum") != Partial("max") and Shard(0) != Replicate()
    shard, partial = Shard(0), Partial()
    with pytest.raises(AttributeError):  # FrozenInstanceError subclasses AttributeError
        shard.dim = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        partial.reduce_op = "max"  # type: ignore[misc]
    assert shard == Shard(0) and partial == Partial("sum")
    assert {(Shard(1), Replicate()): 1}[(Shard(1), Replicate())] == 1


def test_placements_str_is_short_like_torch():
    assert [str(p) for p in (Shard(0), Shard(2), Replicate(), Partial(), Partial("max"))] == [
        "S(0)",
        "S(2)",
        "R",
        "P(sum)",
        "P(max)",
    ]
    assert [str(p) for p in (TorchShard(0), TorchReplicate(), TorchPartial())] == ["S(0)", "R", "P(sum)"]


def test_placement_predicates_match_torch():
    pairs = [(Shard(1), TorchShard(1)), (Replicate(), TorchReplicate()), (Partial("max"), TorchPartial("max"))]
    for ours, theirs in pairs:
        assert ours.is_shard() == theirs.is_shard()
        assert ours.is_shard(1) == theirs.is_shard(1) and ours.is_shard(0) == theirs.is_shard(0)
        assert ours.is_replicate() == theirs.is_replicate()
        assert ours.is_partial() == theirs.is_partial()


def test_partial_rejects_unknown_reduce_op():
    with pytest.raises(ValueError, match="bogus"):
        Partial("bogus")
    for op in ("sum", "avg", "min", "max"):
        assert Partial(op).reduce_op == op
