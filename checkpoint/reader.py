"""Filling this rank's shards from a checkpoint: only the byte ranges that overlap them.

For every target shard (a DTensor's local box, `_StridedShard` included, or a whole plain tensor)
`read_plan` names the overlapping pieces of the saved chunks. A piece whose bytes are contiguous in
the file and in a contiguous CPU destination is read straight into the destination; any other is
read as the chunk's smallest covering byte span into scratch and copied out with a strided view.
Reads run on a few threads (`preadv` and CRC-32 release the GIL), in pieces of at most 64 MiB.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from parallelisms.dtensor import DTensor

from .format import DTYPES, CheckpointError, ChunkEntry, Index, read_index
from .planner import Chunk, read_plan
from .storage import CheckedFile, tensor_bytes

_PIECE = 64 << 20
_THREADS = 4


def fill_tensors(targets: dict[str, torch.Tensor], index: Index, directory: Path, *, verify: bool) -> None:
    """Copy the checkpoint's data into every tensor of `targets` (already checked to fit)."""
    files: dict[str, CheckedFile] = {}
    jobs: list[Callable[[], None]] = []
    try:
        for key, target in targets.items():
            entry = index.tensors[key]
            local, box = _shard(target)
            for step in read_plan([Chunk(c.offset, c.shape) for c in entry.chunks], box):
                chunk = entry.chunks[step.chunk_index]
                if chunk.file not in files:
                    files[chunk.file] = CheckedFile(directory / chunk.file, index.files[chunk.file], verify=verify)
                jobs += _read_jobs(files[chunk.file], chunk, step.src, local, step.dst)
        with ThreadPoolExecutor(_THREADS) as pool:
            for done in [pool.submit(job) for job in jobs]:
                done.result()
    finally:
        for f in files.values():
            f.close()


def _shard(target: torch.Tensor) -> tuple[torch.Tensor, Chunk]:
    """The tensor this rank fills and the box of the global tensor it is."""
    if isinstance(target, DTensor):
        shape, offset = target._spec.local_shape_and_offset()
        return target._local_tensor, Chunk(tuple(offset), tuple(shape))
    return target, Chunk((0,) * target.ndim, tuple(target.shape))


def _c_strides(shape: Sequence[int]) -> list[int]:
    return [math.prod(shape[i + 1 :]) for i in range(len(shape))]


def _span(shape: Sequence[int], box: Sequence[slice]) -> tuple[int, int, bool]:
    """[first, last + 1) linear (C-order) element index of `box` in a tensor of `shape`, and
    whether the box is exactly that range."""
    strides = _c_strides(shape)
    first = sum(s.start * st for s, st in zip(box, strides))
    last = sum((s.stop - 1) * st for s, st in zip(box, strides))
    count = math.prod(s.stop - s.start for s in box)
    return first, last + 1, last + 1 - first == count


def _read_jobs(
    file: CheckedFile, chunk: ChunkEntry, src: tuple[slice, ...], local: torch.Tensor, dst: tuple[slice, ...]
) -> list[Callable[[], None]]:
    itemsize = local.element_size()
    first, stop, exact = _span(chunk.shape, src)
    begin = chunk.begin + first * itemsize
    if exact and local.device.type == "cpu" and local.is_contiguous():
        d_first, d_stop, d_exact = _span(local.shape, dst)
        if d_exact:  # straight into the destination, in pieces the threads share
            view = tensor_bytes(local)[d_first * itemsize : d_stop * itemsize]
            return [
                functools.partial(file.read_into, begin + lo, view[lo : lo + _PIECE])
                for lo in range(0, len(view), _PIECE)
            ]

    def read_and_copy() -> None:
        scratch = torch.empty(stop - first, dtype=local.dtype)
        file.read_into(begin, tensor_bytes(scratch))
        piece = scratch.as_strided([s.stop - s.start for s in src], _c_strides(chunk.shape))
        local[dst].copy_(piece)

    return [read_and_copy]


def read_tensor(directory: str | Path, key: str, *, index: Index | None = None, verify: bool = True) -> torch.Tensor:
    """The whole tensor `key` of a checkpoint, assembled from its chunks, on the CPU (for one-process
    tools such as the Hugging Face export, which hold one tensor at a time)."""
    directory = Path(directory)
    index = index or read_index(directory)
    if key not in index.tensors:
        raise CheckpointError(f"{directory} has no tensor {key!r}")
    entry = index.tensors[key]
    out = torch.empty(entry.shape, dtype=DTYPES[entry.dtype])
    fill_tensors({key: out}, index, directory, verify=verify)
    return out
