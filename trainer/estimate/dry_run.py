"""The dry run of one layout: `estimate(cfg, world_size, device)`.

In one CPU process, with no GPU: a fake process group of N ranks; rank 0 builds the model on meta with
the trainer's own recipe under the config's degrees and runs one training step on fake tensors
(trainer.estimate.trace). Without PP every rank has the same role, so rank 0 represents them all; under
PP the first and the last stage are traced, each on its first rank, and the step is the slower's. It
reports memory per rank by category and its peak (trainer.estimate.live_bytes), the collectives by kind and
mesh dim, the FLOPs, and a step time, tok/s per device and MFU (trainer.estimate.pricing on the tables of
trainer.estimate.devices), as docs/architecture.md §7's object. trainer.estimate.search ranks layouts by it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from models.registry import job_model_args, model_family
from parallelisms.dtensor.cost import CostModel, use_cost_model
from parallelisms.expert_parallel.splits import assume_routing_imbalance
from parallelisms.parallel_dims import ParallelDims

from ..config.sections import JobConfig
from ..preflight import build_parallel_dims, check_config
from ..runtime import build_runtime, resolve_precision
from .devices import Device, gpus_per_node
from .pricing import StepTime, pipeline_stretch, price_step
from .sampling import trace_step_sampled
from .trace import StepTrace, job_vocab_size

logger = logging.getLogger(__name__)


LAYOUT_DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp")  # the JSON's "layout"


@dataclass(frozen=True)
class Role:
    """Ranks that hold the same shards and run the same step: all of them without PP; under PP the first
    and the last stage (the embedding's and the output's), each traced on its first rank."""

    name: str
    ranks: tuple[int, int]  # [first, last] global rank of the role (pp is the outermost mesh dim)
    trace: StepTrace
    time: StepTime


@dataclass(frozen=True)
class Estimate:
    """One layout's prediction: each role's memory and traffic; the step is the slowest role's."""

    world_size: int
    device: Device
    dims: ParallelDims
    roles: tuple[Role, ...]
    ac_mode: str
    local_batch_size: int
    warnings: tuple[str, ...] = ()  # what the layout wastes or risks, beside the numbers
    routing_imbalance: float = 1.0  # under EP: the busiest ep rank receives this x the mean routed rows

    @property
    def critical(self) -> Role:
        return max(self.roles, key=lambda r: r.time.step_s)

    @property
    def trace(self) -> StepTrace:
        """The slowest role's trace (the one whole role without PP)."""
        return self.critical.trace

    @property
    def time(self) -> StepTime:
        return self.critical.time

    @property
    def peak_bytes(self) -> int:
        """The highest peak of any role: what must fit on every device."""
        return max(r.trace.memory.peak for r in self.roles)

    @property
    def steady_bytes(self) -> int:
        return max(sum(r.trace.memory.steady.values()) for r in self.roles)

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.trace.local_tokens / self.time.step_s / self.dims.non_data_parallel_size

    @property
    def mfu(self) -> float:
        return self.tokens_per_s_per_device * self.trace.flops_per_token / (self.device.peak_tflops * 1e12)

    def as_json(self) -> dict[str, Any]:
        """docs/architecture.md §7's object (extra keys beside the contract's: detail, never in place of it)."""
        d = self.dims
        model_flops = self.trace.flops_per_token * self.trace.local_tokens / d.non_data_parallel_size
        return {
            "world_size": self.world_size,
            "device": self.device.name,
            "warnings": list(self.warnings),
            "layout": {name: getattr(d, name) for name in LAYOUT_DEGREES},
            "routing_imbalance": self.routing_imbalance,
            "ranks": [
                {
                    "role": r.name,
                    "ranks": list(r.ranks),
                    "memory_bytes": r.trace.memory.as_dict(),
                    "peak_where": r.trace.memory.peak_where,
                    "reserved_bytes": r.trace.memory.reserved,
                    "steady_bytes": r.trace.memory.steady,
                    "collectives": [dataclasses.asdict(c) for c in r.trace.collectives],
                    "executed_flops_per_step": r.trace.executed_flops,
                    "float8_flops_per_step": r.trace.float8_flops,
                    "float8_casts_per_step": r.trace.float8_casts,
                    "step_time_s": r.time.step_s,
                }
                for r in self.roles
            ],  # fmt: skip
            "flops_per_step": model_flops,  # model FLOPs (6N + 12 L d T per token) per device
            "step_time_s": self.time.step_s,
            "compute_s": self.time.compute_s,
            "exposed_comm_s": self.time.exposed_s,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "mfu": self.mfu,
            "activation_checkpoint": self.ac_mode,
            "local_batch_size": self.local_batch_size,
        }


