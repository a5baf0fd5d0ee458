"""The communication cost model: what moving bytes over a mesh dim costs, in seconds, under an
α–β model.

A collective on a mesh dim costs `α` (latency) plus the bytes one rank sends divided by the link
bandwidth `β`. A mesh dim whose groups stay inside one host uses the intra-host link, one whose
groups span hosts the inter-host link (hosts are blocks of LOCAL_WORLD_SIZE ranks, as torchrun
numbers them). `use_cost_model(...)` overrides the defaults.

What each transition sends (ring volumes, padding) and so what a redistribution costs is
redistribute.py's: it owns the transition table and prices its steps here. Everything the planners
compare goes through there: the dispatcher's choice between a rule's Shardings, the foreach rules,
and `plan_transitions` choosing between walks. Costs are pure shape math, the same on every rank,
so every rank picks the same plan.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .device_mesh import DeviceMesh

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
    Counts moved with what a local partition costs (redistribute.transition_seconds), not with α.
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


def link_seconds(sent_bytes: float, mesh: DeviceMesh, mesh_dim: int) -> float:
    """One collective step on `mesh_dim` in which each rank sends `sent_bytes`: α plus the bytes over β."""
    link = cost_model().link(mesh, mesh_dim)
    return link.latency_s + sent_bytes / link.bandwidth_bytes_per_s


def copy_seconds(nbytes: float) -> float:
    """A local copy of `nbytes` (a chunk or a partition of a replicated value)."""
    return nbytes / cost_model().local_copy_bytes_per_s
