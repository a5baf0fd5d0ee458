"""File I/O: safetensors files written with per-block CRC-32s, verified reads of byte ranges, and
the atomic directory commit.

Writing streams each tensor's bytes from its own memory into the file (no serialized copy) while a
second thread computes the block checksums; both release the GIL. Reading fills the destination
tensor's memory straight from the file with `preadv` when the wanted bytes are contiguous in both,
and verifies each touched block by folding the block's margins (read into scratch) and the
destination bytes into one incremental CRC. So a verified read costs one copy, like a raw read.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import struct
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from .format import SAFETENSORS_DTYPES, CheckpointError, FileEntry

BLOCK_SIZE = 4 << 20  # checksum granularity: a reader verifies at most one extra block per range end
_IO_SIZE = 64 << 20  # bytes per syscall (Linux caps one read/write at ~2 GiB)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    assert t.device.type == "cpu" and t.is_contiguous(), "tensor_bytes needs a contiguous CPU tensor"
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")  # type: ignore[arg-type]


class _BlockCrc:
    """CRC-32 per `block_size` bytes of a byte stream fed in arbitrary pieces."""

    def __init__(self, block_size: int) -> None:
        self.block_size, self._crc, self._filled = block_size, 0, 0
        self.crcs: list[int] = []

    def update(self, data: memoryview) -> None:
        pos = 0
        while pos < len(data):
            take = min(self.block_size - self._filled, len(data) - pos)
            self._crc = zlib.crc32(data[pos : pos + take], self._crc)
            self._filled += take
            pos += take
            if self._filled == self.block_size:
                self.crcs.append(self._crc)
                self._crc, self._filled = 0, 0

    def finish(self) -> list[int]:
        if self._filled:
            self.crcs.append(self._crc)
            self._crc, self._filled = 0, 0
        return self.crcs


@dataclass(frozen=True, slots=True)
class WrittenFile:
    entry: FileEntry
    ranges: dict[str, tuple[int, int]]  # key -> absolute [begin, end) of its data


def safetensors_header(tensors: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    """The 8-byte length + JSON header of a safetensors file holding `tensors` back to back."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    pos = 0
    for key, t in tensors:
        n = t.numel() * t.element_size()
        header[key] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(
    path: Path, tensors: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None
) -> WrittenFile:
    """Write contiguous CPU `tensors` as one safetensors file and fsync it; returns the sizes and
    block checksums the index records."""
    header = safetensors_header(tensors, metadata or {})
    pieces = [memoryview(header)] + [tensor_bytes(t) for _, t in tensors]
    crc = _BlockCrc(BLOCK_SIZE)
    with ThreadPoolExecutor(1) as pool:
        checksums = pool.submit(_feed, crc, pieces)  # overlaps the writes
        with open(path, "wb", buffering=0) as f:
            for piece in pieces:
                for pos in range(0, len(piece), _IO_SIZE):
                    _write_all(f.fileno(), piece[pos : pos + _IO_SIZE])
            os.fsync(f.fileno())
        checksums.result()
    ranges, pos = {}, len(header)
    for (key, _), piece in zip(tensors, pieces[1:]):
        ranges[key] = (pos, pos + len(piece))
        pos += len(piece)
    return WrittenFile(FileEntry(pos, BLOCK_SIZE, tuple(crc.finish())), ranges)


def _feed(crc: _BlockCrc, pieces: list[memoryview]) -> None:
    for piece in pieces:
        crc.update(piece)


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        data = data[os.write(fd, data) :]


class CheckedFile:
    """A checkpoint file opened for verified range reads (`verify=False`: plain reads)."""

    def __init__(self, path: Path, entry: FileEntry, *, verify: bool) -> None:
        self.path, self.entry, self.verify = path, entry, verify
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise CheckpointError(f"{path} is missing from the checkpoint") from e
        size = os.fstat(self.fd).st_size
        if size != entry.size:
            os.close(self.fd)
            raise CheckpointError(f"{path} is {size} bytes, the index says {entry.size}: the file is truncated or "
                                  f"was replaced")  # fmt: skip

    def close(self) -> None:
        os.close(self.fd)

    def read_into(self, begin: int, dst: memoryview) -> None:
        """Fill `dst` with the file's bytes from `begin`, verifying every block they touch."""
        end = begin + len(dst)
        if not self.verify:
            self._preadv([dst], begin)
            return
        block = self.entry.block_size
        for b in range(begin // block, (end - 1) // block + 1 if end > begin else 0):
            lo, hi = b * block, min((b + 1) * block, self.entry.size)
            head = bytearray(max(0, begin - lo))
            tail = bytearray(max(0, hi - end))
            mid = dst[max(lo, begin) - begin : min(hi, end) - begin]
            self._preadv([memoryview(head), mid, memoryview(tail)], lo)
            crc = zlib.crc32(tail, zlib.crc32(mid, zlib.crc32(head)))
            if crc != self.entry.crc32[b]:
                raise CheckpointError(
                    f"{self.path}: checksum mismatch in bytes [{lo}, {hi}) (block {b}): the file is corrupt; "
                    f"restore it or resume from an earlier step with checkpoint.load_step"
                )

    def _preadv(self, buffers: list[memoryview], offset: int) -> None:
        buffers = [b for b in buffers if len(b)]
        while buffers:
            n = os.preadv(self.fd, buffers[:64], offset)
            if n == 0:
                raise CheckpointError(f"{self.path} ended at byte {offset}: the file is truncated")
            offset += n
            while buffers and n >= len(buffers[0]):
                n -= len(buffers[0])
                buffers.pop(0)
            if n:
                buffers[0] = buffers[0][n:]


# ------------------------------------------------------------------------------ atomic commit
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def commit(tmp: Path, final: Path) -> None:
    """Make `tmp` the committed checkpoint `final`: fsync it, rename, fsync the parent. A crash at any
    point leaves either no `final` or a complete one."""
    fsync_dir(tmp)
    if final.exists():
        raise FileExistsError(f"{final} appeared while saving; refusing to replace a committed checkpoint")
    os.rename(tmp, final)
    fsync_dir(final.parent)


def temporary_dir(final: Path, save_id: str) -> Path:
    return final.with_name(f"{final.name}.tmp-{save_id}")


def set_aside(path: Path, reason: str) -> Path:
    """Rename `path` to `<name>.<reason>` (`<name>.<reason>-2`, ... when taken) and return the new path:
    kept for its owner, under a name no committed step (`step-<N>`) nor leftover (`*.tmp-*`) matches, so
    it is neither loaded, purged nor cleaned up. Never deletes anything."""
    assert ".tmp-" not in reason, "a set-aside name must not look like a leftover"
    for n in itertools.count(1):
        target = path.with_name(f"{path.name}.{reason}" + (f"-{n}" if n > 1 else ""))
        if not target.exists() and not target.is_symlink():
            os.rename(path, target)  # one writer (rank 0) names it: checked, then renamed
            fsync_dir(path.parent)
            return target
    raise AssertionError("unreachable")


def remove_leftovers(folder: Path) -> list[Path]:
    """Delete the `*.tmp-*` directories interrupted saves left in `folder`; returns them."""
    found = sorted(p for p in folder.glob("*.tmp-*") if p.is_dir()) if folder.is_dir() else []
    for p in found:
        shutil.rmtree(p, ignore_errors=True)
    return found
