"""The on-disk format: `index.json` (what a checkpoint holds and where) and its validation.

A checkpoint directory holds one safetensors file per writing rank and `index.json`:

    {"format": "meshtrain-checkpoint", "version": 1, "world_size": 4,
     "tensors": {"model.layers.0.attention.wq.weight":
                    {"dtype": "float32", "shape": [256, 256],
                     "chunks": [{"offset": [0, 0], "shape": [128, 256], "file": "rank-0.safetensors",
                                 "key": "model.layers.0.attention.wq.weight@0,0", "begin": 1024, "end": 132096}],
                     "layout": "S(0) on (2,)"}},
     "files": {"rank-0.safetensors": {"size": 4195328, "block_size": 4194304, "crc32": [..., ...]}},
     "values": {"train_state.step": 3, ...},
     "metadata": {...}}

`begin`/`end` are absolute byte offsets of the chunk's data in its file (the safetensors header
says the same; keeping them here lets a reader seek without parsing it). `crc32` holds one CRC-32
per `block_size` bytes of the file, header included, so a reader verifies exactly the blocks it
reads, whatever slice of a chunk its shard needs. Everything is plain JSON: loading a checkpoint
never unpickles, so it cannot execute code.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FORMAT_NAME = "meshtrain-checkpoint"
FORMAT_VERSION = 1
INDEX_FILE = "index.json"
_FILE_NAME = re.compile(r"rank-\d{1,6}\.safetensors")  # the only files an index may point at
STEP_DIR = re.compile(r"step-(\d+)")  # a checkpoint folder's name in the trainer's checkpoint folder
HF_INDEX_FILE = "model.safetensors.index.json"  # a Hugging Face folder's, told apart from ours
HF_CONFIG_FILE = "config.json"

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.uint16, torch.uint32, torch.uint64,
    )
}  # fmt: skip
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16",
    torch.uint32: "U32", torch.uint64: "U64",
}  # fmt: skip


class CheckpointError(ValueError):
    """A checkpoint that is malformed, corrupt or does not fit the state dict it is loaded into."""


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"dtype {dtype} cannot be checkpointed; supported: {sorted(DTYPES)}")
    return name


@dataclass(frozen=True, slots=True)
class ChunkEntry:
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    file: str
    key: str
    begin: int
    end: int


@dataclass(frozen=True, slots=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkEntry, ...]
    layout: str  # how the saving job held it, for people (`inspect`); loading never reads it


@dataclass(frozen=True, slots=True)
class FileEntry:
    size: int
    block_size: int
    crc32: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Index:
    world_size: int
    tensors: dict[str, TensorEntry]
    files: dict[str, FileEntry]
    values: dict[str, Any]
    metadata: dict[str, Any]

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "world_size": self.world_size,
                "tensors": {
                    k: {
                        "dtype": t.dtype,
                        "shape": list(t.shape),
                        "chunks": [
                            {
                                "offset": list(c.offset),
                                "shape": list(c.shape),
                                "file": c.file,
                                "key": c.key,
                                "begin": c.begin,
                                "end": c.end,
                            }
                            for c in t.chunks
                        ],  # fmt: skip
                        "layout": t.layout,
                    }
                    for k, t in self.tensors.items()
                },
                "files": {
                    k: {"size": f.size, "block_size": f.block_size, "crc32": list(f.crc32)}
                    for k, f in self.files.items()
                },
                "values": self.values,
                "metadata": self.metadata,
            },
            indent=1,
        )


def read_index(directory: str | Path) -> Index:
    """The validated index of the checkpoint in `directory`; CheckpointError names what is wrong."""
    path = Path(directory) / INDEX_FILE
    if not path.is_file():
        raise CheckpointError(not_a_checkpoint(Path(directory)))
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the checkpoint is corrupt") from e
    try:
        return _parse(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path} is malformed: {e}") from e


def not_a_checkpoint(directory: Path) -> str:
    """What `directory`, which has no index.json, is instead of a checkpoint, and what to pass: nothing, the
    folder of step-N checkpoints, a Hugging Face folder, or an interrupted (never committed) save."""
    if not directory.exists():
        return f"{directory} does not exist"
    if not directory.is_dir():
        return f"{directory} is a file, not a checkpoint (a step-<N> folder with {INDEX_FILE})"
    steps = sorted((int(m.group(1)), p.name) for p in directory.iterdir()
                   if (m := STEP_DIR.fullmatch(p.name)) and (p / INDEX_FILE).is_file())  # fmt: skip
    if len(steps) == 1:
        return f"{directory} holds {steps[0][1]} (a checkpoint): pass {directory / steps[0][1]}"
    if steps:
        return (f"{directory} holds {_listed([name for _, name in steps])} (checkpoints): pass one of them, e.g. "
                f"the newest {directory / steps[-1][1]}")  # fmt: skip
    foreign = [p.name for p in directory.glob("*.safetensors") if not _FILE_NAME.fullmatch(p.name)]
    if (directory / HF_INDEX_FILE).is_file() or foreign:
        return (f"{directory} is a Hugging Face model folder: use from-hf to convert it (python -m checkpoint.convert "
                f"from-hf {directory} OUT), or train from it with checkpoint.initial_load_in_hf")  # fmt: skip
    if ".tmp-" in directory.name or STEP_DIR.fullmatch(directory.name) or any(directory.glob("rank-*.safetensors")):
        return (f"{directory / INDEX_FILE} does not exist: {directory} is not a committed checkpoint (an interrupted "
                f"save leaves only a '.tmp-' directory, which is never loaded)")  # fmt: skip
    return f"{directory} has no {INDEX_FILE}: it is not a checkpoint (a step-<N> folder of rank-*.safetensors files)"


def _listed(names: list[str]) -> str:
    """'a, b and c'; a long list by its first three and its last."""
    if len(names) > 6:
        return f"{', '.join(names[:3])}, ... and {names[-1]} ({len(names)} in all)"
    return f"{', '.join(names[:-1])} and {names[-1]}"


def _parse(raw: dict[str, Any]) -> Index:
    if raw.get("format") != FORMAT_NAME:
        raise ValueError(f"format is {raw.get('format')!r}, expected {FORMAT_NAME!r}")
    if raw.get("version") != FORMAT_VERSION:
        raise ValueError(f"version {raw.get('version')!r} is not supported (this meshtrain reads {FORMAT_VERSION})")
    files = {}
    for name, f in raw["files"].items():
        entry = FileEntry(int(f["size"]), int(f["block_size"]), tuple(map(int, f["crc32"])))
        if entry.block_size <= 0 or len(entry.crc32) != -(-entry.size // entry.block_size):
            raise ValueError(f"{name}: {len(entry.crc32)} checksums of {entry.block_size}-byte blocks cannot cover "
                             f"{entry.size} bytes")  # fmt: skip
        files[_checked_file_name(name)] = entry
    tensors = {}
    for key, t in raw["tensors"].items():
        if t["dtype"] not in DTYPES:
            raise ValueError(f"tensor {key!r} has unknown dtype {t['dtype']!r}")
        chunks = []
        for c in t["chunks"]:
            if c["file"] not in files:
                raise ValueError(f"tensor {key!r} has a chunk in {c['file']!r}, which the index does not list")
            chunk = ChunkEntry(
                tuple(map(int, c["offset"])), tuple(map(int, c["shape"])), c["file"], str(c["key"]),
                int(c["begin"]), int(c["end"]),
            )  # fmt: skip
            if not 0 <= chunk.begin <= chunk.end <= files[chunk.file].size:
                raise ValueError(f"tensor {key!r}: chunk bytes [{chunk.begin}, {chunk.end}) lie outside {chunk.file}")
            chunks.append(chunk)
        tensors[key] = TensorEntry(t["dtype"], tuple(map(int, t["shape"])), tuple(chunks), str(t.get("layout", "")))
    return Index(int(raw["world_size"]), tensors, files, dict(raw["values"]), dict(raw.get("metadata", {})))


def _checked_file_name(name: str) -> str:
    """Index file names are bare `rank-<r>.safetensors`: no path can lead outside the directory."""
    if not _FILE_NAME.fullmatch(name):
        raise ValueError(f"file name {name!r} is not of the form rank-<r>.safetensors (refused: it could point "
                         f"outside the checkpoint directory)")  # fmt: skip
    return name
