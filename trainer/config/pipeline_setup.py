"""The job's pipeline, resolved once from the config into a frozen `PipelineSetup` (torch-free, so the pre-flight
resolves it the same way the trainer and the dry run do): the schedule, the named one
(`parallelism.pipeline_parallel_schedule`) or, when set, the CSV file's (`pipeline_parallel_schedule_csv`, which
wins, as in torchtitan); the stages each rank holds; each stage's modules; the microbatches; the boundary shape."""

from __future__ import annotations

import math
from dataclasses import dataclass

from models.common.stage_split import check_module_fqns, module_fqns_per_stage
from models.registry import FAMILIES, flavor_args
from parallelisms.pipeline_parallel import ScheduleSpec, StagePlacement, csv_schedule_spec, get_schedule, stage_to_rank

from .sections import JobConfig


@dataclass(frozen=True)
class PipelineSetup:
    """What every pipeline component reads, resolved once (`resolve_pipeline`) and held by the runtime record."""

    schedule: ScheduleSpec
    pp: int
    stages_per_rank: int
    stage_fqns: tuple[tuple[str, ...], ...]  # the modules of each stage, in stage order
    microbatch_size: int
    microbatches: int  # pipeline microbatches per accumulation micro-batch: local_batch_size / microbatch_size
    boundary_shape: tuple[int, int, int]  # (mb, T/(cp tp), D): what a stage sends the next

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stage_to_rank(self) -> dict[int, int]:
        """Stage index -> pp rank, by the schedule's placement (looped or V)."""
        return stage_to_rank(self.pp, self.stages_per_rank, self.schedule.placement)

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages `pp_rank` holds, in stage order."""
        return [s for s, r in self.stage_to_rank().items() if r == pp_rank]


def resolve_pipeline(cfg: JobConfig, *, n_layers: int | None = None) -> PipelineSetup:
    """The job's pipeline (a CSV schedule's file read once, here), checked: raises ValueError with the keys and
    the arithmetic where the stages do not suit the schedule or the split. `n_layers`: the model's blocks, when
    they are not the flavor's (the dry run's sampled traces)."""
    p, training = cfg.parallelism, cfg.training
    args = flavor_args(cfg.model.name, cfg.model.flavor)
    spec = schedule_spec(cfg)
    per_rank = stages_per_rank(cfg, spec)
    pp, mb = p.pipeline_parallel_degree, p.pipeline_parallel_microbatch_size
    fqns = stage_fqns(cfg, pp * per_rank, args.n_layers if n_layers is None else n_layers)
    # context parallelism: each cp rank holds T/cp tokens; sequence parallelism: each TP rank sends T/(cp tp)
    share = p.tensor_parallel_degree * p.context_parallel_degree
    return PipelineSetup(
        schedule=spec, pp=pp, stages_per_rank=per_rank, stage_fqns=tuple(tuple(f) for f in fqns), microbatch_size=mb,
        microbatches=training.local_batch_size // max(mb, 1), boundary_shape=(mb, training.seq_len // share, args.dim),
    )  # fmt: skip


def schedule_spec(cfg: JobConfig) -> ScheduleSpec:
    p = cfg.parallelism
    if p.pipeline_parallel_schedule_csv:
        microbatches = cfg.training.local_batch_size // max(p.pipeline_parallel_microbatch_size, 1)
        try:
            return csv_schedule_spec(p.pipeline_parallel_schedule_csv, p.pipeline_parallel_degree, microbatches)
        except ValueError as e:
            raise ValueError(
                f"parallelism.pipeline_parallel_schedule_csv, for {microbatches} microbatches "
                f"(training.local_batch_size / pipeline_parallel_microbatch_size): {e}"
            ) from None
    return get_schedule(p.pipeline_parallel_schedule)


STAGES_PER_RANK_MULTI = 2  # torchtitan's default for the multi-stage schedules without layers_per_stage


def stages_per_rank(cfg: JobConfig, spec: ScheduleSpec | None = None) -> int:
    """The stages each pp rank holds, counted as torchtitan counts them, and checked against the schedule:
    a CSV schedule's own count; else `module_fqns_per_model_part`'s parts over pp; else, with
    `pipeline_parallel_layers_per_stage`, ceil((layers + the first / last stage's weights) / it) over pp;
    else 1 for a single-stage schedule (GPipe, 1F1B) and 2 for the others. Raises, with the keys and the
    arithmetic, where the stages do not divide by pp or do not suit the schedule: one per rank for a
    single-stage schedule, two or more for a looped multi-stage one, exactly two for a V schedule."""
    p = cfg.parallelism
    spec = spec or schedule_spec(cfg)
    pp, parts = p.pipeline_parallel_degree, p.module_fqns_per_model_part
    if spec.stages_per_rank is not None:  # the file lays out its stages
        if parts and len(parts) != pp * spec.stages_per_rank:
            raise ValueError(
                f"parallelism.module_fqns_per_model_part has {len(parts)} parts, and "
                f"parallelism.pipeline_parallel_schedule_csv schedules {spec.stages_per_rank} stages on each of "
                f"pipeline_parallel_degree({pp}) ranks = {pp * spec.stages_per_rank}; give one part per stage"
            )
        return spec.stages_per_rank
    counted = _configured_stages(cfg)
    if counted is None:
        return 1 if spec.single_stage else STAGES_PER_RANK_MULTI
    stages, source = counted
    if stages % pp:
        raise ValueError(f"{source} do not divide by parallelism.pipeline_parallel_degree({pp}): each rank holds "
                         f"as many stages as every other; change one of them")  # fmt: skip
    per_rank = stages // pp
    if spec.placement == StagePlacement.V:
        fits, wanted = per_rank == 2, "exactly 2 stages (a V: rank r holds stages r and 2 x pp - 1 - r)"
    elif spec.single_stage:
        fits, wanted = per_rank == 1, "exactly 1 stage"
    else:
        fits, wanted = per_rank >= 2, "2 or more stages"
    if not fits:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule={spec.name!r} runs {wanted} per rank, and {source} "
            f"over pipeline_parallel_degree({pp}) ranks is {per_rank} per rank; change the schedule or the split"
        )
    return per_rank


def _configured_stages(cfg: JobConfig) -> tuple[int, str] | None:
    """(stages, how the config says so) when it sets them: the explicit parts, or the layers per stage."""
    p = cfg.parallelism
    if p.module_fqns_per_model_part:
        n = len(p.module_fqns_per_model_part)
        return n, f"parallelism.module_fqns_per_model_part's {n} parts"
    if not p.pipeline_parallel_layers_per_stage:
        return None
    family = FAMILIES.get(cfg.model.name)
    n_layers = family.flavors[cfg.model.flavor].n_layers if family and cfg.model.flavor in family.flavors else 0
    first, last, per_layer = (p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers,
                              p.pipeline_parallel_layers_per_stage)  # fmt: skip
    stages = math.ceil((n_layers + first + last) / per_layer)
    return stages, (
        f"ceil(({n_layers} layers + pipeline_parallel_first_stage_less_layers({first}) + "
        f"pipeline_parallel_last_stage_less_layers({last})) / parallelism.pipeline_parallel_layers_per_stage"
        f"({per_layer})) = {stages} stages"
    )


def stage_fqns(cfg: JobConfig, num_stages: int, n_layers: int) -> list[list[str]]:
    """The modules of each of `num_stages` stages: `module_fqns_per_model_part` when set (checked: one part per
    stage, every module once, in forward order), else torchtitan's split of the layers."""
    p = cfg.parallelism
    if p.module_fqns_per_model_part:
        if len(p.module_fqns_per_model_part) != num_stages:
            raise ValueError(
                f"parallelism.module_fqns_per_model_part has {len(p.module_fqns_per_model_part)} parts for "
                f"{num_stages} pipeline stages (pp {p.pipeline_parallel_degree} x stages per rank); give one per stage"
            )
        check_module_fqns(p.module_fqns_per_model_part, n_layers)
        return p.module_fqns_per_model_part
    return module_fqns_per_stage(
        num_stages, n_layers, first_stage_less_layers=p.pipeline_parallel_first_stage_less_layers,
        last_stage_less_layers=p.pipeline_parallel_last_stage_less_layers,
    )  # fmt: skip
