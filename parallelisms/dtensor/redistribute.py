"""Redistribution: plan the per-mesh-dim transitions between two placements, run them, and price
them.

One transition changes one mesh dim by the collective (or local step) that the transition table,
cost.TRANSITIONS, names for its pair of placements (DESIGN.md §3); only Replicate becomes Partial.
The plan of a redistribution is computed once per (spec, target) and carries each step's name:
run_transition runs that step, the cost model prices it and MESHTRAIN_DEBUG logs it.

Mesh dims that shard the same tensor dim nest in mesh order, so a transition on mesh dim m is only
legal when no inner mesh dim (> m) still shards that tensor dim. The planner (after torch's)
first walks mesh dims inner -> outer, un-sharding whatever would break that nesting, then walks
outer -> inner to reach the targets; a source that shards nothing may skip the first walk when
that moves fewer bytes. Each transition is told the 'logical' shape its mesh dim splits,
computed from the placements current at that step, which is what uneven gathers need.

The differentiable entry point (the Redistribute autograd Function) lives with the DTensor class
in dtensor.py; this module works on local tensors and specs only.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import cast

import torch

from . import collectives
from .cost import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    LOCAL_CHUNK,
    LOCAL_PARTITION,
    REDUCE_SCATTER,
    collective_seconds,
    cost_model,
    plan_seconds,
    transition_kind,
)
from .device_mesh import DeviceMesh
from .errors import ShardingError
from .placements import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
    application_order,
    chunk_size_and_offset,
    chunk_sizes,
    interleaved_lengths,
    is_strided,
    local_shape_and_offset,
    logical_shape_before,
    partition_divisor,
    strided_pieces,
)
from .spec import DTensorSpec, dense_stride_like, is_dense, stride_order


@dataclass(frozen=True, slots=True)
class Transition:
    """Change mesh dim `mesh_dim` from `src` to `dst` by `kind` (its cost.TRANSITIONS name);
    `logical_shape` is what that dim splits, into `pieces` chunked at once (an interleaved
    `_StridedShard`'s split_factor; 1 for every other placement)."""

    mesh_dim: int
    src: Placement
    dst: Placement
    logical_shape: tuple[int, ...]
    kind: str
    pieces: int = 1


def plan_transitions(src: DTensorSpec, dst_placements: tuple[Placement, ...]) -> tuple[Transition, ...]:
    """The transitions that take `src` to `dst_placements`, in execution order (cached per rank and cost
    model: under `use_cost_model` the cheaper walk may be another)."""
    return _plan_transitions(src, dst_placements, id(cost_model()))


@lru_cache(maxsize=4096)
def _plan_transitions(src: DTensorSpec, dst_placements: tuple[Placement, ...], _model: int) -> tuple[Transition, ...]:
    """`plan_transitions` under the cost model of identity `_model` (the current one).

    The un-nesting walk (inner -> outer, then outer -> inner) is always correct. When the source
    shards nothing there is no nesting to undo and a plain outer -> inner walk is correct too; it
    is cheaper when an outer mesh dim chunks locally or reduce-scatters before an inner one
    reduces (e.g. (R, P) -> (S(0), R)), so the cheaper of the two plans is kept. The estimate is
    pure shape math over every mesh coordinate, so every rank picks the same plan.
    """
    coordinate = src.mesh.get_coordinate()
    assert coordinate is not None, "ranks outside the mesh hold no shard and never redistribute"
    if is_strided(src.placements) or is_strided(dst_placements):
        return _strided_walk(src, dst_placements, coordinate)
    plans = [_walk(src, dst_placements, coordinate, unnest_first=True)]
    if not any(isinstance(p, Shard) for p in src.placements):
        plans.append(_walk(src, dst_placements, coordinate, unnest_first=False))
    return min(plans, key=lambda steps: _estimated_cost(src, steps))


def _walk(
    src: DTensorSpec, dst_placements: tuple[Placement, ...], coordinate: list[int], *, unnest_first: bool
) -> tuple[Transition, ...]:
    shape, mesh_shape = list(src.shape), src.mesh.shape
    current = list(src.placements)
    steps: list[Transition] = []

    def move(mesh_dim: int, target: Placement) -> None:
        logical = logical_shape_before(shape, mesh_shape, coordinate, current, mesh_dim)
        src = current[mesh_dim]
        steps.append(Transition(mesh_dim, src, target, tuple(logical), transition_kind(src, target)))
        current[mesh_dim] = target

    for mesh_dim in reversed(range(len(current)) if unnest_first else ()):
        target = dst_placements[mesh_dim]
        if isinstance(target, Shard):
            now = [i for i in range(mesh_dim) if current[i].is_shard(target.dim)]
            want = [i for i in range(mesh_dim) if dst_placements[i].is_shard(target.dim)]
            if now != want:  # outer sharding of this tensor dim changes: un-shard here first
                target = Replicate()
        if current[mesh_dim] != target:
            move(mesh_dim, target)
    for mesh_dim, target in enumerate(dst_placements):
        if current[mesh_dim] != target:
            move(mesh_dim, target)
    return tuple(steps)


def _strided_walk(
    src: DTensorSpec, dst_placements: tuple[Placement, ...], coordinate: list[int]
) -> tuple[Transition, ...]:
    """Through mesh-order placements. Tensor dims that a `_StridedShard` splits (in the source or
    the target) and whose sharding changes are gathered first, on every mesh dim that splits them,
    in reverse application order (the last split is undone first); the rest walks as usual to the
    target with those dims whole; then those dims are chunked locally, in application order.
    A strided dim whose sharding stays is never touched."""
    shape, mesh_shape = list(src.shape), src.mesh.shape
    moved = _moved_strided_dims(src.placements, dst_placements)
    current = list(src.placements)
    steps: list[Transition] = []
    for m in reversed(application_order(src.placements, mesh_shape)):
        p = src.placements[m]
        if isinstance(p, (Shard, _StridedShard)) and p.dim in moved:
            # read in the full source layout: its earlier splits are all still in place
            logical = tuple(logical_shape_before(shape, mesh_shape, coordinate, src.placements, m))
            pieces = strided_pieces(src.placements, mesh_shape, m)
            steps.append(Transition(m, p, Replicate(), logical, transition_kind(p, Replicate()), pieces))
            current[m] = Replicate()
    middle = tuple(
        Replicate() if isinstance(p, (Shard, _StridedShard)) and p.dim in moved else p for p in dst_placements
    )
    if tuple(current) != middle:
        steps.extend(_walk(src.with_placements(tuple(current)), middle, coordinate, unnest_first=True))
    for m in application_order(dst_placements, mesh_shape):
        p = dst_placements[m]
        if isinstance(p, (Shard, _StridedShard)) and p.dim in moved:
            logical = tuple(logical_shape_before(shape, mesh_shape, coordinate, dst_placements, m))
            pieces = strided_pieces(dst_placements, mesh_shape, m)
            steps.append(Transition(m, Replicate(), p, logical, transition_kind(Replicate(), p), pieces))
    return tuple(steps)


def _moved_strided_dims(src: Sequence[Placement], dst: Sequence[Placement]) -> set[int]:
    """Tensor dims a `_StridedShard` splits in `src` or `dst` whose per-mesh-dim sharding differs."""
    dims = {p.dim for p in (*src, *dst) if isinstance(p, _StridedShard)}

    def sharding(placements: Sequence[Placement], d: int) -> list[tuple[int, Placement]]:
        return [(m, p) for m, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard)) and p.dim == d]

    return {d for d in dims if sharding(src, d) != sharding(dst, d)}


