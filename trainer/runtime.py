"""Runtime: the facts of where and how the job runs, resolved once from the config and the world.

The parallel degrees and the world mesh, this rank's device and data-parallel coordinates, whether the
loss is vocabulary-parallel, and the precision record. Every component reads them here; nothing
recomputes them from the config at its call site.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from parallelisms.context_parallel import SequenceSharding
from parallelisms.dtensor import DeviceMesh
from parallelisms.parallel_dims import ParallelDims

from .config.pipeline_setup import PipelineSetup, resolve_pipeline
from .config.sections import JobConfig
from .step import MicroBatches


@dataclass(frozen=True)
class Precision:
    """The dtypes of mixed precision: FSDP's parameter and gradient-reduce dtypes, and the autocast dtype
    of a forward no FSDP casts for (None: float32, nothing cast)."""

    param: torch.dtype | None = None
    reduce: torch.dtype | None = None
    autocast: torch.dtype | None = None

    def summary(self, device: torch.device, reduce_name: str) -> str:
        if self.param is None and self.autocast is None:
            where = "" if device.type == "cuda" else " (the CPU ignores training.mixed_precision_*)"
            return f"float32{where}"
        how = "autocast" if self.autocast is not None else f"FSDP params, {reduce_name} reduce"
        return f"mixed precision {self.param or self.autocast} ({how})".replace("torch.", "")


_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_precision(cfg: JobConfig, device: torch.device, parallel_dims: ParallelDims) -> Precision:
    """float32 on the CPU; on CUDA training.mixed_precision_param / _reduce, by FSDP when it shards the
    model, else by torch.autocast (torchtitan's choice without FSDP)."""
    if device.type != "cuda":
        return Precision()
    param = _DTYPES[cfg.training.mixed_precision_param]
    reduce = _DTYPES[cfg.training.mixed_precision_reduce]
    if param == torch.float32:
        return Precision(reduce=reduce)
    if parallel_dims.fsdp_enabled:
        return Precision(param=param, reduce=reduce)
    return Precision(reduce=reduce, autocast=param)


@dataclass(frozen=True)
class Runtime:
    """Where the job runs: its parallel degrees, the world mesh and this rank's device; how: loss
    parallelism, precision and the pipeline setup. dp_rank / dp_size are this rank's place on the data-loading
    "dp" dim."""

    parallel_dims: ParallelDims
    world_mesh: DeviceMesh
    device: torch.device
    loss_parallel: bool = False
    precision: Precision = field(default_factory=Precision)
    pipeline: PipelineSetup | None = None  # None: no pipeline parallelism
    dp_rank: int = field(init=False)
    dp_size: int = field(init=False)

    def __post_init__(self) -> None:
        dims = self.parallel_dims
        dp_size = dims.dp_replicate * dims.dp_shard
        object.__setattr__(self, "dp_size", dp_size)
        object.__setattr__(self, "dp_rank", self.world_mesh["dp"].get_local_rank() if dp_size > 1 else 0)

    @property
    def grad_average_size(self) -> int:
        """The ranks FSDP / DDP average gradients over: dp_replicate x dp_shard x cp (FSDP shards over
        dp_shard x cp). The loss is scaled up by it, being already a mean over the step's global targets."""
        return self.dp_size * self.parallel_dims.cp

    @cached_property
    def sequence(self) -> SequenceSharding | None:
        """This rank's share of each sequence under context parallelism (None without); made once."""
        return SequenceSharding.of(self.world_mesh["cp"]) if self.parallel_dims.cp_enabled else None

    def shard_sequences(self, micro_batches: MicroBatches) -> MicroBatches:
        """Each (inputs, labels) cut to this rank's tokens (context parallelism), else as given."""
        sequence = self.sequence
        if sequence is None:
            return micro_batches
        return [(sequence.shard(x), sequence.shard(y)) for x, y in micro_batches]

    @property
    def dp_cp_mesh(self) -> DeviceMesh | None:
        """The mesh the loss and the target count reduce over (None: a single data-parallel rank)."""
        return self.world_mesh["dp_cp"] if self.parallel_dims.dp_cp_enabled else None


def build_runtime(cfg: JobConfig, parallel_dims: ParallelDims, world_mesh: DeviceMesh, device: torch.device) -> Runtime:
    p = cfg.parallelism
    loss_parallel = parallel_dims.tp_enabled and p.enable_loss_parallel and not p.disable_loss_parallel
    precision = resolve_precision(cfg, device, parallel_dims)
    pipeline = resolve_pipeline(cfg) if parallel_dims.pp_enabled else None
    return Runtime(
        parallel_dims, world_mesh, device, loss_parallel=loss_parallel, precision=precision, pipeline=pipeline
    )
