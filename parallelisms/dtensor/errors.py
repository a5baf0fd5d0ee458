"""Error types of the DTensor core.

User mistakes raise ValueError / TypeError / NotImplementedError. Where torch's DTensor raises a
RuntimeError for the same misuse, ours is a `ShardingError`, which is both a ValueError and a
RuntimeError, so the `except RuntimeError:` clauses of ported code keep working.
"""


class ShardingError(ValueError, RuntimeError):
    """An op or call that these placements cannot run as asked (torch: RuntimeError)."""


class UsageError(ValueError, RuntimeError):
    """A call torch's DTensor refuses with a RuntimeError that is not about placements (a non-leaf
    tensor given to distribute_tensor, say); ValueError is our convention for user mistakes."""


class ArgumentTypeError(TypeError, RuntimeError):
    """An argument of the wrong type where torch's DTensor raises a RuntimeError."""


class StyleArgumentError(ValueError, AssertionError):
    """Inconsistent arguments to a parallel style, which torch's tensor parallel API rejects with an
    AssertionError (so `assertRaises(AssertionError)` in ported tests keeps passing)."""


class LocalMapArgumentError(ValueError, AssertionError):
    """Placements `local_map` cannot pair with its function's arguments or outputs, which torch's local_map
    rejects with an AssertionError."""
