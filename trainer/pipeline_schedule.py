"""The job's pipeline schedule (torch-free, so the pre-flight reads it too): the named one
(`parallelism.pipeline_parallel_schedule`) or, when set, the CSV file's (`pipeline_parallel_schedule_csv`,
which wins, as in torchtitan)."""

from __future__ import annotations

from parallelisms.pipeline_parallel import ScheduleSpec, csv_schedule_spec, get_schedule

from .job_config import JobConfig


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
