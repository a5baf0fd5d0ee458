"""Resharding distributed checkpoint on safetensors (docs/architecture.md §5).

`save(state_dict, dir)` writes a committed checkpoint atomically (one safetensors file per writing
rank + `index.json`); `async_save` stages to CPU and writes on a background thread; `load(state_dict,
dir)` fills any layout, any world size, from any layout. Nothing is ever pickled.
"""

from .distributed import LoadResult, async_save, load, save
from .format import CheckpointError, Index, read_index
from .planner import Chunk, ReadStep, read_plan
from .reader import read_tensor

__all__ = [
    "CheckpointError", "Chunk", "Index", "LoadResult", "ReadStep", "async_save", "load", "read_index", "read_plan",
    "read_tensor", "save",
]  # fmt: skip
