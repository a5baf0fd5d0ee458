"""Async tensor parallelism: the parallel styles that run sequence-parallel TP's collectives as collective
matmuls (collective_matmul.py), and `async_tp_plan`, which rewrites a block's plan to use them.

    AllGatherMatmulInput        on a module whose column-parallel linears share one sequence-sharded input
                                (attention: wq, wk, wv; the MLP: w1, w3). The input stays S(dim), and the
                                module's `project(x)` becomes one all-gather matmul over all of them: one ring,
                                each chunk multiplied by every weight. The linears keep their ColwiseParallel.
    MatmulReduceScatterRowwise  a RowwiseParallel whose output is S(dim): matmul and reduce-scatter as one ring.

A linear the ring cannot take runs as synchronous TP does, and says so once: a sequence that does not divide
by tp, or a Linear subclass with a matmul of its own (float8).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn as nn
from torch._dynamo.comptime import comptime

from ..dtensor import DeviceMesh, DTensor, Placement, Replicate, Shard
from ..dtensor.collectives import traced
from ..ring_pass import RingGroup
from .collective_matmul import SequenceRing, all_gather_matmul, matmul_reduce_scatter
from .style import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

logger = logging.getLogger(__name__)
_said: set[str] = set()


def _say_once(message: str) -> None:
    """Log `message` once per process; while torch.compile traces, at trace time (a log call is not graph code;
    a comptime function may not close over variables: it reads `message` from this frame)."""
    if traced():
        comptime(lambda ctx: _say(ctx.get_local("message").as_python_constant()))
    else:
        _say(message)


def _say(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logger.warning("async TP: %s", message)


def _sequence_dim(layout: Placement | None, what: str) -> int:
    if not isinstance(layout, Shard) or layout.dim == -1:
        raise ValueError(
            f"{what} must be Shard(dim) on a sequence dim (not the last, which the matmul contracts); got {layout}"
        )
    return layout.dim


def _unchunkable(x: DTensor, dim: int, linears: list[nn.Linear], mesh: DeviceMesh) -> str | None:
    """Why the ring cannot take these linears on `x` (None if it can)."""
    if any(type(linear) is not nn.Linear for linear in linears):
        return f"{type(linears[0]).__name__} runs a matmul of its own"
    if x.shape[dim] % mesh.size():
        return f"the sequence ({x.shape[dim]} tokens) does not divide by tp ({mesh.size()})"
    return None


class AllGatherMatmulInput(PrepareModuleInput):
    """Async TP for a module with column-parallel `input_projections` (names of Linear children, each under
    ColwiseParallel) that its `project(x)` applies to its first input: that input stays sharded on the
    sequence (`input_layouts[0]`, a Shard), and `project` gathers it once, chunk by chunk, under the matmuls.
    Other inputs are converted as PrepareModuleInput does (None leaves one alone)."""

    def __init__(self, *, input_layouts: Placement | tuple[Placement | None, ...]) -> None:
        layouts = (input_layouts,) if isinstance(input_layouts, Placement) else tuple(input_layouts)
        self.dim = _sequence_dim(layouts[0], "AllGatherMatmulInput's first input layout")
        super().__init__(input_layouts=layouts, desired_input_layouts=layouts)

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        names = getattr(module, "input_projections", None)
        if not names or not callable(getattr(module, "project", None)):
            raise ValueError(
                f"AllGatherMatmulInput needs a module with `input_projections` (its column-parallel Linear "
                f"children) and `project(x)`; {type(module).__name__} has not both: use PrepareModuleInput"
            )
        ring = SequenceRing(RingGroup.of(device_mesh), self.dim)
        module.project = functools.partial(_project, module, names, ring, device_mesh)  # type: ignore[assignment]
        return super().apply(module, device_mesh)

    def __repr__(self) -> str:
        return f"AllGatherMatmulInput(input_layouts={self.input_layouts})"


def _project(module: nn.Module, names: tuple[str, ...], ring: SequenceRing, mesh: DeviceMesh, x: Any) -> tuple:
    linears = [cast(nn.Linear, module.get_submodule(name)) for name in names]
    why = _unchunkable(x, ring.dim, linears, mesh)
    if why is not None:
        _say_once(f"{type(module).__name__}'s {', '.join(names)} gather their input at once: {why}")
        x = x.redistribute(placements=(Replicate(),))
        return tuple(linear(x) for linear in linears)
    outputs = all_gather_matmul(ring, x.to_local(), *(_local(linear.weight) for linear in linears))
    return tuple(out if linear.bias is None else out + _local(linear.bias) for out, linear in zip(outputs, linears))


def _local(param: torch.Tensor) -> torch.Tensor:
    """A TP parameter's shard, differentiable: its gradient returns as the DTensor's, with its placements."""
    return cast(DTensor, param).to_local()


@dataclass(kw_only=True)
class MatmulReduceScatterRowwise(RowwiseParallel):
    """RowwiseParallel with a sequence-sharded output (`output_layouts`, a Shard) whose matmul and
    reduce-scatter run as one ring."""

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        dim = _sequence_dim(self.output_layouts, "MatmulReduceScatterRowwise's output_layouts")
        if not isinstance(module, nn.Linear):
            raise NotImplementedError(f"MatmulReduceScatterRowwise takes an nn.Linear, got {type(module).__name__}")
        super().apply(module, device_mesh)
        ring = SequenceRing(RingGroup.of(device_mesh), dim)
        module.forward = functools.partial(_rowwise_forward, module, ring, device_mesh)  # type: ignore[method-assign]
        return module


def _rowwise_forward(module: nn.Linear, ring: SequenceRing, mesh: DeviceMesh, x: DTensor) -> torch.Tensor:
    why = _unchunkable(x, ring.dim, [module], mesh)
    if why is not None:
        _say_once(f"a row-parallel {type(module).__name__} reduces, then scatters: {why}")
        return type(module).forward(module, x)
    local = matmul_reduce_scatter(ring, x.to_local(), _local(module.weight))
    y = DTensor.from_local(local, mesh, (Shard(ring.dim),), run_check=False)
    return y if module.bias is None else y + module.bias


def async_tp_plan(block: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """`plan` (a block's sequence-parallel TP plan) with its collectives as collective matmuls: a
    PrepareModuleInput that gathers a sequence-sharded input for a module's `input_projections`, all
    ColwiseParallel in the plan, becomes AllGatherMatmulInput; a RowwiseParallel Linear with a Shard
    output becomes MatmulReduceScatterRowwise. Everything else is kept."""
    rewritten = dict(plan)
    for name, style in plan.items():
        if isinstance(style, PrepareModuleInput) and _gathers_for_projections(block, name, style, plan):
            rewritten[name] = AllGatherMatmulInput(input_layouts=style.input_layouts)  # type: ignore[arg-type]
        elif (
            type(style) is RowwiseParallel
            and isinstance(style.output_layouts, Shard)
            and isinstance(block.get_submodule(name), nn.Linear)
        ):
            rewritten[name] = MatmulReduceScatterRowwise(
                input_layouts=style.input_layouts,
                output_layouts=style.output_layouts,
                use_local_output=style.use_local_output,
            )
    return rewritten


def _gathers_for_projections(block: nn.Module, name: str, style: PrepareModuleInput, plan: dict) -> bool:
    module = block.get_submodule(name)
    projections = getattr(module, "input_projections", None)
    layouts, desired = style.input_layouts or (), style.desired_input_layouts or ()
    projections = projections if isinstance(projections, tuple) else ()
    return (
        type(style) is PrepareModuleInput
        and bool(projections)
        and bool(layouts)
        and isinstance(layouts[0], Shard)
        and desired[0] == Replicate()
        and all(
            type(plan.get(f"{name}.{p}")) is ColwiseParallel and plan[f"{name}.{p}"].input_layouts is None
            for p in projections
        )
    )