def _estimated_cost(src: DTensorSpec, steps: tuple[Transition, ...]) -> float:
    """Mean seconds per rank of a plan under the cost model, with every rank's exact (uneven,
    padded) sizes: pure shape math, identical on every rank, so all ranks pick the same plan."""
    mesh_shape = src.mesh.shape
    priced: list[tuple[int, str, float]] = []
    coordinates = list(itertools.product(*(range(n) for n in mesh_shape)))
    for coordinate in coordinates:
        current = list(src.placements)
        for step in steps:
            m, n = step.mesh_dim, mesh_shape[step.mesh_dim]
            if not isinstance(step.src, Replicate) and n > 1:
                local = list(local_shape_and_offset(src.shape, mesh_shape, coordinate, current)[0])
                logical = logical_shape_before(src.shape, mesh_shape, coordinate, current, m)
                padded_dim = step.src.dim if isinstance(step.src, Shard) and isinstance(step.dst, Replicate) else None
                if isinstance(step.src, Partial) and isinstance(step.dst, Shard):
                    padded_dim = step.dst.dim
                if padded_dim is not None:  # fixed-size collectives pad to the largest chunk
                    full = -(-logical[padded_dim] // n)
                    local[padded_dim] = full * n if isinstance(step.dst, Shard) else full
                priced.append((m, step.kind, math.prod(local)))
            current[m] = step.dst
    return plan_seconds(src.mesh, src.dtype.itemsize, priced) / len(coordinates)


def redistribute_seconds(spec: DTensorSpec, target: Sequence[Placement] | None) -> float:
    """Moving `spec` to `target` along its planned transitions, even shards assumed (the cost
    model's seconds; what the dispatcher and the foreach rules compare)."""
    if target is None or tuple(target) == spec.placements:
        return 0.0
    mesh = spec.mesh
    current = list(spec.placements)
    total = 0.0
    for t in plan_transitions(spec, tuple(target)):
        total += collective_seconds(t.kind, _group_bytes(spec, current, t.mesh_dim), mesh, t.mesh_dim)
        current[t.mesh_dim] = t.dst
    return total


def _group_bytes(spec: DTensorSpec, current: Sequence[Placement], mesh_dim: int) -> float:
    """Bytes of the tensor one group along `mesh_dim` works on: sharded by the other mesh dims."""
    numel: float = math.prod(spec.shape)
    for m, p in enumerate(current):
        if m != mesh_dim and isinstance(p, Shard):
            numel /= spec.mesh.shape[m]
    return numel * spec.dtype.itemsize


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
        # consecutive steps one collective over the flattened mesh of their dims can do (as torch:
        # an HSDP (P, P) -> (R, R) with `dp` flattened is one all-reduce), else one step
        run = _fusable_run(steps, i) if fuse else steps[i : i + 1]
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


# ------------------------------------------------------------------------------------------------
# Consecutive collectives of one kind fused over a flattened mesh (as torch's redistribute does)
# ------------------------------------------------------------------------------------------------


def _fusable_run(steps: tuple[Transition, ...], start: int) -> tuple[Transition, ...]:
    """The longest run of steps from `start` that one collective over their mesh dims can do."""
    first = steps[start]
    if first.kind not in (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER) or is_strided((first.src, first.dst)):
        return (first,)
    run = [first]
    for step in steps[start + 1 :]:
        prev = run[-1]
        if step.kind != first.kind or step.src != first.src or step.dst != first.dst:
            break
        if first.kind == ALL_GATHER and step.mesh_dim > prev.mesh_dim:  # gathers undo inner dims first
            break
        if first.kind == REDUCE_SCATTER and step.mesh_dim < prev.mesh_dim:  # scatters nest outer first
            break
        run.append(step)
    return tuple(run)


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
    if first.kind == ALL_REDUCE:
        return collectives.all_reduce(local, cast(Partial, first.src).reduce_op, group, n, async_op=async_op)
    flat_coords = [list(coordinate) for _ in range(n)]
    for j, coord in enumerate(flat_coords):
        rest = j
        for m in reversed(dims):
            coord[m], rest = rest % mesh_shape[m], rest // mesh_shape[m]
    if first.kind == ALL_GATHER:
        dim = cast(Shard, first.src).dim
        sizes = [local_shape_and_offset(src.shape, mesh_shape, c, current)[0][dim] for c in flat_coords]
        return collectives.all_gather(local, dim, group, sizes, async_op=async_op)
    dim = cast(Shard, first.dst).dim
    if first.logical_shape[dim] % n:  # uneven: nested chunks need not be one chunking (torch too runs one per dim)
        return None
    index = 0  # this rank's row-major position on the flattened dims
    for m in dims:
        index = index * mesh_shape[m] + coordinate[m]
    reduce_op = cast(Partial, first.src).reduce_op
    return collectives.reduce_scatter(local, dim, reduce_op, group, index, async_op=async_op)


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


def layout_mismatch(local: torch.Tensor, spec: DTensorSpec) -> tuple[int, ...] | None:
    """The strides `local` should have to follow `spec`'s dim order, or None when it already does
    (or when `spec`'s strides are not dense: an expanded or sliced view has no order to follow)."""
    if local.is_contiguous() and _is_contiguous_stride(spec.shape, spec.stride):
        return None
    if local.numel() == 0 or local.ndim != spec.ndim or not is_dense(spec.shape, spec.stride):
        return None
    want = dense_stride_like(spec.stride, local.shape)
    return None if stride_order(local.shape, local.stride()) == stride_order(local.shape, want) else want


@lru_cache(maxsize=4096)
def _is_contiguous_stride(shape: torch.Size, stride: tuple[int, ...]) -> bool:
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


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
    if kind == ALL_GATHER:  # Shard or _StridedShard: both name their dim
        dim = cast(Shard, src).dim
        sizes = chunk_sizes(step.logical_shape[dim], n)
        return collectives.all_gather(local, dim, mesh.get_group(m), sizes, async_op=async_op)
    if kind == ALL_REDUCE:
        return collectives.all_reduce(local, cast(Partial, src).reduce_op, mesh.get_group(m), n, async_op=async_op)
    if kind == REDUCE_SCATTER:
        reduce_op = cast(Partial, src).reduce_op
        return collectives.reduce_scatter(
            local, cast(Shard, dst).dim, reduce_op, mesh.get_group(m), index, async_op=async_op
        )
    if kind == ALL_TO_ALL:
        return collectives.all_to_all(
            local, cast(Shard, src).dim, cast(Shard, dst).dim, mesh.get_group(m), index, list(step.logical_shape)
        )
    if kind == LOCAL_CHUNK and step.pieces > 1:
        return interleaved_chunk(local, cast(_StridedShard, dst).dim, step.pieces, n, index)
    if kind == LOCAL_CHUNK:
        dim = cast(Shard, dst).dim
        size, start = chunk_size_and_offset(local.shape[dim], n, index)
        return local.narrow(dim, start, size).clone(memory_format=torch.contiguous_format)
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


def interleaved_chunk(whole: torch.Tensor, dim: int, pieces: int, n: int, index: int) -> torch.Tensor:
    """Replicate -> interleaved `_StridedShard`: chunk `index` of each of the `pieces` pieces of
    `dim`, concatenated (torch's `_StridedShard._split_tensor`, one rank's shard)."""
    out, start = [], 0
    for piece in chunk_sizes(whole.shape[dim], pieces):
        size, at = chunk_size_and_offset(piece, n, index)
        out.append(whole.narrow(dim, start + at, size))
        start += piece
    return torch.cat(out, dim=dim).contiguous()


def partition_value(local: torch.Tensor, reduce_op: str, n: int, index: int) -> torch.Tensor:
    """R -> P on a group of `n`: this rank's piece, so that reducing the pieces gives `local` back."""
    if reduce_op == "prod":  # the first rank keeps the value, the others the identity of *
        return local if index == 0 else torch.ones_like(local)
    divisor = partition_divisor(reduce_op, n)
    return local / divisor if divisor != 1 else local


def check_target(src: DTensorSpec, dst_placements: tuple[Placement, ...]) -> None:
    """Reject targets the public `redistribute` refuses, before any communication (every rank raises
    the same error). As torch's, it never makes a Partial: a mesh dim may be Partial after only if it
    was the same Partial before. (Rules and backward still move Replicate -> Partial internally: a
    pending sum is a result of ops, not a layout users ask for. `DTensor.from_local(t, mesh,
    [Partial()])` declares one.)"""
    for m, (s, d) in enumerate(zip(src.placements, dst_placements)):
        if isinstance(d, Partial) and s != d:
            # torch's words and error type (RuntimeError; ours is also the ValueError of a misuse)
            raise ShardingError(
                f"Can not redistribute from {s} to {d} on mesh dim {m} (placements "
                f"{[str(p) for p in src.placements]} -> {[str(p) for p in dst_placements]}): redistribute "
                f"never creates a Partial; declare pending sums with DTensor.from_local(local, mesh, "
                f"[..., Partial(), ...]) or keep {s} on that mesh dim"
            )
