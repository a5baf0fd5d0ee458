"""Profiling: torch.profiler traces of a window of steps and, on CUDA, allocator memory snapshots.

As torchtitan's `maybe_enable_profiling` / `maybe_enable_memory_snapshot`, behind one component that
the loop enters once and steps once per training step:

    with profiler:               # builds nothing when profiling is off
        for step in ...:
            ...
            profiler.step()

Traces: every `profile_freq` steps a window of `profiler_warmup` + `profiler_active` steps ends, after
wait = profile_freq - warmup - active idle steps (torch.profiler.schedule); the recorded steps are
written as Chrome JSON to dump_folder/save_traces_folder/iteration_<N>/rank<R>_trace.json (N the last
recorded step; open in chrome://tracing or ui.perfetto.dev). The schedule counts global steps, so a
resumed run traces the same steps as an uninterrupted one.
Memory snapshots (CUDA): allocator history is recorded from the start and dumped every `profile_freq`
steps, and once more on an out-of-memory error, as
dump_folder/save_memory_snapshot_folder/iteration_<N>[_exit]/rank<R>_memory_snapshot.pickle (open in
pytorch.org/memory_viz). On CPU there is no allocator history: a warning, and nothing is recorded.
"""

from __future__ import annotations

import logging
import pickle
import time
import warnings
from pathlib import Path
from types import TracebackType

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from .config import Profiling

logger = logging.getLogger(__name__)

MEMORY_SNAPSHOT_MAX_ENTRIES = 100_000  # allocator events kept (torchtitan's bound on the history's memory)


def check_profiling(cfg: Profiling) -> None:
    """The window must fit in one period: wait = profile_freq - warmup - active >= 0."""
    window = cfg.profiler_warmup + cfg.profiler_active
    if cfg.enable_profiling and cfg.profile_freq < window:
        raise ValueError(
            f"profiling.profile_freq({cfg.profile_freq}) must be >= profiling.profiler_warmup({cfg.profiler_warmup}) "
            f"+ profiling.profiler_active({cfg.profiler_active}) = {window}: each period waits, warms up, then "
            f"records; raise profile_freq to {window} or more"
        )


class Profiler:
    """Traces and memory snapshots for one training run (a no-op when both are off).

    Args:
        cfg: the [profiling] section.
        dump_folder: job.dump_folder; the configured folders go under it.
        rank: this process's global rank, in the file names.
        device: this rank's device (CUDA adds device activity and memory snapshots).
        global_step: the last step already trained (the resumed step; 0 for a fresh run).
    """

    def __init__(self, cfg: Profiling, *, dump_folder: Path, rank: int, device: torch.device, global_step: int) -> None:
        check_profiling(cfg)
        self.cfg, self.rank, self.device, self.step_num = cfg, rank, device, global_step
        self.trace_folder = dump_folder / cfg.save_traces_folder
        self.snapshot_folder = dump_folder / cfg.save_memory_snapshot_folder
        self.snapshots = cfg.enable_memory_snapshot and device.type == "cuda"
        if cfg.enable_memory_snapshot and not self.snapshots:
            logger.warning(
                "profiling.enable_memory_snapshot: memory snapshots record the CUDA caching allocator, and this "
                "rank runs on %s; skipped (use enable_profiling for CPU traces)", device,
            )  # fmt: skip
        self._torch_profiler: profile | None = None
        self._start_step = global_step

    def __enter__(self) -> Profiler:
        if self.cfg.enable_profiling:
            self._torch_profiler = self._build_torch_profiler()
            self._torch_profiler.__enter__()
            logger.info(
                "profiling: a trace of %d step(s) (after %d warm-up) every %d steps, under %s",
                self.cfg.profiler_active, self.cfg.profiler_warmup, self.cfg.profile_freq, self.trace_folder,
            )  # fmt: skip
        if self.snapshots:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_SNAPSHOT_MAX_ENTRIES)
            logger.info("memory snapshots every %d steps under %s", self.cfg.profile_freq, self.snapshot_folder)
        return self

    def _build_torch_profiler(self) -> profile:
        cfg = self.cfg
        wait = cfg.profile_freq - cfg.profiler_warmup - cfg.profiler_active
        by_index = schedule(wait=wait, warmup=cfg.profiler_warmup, active=cfg.profiler_active)
        start = self._start_step

        def by_global_step(index: int) -> object:  # index 0 is the first step this run trains
            return by_index(start + index)

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        return profile(
            activities=activities, schedule=by_global_step, on_trace_ready=self._write_trace,  # type: ignore[arg-type]
            record_shapes=True,
        )  # fmt: skip

    def _write_trace(self, prof: profile) -> None:
        step = self._start_step + prof.step_num  # the last step recorded
        folder = self.trace_folder / f"iteration_{step}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_trace.json"
        begin = time.perf_counter()
        prof.export_chrome_trace(str(path))
        logger.info("profiler trace of step %d written to %s in %.2fs", step, path, time.perf_counter() - begin)

    def step(self) -> None:
        """Call once at the end of every training step."""
        self.step_num += 1
        if self._torch_profiler is not None:
            with warnings.catch_warnings():  # "clears events at the end of each cycle": each trace is one window
                warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
                self._torch_profiler.step()
        if self.snapshots and self.step_num % self.cfg.profile_freq == 0:
            self._dump_snapshot(f"iteration_{self.step_num}")

    def _dump_snapshot(self, name: str) -> None:
        folder = self.snapshot_folder / name
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_memory_snapshot.pickle"
        begin = time.perf_counter()
        with path.open("wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        logger.info("memory snapshot %s written to %s in %.2fs", name, path, time.perf_counter() - begin)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Stop recording; an out-of-memory error first dumps the allocator's state (then propagates)."""
        try:
            if self.snapshots and isinstance(exc, torch.OutOfMemoryError):
                self._dump_snapshot(f"iteration_{self.step_num + 1}_exit")  # the step that ran out
        finally:
            if self.snapshots:
                torch.cuda.memory._record_memory_history(enabled=None)
            if self._torch_profiler is not None:
                self._torch_profiler.__exit__(exc_type, exc, tb)
                self._torch_profiler = None
