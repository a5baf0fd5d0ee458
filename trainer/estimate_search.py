"""`--search`: the layouts worth running for a model on a world, best predicted throughput first.

Enumerates pp (a power of two leaving each stage at least two layers; the config's schedule), tp (a power
of two up to the GPUs per node, dividing the heads), cp (a power of two up to MAX_CP that splits the
sequence into 2 x cp x tp pieces), dp_replicate x dp_shard = the rest (dp_shard 1 is DDP, dp_replicate 1
plain FSDP, between them HSDP), activation checkpointing none / selective / full, and the local batch for
the job's global batch (training.global_batch_size, or the config's local batch x its dp degree): every
local batch dividing it, largest first, stopping at the first that fits in the device memory less the
margin (a smaller one only re-gathers FSDP's parameters more often). Each candidate is one
`trainer.estimate.estimate`; the fitting ones are ranked by tok/s per device.

The pipeline microbatch stays the config's (pipeline_parallel_microbatch_size): under this model a larger
one only lengthens the bubble (fewer microbatches) and grows the activations 1F1B keeps in flight, so
the smallest is never worse.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

from models.llama3 import llama3_configs

from .config import load_config
from .devices import GIB, Device, gpus_per_node
from .estimate import Estimate, estimate
from .job_config import JobConfig
from .train import build_parallel_dims

logger = logging.getLogger(__name__)
AC_MODES = ("none", "selective", "full")
MAX_CP = 8  # torchtitan's long-context runs stop here; each doubling adds ring passes and halves a block


@dataclass(frozen=True, slots=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def overrides(self) -> list[str]:
        return [
            "--parallelism.data_parallel_replicate_degree", str(self.dp_replicate),
            "--parallelism.data_parallel_shard_degree", str(self.dp_shard),
            "--parallelism.context_parallel_degree", str(self.cp),
            "--parallelism.tensor_parallel_degree", str(self.tp),
            "--parallelism.pipeline_parallel_degree", str(self.pp),
        ]  # fmt: skip


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(n: int) -> list[int]:
    return [d for d in _divisors(n) if d & (d - 1) == 0]


def layouts(cfg: JobConfig, world_size: int, per_node: int) -> list[Layout]:
    """Every (dp_replicate, dp_shard, cp, tp, pp) for the model on `world_size` ranks (see the module doc)."""
    args = llama3_configs[cfg.model.flavor]
    kv_heads = args.n_kv_heads or args.n_heads
    seq = cfg.training.seq_len
    found = []
    for pp in (p for p in _powers_of_two(world_size) if p == 1 or args.n_layers >= 2 * p):
        for tp in (t for t in _powers_of_two(world_size // pp) if t <= per_node):
            if args.n_heads % tp or kv_heads % tp:
                continue
            for cp in (c for c in _powers_of_two(world_size // (pp * tp)) if c <= MAX_CP):
                if cp > 1 and seq % (2 * cp * tp):
                    continue
                dp = world_size // (pp * tp * cp)
                found += [Layout(r, dp // r, cp, tp, pp) for r in _divisors(dp)]
    return found


def global_batch(cfg: JobConfig, world_size: int) -> int:
    """The job's sequences per step: training.global_batch_size, else its local batch x its dp degree."""
    if cfg.training.global_batch_size > 0:
        return cfg.training.global_batch_size
    dims = build_parallel_dims(cfg.parallelism, world_size)
    return cfg.training.local_batch_size * dims.dp_replicate * dims.dp_shard


def search(
    cfg: JobConfig, world_size: int, device: Device, *, margin: float, argv: list[str] | None = None
) -> list[tuple[Estimate, list[str]]]:
    """Every fitting candidate with the overrides that run it, best tok/s per device first. `argv`: the
    config's own command line (the candidates' overrides go after it); the default rebuilds it from `cfg`."""
    base = argv if argv is not None else ["--job.config_file", cfg.job.config_file or ""]
    budget = device.memory_bytes * (1 - margin)
    batch = global_batch(cfg, world_size)
    found: list[tuple[Estimate, list[str]]] = []
    for layout in layouts(cfg, world_size, gpus_per_node()):
        if batch % layout.dp == 0:
            found += _search_layout(base, layout, batch, world_size, device, budget)
    found.sort(key=lambda pair: (-pair[0].tokens_per_s_per_device, pair[0].peak_bytes))
    return found


def _search_layout(
    base: list[str], layout: Layout, batch: int, world_size: int, device: Device, budget: float
) -> list[tuple[Estimate, list[str]]]:
    """The fitting candidates of one layout: per AC mode (none first), the largest local batch that fits.
    Pruned: a layout whose parameters, gradients and optimizer state alone overflow is dropped after one
    estimate, and once a mode fits at the largest local batch, more recomputation can only be slower."""
    locals_ = sorted(_divisors(batch // layout.dp), reverse=True)
    found: list[tuple[Estimate, list[str]]] = []
    for ac in AC_MODES:
        for local in locals_:
            overrides = [
                *layout.overrides(), "--activation_checkpoint.mode", ac,
                "--training.local_batch_size", str(local), "--training.global_batch_size", str(batch),
            ]  # fmt: skip
            gc.collect()  # the last candidate's model, optimizer and meshes (reference cycles)
            try:
                result = estimate(load_config([*base, *overrides]), world_size, device)
            except (ValueError, NotImplementedError) as error:
                logger.info("skipped %s: %s", " ".join(overrides), error)
                return found
            logger.info("%s: peak %.1f GiB", " ".join(overrides), result.peak_bytes / GIB)
            if result.steady_bytes > budget:
                return found  # no batch or AC mode makes room for the model state itself
            if result.peak_bytes <= budget:
                found.append((result, overrides))
                if local == locals_[0]:
                    return found
                break
    return found


def format_candidates(found: list[tuple[Estimate, list[str]]], cfg: JobConfig, *, margin: float) -> str:
    if not found:
        return f"no layout of {cfg.model.flavor} fits in the device memory with a {margin:.0%} margin"
    lines = [f"{'tok/s/dev':>10}{'mfu':>7}{'step s':>8}{'peak GiB':>10}  overrides"]
    for e, overrides in found:
        lines.append(f"{e.tokens_per_s_per_device:>10,.0f}{e.mfu:>7.1%}{e.time.step_s:>8.2f}"
                     f"{e.peak_bytes / GIB:>10.1f}  {' '.join(overrides)}")  # fmt: skip
    return "\n".join(lines)
