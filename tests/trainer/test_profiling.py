"""Profiling: torch.profiler Chrome traces per window (by global step, also when resumed), the window
check, memory snapshots skipped on CPU, and each rank's trace from a real 2-rank run."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from tests.trainer.test_train import _SHORT_DEBUG_JOB, _train_rank
from tests.world import run_world
from trainer.config import Profiling
from trainer.profiling import Profiler

WINDOW = {"enable_profiling": True, "profile_freq": 3, "profiler_warmup": 1, "profiler_active": 1}


def _trace_events(path: Path) -> list[dict]:
    with path.open() as f:
        trace = json.load(f)
    return trace["traceEvents"]


def _run_steps(tmp_path: Path, *, first: int, last: int) -> list[str]:
    """Steps first..last of a tiny "training" loop under a Profiler resumed after step first - 1."""
    x = torch.ones(8, 8)
    profiler = Profiler(Profiling(**WINDOW), dump_folder=tmp_path, rank=0, device=torch.device("cpu"),
                        global_step=first - 1)  # fmt: skip
    with profiler:
        for _ in range(first, last + 1):
            x = (x @ x).tanh()
            profiler.step()
    return sorted(p.name for p in (tmp_path / "profile_traces").iterdir())


def test_traces_every_profile_freq_steps_counted_by_global_step(tmp_path: Path) -> None:
    assert _run_steps(tmp_path / "fresh", first=1, last=7) == ["iteration_3", "iteration_6"]
    events = _trace_events(tmp_path / "fresh" / "profile_traces" / "iteration_6" / "rank0_trace.json")
    assert any(e.get("name") == "aten::mm" for e in events)
    # resumed after step 4: the window still ends at step 6, the one an uninterrupted run traces
    assert _run_steps(tmp_path / "resumed", first=5, last=7) == ["iteration_6"]


def test_profile_freq_must_hold_the_window(tmp_path: Path) -> None:
    cfg = Profiling(enable_profiling=True, profile_freq=3, profiler_warmup=3, profiler_active=1)
    with pytest.raises(ValueError, match=r"profiling.profile_freq\(3\) must be >= .* = 4"):
        Profiler(cfg, dump_folder=tmp_path, rank=0, device=torch.device("cpu"), global_step=0)


def test_memory_snapshot_on_cpu_warns_and_records_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = Profiling(enable_memory_snapshot=True, profile_freq=1)
    with caplog.at_level(logging.WARNING, logger="trainer.profiling"):
        profiler = Profiler(cfg, dump_folder=tmp_path, rank=0, device=torch.device("cpu"), global_step=0)
    assert "CUDA caching allocator" in caplog.text and "skipped" in caplog.text
    with profiler:
        profiler.step()
    assert not (tmp_path / "memory_snapshot").exists()


def test_a_2_rank_run_writes_each_ranks_trace(tmp_path: Path) -> None:
    argv = [*_SHORT_DEBUG_JOB, "--job.dump_folder", str(tmp_path), "--profiling.enable_profiling",
            *(f"--profiling.{k}={v}" for k, v in WINDOW.items() if k != "enable_profiling")]  # fmt: skip
    run_world(_train_rank, 2, argv)
    folder = tmp_path / "profile_traces" / "iteration_3"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0_trace.json", "rank1_trace.json"]
    for rank in (0, 1):
        names = {e.get("name") for e in _trace_events(folder / f"rank{rank}_trace.json")}
        collectives = [n for n in names if "all_gather" in str(n) or "gloo" in str(n)]  # FSDP's, on this rank
        assert "aten::mm" in names and collectives, sorted(map(str, names))[:50]
