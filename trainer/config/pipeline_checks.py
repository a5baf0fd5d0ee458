"""The pre-flight's pipeline checks (torch-free): the job's pipeline setup resolved as the trainer and the dry
run resolve it (`pipeline_setup.py`), then what it asks of the batches, of FSDP and of the schedule's order, which
the process-free simulator runs before any rank starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .pipeline_setup import PipelineSetup, resolve_pipeline
from .sections import JobConfig

if TYPE_CHECKING:
    from parallelisms.pipeline_parallel import Schedule, ScheduleSpec


def check_pipeline(cfg: JobConfig) -> PipelineSetup | None:
    """Under pipeline parallelism, the job's pipeline setup (None without), resolved as the trainer and the dry
    run resolve it: a schedule the runtime runs, microbatches that split the local batch and that the schedule
    accepts, a layer split that leaves no stage empty, and what is not built yet refused."""
    if cfg.parallelism.pipeline_parallel_degree <= 1:
        return None
    _check_pipeline_batches(cfg)
    setup = resolve_pipeline(cfg)  # a CSV schedule's file is read and checked here
    _check_pipeline_schedule(cfg, setup.schedule)
    _check_schedule_microbatches(cfg, setup)
    return setup


def _local_batches(cfg: JobConfig) -> dict[str, int]:
    """Each section's local batch, by section: validation's 0 means the training one."""
    return {"training": cfg.training.local_batch_size,
            "validation": cfg.validation.local_batch_size or cfg.training.local_batch_size}  # fmt: skip


def _check_pipeline_batches(cfg: JobConfig) -> None:
    """Training and validation batches split into whole microbatches of one shape."""
    training, mb = cfg.training, cfg.parallelism.pipeline_parallel_microbatch_size
    for section, batch in _local_batches(cfg).items():
        key = f"{section}.local_batch_size"
        if mb < 1 or batch % mb:
            raise ValueError(
                f"{key}({batch}) must be a multiple of parallelism.pipeline_parallel_microbatch_size({mb}): the "
                f"pipeline splits each batch into microbatches"
            )  # fmt: skip
    if cfg.validation.enable and cfg.validation.seq_len not in (0, training.seq_len):
        raise NotImplementedError(
            f"validation.seq_len({cfg.validation.seq_len}) under pipeline parallelism must be training.seq_len "
            f"(or 0): the stages' boundary activations have one shape"
        )


def _check_pipeline_schedule(cfg: JobConfig, spec: ScheduleSpec) -> None:
    """What the schedule needs of FSDP, and a CSV schedule's fixed microbatch count."""
    p, training = cfg.parallelism, cfg.training
    if spec.split_backward and p.fsdp_reshard_after_forward == "always":
        raise ValueError(
            f"parallelism.fsdp_reshard_after_forward='always' with parallelism.pipeline_parallel_schedule="
            f"{spec.name!r}: a split backward computes the weight gradients (W) after the input's (I), from the "
            f"gathered parameters the forward used, which resharding after forward frees; set it to 'default'"
        )
    val_batch = _local_batches(cfg)["validation"]
    if p.pipeline_parallel_schedule_csv and cfg.validation.enable and val_batch != training.local_batch_size:
        raise NotImplementedError(
            f"validation.local_batch_size({val_batch}) with parallelism.pipeline_parallel_schedule_csv must be "
            f"training.local_batch_size({training.local_batch_size}) (or 0): the file schedules that many "
            f"microbatches"
        )


def _check_schedule_microbatches(cfg: JobConfig, setup: PipelineSetup) -> None:
    """The schedule lays out the microbatches of each batch it runs (training's, and validation's when on)."""
    p = cfg.parallelism
    batches = _local_batches(cfg)
    if not cfg.validation.enable:  # validation runs the schedule's forwards over its own microbatch count
        del batches["validation"]
    for section, batch in batches.items():
        microbatches = batch // p.pipeline_parallel_microbatch_size
        try:
            actions = setup.schedule.generate(setup.pp, setup.stages_per_rank, microbatches)
        except ValueError as e:
            raise ValueError(f"parallelism.pipeline_parallel_schedule={p.pipeline_parallel_schedule!r} with "
                             f"{microbatches} microbatches ({section}.local_batch_size / "
                             f"parallelism.pipeline_parallel_microbatch_size): {e}") from None  # fmt: skip
        if section == "training":  # validation runs forwards only, in the schedule's stage order
            _check_schedule_runs(cfg, setup, actions)


def _check_schedule_runs(cfg: JobConfig, setup: PipelineSetup, actions: Schedule) -> None:
    """The step's schedule runs to its end in the process-free simulator (a user's CSV file can order the ranks'
    actions so that they wait on each other forever; the ranks would start, then hang or fail at step 1)."""
    from parallelisms.pipeline_parallel import simulate  # pure Python: no torch

    p = cfg.parallelism
    source = (f"parallelism.pipeline_parallel_schedule_csv={p.pipeline_parallel_schedule_csv!r}"
              if p.pipeline_parallel_schedule_csv else f"parallelism.pipeline_parallel_schedule="
              f"{p.pipeline_parallel_schedule!r}")  # fmt: skip
    try:
        simulate(actions, stage_to_rank=setup.stage_to_rank())
    except ValueError as e:  # DeadlockError too: which ranks wait, at which action, for what
        raise ValueError(f"{source} cannot run {setup.microbatches} microbatches: {e}; fix the order") from None
