"""The class a module gets when a parallelism takes it over: `(Mixin, its class)`, e.g. FSDPTransformer.

fully_shard and replicate swap `module.__class__` for it, so `isinstance(m, FSDPModule)` holds and the
module keeps every method of its own class. One subclass per (mixin, class), cached, so isinstance and
pickling agree across modules of one class.
"""

from __future__ import annotations

_CLASSES: dict[tuple[type, type], type] = {}  # a type cache, like torch's: never holds modules or groups


def with_mixin(mixin: type, cls: type, prefix: str) -> type:
    """The `(mixin, cls)` subclass named `prefix + cls.__name__`, in `cls`'s module."""
    key = (mixin, cls)
    combined = _CLASSES.get(key)
    if combined is None:
        combined = type(f"{prefix}{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})
        _CLASSES[key] = combined
    return combined
