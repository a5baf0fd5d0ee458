"""Objects torch.compile's graphs hold by reference: a mesh (it owns process groups) or a ring attention plan
cannot be rebuilt from a string, so the graph's code names them by a lookup of the very object
(`__fx_repr__`; see traceable.py). They are kept for the life of the process, as the graphs are."""

from __future__ import annotations

_constants: dict[int, object] = {}


def graph_constant(key: int) -> object:
    return _constants[key]


def fx_repr_by_reference(obj: object) -> tuple[str, dict[str, object]]:
    """An `__fx_repr__` that looks `obj` up again: the expression and the name it needs."""
    _constants[id(obj)] = obj
    return f"graph_constant({id(obj)})", {"graph_constant": graph_constant}
