"""Resharding distributed checkpoint on safetensors (DESIGN.md section 5; issue 9).

Built so far: `planner.py`, the pure resharding math that `save`/`load` will stand on (which byte
ranges of which saved chunks fill a rank's shard). `checkpoint.save` / `checkpoint.load` do not exist
yet; the trainer refuses `checkpoint.enable = true` with a clear error until they do.
"""

from .planner import Chunk, ReadStep, read_plan

__all__ = ["Chunk", "ReadStep", "read_plan"]
