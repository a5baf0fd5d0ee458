"""The floor under a rank's model state, from the config alone (no torch).

Every rank holds its share of the parameters, their gradients and AdamW's two moments. The dry run's
`--search` drops a layout whose floor overflows the device before estimating it, and the pre-flight refuses a
CPU job whose ranks on this machine cannot hold theirs: such a job would otherwise start, allocate for minutes
and end killed by the kernel's OOM killer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from .sections import JobConfig

GIB = 2**30


class Degrees(Protocol):
    """The sharding degrees of a layout (ParallelDims, or the search's frozen Layout): read only."""

    @property
    def dp_shard(self) -> int: ...
    @property
    def cp(self) -> int: ...
    @property
    def tp(self) -> int: ...
    @property
    def pp(self) -> int: ...
    @property
    def ep(self) -> int: ...


def state_bytes_lower_bound(cfg: JobConfig, n_params: int, layout: Degrees) -> float:
    """A floor under the busiest rank's parameters, gradients and AdamW's two moments (and, under PP with
    FSDP, its stage's gathered parameters): every parameter split evenly over the ranks that shard it (tp,
    FSDP's dp_shard x cp, pp stages). The real shards are never smaller on the busiest rank (replicated norms,
    uneven chunks and stages only add), so a layout over the budget on this floor cannot fit."""
    element = 2 if cfg.training.dtype == "bfloat16" else 4
    state = 4 * element * n_params / (layout.tp * layout.dp_shard * layout.cp * layout.pp)
    if layout.pp > 1 and layout.dp_shard * layout.cp > 1 and cfg.parallelism.fsdp_reshard_after_forward != "always":
        # under PP, FSDP keeps a stage's parameters gathered through the step (trainer: reshard_after_forward
        # = not pp; the runtime: no reshard before the stage's last backward): all of them at its first forward
        gathered = 2 if cfg.training.mixed_precision_param == "bfloat16" else element
        # under expert parallelism the experts are gathered over fewer ranks than ep: dividing all by ep stays under
        state += gathered * n_params / (layout.tp * layout.pp * layout.ep)
    return state


def parameter_count(cfg: JobConfig, vocab_size: int) -> int:
    """The config's model's parameters with a `vocab_size` vocabulary, counted from the flavor's shapes."""
    from models.registry import job_model_args  # dataclasses only, no torch

    return int(job_model_args(cfg.model.name, cfg.model.flavor, vocab_size=vocab_size).parameter_count)


def check_host_memory(cfg: JobConfig, layout: Degrees, ranks_here: int, available: int) -> None:
    """Raise ValueError when `ranks_here` CPU ranks cannot hold their model state in `available` bytes."""
    vocab = max(cfg.model.vocab_size, 1)  # a tokenizer's vocabulary is not read here: the floor leaves it out (one row)
    n_params = parameter_count(cfg, vocab)
    per_rank = state_bytes_lower_bound(cfg, n_params, layout)
    if per_rank * ranks_here <= available:
        return
    shards = layout.tp * layout.dp_shard * layout.cp * layout.pp
    tables = "" if vocab else " (the vocabulary's tables left out: model.vocab_size is unset)"
    raise ValueError(
        f"model.flavor={cfg.model.flavor!r} does not fit this machine: its {n_params:,} parameters{tables}, their "
        f"gradients and AdamW's two moments in {cfg.training.dtype} need at least {per_rank / GIB:.1f} GiB a rank "
        f"(split over the {shards} ranks that shard them: dp_shard x cp x tp x pp), "
        f"{per_rank * ranks_here / GIB:.1f} GiB for the {ranks_here} ranks here (NGPU), and {available / GIB:.1f} GiB "
        f"of memory is available; train a smaller model.flavor, on more nodes (NNODES), or on GPUs"
    )


def available_host_memory() -> int | None:
    """The kernel's estimate of memory available to new work (/proc/meminfo MemAvailable), None off Linux."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def runs_on_cpu() -> bool:
    """run_train.sh found no GPU for this node's ranks (GPUS_HERE=0, its count_gpus): they will train on the CPU,
    in host memory. Unknown (the pre-flight run by hand) reads as False: nothing is refused on a guess."""
    return os.environ.get("GPUS_HERE") == "0"
