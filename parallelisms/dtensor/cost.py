"""The communication cost model: what moving a DTensor costs, in seconds, under an α–β model.

Every collective on a mesh dim costs `α` (latency) plus the bytes one rank sends divided by the
link bandwidth `β`. A mesh dim whose groups stay inside one host uses the intra-host
link, one whose groups span hosts the inter-host link (hosts are blocks of LOCAL_WORLD_SIZE ranks,
as torchrun numbers them). `use_cost_model(...)` overrides the defaults.

The transition table (TRANSITIONS) lives here too: it names the collective that changes one mesh
dim, once, for the redistribution that runs it, the prices below and the MESHTRAIN_DEBUG log.

Everything the planners compare goes through here: the dispatcher's choice between a rule's
Shardings (their input redistributions, `redistribute.redistribute_seconds`; a Partial input's
reduction is priced by the op that consumes it, a Replicate made Partial by the op that makes it),
the foreach rules, and `plan_transitions`
choosing between walks. Costs use even shards (global sizes over mesh sizes) unless a caller
passes exact per-rank sizes, so that every rank computes the same number and picks the same plan.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from .placements import Partial, Placement, Replicate, Shard, _StridedShard

if TYPE_CHECKING:
    from .device_mesh import DeviceMesh

# The names of the steps a transition takes; each is written here only.
ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER = "all_gather", "all_reduce", "all_to_all", "reduce_scatter"
LOCAL_CHUNK, LOCAL_PARTITION = "local chunk", "local partition"
UNREACHABLE = "unreachable"  # S -> P, or P between reduce ops: only Replicate becomes Partial

# The transition table (DESIGN.md §3): what changes one mesh dim from a placement of the first type
# to one of the second. Transitions carry their entry; redistribute.run_transition runs it.
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

# Bytes one rank sends in each collective on a tensor of `nbytes` (what its group of n works on).
# Ring volumes: all_gather and reduce_scatter send (n-1)/n of it, all_reduce twice that, all_to_all
# (n-1)/n of its own 1/n. Every other step is a local copy.
RING_VOLUME: dict[str, Callable[[float, int], float]] = {
    ALL_GATHER: lambda nbytes, n: nbytes * (n - 1) / n,
    REDUCE_SCATTER: lambda nbytes, n: nbytes * (n - 1) / n,
    ALL_REDUCE: lambda nbytes, n: 2 * nbytes * (n - 1) / n,
    ALL_TO_ALL: lambda nbytes, n: nbytes * (n - 1) / n / n,
}


CALL_SECONDS = 1e-12  # a transition on a group of one: no data moves, a Python call still runs


@dataclass(frozen=True, slots=True)
class LinkCost:
    """α (seconds per collective step) and β (bytes per second one rank sends) of a link."""

    latency_s: float
    bandwidth_bytes_per_s: float


@dataclass(frozen=True, slots=True)
class CostModel:
    """Link costs inside a host and across hosts; `local_copy` prices local chunking.

    The default α is small (about 1 KiB of bandwidth), far below a real one: gloo on this
    project's CPU runners takes a median 0.1 ms for a 1-element all-reduce on 2 ranks (95-125 µs
    over three runs of 2,000; 4 KiB: 0.24 ms, 1 MiB: 0.58 ms, about 2 GB/s). It stays small
    because no choice depends on it: on the hand-sharded Llama (tests/dtensor/test_comm_cost.py)
    and the programs of tests/dtensor/test_independent_programs.py, 2 and 4 ranks, α of 10 ns,
    10 µs and 100 µs give the same collectives and bytes (54 on the Llama's 2 steps; torch: 208).
    Counts moved with what a local partition costs (collective_seconds), not with α.
    """

    intra_host: LinkCost = LinkCost(latency_s=1e-8, bandwidth_bytes_per_s=100e9)
    inter_host: LinkCost = LinkCost(latency_s=8e-8, bandwidth_bytes_per_s=12.5e9)
    # a local chunk is a copy: far cheaper than a collective, but not free, so that between two
    # plans with the same collectives the one that copies less wins (a partition also owes the
    # all-reduce that makes it whole again, see collective_seconds)
    local_copy_bytes_per_s: float = 1e14
    host_size: int = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or 1 << 30

    def link(self, mesh: DeviceMesh, mesh_dim: int) -> LinkCost:
        """The intra-host link when every group along `mesh_dim` lies inside one host."""
        if getattr(mesh, "mesh", None) is None:  # a stand-in mesh without rank ids (rule tests)
            return self.intra_host
        return self.inter_host if _spans_hosts(mesh, mesh_dim, self.host_size) else self.intra_host


@lru_cache(maxsize=1024)
def _spans_hosts(mesh: DeviceMesh, mesh_dim: int, host_size: int) -> bool:
    lines = mesh.mesh.movedim(mesh_dim, -1).reshape(-1, mesh.shape[mesh_dim]) // host_size
    return not bool((lines == lines[:, :1]).all())


# context-local, so one thread's planning under a model never changes another's
_MODEL: ContextVar[CostModel] = ContextVar("meshtrain_cost_model", default=CostModel())  # noqa: B039 (frozen)


# every model ever planned with, kept alive: plan caches key a model by its id, which a freed one could pass on
_PLANNED_WITH: dict[int, CostModel] = {}


def cost_model() -> CostModel:
    return _MODEL.get()


@contextmanager
def use_cost_model(model: CostModel) -> Iterator[CostModel]:
    """Plan with `model` inside the context, in this thread / task. Plans are cached per model: leaving
    the context brings back the plans of the model outside."""
    _PLANNED_WITH.setdefault(id(model), model)
    token = _MODEL.set(model)
    try:
        yield model
    finally:
        _MODEL.reset(token)


def collective_seconds(kind: str, nbytes: float, mesh: DeviceMesh, mesh_dim: int) -> float:
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
    model = cost_model()
    copy = nbytes / model.local_copy_bytes_per_s
    if kind == LOCAL_PARTITION:
        return collective_seconds(ALL_REDUCE, nbytes, mesh, mesh_dim) + copy
    volume = RING_VOLUME.get(kind)
    if volume is None:  # a local chunk (or a transition redistribute refuses)
        return copy
    link = model.link(mesh, mesh_dim)
    return link.latency_s + volume(nbytes, n) / link.bandwidth_bytes_per_s


def transition_kind(src: Placement, dst: Placement) -> str:
    """The TRANSITIONS name of changing one mesh dim from `src` to `dst`; UNREACHABLE if none."""
    for (src_type, dst_type), kind in TRANSITIONS.items():
        if isinstance(src, src_type) and isinstance(dst, dst_type):
            return kind
    return UNREACHABLE


def plan_seconds(mesh: DeviceMesh, elsize: int, steps: Sequence[tuple[int, str, float]]) -> float:
    """A plan given as (mesh dim, kind, elements one rank sends) per step, exact sizes."""
    model = cost_model()
    total = 0.0
    for mesh_dim, kind, sent in steps:
        if kind not in RING_VOLUME or mesh.shape[mesh_dim] == 1:
            continue
        link = model.link(mesh, mesh_dim)
        total += link.latency_s + sent * elsize / link.bandwidth_bytes_per_s
    return total
