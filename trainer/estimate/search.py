"""`--search`: the layouts worth running for a model on a world, best predicted throughput first.

Enumerates pp (a power of two leaving each stage at least two layers; the config's schedule), tp (a power
of two up to the GPUs per node, dividing the heads), cp (a power of two up to MAX_CP that splits the
sequence into 2 x cp x tp pieces), dp_replicate x dp_shard = the rest (dp_shard 1 is DDP, dp_replicate 1
plain FSDP, between them HSDP), for an MoE model ep (1, and each divisor of num_experts that ParallelDims
accepts on that layout, with etp 1 and, under TP, etp = tp), activation checkpointing none / selective / full,
and the local batch for the job's global batch (training.global_batch_size, or the config's local batch x its
dp degree): every local batch dividing it, largest first, stopping at the first that fits in the device memory
less the margin (a smaller one only re-gathers FSDP's parameters more often). Each candidate is one
`trainer.estimate.dry_run.estimate`; the fitting ones are ranked by tok/s per device. A layout whose model state
alone cannot fit is dropped before any estimate, and the layouts are estimated on one process per core.

The pipeline microbatch stays the config's (pipeline_parallel_microbatch_size): under this model a larger
one only lengthens the bubble (fewer microbatches) and grows the activations 1F1B keeps in flight, so
the smallest is never worse.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from models.registry import flavor_args, moe_args_of

from ..config import load_config, state_floor
from ..config.sections import JobConfig
from ..config.state_floor import state_bytes_lower_bound
from ..preflight import build_parallel_dims, check_names
from .devices import GIB, Device, gpus_per_node
from .dry_run import LOG_FORMAT, Estimate, estimate
from .trace import job_vocab_size

logger = logging.getLogger(__name__)
AC_MODES = ("none", "selective", "full")
MIN_LAYOUTS_PER_WORKER = 8  # fewer run in this process: starting a worker costs a few estimates' time
MAX_CP = 8  # torchtitan's long-context runs stop here; each doubling adds ring passes and halves a block


@dataclass(frozen=True, slots=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int = 1
    etp: int = 1
    experts: bool = False  # an MoE model: the overrides set the ep keys too (the config's may not be 1)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def overrides(self) -> list[str]:
        ep = ["--parallelism.expert_parallel_degree", str(self.ep),
              "--parallelism.expert_tensor_parallel_degree", str(self.etp)]  # fmt: skip
        return [
            "--parallelism.data_parallel_replicate_degree", str(self.dp_replicate),
            "--parallelism.data_parallel_shard_degree", str(self.dp_shard),
            "--parallelism.context_parallel_degree", str(self.cp),
            "--parallelism.tensor_parallel_degree", str(self.tp),
            "--parallelism.pipeline_parallel_degree", str(self.pp),
            *(ep if self.experts or self.ep > 1 else []),
        ]  # fmt: skip


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(n: int) -> list[int]:
    return [d for d in _divisors(n) if d & (d - 1) == 0]


def layouts(cfg: JobConfig, world_size: int, per_node: int) -> list[Layout]:
    """Every (dp_replicate, dp_shard, cp, tp, pp) for the model on `world_size` ranks (see the module doc), and for
    an MoE model every (ep, etp) of each (`expert_layouts`)."""
    args = flavor_args(cfg.model.name, cfg.model.flavor)
    moe = moe_args_of(args)
    kv_heads = getattr(args, "n_kv_heads", None) or args.n_heads
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
                dense = [Layout(r, dp // r, cp, tp, pp) for r in _divisors(dp)]
                found += dense if moe is None else [e for d in dense for e in expert_layouts(d, moe.num_experts)]
    return found


def expert_layouts(layout: Layout, num_experts: int) -> list[Layout]:
    """`layout` without expert parallelism, and with each ep that divides `num_experts` and the ranks it borrows
    (dp_shard x cp, x tp with etp 1) and spans whole cp (and, etp 1, tp) groups (ParallelDims' constraints), for
    etp 1 and, under TP, etp = tp."""
    found = [replace(layout, experts=True)]
    for etp in sorted({1, layout.tp}):
        whole = layout.cp * (layout.tp if etp == 1 else 1)
        for ep in _divisors(layout.dp_shard * whole):
            if ep > 1 and ep % whole == 0 and num_experts % ep == 0:
                found.append(replace(layout, ep=ep, etp=etp, experts=True))
    return found


def global_batch(cfg: JobConfig, world_size: int) -> int:
    """The job's sequences per step: training.global_batch_size, else its local batch x its dp degree."""
    if cfg.training.global_batch_size > 0:
        return cfg.training.global_batch_size
    dims = build_parallel_dims(cfg.parallelism, world_size)
    return cfg.training.local_batch_size * dims.dp_replicate * dims.dp_shard


def search(
    cfg: JobConfig,
    world_size: int,
    device: Device,
    *,
    margin: float,
    argv: list[str] | None = None,
    workers: int | None = None,
    routing_imbalance: float = 1.0,
) -> list[tuple[Estimate, list[str]]]:
    """Every fitting candidate with the overrides that run it, best tok/s per device first. `argv`: the
    config's own command line (the candidates' overrides go after it); the default rebuilds it from `cfg`.
    Layouts whose model state cannot fit are dropped without an estimate (`state_bytes_lower_bound`); the
    others are estimated on `workers` processes (default: one per core this process may use).
    `routing_imbalance`: each expert-parallel candidate's (`dry_run.estimate`)."""
    check_names(cfg)  # the candidates' own estimates check the rest, each with its degrees
    base = argv if argv is not None else ["--job.config_file", cfg.job.config_file or ""]
    budget = device.memory_bytes * (1 - margin)
    batch = global_batch(cfg, world_size)
    n_params = parameter_count(cfg)
    todo = [
        layout for layout in layouts(cfg, world_size, gpus_per_node())
        if batch % layout.dp == 0 and state_bytes_lower_bound(cfg, n_params, layout) <= budget
    ]  # fmt: skip
    families: dict[tuple[int, ...], list[Layout]] = {}
    for layout in sorted(todo, key=lambda layout: layout.dp_replicate):
        families.setdefault((layout.pp, layout.tp, layout.cp, layout.ep, layout.etp), []).append(layout)
    jobs = [(base, family, batch, world_size, device, budget, routing_imbalance) for family in families.values()]
    workers = min(workers or len(os.sched_getaffinity(0)), len(todo) // MIN_LAYOUTS_PER_WORKER)
    logger.info("%d layouts in %d families to estimate on %d processes", len(todo), len(jobs), max(workers, 1))
    if workers <= 1:
        per_family = [_search_family(*job) for job in jobs]
    else:  # spawned: a fresh interpreter per worker, no inherited process group or OpenMP state
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker) as pool:
            per_family = list(pool.map(_search_family, *zip(*jobs)))
    found = [candidate for candidates in per_family for candidate in candidates]
    found.sort(key=lambda pair: (-pair[0].tokens_per_s_per_device, pair[0].peak_bytes))
    return found


def _search_family(
    base: list[str], family: list[Layout], batch: int, world_size: int, device: Device, budget: float,
    routing_imbalance: float = 1.0,
) -> list[tuple[Estimate, list[str]]]:  # fmt: skip
    """The layouts of one (pp, tp, cp, ep, etp), the most sharded split of the data-parallel ranks first
    (dp_replicate 1): replicating more only adds model state per rank, so once a split cannot fit even its most
    frugal candidate, no split after it can."""
    found: list[tuple[Estimate, list[str]]] = []
    for layout in family:
        candidates = _search_layout(base, layout, batch, world_size, device, budget, routing_imbalance)
        if candidates is None:
            break
        found += candidates
    return found


def parameter_count(cfg: JobConfig) -> int:
    """The model's parameters at the job's vocabulary (its tokenizer's when model.vocab_size is unset)."""
    return state_floor.parameter_count(cfg, job_vocab_size(cfg))


def _init_worker() -> None:
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    logger.setLevel(logging.INFO)


def _search_layout(
    base: list[str], layout: Layout, batch: int, world_size: int, device: Device, budget: float,
    routing_imbalance: float = 1.0,
) -> list[tuple[Estimate, list[str]]] | None:  # fmt: skip
    """The fitting candidates of one layout: per AC mode (none first), the largest local batch that fits.

    The peak grows with the local batch and shrinks with more recomputation, so: the fastest candidate (no
    AC, the largest local batch) is estimated first, and when it fits it is the layout's only one; then the most
    frugal (full AC, the smallest local batch), and when it overflows nothing of the layout fits;
    each mode's largest fitting local batch is found by bisection; and a mode is only tried on local batches
    above the last mode's, since more recomputation on as many tokens can only be slower. None: not even the
    most frugal candidate fits (`_search_family` then stops)."""
    locals_ = sorted(_divisors(batch // layout.dp))
    memo: dict[tuple[str, int], Estimate | None] = {}

    def run(ac: str, local: int) -> Estimate | None:
        if (ac, local) not in memo:
            memo[ac, local] = _estimate(base, layout, batch, world_size, device, ac, local, routing_imbalance)
        return memo[ac, local]

    def fits(ac: str, local: int) -> bool:
        result = run(ac, local)
        return result is not None and result.peak_bytes <= budget

    if fits(AC_MODES[0], locals_[-1]):  # no recomputation at the largest local batch: nothing is faster
        return [(run(AC_MODES[0], locals_[-1]), _overrides(layout, AC_MODES[0], locals_[-1], batch))]  # type: ignore[list-item]
    if not fits(AC_MODES[-1], locals_[0]):
        return None
    found: list[tuple[Estimate, list[str]]] = []
    floor = 0  # locals_[floor:] are larger than the last mode's fit
    for ac in AC_MODES:
        lo, hi, best = floor, len(locals_) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            if fits(ac, locals_[mid]):
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        if best is None:
            continue
        found.append((run(ac, locals_[best]), _overrides(layout, ac, locals_[best], batch)))  # type: ignore[arg-type]
        if best == len(locals_) - 1:
            break
        floor = best + 1
    return found


def _overrides(layout: Layout, ac: str, local: int, batch: int) -> list[str]:
    return [
        *layout.overrides(), "--activation_checkpoint.mode", ac,
        "--training.local_batch_size", str(local), "--training.global_batch_size", str(batch),
    ]  # fmt: skip


def _estimate(
    base: list[str], layout: Layout, batch: int, world_size: int, device: Device, ac: str, local: int,
    routing_imbalance: float = 1.0,
) -> Estimate | None:  # fmt: skip
    """One candidate's estimate; None when the pre-flight refuses it (logged)."""
    overrides = _overrides(layout, ac, local, batch)
    gc.collect()  # the last candidate's model, optimizer and meshes (reference cycles)
    # rows move between ep ranks only, and the busiest receives at most every rank's: ep x the mean
    imbalance = min(routing_imbalance, layout.ep)
    try:
        result = estimate(load_config([*base, *overrides]), world_size, device, routing_imbalance=imbalance)
    except (ValueError, NotImplementedError) as error:
        logger.info("skipped %s: %s", " ".join(overrides), error)
        return None
    logger.info("%s: peak %.1f GiB", " ".join(overrides), result.peak_bytes / GIB)
    return result