def init_fake_world(world_size: int, rank: int = 0) -> None:
    """A fake process group of `world_size` ranks, this process rank `rank` (kept if one exists like it)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_world_size() == world_size and dist.get_rank() == rank:
            return
        if dist.get_backend() != "fake":
            raise RuntimeError(
                f"a process group of {dist.get_world_size()} ranks exists; the estimate needs a fake one of "
                f"{world_size}"
            )
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def roles_of(dims: ParallelDims, world_size: int) -> list[tuple[str, tuple[int, int]]]:
    """(name, [first, last] rank) of each role: one without PP; under PP the first and the last stage."""
    if not dims.pp_enabled:
        return [("all", (0, world_size - 1))]
    per_stage = world_size // dims.pp
    last = world_size - per_stage
    return [("first stage", (0, per_stage - 1)), ("last stage", (last, world_size - 1))]


def estimate(
    cfg: JobConfig,
    world_size: int,
    device: Device,
    *,
    nodes_of: int | None = None,
    every_block: bool = False,
    routing_imbalance: float = 1.0,
) -> Estimate:
    """One layout: the config's degrees on `world_size` ranks of `device` (NGPU per node unless `nodes_of`);
    `every_block`: trace every block instead of two samples (`trace_step_sampled`); `routing_imbalance`: under
    expert parallelism the traced rank is the busiest of its ep group, receiving this x the mean routed rows
    (parallelisms/expert_parallel/splits.py)."""
    check_config(cfg, world_size, local_files=False)  # the job's tokenizer and data live on the cluster
    if cfg.model.converters and not device.float8_tflops:
        raise ValueError(
            f"model.converters={cfg.model.converters} on --device {device.name}: it has no float8 tensor cores "
            f"(sm_89 or newer needed); set model.converters=[] or pick h100, h200 or b200"
        )
    dims = build_parallel_dims(cfg.parallelism, world_size)
    check_routing_imbalance(routing_imbalance, dims)
    roles = []
    per_node = nodes_of or gpus_per_node()
    # the DTensor plans are the target's: priced with its backend's links and hosts of `per_node` ranks
    target_links = CostModel(backend="gloo" if device.name == "cpu" else "nccl", host_size=per_node)
    for name, ranks in roles_of(dims, world_size):
        init_fake_world(world_size, ranks[0])
        with use_cost_model(target_links), assume_routing_imbalance(routing_imbalance), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fake tensors' data_ptr deprecation, from code that caches by pointer
            mesh = dims.build_mesh("cpu")
            runtime = build_runtime(cfg, dims, mesh, torch.device("cpu"))  # the tensors: fake, on the CPU
            precision = resolve_precision(cfg, torch.device("cpu" if device.name == "cpu" else "cuda"), dims)
            runtime = dataclasses.replace(runtime, precision=precision)  # the dtypes: the target device's
            stretch = 1.0 if runtime.pipeline is None else pipeline_stretch(runtime.pipeline)
            trace = trace_step_sampled(cfg, runtime, every_block=every_block)
        compiled = cfg.compile.enable and "model" in cfg.compile.components
        time = price_step(trace, dims, device, per_node, pipeline_stretch=stretch, compiled=compiled,
                          async_tp=cfg.parallelism.enable_async_tensor_parallel)  # fmt: skip
        roles.append(Role(name, ranks, trace, time))
    return Estimate(
        world_size, device, dims, tuple(roles), cfg.activation_checkpoint.mode, cfg.training.local_batch_size,
        warnings=padding_warnings(cfg, dims), routing_imbalance=routing_imbalance,
    )  # fmt: skip


def check_routing_imbalance(factor: float, dims: ParallelDims) -> None:
    """The busiest ep rank receives between the mean rows (1) and every rank's rows (ep x the mean)."""
    ceiling = dims.ep if dims.ep_enabled else math.inf
    if not 1 <= factor <= ceiling:
        bound = f"[1, expert_parallel_degree({dims.ep})]" if dims.ep_enabled else ">= 1"
        raise ValueError(
            f"--routing_imbalance {factor}: the busiest ep rank receives this x the mean routed tokens, so it lies "
            f"in {bound}: the mean at least, at most every rank's tokens"
        )


# TP splits dim 1 of these, dim 0 of the other matrices; an MoE's experts (E, ...) keep dim 0 whole, its router too
ROWWISE = ("attention.wo.weight", "feed_forward.w2.weight", "shared_experts.w2.weight")
_TP_KEEPS_ROWS = (".moe.experts.", ".moe.router.", "norm.weight")


def padding_warnings(cfg: JobConfig, dims: ParallelDims) -> tuple[str, ...]:
    """FSDP shards dim 0 of each parameter (what TP leaves of it) over dp_shard x cp ranks; where that degree
    exceeds the rows, the ranks past the last row hold only padding, and their memory and traffic are waste."""
    fsdp = dims.dp_shard * dims.cp
    if fsdp == 1:
        return ()
    args = job_model_args(cfg.model.name, cfg.model.flavor, vocab_size=job_vocab_size(cfg))
    shapes = model_family(cfg.model.name).parameter_shapes(args)
    split = (fqn for fqn in shapes if not fqn.endswith(ROWWISE) and not any(k in fqn for k in _TP_KEEPS_ROWS))
    rows = {fqn: shape[0] for fqn, shape in shapes.items()} | {fqn: shapes[fqn][0] // dims.tp for fqn in split}
    short = {fqn: n for fqn, n in rows.items() if n < fsdp}
    if not short:
        return ()
    fewest = min(short, key=short.__getitem__)
    return (
        f"dp_shard x cp = {fsdp} ranks shard dim 0 of {len(short)} of the {len(rows)} parameters, which have fewer "
        f"rows (the fewest: {fewest}, {short[fewest]}): ranks past the last row hold only padding, so the memory "
        f"and traffic estimated for them are waste; shard over fewer ranks (more tp, pp or dp_replicate)",
    )


LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
