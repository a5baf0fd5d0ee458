"""Error types of the DTensor core.

User mistakes raise ValueError / TypeError / NotImplementedError. Where torch's DTensor raises a
RuntimeError for the same misuse, ours is a `ShardingError`, which is both a ValueError and a
RuntimeError, so the `except RuntimeError:` clauses of ported code keep working.
"""


class ShardingError(ValueError, RuntimeError):
    """An op or call that these placements cannot run as asked (torch: RuntimeError)."""
