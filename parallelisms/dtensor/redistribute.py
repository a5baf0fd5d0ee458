"""Redistribution's runners and its differentiable entry points (the Redistribute autograd Functions).

`redistribute_local` runs the plan that transitions.py makes for (spec, target) on this rank's shard:
`run_transition` runs a step on its mesh dim's group, `_run_on_flat_group` a run of like steps
(`transitions.fusable_run`) on the flattened group of their dims (both through `_run_collective`, which
calls collectives.py), and the local steps chunk or partition (`partition_value`) the shard in place of
a collective; `conform_layout` then puts the result in its spec's dim order. Which steps run, in which
order and at what price is transitions.py's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from . import collectives
from .device_mesh import DeviceMesh
from .placements import (
    Partial,
    Placement,
    Shard,
    _StridedShard,
    chunk_sizes,
    interleaved_chunk,
    interleaved_lengths,
    local_chunk,
    local_shape_and_offset,
    partition_divisor,
)
from .spec import DTensorSpec
from .transitions import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    LOCAL_CHUNK,
    LOCAL_PARTITION,
    REDUCE_SCATTER,
    RING_VOLUME,
    Transition,
    backward_placements,
    fusable_run,
    layout_mismatch,
    plan_transitions,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from .dtensor import DTensor

# ------------------------------------------------------------------------------------------------
# Running a plan
# ------------------------------------------------------------------------------------------------


def redistribute_local(
    local: torch.Tensor,
    src: DTensorSpec,
    dst_placements: tuple[Placement, ...],
    *,
    is_backward: bool = False,
    async_op: bool = False,
) -> torch.Tensor:
    """Run the planned transitions on this rank's shard; returns the new local tensor.

    `async_op`: the last collective returns without waiting (a PendingTensor, async_tensor.py);
    earlier ones feed the next step and so complete first.
    """
    if src.placements == dst_placements:
        return local
    mesh = src.mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # off the mesh: no shard to move
        return local
    steps = plan_transitions(src, dst_placements)
    fuse = len(steps) > 1 and bool(mesh._root._flat_groups)
    current = list(src.placements)  # the placements after the steps run so far
    i = 0
    while i < len(steps):
        run = fusable_run(steps, i) if fuse else steps[i : i + 1]
        out = None
        if len(run) > 1:
            out = _run_on_flat_group(local, src, run, current, coordinate, async_op and i + len(run) == len(steps))
        if out is None:
            run = run[:1]
            step, last = run[0], async_op and i + 1 == len(steps)
            out = run_transition(local, step, mesh, coordinate[step.mesh_dim], is_backward=is_backward, async_op=last)
        local = out
        for t in run:
            current[t.mesh_dim] = t.dst
        i += len(run)
    return conform_layout(local, src)


def _run_collective(
    local: torch.Tensor,
    step: Transition,
    group: ProcessGroup,
    n: int,
    index: int,
    gather_sizes: Callable[[], list[int]],
    async_op: bool,
) -> torch.Tensor:
    """A collective step on `group` (n ranks, this one at `index`); `gather_sizes()` gives each
    member's shard length along the gathered dim. The one runner of a mesh dim's group and of a
    flattened one."""
    kind, src, dst = step.kind, step.src, step.dst
    if kind == ALL_GATHER:  # Shard or _StridedShard: both name their dim
        return collectives.all_gather(local, cast(Shard, src).dim, group, gather_sizes(), async_op=async_op)
    if kind == ALL_REDUCE:
        return collectives.all_reduce(local, cast(Partial, src).reduce_op, group, n, async_op=async_op)
    if kind == REDUCE_SCATTER:
        reduce_op = cast(Partial, src).reduce_op
        return collectives.reduce_scatter(local, cast(Shard, dst).dim, reduce_op, group, index, async_op=async_op)
    assert kind == ALL_TO_ALL, kind
    src_dim, dst_dim = cast(Shard, src).dim, cast(Shard, dst).dim
    return collectives.all_to_all(local, src_dim, dst_dim, group, index, list(step.logical_shape))


def _run_on_flat_group(
    local: torch.Tensor,
    src: DTensorSpec,
    run: tuple[Transition, ...],
    current: list[Placement],
    coordinate: list[int],
    async_op: bool,
) -> torch.Tensor | None:
    """`run` as one collective on the group of its mesh dims flattened (row-major); None when the
    root has not flattened those dims, or for an uneven reduce-scatter (its nested chunks need not
    be one chunking, and torch keeps it per mesh dim)."""
    dims = tuple(sorted(t.mesh_dim for t in run))
    group = src.mesh._flattened_group(dims)
    if group is None:
        return None
    mesh_shape = src.mesh.shape
    n = math.prod(mesh_shape[m] for m in dims)
    first = run[0]
    if first.kind == REDUCE_SCATTER and first.logical_shape[cast(Shard, first.dst).dim] % n:
        return None
    index = 0  # this rank's row-major position on the flattened dims
    for m in dims:
        index = index * mesh_shape[m] + coordinate[m]

    def gather_sizes() -> list[int]:  # every member's shard length, member j at row-major position j
        dim, sizes = cast(Shard, first.src).dim, []
        for j in range(n):
            member, rest = list(coordinate), j
            for m in reversed(dims):
                member[m], rest = rest % mesh_shape[m], rest // mesh_shape[m]
            sizes.append(local_shape_and_offset(src.shape, mesh_shape, member, current)[0][dim])
        return sizes

    return _run_collective(local, first, group, n, index, gather_sizes, async_op)


def run_transition(
    local: torch.Tensor, step: Transition, mesh: DeviceMesh, index: int, *, is_backward: bool, async_op: bool = False
) -> torch.Tensor:
    """Take this rank's shard (at coordinate `index` of the step's mesh dim) through `step`."""
    m = step.mesh_dim
    n = mesh.size(m)
    if n == 1:
        return local  # a group of one: every transition is the identity
    kind, src, dst = step.kind, step.src, step.dst
    if kind == ALL_GATHER and step.pieces > 1:
        return _gather_interleaved(local, step, mesh)
    if kind in RING_VOLUME:

        def gather_sizes() -> list[int]:
            return chunk_sizes(step.logical_shape[cast(Shard, src).dim], n)

        return _run_collective(local, step, mesh.get_group(m), n, index, gather_sizes, async_op)
    if kind == LOCAL_CHUNK and step.pieces > 1:
        return interleaved_chunk(local, cast(_StridedShard, dst).dim, step.pieces, n, index)
    if kind == LOCAL_CHUNK:
        return local_chunk(local, cast(Shard, dst).dim, n, index)
    if kind == LOCAL_PARTITION:
        if is_backward:  # a replicated grad stays replicated: partitioning it would only add a reduce
            return local
        return partition_value(local, cast(Partial, dst).reduce_op, n, index)
    if isinstance(src, Partial) and isinstance(dst, Partial):
        raise ValueError(
            f"cannot redistribute {src} to {dst} on mesh dim {m}: reduce ops differ; go through Replicate()"
        )
    raise ValueError(
        f"cannot redistribute {src} to {dst} on mesh dim {m}: only a Replicate tensor can become Partial; "
        f"redistribute to Replicate() first"
    )


def _gather_interleaved(local: torch.Tensor, step: Transition, mesh: DeviceMesh) -> torch.Tensor:
    """An interleaved `_StridedShard` -> Replicate: one all-gather of the shards, then every
    piece's chunks put back in rank order (a local copy)."""
    dim, n = cast(_StridedShard, step.src).dim, mesh.size(step.mesh_dim)
    lengths = interleaved_lengths(step.logical_shape[dim], step.pieces, n)  # [rank][piece]
    totals = [sum(r) for r in lengths]
    gathered = collectives.all_gather(local, dim, mesh.get_group(step.mesh_dim), totals)
    blocks = [rank.split(sizes, dim=dim) for rank, sizes in zip(gathered.split(totals, dim), lengths)]
    return torch.cat([blocks[r][i] for i in range(step.pieces) for r in range(n)], dim=dim)


