"""The step-time model: compute at the device's efficiency plus the exposed part of each mesh dim's traffic.

    step_s  = compute_s + sum over mesh dims of exposed_s(dim)
    compute_s = (executed FLOPs - float8 FLOPs) / (peak x efficiency)                 (trainer.estimate.devices)
              + float8 FLOPs / (float8 peak x efficiency)         (model.converters = ["float8"])
    comm_s(dim) = sum over its collectives of count x α + bytes sent / β               (α–β, as dtensor.cost)

β and α are the device's NVLink figures when every group of the dim lies inside one node (NGPU ranks in a
row, the mesh order pp, dp_replicate, dp_shard, cp, tp putting tp innermost; under expert parallelism dp_shard
is dp_shard_mod_ep, dp_shard_in_ep, and "ep" spans dp_shard_in_ep, cp and, with etp 1, tp:
ParallelDims.mesh_dims), else its network's. Bytes sent per rank follow the ring volumes of
parallelisms.dtensor.redistribute.RING_VOLUME, from the payload the rank hands the collective (an all-gather's
payload is its shard, so it sends (n-1) x payload; an all-to-all's, its rows, sends (n-1)/n of them).

float8 (models.float8): its matmuls' FLOPs run at the float8 peak, and every element cast to float8 costs
memory traffic at the HBM bandwidth, FLOAT8_CAST_BYTES per element. Eager, a cast with its amax is three
kernels (the amax reads the bf16 tensor, 2 bytes; the float32 product of tensor and scale reads it and
writes 4; the rounding to float8 reads those and writes 1: 13 bytes), 11 where the backward casts again
with the forward's scale; 3 of a linear's 5 casts take an amax: 12.2 bytes on average. Compiled, each fuses
into a read for the amax and a read and a write for the cast: 5 bytes.

Pipeline parallelism: each role (first and last stage) is traced on its own rank; the step takes the
schedule's makespan, simulated (parallelisms.pipeline_parallel.simulate) with the forward one unit and the
backward two: compute x (makespan / the busiest rank's busy time). Point-to-point passes are priced at
their sends, exposed.

Exposure: tensor- and context-parallel collectives sit on the critical path: fully exposed (ring attention's
passes overlap its block kernels in practice; the estimate does not credit that), and so are expert
parallelism's all-to-alls ("ep": the experts wait for their rows). Under async TP
(`parallelism.enable_async_tensor_parallel`) the blocks' TP collectives are rings of passes under their matmuls
(parallelisms/tensor_parallel/collective_matmul.py), with the same bytes: "tp" is priced as data-parallel
traffic is, exposed beyond the compute and at least one layer's worth (the embedding's and the output's
collectives are no rings). A point-to-point pass is
priced at its send; its receive costs nothing more.
Data-parallel traffic (FSDP's all-gathers and reduce-scatters, HSDP's and DDP's all-reduces) overlaps the
layers' compute, prefetched one layer ahead: exposed is what exceeds the compute, and at least the one
layer's worth that cannot overlap (the first all-gather, the last reduce-scatter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parallelisms.parallel_dims import FLATTENED, MESH_ORDER, ParallelDims
from parallelisms.pipeline_parallel import Costs, simulate

from ..config.pipeline_setup import PipelineSetup
from .devices import Device
from .trace import Collective, StepTrace

FLOAT8_CAST_BYTES = {"eager": 12.2, "compiled": 5.0}  # per element cast (module docstring)
# data-parallel dims (under EP also dp_shard's two mesh dims, FSDP's of the experts): hidden behind compute
OVERLAPPED = frozenset({"dp_replicate", "dp_shard", "dp_shard_mod_ep", "dp_shard_in_ep", *FLATTENED})


def _volume(kind: str, payload: float, n: int) -> float:
    """Bytes one rank sends for a collective on a group of n, from the payload it handed it."""
    if n <= 1:
        return 0.0
    if kind.startswith("all_gather"):
        return payload * (n - 1)
    if kind.startswith("reduce_scatter") or kind.startswith("all_to_all"):
        return payload * (n - 1) / n
    if kind.startswith("all_reduce"):
        return 2 * payload * (n - 1) / n
    return payload  # broadcast, scatter, gather, reduce: once


def _base_dims(dims: ParallelDims, name: str) -> tuple[dict[str, int], tuple[str, ...]]:
    """(every mesh dim in order with its degree, the ones `name` spans): a mesh dim, a flattened one, "world", or
    under EP "dp_shard" (its two mesh dims there)."""
    degrees, flattened = dims.mesh_dims()
    if name == "world":
        return degrees, tuple(degrees)
    if name == "dp_shard" and name not in degrees:
        return degrees, ("dp_shard_mod_ep", "dp_shard_in_ep")
    return degrees, flattened.get(name, (name,))


def dim_extent(dims: ParallelDims, name: str) -> tuple[int, int]:
    """(group size, stride between its ranks) of a mesh dim or flattened dim, in the mesh order."""
    degrees, parts = _base_dims(dims, name)
    order = list(degrees)
    size = math.prod(degrees[d] for d in parts)
    stride = math.prod(degrees[d] for d in order[order.index(parts[-1]) + 1 :])
    return size, stride


def priced_dim(dims: ParallelDims, name: str) -> str:
    """The dim a collective's row is priced on: its own, or the world's for a group of no mesh dim ("other")."""
    degrees, flattened = dims.mesh_dims()
    return name if name in (*degrees, *flattened, *MESH_ORDER) else "world"


def spans_nodes(dims: ParallelDims, name: str, gpus_per_node: int) -> bool:
    """Whether a group of the dim holds ranks of two or more nodes (blocks of `gpus_per_node` ranks)."""
    size, stride = dim_extent(dims, name)
    return size > 1 and size * stride > gpus_per_node


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_s: dict[str, float]  # per mesh dim, the whole traffic
    exposed_s: dict[str, float]  # per mesh dim, the part on the critical path
    inter_node: dict[str, bool]  # per mesh dim, whether it is priced on the network
    step_s: float
    bubble_s: float = 0.0  # pipeline parallelism: the rank's idle time in the schedule


def collective_seconds(c: Collective, dims: ParallelDims, device: Device, gpus_per_node: int) -> float:
    """count x α + bytes sent / β of one row of the trace (a group not of the mesh is priced as the world)."""
    if c.kind.startswith("recv"):  # a point-to-point pass is priced once, at its send
        return 0.0
    name = priced_dim(dims, c.mesh_dim)
    size, _ = dim_extent(dims, name)
    link = device.inter_node if spans_nodes(dims, name, gpus_per_node) else device.intra_node
    if size <= 1:
        return 0.0
    return c.count * link.latency_s + _volume(c.kind, c.bytes, size) / link.bandwidth_bytes_per_s


def price_step(
    trace: StepTrace,
    dims: ParallelDims,
    device: Device,
    gpus_per_node: int,
    *,
    pipeline_stretch: float = 1.0,
    compiled: bool = False,
    async_tp: bool = False,
) -> StepTime:
    """The step time of `trace` on `device` (see the module docstring). `pipeline_stretch`: the schedule's
    makespan over one rank's busy time (`pipeline_stretch`); the rest of it is the rank's bubble. `compiled`:
    the blocks run under torch.compile (float8 casts fused). `async_tp`: TP's collectives overlap the matmuls."""
    rate = 1e12 * device.efficiency
    float8_s = trace.float8_flops / (device.float8_tflops * rate) if trace.float8_flops else 0.0
    cast_bytes = FLOAT8_CAST_BYTES["compiled" if compiled else "eager"] * trace.float8_casts
    float8_s += cast_bytes / device.memory_bytes_per_s
    compute_s = (trace.executed_flops - trace.float8_flops) / (device.peak_tflops * rate) + float8_s
    bubble_s = compute_s * (pipeline_stretch - 1)
    comm: dict[str, float] = {}
    for c in trace.collectives:
        comm[c.mesh_dim] = comm.get(c.mesh_dim, 0.0) + collective_seconds(c, dims, device, gpus_per_node)
    exposed = {}
    for dim, seconds in comm.items():
        if dim in OVERLAPPED or (async_tp and dim == "tp"):
            exposed[dim] = max(seconds - compute_s, seconds / max(trace.n_layers, 1))
        else:
            exposed[dim] = seconds
    inter = {dim: spans_nodes(dims, priced_dim(dims, dim), gpus_per_node) for dim in comm}
    return StepTime(compute_s, comm, exposed, inter, compute_s + bubble_s + sum(exposed.values()), bubble_s)


def pipeline_stretch(setup: PipelineSetup) -> float:
    """The makespan of the schedule over the busiest rank's compute (F = 1, B = 2, or I = W = 1), simulated."""
    result = simulate(setup.schedule.generate(setup.pp, setup.stages_per_rank, setup.microbatches), Costs())
    return result.makespan / max(result.busy.values())
