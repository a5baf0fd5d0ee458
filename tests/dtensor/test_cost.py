"""The α–β cost model: link choice per mesh dim, collective prices, overrides."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from parallelisms.dtensor.cost import (
    GLOO_LINKS,
    NCCL_LINKS,
    BackendLinks,
    CostModel,
    LinkCost,
    cost_model,
    use_cost_model,
)
from parallelisms.dtensor.transitions import transition_seconds


@dataclass(frozen=True, eq=False)
class RankGrid:
    """What the cost model reads from a DeviceMesh: its rank ids and shape."""

    mesh: torch.Tensor
    device_type: str = "cpu"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)


GRID = RankGrid(torch.arange(8).view(2, 4))  # 2 hosts of 4 ranks: dim 0 spans hosts, dim 1 does not
LINKS = BackendLinks(
    intra_host=LinkCost(latency_s=1e-6, bandwidth_bytes_per_s=1e11),
    inter_host=LinkCost(latency_s=1e-5, bandwidth_bytes_per_s=1e10),
)
TWO_HOSTS = CostModel(gloo=LINKS, host_size=4)


def test_mesh_dims_inside_a_host_use_the_intra_host_link() -> None:
    assert TWO_HOSTS.link(GRID, 1) == LINKS.intra_host
    assert TWO_HOSTS.link(GRID, 0) == LINKS.inter_host


def test_each_backend_prices_its_own_links() -> None:
    """A CPU mesh runs on gloo and a CUDA mesh on NCCL; `backend` prices every mesh as the one it names
    (the dry run plans a GPU job on fake CPU meshes). A collective costs what ~200 KB moved costs on gloo
    and ~4.5 MB on NCCL, so the latency weighs in choices between plans with different collective counts."""
    cuda_grid = RankGrid(GRID.mesh, device_type="cuda")
    model = CostModel(host_size=4)
    assert model.link(GRID, 1) == GLOO_LINKS.intra_host and model.link(GRID, 0) == GLOO_LINKS.inter_host
    assert model.link(cuda_grid, 1) == NCCL_LINKS.intra_host and model.link(cuda_grid, 0) == NCCL_LINKS.inter_host
    as_nccl = CostModel(backend="nccl", host_size=4)
    assert as_nccl.link(GRID, 1) == NCCL_LINKS.intra_host
    with use_cost_model(as_nccl):
        one_element = transition_seconds("all_reduce", 4, GRID, 1)
        assert one_element == pytest.approx(NCCL_LINKS.intra_host.latency_s, rel=1e-3)
    for links, moved in ((GLOO_LINKS, 200e3), (NCCL_LINKS, 4.5e6)):
        link = links.intra_host
        assert link.latency_s * link.bandwidth_bytes_per_s == pytest.approx(moved, rel=0.2)
        assert links.inter_host.latency_s > link.latency_s
        assert links.inter_host.bandwidth_bytes_per_s < link.bandwidth_bytes_per_s
    with pytest.raises(ValueError, match="CostModel.backend='mpi'"):
        CostModel(backend="mpi").link(GRID, 1)


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
    from parallelisms.dtensor.spec import DTensorSpec, TensorMeta
    from parallelisms.dtensor.transitions import _plan_transitions, plan_transitions

    mesh = init_device_mesh("cpu", (2,))
    t = torch.empty(4, 6)
    spec = DTensorSpec(mesh, (Replicate(),), TensorMeta(t.shape, t.stride(), t.dtype))
    plan_transitions(spec, (Shard(0),))  # planned now, or cached by an earlier test
    first = _plan_transitions.cache_info().misses
    with use_cost_model(TWO_HOSTS):
        plan_transitions(spec, (Shard(0),))  # planned again: another model may walk another way
    second = _plan_transitions.cache_info().misses
    plan_transitions(spec, (Shard(0),))  # the first model's plan, from the cache
    third = _plan_transitions.cache_info().misses
    with use_cost_model(CostModel()):  # equal to the default, so its plans are the default's
        plan_transitions(spec, (Shard(0),))
    return [second - first, third - second, _plan_transitions.cache_info().misses - third]


def test_redistribution_plans_are_cached_per_cost_model() -> None:
    from tests.world import run_world

    assert run_world(_plans_per_cost_model, 2) == [[1, 0, 0], [1, 0, 0]]


def test_coordinate_classes_stand_for_every_rank_exactly() -> None:
    """`_plan_seconds` prices one representative per class of ranks, weighted by the class's size, instead of
    every coordinate (a million for the dry run's 1,000,000-rank world). The weighted representatives must give
    every rank's shard shapes (in every state of the walk) as a multiset: any function of the shapes then sums
    the same, checked with a random one."""
    import collections
    import itertools
    import math
    import random

    from parallelisms.dtensor import Partial, Replicate, Shard
    from parallelisms.dtensor.placements import local_shape_and_offset
    from parallelisms.dtensor.transitions import _coordinate_classes

    rng = random.Random(0)
    choices = [Replicate(), Partial(), Shard(0), Shard(1)]
    for _ in range(300):
        mesh_shape = rng.choice([(2,), (5,), (8,), (2, 3), (4, 4), (3, 2, 2), (7, 3)])
        shape = (rng.randint(0, 12), rng.randint(1, 9))
        states = [[rng.choice(choices) for _ in mesh_shape] for _ in range(rng.randint(1, 3))]

        def shapes(c: tuple[int, ...], states: list = states, shape: tuple = shape, mesh: tuple = mesh_shape) -> tuple:
            return tuple(local_shape_and_offset(shape, mesh, c, s)[0] for s in states)

        value: collections.defaultdict[tuple, int] = collections.defaultdict(lambda: rng.getrandbits(40))
        classes = _coordinate_classes(shape, mesh_shape, states)
        assert sum(weight for _, weight in classes) == math.prod(mesh_shape)
        every_rank = sum(value[shapes(c)] for c in itertools.product(*(range(n) for n in mesh_shape)))
        assert sum(weight * value[shapes(tuple(c))] for c, weight in classes) == every_rank, (mesh_shape, states)
