"""The communication cost model: what moving bytes over a mesh dim costs, in seconds, under an
α–β model, with each backend's own link prices.

A collective on a mesh dim costs `α` (latency) plus the bytes one rank sends divided by the link
bandwidth `β`. The link is the mesh's backend's (gloo on CPU meshes, NCCL on CUDA ones, or the one
`CostModel.backend` names, as the dry run names its target's), inside one host or across hosts: a
mesh dim whose groups stay inside one host uses the intra-host link, one whose groups span hosts the
inter-host link (hosts are blocks of LOCAL_WORLD_SIZE ranks, as torchrun numbers them).
`use_cost_model(...)` overrides the defaults.

What each transition sends (ring volumes, padding) and so what a redistribution costs is
transitions.py's: it owns the transition table and prices its steps here. Everything the planners
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

from torch.utils._python_dispatch import _disable_current_modes

from .device_mesh import BACKEND_FOR_DEVICE

if TYPE_CHECKING:
    from .device_mesh import DeviceMesh

CALL_SECONDS = 1e-12  # a transition on a group of one: no data moves, a Python call still runs


@dataclass(frozen=True, slots=True)
class LinkCost:
    """α (seconds per collective) and β (bytes per second one rank sends) of a link."""

    latency_s: float
    bandwidth_bytes_per_s: float


@dataclass(frozen=True, slots=True)
class BackendLinks:
    """One backend's links: between ranks of one host and between hosts."""

    intra_host: LinkCost
    inter_host: LinkCost


# gloo, measured by bench/collective_latency.py on this project's 2-core CPU runners (2 ranks, medians): a
# 1-element all-reduce takes 95-125 µs on a quiet machine (260-370 µs with other tenants at load 2-3), and
# β is 0.5-2 GB/s; what a choice between plans weighs, α x β, the bytes one collective is worth, stays about
# 200 KB. Across hosts gloo runs over TCP: a 10 GbE link (1.25 GB/s) and a network round trip on top of α.
GLOO_LINKS = BackendLinks(
    intra_host=LinkCost(latency_s=100e-6, bandwidth_bytes_per_s=2e9),
    inter_host=LinkCost(latency_s=150e-6, bandwidth_bytes_per_s=1.25e9),
)
# NCCL, from published nccl-tests all_reduce_perf figures on H100 SXM: bus bandwidth 460-480 GB/s on one
# NVSwitch host, small-message time about 10 µs there; across hosts one 400 Gb/s NIC per GPU (50 GB/s,
# about 45 usable) and about 25 µs. β is bus bandwidth, the bytes one rank sends per second in a ring.
NCCL_LINKS = BackendLinks(
    intra_host=LinkCost(latency_s=10e-6, bandwidth_bytes_per_s=450e9),
    inter_host=LinkCost(latency_s=25e-6, bandwidth_bytes_per_s=45e9),
)


@dataclass(frozen=True, slots=True)
class CostModel:
    """Each backend's links; `local_copy` prices local chunking.

    `backend` None prices a mesh with its own backend's links (gloo for "cpu" meshes, NCCL for
    "cuda"); "gloo" or "nccl" prices every mesh as that backend, as the dry run plans a GPU job on
    fake CPU meshes. The latency matters to choices between plans with different collective counts
    on small tensors: at gloo's α a collective costs as much as 200 KB moved, at NCCL's as 4.5 MB.
    """

    gloo: BackendLinks = GLOO_LINKS
    nccl: BackendLinks = NCCL_LINKS
    backend: str | None = None
    # a local chunk is a copy: far cheaper than a collective, but not free, so that between two
    # plans with the same collectives the one that copies less wins (a partition also owes the
    # all-reduce that makes it whole again, see collective_seconds)
    local_copy_bytes_per_s: float = 1e14
    host_size: int = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or 1 << 30

    def backend_links(self, mesh: DeviceMesh) -> BackendLinks:
        backend = self.backend or BACKEND_FOR_DEVICE.get(getattr(mesh, "device_type", "cpu"), "gloo")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"CostModel.backend={backend!r}: the cost model prices 'gloo' and 'nccl' links")
        return self.nccl if backend == "nccl" else self.gloo

    def link(self, mesh: DeviceMesh, mesh_dim: int) -> LinkCost:
        """The intra-host link when every group along `mesh_dim` lies inside one host."""
        links = self.backend_links(mesh)
        if getattr(mesh, "mesh", None) is None:  # a stand-in mesh without rank ids (rule tests)
            return links.intra_host
        return links.inter_host if _spans_hosts(mesh, mesh_dim, self.host_size) else links.intra_host


@lru_cache(maxsize=1024)
def _spans_hosts(mesh: DeviceMesh, mesh_dim: int, host_size: int) -> bool:
    with _disable_current_modes():  # the rank ids are real: under fake or traced tensors too (compile, dry run)
        lines = mesh.mesh.movedim(mesh_dim, -1).reshape(-1, mesh.shape[mesh_dim]) // host_size
        return not bool((lines == lines[:, :1]).all())


# One object per distinct model, kept alive: plan caches key a model by its id, so equal models (the dry
# run makes one per estimate) share their plans, and no freed model's id is passed on to another.
_DEFAULT = CostModel()
_CANONICAL: dict[CostModel, CostModel] = {_DEFAULT: _DEFAULT}

# context-local, so one thread's planning under a model never changes another's (a frozen default: sharing is safe)
_MODEL: ContextVar[CostModel] = ContextVar("meshtrain_cost_model", default=_DEFAULT)


def cost_model() -> CostModel:
    return _MODEL.get()


@contextmanager
def use_cost_model(model: CostModel) -> Iterator[CostModel]:
    """Plan with `model` inside the context, in this thread / task. Plans are cached per model: leaving
    the context brings back the plans of the model outside."""
    model = _CANONICAL.setdefault(model, model)
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
