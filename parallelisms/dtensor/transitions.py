"""The transition algebra of redistribution: the transition table, the walks that plan a
redistribution through it, the prices of its steps and plans, and the one ranking of candidate
shardings. Pure spec and shape math: nothing here issues a collective or touches a local tensor's
values (redistribute.py runs the plans), so the planners (planning.py, ops/foreach.py) price and
rank without the runners, and every rank computes the same answers.

One transition changes one mesh dim by the collective (or local step) that TRANSITIONS names for its
pair of placements (docs/architecture.md §3); only Replicate becomes Partial. The plan of a
redistribution is computed once per (spec, target, cost model) and carries each step's name;
`fusable_run` says which consecutive steps one collective on a flattened group can do.
`transition_seconds` prices a step from the bytes its group works on and `_plan_seconds` a whole walk
from each rank's padded payload (`_payload_numel`), both on cost.py's α–β links; `candidate_rank`
ranks a rule's candidate shardings by `redistribute_seconds`.

Mesh dims that shard the same tensor dim nest in mesh order, so a transition on mesh dim m is only
legal when no inner mesh dim (> m) still shards that tensor dim. The planner (after torch's)
first walks mesh dims inner -> outer, un-sharding whatever would break that nesting, then walks
outer -> inner to reach the targets; a source that shards nothing may skip the first walk when
that moves fewer bytes. Each transition is told the 'logical' shape its mesh dim splits,
computed from the placements current at that step, which is what uneven gathers need.

Also here: what the public `redistribute` refuses (`check_target`), where a gradient goes in
backward (`backward_placements`) and the strides a shard should have (`layout_mismatch`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, cast

from .cost import CALL_SECONDS, copy_seconds, cost_model, link_seconds
from .errors import ShardingError
from .placements import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
    application_order,
    is_strided,
    local_shape_and_offset,
    logical_shape_before,
    shards,
    strided_pieces,
)
from .spec import DTensorSpec, dense_stride_like, is_contiguous_stride, is_dense, stride_order

if TYPE_CHECKING:
    import torch

    from .device_mesh import DeviceMesh

# ------------------------------------------------------------------------------------------------
# The transition table
# ------------------------------------------------------------------------------------------------

# The names of the steps a transition takes; each is written here only.
ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER = "all_gather", "all_reduce", "all_to_all", "reduce_scatter"
LOCAL_CHUNK, LOCAL_PARTITION = "local chunk", "local partition"
UNREACHABLE = "unreachable"  # S -> P, or P between reduce ops: only Replicate becomes Partial

# What changes one mesh dim from a placement of the first type to one of the second.
TRANSITIONS: dict[tuple[type[Placement], type[Placement]], str] = {
    (Shard, Replicate): ALL_GATHER,
    (Partial, Replicate): ALL_REDUCE,
    (Shard, Shard): ALL_TO_ALL,  # S(i) -> S(j)
    (Partial, Shard): REDUCE_SCATTER,
    (Replicate, Shard): LOCAL_CHUNK,
    # sum: v / n; norm<p>: v / n**(1/p); avg/min/max: v; prod: v on the first rank, 1 on the others
    (Replicate, Partial): LOCAL_PARTITION,
    (_StridedShard, Replicate): ALL_GATHER,  # of the pieces the later mesh dims made
    (Replicate, _StridedShard): LOCAL_CHUNK,
}


def transition_kind(src: Placement, dst: Placement) -> str:
    """The TRANSITIONS name of changing one mesh dim from `src` to `dst`; UNREACHABLE if none."""
    for (src_type, dst_type), kind in TRANSITIONS.items():
        if isinstance(src, src_type) and isinstance(dst, dst_type):
            return kind
    return UNREACHABLE


@dataclass(frozen=True, slots=True)
class Transition:
    """Change mesh dim `mesh_dim` from `src` to `dst` by `kind` (its TRANSITIONS name);
    `logical_shape` is what that dim splits, into `pieces` chunked at once (an interleaved
    `_StridedShard`'s split_factor; 1 for every other placement)."""

    mesh_dim: int
    src: Placement
    dst: Placement
    logical_shape: tuple[int, ...]
    kind: str
    pieces: int = 1


# ------------------------------------------------------------------------------------------------
# Plans: walks through the table
# ------------------------------------------------------------------------------------------------


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
    return min(plans, key=lambda steps: _plan_seconds(src, steps))


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
            now = [i for i in range(mesh_dim) if shards(current[i], target.dim)]
            want = [i for i in range(mesh_dim) if shards(dst_placements[i], target.dim)]
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


def fusable_run(steps: tuple[Transition, ...], start: int) -> tuple[Transition, ...]:
    """The longest run of steps from `start` that one collective over the flattened group of their
    mesh dims can do (as torch: an HSDP (P, P) -> (R, R) with `dp` flattened is one all-reduce)."""
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


# ------------------------------------------------------------------------------------------------
# Prices
# ------------------------------------------------------------------------------------------------

# Bytes one rank sends in each collective on a tensor of `nbytes` (what its group of n works on).
# Ring volumes: all_gather and reduce_scatter send (n-1)/n of it, all_reduce twice that, all_to_all
# (n-1)/n of its own 1/n. Every other step is a local copy.
RING_VOLUME: dict[str, Callable[[float, int], float]] = {
    ALL_GATHER: lambda nbytes, n: nbytes * (n - 1) / n,
    REDUCE_SCATTER: lambda nbytes, n: nbytes * (n - 1) / n,
    ALL_REDUCE: lambda nbytes, n: 2 * nbytes * (n - 1) / n,
    ALL_TO_ALL: lambda nbytes, n: nbytes * (n - 1) / n / n,
}


def transition_seconds(kind: str, nbytes: float, mesh: DeviceMesh, mesh_dim: int) -> float:
    """One transition of `kind` (a TRANSITIONS name, or "local") over `mesh_dim` on a tensor of
    `nbytes` (what the group works on): a collective costs α once (the backend pipelines a ring's
    steps) plus its RING_VOLUME over β; anything else is a local copy.

    A local partition (R -> P) moves nothing now but owes a reduction: its value is only ever read
    after an all-reduce (or a reduce-scatter) of the same tensor, so it costs that all-reduce, plus
    the copy. Priced as a copy alone, the greedy planner partitioned every Replicate it met (R + P
    -> P) and each consumer that needed the value whole paid the reduction again (a nonlinear op
    and its backward, which reads the saved Partial input: two all-reduces where one was due). On
    the hand-sharded Llama (tests/dtensor/test_comm_cost.py, 2 ranks, 2 steps) this takes ours from
    146 collectives to 54 (torch: 208), and the AdamW program of test_independent_programs.py from
    105 to 83 (torch: 105). A deferral still wins where it saves a reduction outright (P + P -> P).
    """
    n = mesh.shape[mesh_dim]
    if n == 1:  # moves nothing, but the call is not free: plans that skip it must still win ties
        return CALL_SECONDS
    if kind == LOCAL_PARTITION:
        return transition_seconds(ALL_REDUCE, nbytes, mesh, mesh_dim) + copy_seconds(nbytes)
    volume = RING_VOLUME.get(kind)
    if volume is None:  # a local chunk (or a transition redistribute refuses)
        return copy_seconds(nbytes)
    return link_seconds(volume(nbytes, n), mesh, mesh_dim)


def _payload_numel(step: Transition, local: Sequence[int], logical: Sequence[int], n: int) -> int:
    """Elements a rank hands the step's collective, from its `local` shape and the `logical` shape
    its mesh dim splits (both before the step, at that rank's coordinate): fixed-size collectives
    pad to the largest chunk (a gather's shard to it, a reduce-scatter's input to n of it)."""
    shape = list(local)
    if step.kind == ALL_GATHER:
        dim = cast(Shard, step.src).dim
        shape[dim] = -(-logical[dim] // n)
    elif step.kind == REDUCE_SCATTER:
        dim = cast(Shard, step.dst).dim
        shape[dim] = -(-logical[dim] // n) * n
    return math.prod(shape)


def _plan_seconds(src: DTensorSpec, steps: tuple[Transition, ...]) -> float:
    """Mean seconds per rank of a plan's collectives, from every rank's exact (uneven, padded)
    payload: pure shape math, identical on every rank, so all ranks pick the same plan.

    Walks are compared by payload (the bytes CommDebugMode counts), choices between rules' inputs
    by `transition_seconds`' ring volumes on even shards: a walk changes the order of the same
    collectives, where payload and volume rank alike except on uneven pads. Ranks are priced by
    class (`_coordinate_classes`), so the cost does not grow with the world."""
    mesh, mesh_shape = src.mesh, src.mesh.shape
    states = _walk_states(src.placements, steps)
    total = 0.0
    for coordinate, ranks in _coordinate_classes(src.shape, mesh_shape, states):
        for step, current in zip(steps, states):
            n = mesh_shape[step.mesh_dim]
            if step.kind in RING_VOLUME and n > 1:  # a plan's steps carry this rank's shapes: recompute each rank's
                local = local_shape_and_offset(src.shape, mesh_shape, coordinate, current)[0]
                logical = logical_shape_before(src.shape, mesh_shape, coordinate, current, step.mesh_dim)
                payload = _payload_numel(step, local, logical, n) * src.dtype.itemsize
                total += ranks * link_seconds(payload, mesh, step.mesh_dim)
    return total / math.prod(mesh_shape)


def _walk_states(placements: Sequence[Placement], steps: Sequence[Transition]) -> list[list[Placement]]:
    """The placements before each step of a walk."""
    states, current = [], list(placements)
    for step in steps:
        states.append(list(current))
        current[step.mesh_dim] = step.dst
    return states


def _coordinate_classes(
    shape: Sequence[int], mesh_shape: Sequence[int], states: Sequence[Sequence[Placement]]
) -> list[tuple[list[int], int]]:
    """Representative mesh coordinates and how many ranks each stands for: ranks whose shards have the same
    shape in every state of a walk pay alike. Along a mesh dim that splits a tensor dim of size L into n
    `torch.chunk` pieces, the pieces are full up to rank L // ceil(L / n), then one partial, then empty: at most
    three kinds of rank per split, so a world of a million ranks prices as a handful (plain Shards only)."""
    classes: list[tuple[list[int], int]] = [([], 1)]
    for mesh_dim, n in enumerate(mesh_shape):
        refined = []
        for prefix, ranks in classes:
            breaks = {0, n}
            for placements in states:
                p = placements[mesh_dim]
                if isinstance(p, Shard):
                    padded = [*prefix, *[0] * (len(mesh_shape) - mesh_dim)]
                    size = logical_shape_before(shape, mesh_shape, padded, placements, mesh_dim)[p.dim]
                    full = -(-size // n) if size else 0
                    if full:
                        breaks.update(b for b in (size // full, size // full + 1) if 0 < b < n)
            edges = sorted(breaks)
            refined += [([*prefix, lo], ranks * (hi - lo)) for lo, hi in zip(edges, edges[1:])]
        classes = refined
    return classes


def redistribute_seconds(spec: DTensorSpec, target: Sequence[Placement] | None) -> float:
    """Moving `spec` to `target` along its planned transitions, even shards assumed (the cost
    model's seconds; what the dispatcher and the foreach rules compare)."""
    if target is None or tuple(target) == spec.placements:
        return 0.0
    mesh = spec.mesh
    current = list(spec.placements)
    total = 0.0
    for t in plan_transitions(spec, tuple(target)):
        total += transition_seconds(t.kind, _group_bytes(spec, current, t.mesh_dim), mesh, t.mesh_dim)
        current[t.mesh_dim] = t.dst
    return total


def candidate_rank(
    specs: Sequence[DTensorSpec],
    targets: Sequence[Sequence[Placement] | None],
    outputs: Sequence[Sequence[Placement] | None],
) -> tuple[float, int]:
    """The one ranking of a rule's candidate shardings (the dispatcher's `planning.choose` and the foreach
    rules): the seconds to move every input to its target, even shards assumed, so every rank ranks alike and
    picks the same candidate; then more sharded output dims first."""
    seconds = sum(redistribute_seconds(spec, target) for spec, target in zip(specs, targets))
    return seconds, -sum(isinstance(p, (Shard, _StridedShard)) for out in outputs if out for p in out)


def _group_bytes(spec: DTensorSpec, current: Sequence[Placement], mesh_dim: int) -> float:
    """Bytes of the tensor one group along `mesh_dim` works on: sharded by the other mesh dims."""
    numel: float = math.prod(spec.shape)
    for m, p in enumerate(current):
        if m != mesh_dim and isinstance(p, Shard):
            numel /= spec.mesh.shape[m]
    return numel * spec.dtype.itemsize


# ------------------------------------------------------------------------------------------------
# Targets and layouts
# ------------------------------------------------------------------------------------------------


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


def backward_placements(grad: DTensorSpec, forward_src: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """Where a gradient goes in backward: the forward source, except that a Partial source takes a
    Shard or Replicate grad as Replicate (a reduce in backward would be wasted work)."""
    return tuple(
        Replicate() if isinstance(f, Partial) and not isinstance(g, Partial) else f
        for g, f in zip(grad.placements, forward_src)
    )


def layout_mismatch(local: torch.Tensor, spec: DTensorSpec) -> tuple[int, ...] | None:
    """The strides `local` should have to follow `spec`'s dim order, or None when it already does
    (or when `spec`'s strides are not dense: an expanded or sliced view has no order to follow)."""
    if local.is_contiguous() and is_contiguous_stride(spec.shape, spec.stride):
        return None
    if local.numel() == 0 or local.ndim != spec.ndim or not is_dense(spec.shape, spec.stride):
        return None
    want = dense_stride_like(spec.stride, local.shape)
    return None if stride_order(local.shape, local.stride()) == stride_order(local.shape, want) else want
