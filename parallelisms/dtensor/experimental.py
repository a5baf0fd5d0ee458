"""Experimental APIs, named as in torch DTensor's experimental module: `implicit_replication` and `local_map`.

`local_map(func, out_placements, in_placements, ...)` runs a function written for plain tensors on the local
shards of DTensor arguments and wraps its outputs as DTensors of the placements the caller declares: the
escape hatch for code whose sharding the caller knows better than any rule (a local matmul whose Partial
result the caller reduces later, say). It issues no collective of its own, except the redistribution
`redistribute_inputs=True` asks for; the declared output placements are trusted, not checked.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .async_tensor import PendingTensor
from .device_mesh import DeviceMesh
from .dispatch import implicit_replication
from .dtensor import DTensor
from .errors import LocalMapArgumentError
from .placements import Placement

__all__ = ["implicit_replication", "local_map"]

PlacementType = Sequence[Placement] | None  # one argument's or output's placements; None: not a tensor


def local_map(
    func: Callable | None = None,
    out_placements: PlacementType | tuple[PlacementType, ...] = None,
    in_placements: tuple[PlacementType, ...] | None = None,
    in_grad_placements: tuple[PlacementType, ...] | None = None,
    device_mesh: DeviceMesh | None = None,
    *,
    redistribute_inputs: bool = False,
) -> Callable:
    """`func` applied to the local shards of its DTensor arguments, its outputs made DTensors again.

    Args:
        func: the function on plain tensors; without it, a decorator taking it.
        out_placements: the placements of each value of `func`'s flattened output (one `PlacementType`
            for a single output); None for a non-tensor output. Ignored when no argument is a DTensor.
        in_placements: per flattened argument, the placements a DTensor argument must have (None for a
            non-tensor one); a DTensor with others is redistributed with `redistribute_inputs`, refused
            without. None: any placements.
        in_grad_placements: per flattened DTensor argument, the placements its gradient takes
            (`to_local(grad_placements=...)`); None: its own.
        device_mesh: the outputs' mesh; None: the first DTensor argument's.
        redistribute_inputs: redistribute DTensor arguments to `in_placements` instead of raising.
    """
    if func is None:
        return functools.partial(
            local_map, out_placements=out_placements, in_placements=in_placements,
            in_grad_placements=in_grad_placements, device_mesh=device_mesh, redistribute_inputs=redistribute_inputs,
        )  # fmt: skip

    @functools.wraps(func)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        flat, spec = tree_flatten(args)
        _check_count("in_placements", in_placements, len(flat), "flattened arguments")
        mesh, local, distributed = device_mesh, [], False
        for i, arg in enumerate(flat):
            if isinstance(arg, DTensor):
                mesh, distributed = mesh or arg.device_mesh, True
                local.append(_local_argument(arg, i, in_placements, in_grad_placements, redistribute_inputs))
                continue
            if in_placements is not None and in_placements[i] is not None and not isinstance(arg, torch.Tensor):
                raise ValueError(f"local_map: argument {i} ({arg!r}) is not a tensor, so in_placements[{i}] must "
                                 f"be None, got {in_placements[i]}")  # fmt: skip
            local.append(arg)
        out = func(*tree_unflatten(local, spec), **kwargs)
        if not distributed:  # no DTensor argument: a plain call, whatever out_placements says
            return out
        assert mesh is not None
        return _wrap_outputs(out, out_placements, mesh)

    return mapped


def _local_argument(
    arg: DTensor, i: int, in_placements: tuple[PlacementType, ...] | None,
    in_grad_placements: tuple[PlacementType, ...] | None, redistribute: bool,
) -> torch.Tensor:  # fmt: skip
    wanted = _named(in_placements, i, "in_placements", "placements")
    if wanted is not None and tuple(arg.placements) != wanted:
        if not redistribute:
            raise ValueError(
                f"local_map: argument {i} has mismatched placements {tuple(arg.placements)}: in_placements[{i}] "
                f"is {wanted}; redistribute it first, or pass redistribute_inputs=True to local_map"
            )
        arg = arg.redistribute(placements=wanted)
    grad = _named(in_grad_placements, i, "in_grad_placements", "in grad placements")
    local = arg.to_local(grad_placements=grad)
    return local.wait() if isinstance(local, PendingTensor) else local


def _named(given: tuple[PlacementType, ...] | None, i: int, name: str, what: str) -> tuple[Placement, ...] | None:
    """The placements `given` names for DTensor argument i (None when `given` is None: unchecked)."""
    if given is None:
        return None
    if given[i] is None:
        raise LocalMapArgumentError(f"local_map: argument {i} is a DTensor and expects {what}, but {name}[{i}] "
                                    f"is None; name them")  # fmt: skip
    return tuple(given[i])  # type: ignore[arg-type]


def _wrap_outputs(out: Any, out_placements: Any, mesh: DeviceMesh) -> Any:
    flat, spec = tree_flatten(out)
    placements = out_placements if isinstance(out_placements, tuple) else (out_placements,)
    _check_count("out_placements", placements, len(flat), "flattened outputs")
    wrapped = []
    for i, (value, placement) in enumerate(zip(flat, placements)):
        if isinstance(value, DTensor):
            raise LocalMapArgumentError(f"local_map: output {i} of the function is a DTensor, where a torch.Tensor "
                                        f"output is expected: return local tensors, local_map wraps them")  # fmt: skip
        if isinstance(value, torch.Tensor):
            wrapped.append(DTensor.from_local(value, mesh, placement, run_check=False))
        elif placement is not None:
            raise LocalMapArgumentError(f"local_map: output {i} ({value!r}) is not a tensor and expects None "
                                        f"placements, but out_placements[{i}] is {placement}")  # fmt: skip
        else:
            wrapped.append(value)
    return tree_unflatten(wrapped, spec)


def _check_count(name: str, given: tuple | None, expected: int, what: str) -> None:
    if given is not None and len(given) != expected:
        raise LocalMapArgumentError(f"local_map: {name} has {len(given)} entries for {expected} {what}; give one per "
                                    f"value")  # fmt: skip
