"""Nested state dicts <-> flat keys.

A state dict is a tree of dicts and lists whose leaves are tensors (plain or DTensor) and JSON
values. Flattening joins the path with "." (`model.layers.0.attention.wq.weight`,
`optimizer.state.tok_embeddings.weight.exp_avg`). A subtree that holds no tensor is one JSON value
(`optimizer.param_groups` with its floats, tuples and FQN lists), so loading replaces it whole and
keeps the target's tuples as tuples.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

Path = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Leaf:
    path: Path  # keys from the root to this leaf
    value: Any  # a tensor or a JSON value


def flatten(state_dict: dict[str, Any]) -> dict[str, Leaf]:
    """Flat key -> leaf; raises on values that are neither tensors nor JSON, and on two paths
    that flatten to one key."""
    out: dict[str, Leaf] = {}
    _walk(state_dict, (), out)
    return out


def _walk(node: Any, path: Path, out: dict[str, Leaf]) -> None:
    if isinstance(node, dict) and _has_tensor(node):
        for k, v in node.items():
            if not isinstance(k, str | int):
                raise TypeError(f"state dict key {_name((*path, k))!r}: keys must be str or int, got {type(k)}")
            _walk(v, (*path, k), out)
    elif isinstance(node, list | tuple) and _has_tensor(node):
        for i, v in enumerate(node):
            _walk(v, (*path, i), out)
    else:
        name = _name(path)
        if not isinstance(node, torch.Tensor):
            try:
                json.dumps(node)
            except (TypeError, ValueError) as e:
                raise TypeError(
                    f"state dict value {name!r} ({type(node).__name__}) is neither a tensor nor JSON-able ({e}); "
                    f"checkpoints never pickle, so convert it (e.g. to a dict of numbers and strings)"
                ) from None
        if name in out:
            raise ValueError(f"state dict paths {out[name].path} and {path} both flatten to {name!r}; rename one")
        out[name] = Leaf(path, node)


def _has_tensor(node: Any) -> bool:
    if isinstance(node, torch.Tensor):
        return True
    if isinstance(node, dict):
        return any(_has_tensor(v) for v in node.values())
    if isinstance(node, list | tuple):
        return any(_has_tensor(v) for v in node)
    return False


def _name(path: Path) -> str:
    return ".".join(map(str, path))


def set_value(root: dict[str, Any], path: Path, value: Any) -> None:
    """Replace the JSON leaf at `path` by `value`, shaped like the value it replaces (tuples stay tuples)."""
    parent: Any = root
    for k in path[:-1]:
        parent = parent[k]
    if isinstance(parent, tuple):
        raise TypeError(f"cannot load {_name(path)!r} into a tuple; make its parent a list or dict")
    parent[path[-1]] = _like(parent[path[-1]], value)


def _like(old: Any, new: Any) -> Any:
    if isinstance(old, tuple) and isinstance(new, list):
        return tuple(_like(o, n) for o, n in zip(old, new)) if len(old) == len(new) else tuple(new)
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [_like(o, n) for o, n in zip(old, new)]
    if isinstance(old, dict) and isinstance(new, dict):  # JSON made int keys strings: restore them
        keys = {str(k): k for k in old}
        return {keys.get(k, k): _like(old[keys[k]], v) if k in keys else v for k, v in new.items()}
    return new
