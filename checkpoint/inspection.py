"""`inspect` of a checkpoint: its contents (the job that saved it, every tensor with its dtype, global
shape, chunks and layout) and every file verified against its CRC-32 blocks, as the loader reads them.
The report behind `python -m checkpoint.convert inspect CKPT`."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .format import DTYPES, INDEX_FILE, CheckpointError, FileEntry, Index, read_index
from .storage import CheckedFile


def inspect_checkpoint(ckpt: str | Path) -> tuple[list[str], list[str]]:
    """(report lines, problems) for checkpoint `ckpt`: its contents, and every file's CRC-32
    blocks verified. No problems means the checkpoint is intact."""
    ckpt = Path(ckpt)
    try:
        index = read_index(ckpt)
    except CheckpointError as e:
        return [], [str(e)]
    lines = _describe(index, ckpt)
    problems = _check_chunks(index)
    for name, entry in index.files.items():
        problem = verify_file(ckpt / name, entry)
        lines.append(f"  {name}: {entry.size:,} bytes, {len(entry.crc32)} blocks: {problem or 'ok'}")
        if problem:
            problems.append(f"{ckpt / name}: {problem}")
    extra = sorted(p.name for p in ckpt.iterdir() if p.name != INDEX_FILE and p.name not in index.files)
    if extra:
        lines.append(f"  not in the index (ignored by load): {extra}")
    return lines, problems


def _describe(index: Index, ckpt: Path) -> list[str]:
    total = sum(math.prod(t.shape) * DTYPES[t.dtype].itemsize for t in index.tensors.values())
    lines = [f"checkpoint {ckpt}: saved by {index.world_size} rank(s)"]
    job = index.metadata.get("job_config") or {}
    for section in ("model", "parallelism"):
        if section in job:
            lines.append(f"  {section}: {json.dumps(job[section], sort_keys=True)}")
    if "model_args" in index.metadata:
        lines.append(f"  model_args: {json.dumps(index.metadata['model_args'], sort_keys=True)}")
    lines.append(f"tensors: {len(index.tensors)}, {total:,} bytes")
    width = max((len(k) for k in index.tensors), default=0)
    for key, t in index.tensors.items():
        lines.append(f"  {key:<{width}}  {t.dtype:<8}  {list(t.shape)!s:<16}  chunks={len(t.chunks)}  {t.layout}")
    lines.append(f"values: {len(index.values)}: {', '.join(index.values) or '-'}")
    lines.append(f"files: {len(index.files)}, {sum(f.size for f in index.files.values()):,} bytes")
    return lines


def _check_chunks(index: Index) -> list[str]:
    """Each chunk's byte range fits its shape, and the chunks add up to the whole tensor."""
    problems = []
    for key, t in index.tensors.items():
        itemsize = DTYPES[t.dtype].itemsize
        bad = [c for c in t.chunks if c.end - c.begin != math.prod(c.shape) * itemsize]
        covered = sum(math.prod(c.shape) for c in t.chunks)
        if bad:
            problems.append(f"index: {key}: chunk {bad[0].key} spans {bad[0].end - bad[0].begin} bytes for shape "
                            f"{list(bad[0].shape)}")  # fmt: skip
        elif covered != math.prod(t.shape):
            problems.append(f"index: {key}: chunks hold {covered} elements of {math.prod(t.shape)}")
    return problems


def verify_file(path: Path, entry: FileEntry) -> str | None:
    """Why `path` does not match its index entry (missing, wrong size, first bad block), or None:
    the loader's own verified reads (`CheckedFile`), one block at a time over the whole file."""
    if not path.is_file():
        return "missing"
    try:
        checked = CheckedFile(path, entry, verify=True)
    except CheckpointError as e:
        return str(e)
    buffer = memoryview(bytearray(entry.block_size))
    try:
        for lo in range(0, entry.size, entry.block_size):
            checked.read_into(lo, buffer[: min(entry.block_size, entry.size - lo)])
    except CheckpointError as e:
        return str(e)
    finally:
        checked.close()
    return None
