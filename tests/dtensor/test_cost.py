"""The α–β cost model: link choice per mesh dim, collective prices, overrides."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from parallelisms.dtensor.cost import CostModel, LinkCost, cost_model, use_cost_model
from parallelisms.dtensor.redistribute import transition_seconds


@dataclass(frozen=True, eq=False)
class RankGrid:
    """What the cost model reads from a DeviceMesh: its rank ids and shape."""

    mesh: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)


GRID = RankGrid(torch.arange(8).view(2, 4))  # 2 hosts of 4 ranks: dim 0 spans hosts, dim 1 does not
TWO_HOSTS = CostModel(
    intra_host=LinkCost(latency_s=1e-6, bandwidth_bytes_per_s=1e11),
    inter_host=LinkCost(latency_s=1e-5, bandwidth_bytes_per_s=1e10),
    host_size=4,
)


def test_mesh_dims_inside_a_host_use_the_intra_host_link() -> None:
    assert TWO_HOSTS.link(GRID, 1) == TWO_HOSTS.intra_host
    assert TWO_HOSTS.link(GRID, 0) == TWO_HOSTS.inter_host


def test_collectives_cost_latency_plus_ring_volume_over_bandwidth() -> None:
    with use_cost_model(TWO_HOSTS):
        nbytes = 4e6
        assert transition_seconds("all_gather", nbytes, GRID, 1) == pytest.approx(1e-6 + nbytes * 3 / 4 / 1e11)
        assert transition_seconds("all_reduce", nbytes, GRID, 1) == pytest.approx(1e-6 + 2 * nbytes * 3 / 4 / 1e11)
        assert transition_seconds("all_to_all", nbytes, GRID, 1) == pytest.approx(1e-6 + nbytes * 3 / 16 / 1e11)
        assert transition_seconds("reduce_scatter", nbytes, GRID, 0) == pytest.approx(1e-5 + nbytes / 2 / 1e10)
        assert transition_seconds("local", nbytes, GRID, 0) < transition_seconds("all_gather", 1, GRID, 1)
    assert cost_model() != TWO_HOSTS  # the override ends with its context


def test_a_partition_costs_the_all_reduce_it_defers() -> None:
    """R -> P moves nothing now, but its value is read only after an all-reduce: it costs that
    all-reduce plus the copy, so reducing a Partial at once beats partitioning a Replicate into it."""
    with use_cost_model(TWO_HOSTS):
        nbytes = 4e6
        all_reduce = transition_seconds("all_reduce", nbytes, GRID, 1)
        partition = transition_seconds("local partition", nbytes, GRID, 1)
        assert all_reduce < partition == pytest.approx(all_reduce + nbytes / TWO_HOSTS.local_copy_bytes_per_s)
        assert transition_seconds("local chunk", nbytes, GRID, 1) < transition_seconds("all_gather", 1, GRID, 1)


def _plans_per_cost_model() -> list[int]:
    from parallelisms.dtensor import Replicate, Shard, init_device_mesh
    from parallelisms.dtensor.redistribute import _plan_transitions, plan_transitions
    from parallelisms.dtensor.spec import DTensorSpec, TensorMeta

    mesh = init_device_mesh("cpu", (2,))
    t = torch.empty(4, 6)
    spec = DTensorSpec(mesh, (Replicate(),), TensorMeta(t.shape, t.stride(), t.dtype))
    plan_transitions(spec, (Shard(0),))  # planned now, or cached by an earlier test
    first = _plan_transitions.cache_info().misses
    with use_cost_model(TWO_HOSTS):
        plan_transitions(spec, (Shard(0),))  # planned again: another model may walk another way
    second = _plan_transitions.cache_info().misses
    plan_transitions(spec, (Shard(0),))  # the first model's plan, from the cache
    return [second - first, _plan_transitions.cache_info().misses - second]


def test_redistribution_plans_are_cached_per_cost_model() -> None:
    from tests.world import run_world

    assert run_world(_plans_per_cost_model, 2) == [[1, 0], [1, 0]]