def partition_value(local: torch.Tensor, reduce_op: str, n: int, index: int) -> torch.Tensor:
    """R -> P on a group of `n`: this rank's piece, so that reducing the pieces gives `local` back."""
    if reduce_op == "prod":  # the first rank keeps the value, the others the identity of *
        return local if index == 0 else torch.ones_like(local)
    divisor = partition_divisor(reduce_op, n)
    return local / divisor if divisor != 1 else local


def conform_layout(local: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """`local`, copied into the dim order of `spec`'s global strides if it is laid out otherwise.

    Collectives return contiguous shards; a DTensor whose global strides say "transposed" must not
    hold one, or reshape/view decompositions would take a path its shard cannot follow. The global
    strides stay as they are because every rank has the same ones (they pick the decomposition, and
    so the collectives); the shard moves. Free for the common case, contiguous everywhere.
    """
    want = layout_mismatch(local, spec)
    if want is None:
        return local
    return torch.empty_strided(local.shape, want, dtype=local.dtype, device=local.device).copy_(local)


# ------------------------------------------------------------------------------------------------
# The differentiable entry points (outputs are built as `type(input)`: DTensor, which imports this
# module)
# ------------------------------------------------------------------------------------------------


class Redistribute(torch.autograd.Function):
    """DTensor -> DTensor with new placements; backward moves the grad back to the old placements."""

    @staticmethod
    def forward(ctx, input: DTensor, dst_placements: tuple[Placement, ...], async_op: bool = False) -> DTensor:
        src: DTensorSpec = input._spec
        ctx.src_placements = src.placements
        local = redistribute_local(input._local_tensor, src, dst_placements, async_op=async_op)
        return type(input)(local, src.with_placements(dst_placements), requires_grad=input.requires_grad)

    @staticmethod
    def backward(ctx, grad: DTensor) -> tuple[DTensor, None, None]:
        return redistribute_grad(grad, ctx.src_placements), None, None


class CastRedistribute(torch.autograd.Function):
    """Redistribute with dtype casts around the collectives (redistribute's forward/backward_dtype)."""

    @staticmethod
    def forward(
        ctx,
        input: DTensor,
        dst_placements: tuple[Placement, ...],
        async_op: bool,
        forward_dtype: torch.dtype | None,
        backward_dtype: torch.dtype | None,
    ) -> DTensor:
        ctx.src_placements, ctx.original_dtype = input._spec.placements, input.dtype
        ctx.backward_dtype = backward_dtype or input.dtype
        if forward_dtype is not None and forward_dtype != input.dtype:
            input = cast("DTensor", input.to(forward_dtype))  # grad mode is off in forward: a plain DTensor op
        if dst_placements == input._spec.placements:
            local = input._local_tensor
            return type(input)(local.view_as(local), input._spec, requires_grad=False)
        local = redistribute_local(input._local_tensor, input._spec, dst_placements, async_op=async_op)
        return type(input)(local, input._spec.with_placements(dst_placements))

    @staticmethod
    def backward(ctx, grad: DTensor) -> tuple[DTensor, None, None, None, None]:
        if grad.dtype != ctx.backward_dtype:
            grad = cast("DTensor", grad.to(ctx.backward_dtype))
        grad = redistribute_grad(grad, ctx.src_placements)
        if grad.dtype != ctx.original_dtype:
            grad = cast("DTensor", grad.to(ctx.original_dtype))
        return grad, None, None, None, None


def redistribute_grad(grad: DTensor, placements: tuple[Placement, ...]) -> DTensor:
    """Move a DTensor gradient to `placements` (normalized as in `backward_placements`)."""
    spec: DTensorSpec = grad._spec
    target = backward_placements(spec, placements)
    if target == spec.placements:
        return grad
    local = redistribute_local(grad._local_tensor, spec, target, is_backward=True)
    return type(grad)(local, spec.with_placements(target))
