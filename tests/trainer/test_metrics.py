"""Metrics: the peak table, MFU arithmetic, data share, ETA, the fixed line and summary, and (one world)
TensorBoard scalars plus the summary from a real run."""

from __future__ import annotations

import logging
import types
from pathlib import Path

import pytest
import torch

from tests.trainer.test_train import _SHORT_DEBUG_JOB, _losses, _train_rank
from tests.world import run_world
from trainer import metrics
from trainer.metrics import (
    MemoryStats,
    MetricsLogger,
    StepMetrics,
    achieved_tflops,
    data_share_pct,
    format_duration,
    format_metrics,
    format_summary,
    lookup_peak_tflops,
    mfu_pct,
    peak_tflops,
    tensorboard_scalars,
)
from trainer.train_state import TrainState

_CPU = torch.device("cpu")


def _step(**overrides: object) -> StepMetrics:
    fields: dict = dict(
        step=10, loss=3.21449, grad_norm=1.0234, lr=3e-4, tokens_per_s=12345.4, tflops=123.44, mfu=41.23,
        memory=MemoryStats(1.234, 1.0, 12.4, 10.0, cuda=True), step_seconds=1.0, data_seconds=0.013,
        eta_seconds=190,
    )  # fmt: skip
    return StepMetrics(**(fields | overrides))


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100 80GB PCIe", 312), ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835), ("NVIDIA H800", 989), ("NVIDIA H200", 989),
        ("NVIDIA B200", 2250), ("NVIDIA L4", None), ("Tesla V100-SXM2-16GB", None),
    ],
)  # fmt: skip
def test_peak_table_matches_gpu_names(name: str, tflops: float | None) -> None:
    assert lookup_peak_tflops(name) == tflops


def test_peak_override_wins_and_cpu_has_none() -> None:
    assert peak_tflops(_CPU) is None  # MFU n/a on CPU...
    assert peak_tflops(_CPU, 2.5) == 2.5  # ...unless metrics.peak_tflops is set
    assert peak_tflops(torch.device("cuda", 0), 100.0) == 100.0  # the override skips the table (no CUDA needed)


def test_unknown_gpu_warns_once_naming_the_key(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L4")
    cuda = torch.device("cuda", 0)
    with caplog.at_level(logging.WARNING, logger="trainer.metrics"):
        logger = MetricsLogger(flops_per_token=1.0, device=cuda, total_steps=10, tb_folder=None)
        MetricsLogger(flops_per_token=1.0, device=cuda, total_steps=10, tb_folder=None, rank=1)  # rank 1: silent
    assert logger.peak is None
    assert len(caplog.records) == 1 and "metrics.peak_tflops" in caplog.text and "NVIDIA L4" in caplog.text


def test_cuda_memory_is_peak_reserved_and_allocated_of_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    resets: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 20 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 8 * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", resets.append)
    cuda = torch.device("cuda", 0)
    assert metrics.read_memory(cuda) == MemoryStats(20.0, 8.0, 25.0, 10.0, cuda=True)
    assert resets == [cuda]  # the next line shows the next interval's peak, as torchtitan's


def test_mfu_arithmetic() -> None:
    # 1,000 tok/s per device at 6e9 FLOPs per token is 6 TFLOPS: 1.92% of an A100's 312
    assert achieved_tflops(1000, 6e9) == pytest.approx(6.0)
    assert mfu_pct(6.0, 312.0) == pytest.approx(100 * 6 / 312)
    assert mfu_pct(6.0, None) is None


def test_data_share_is_a_percentage_of_step_time() -> None:
    assert data_share_pct(0.013, 1.0) == pytest.approx(1.3)
    assert data_share_pct(0.0, 0.0) == 0.0  # an empty interval does not divide by zero


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0.0s"), (12.34, "12.3s"), (190, "3m10s"), (599.6, "10m00s"), (3720, "1h02m"), (90061, "25h01m")],
)
def test_duration_format(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_metrics_line_format() -> None:
    assert format_metrics(_step()) == (
        "step 10 | loss 3.2145 | grad_norm 1.02 | lr 3.0e-4 | tok/s 12,345 | tflops 123.4 | mfu 41.2% | "
        "mem 1.2GiB (12%) | data 1.3% | eta 3m10s"
    )
    cpu = format_metrics(_step(mfu=None, tflops=0.01234, memory=MemoryStats(0.5, 0.5)))
    assert "| tflops 0.012 | mfu n/a | mem 0.5GiB | data" in cpu  # CPU: RSS, no share of a device
    assert _losses([cpu]) == [3.2145]  # `step N | loss X` stays first: tests and benches parse it


def test_tensorboard_names_follow_torchtitan() -> None:
    scalars = tensorboard_scalars(_step())
    assert scalars["loss_metrics/global_avg_loss"] == 3.21449 and scalars["mfu(%)"] == 41.23
    assert scalars["time_metrics/data_loading(%)"] == pytest.approx(1.3)
    assert {"throughput(tps)", "tflops", "grad_norm", "lr", "memory/max_reserved(GiB)"} <= scalars.keys()
    cpu = tensorboard_scalars(_step(mfu=None, memory=MemoryStats(0.5, 0.5)))
    assert "mfu(%)" not in cpu and cpu["memory/max_rss(GiB)"] == 0.5 and "memory/max_reserved(GiB)" not in cpu


def test_summary_format() -> None:
    line = format_summary(
        steps=10, tokens=40960, losses=[6.19, 2.99], tokens_per_s=[100.0, 1234.0, 1300.0], mfu=[],
        peak_mem=MemoryStats(0.5, 0.5), seconds=12.34, skipped_steps=0,
    )  # fmt: skip
    assert line == (
        "summary | steps 10 | tokens 40,960 | loss 6.1900 -> 2.9900 | tok/s (median) 1,234 | mfu n/a | "
        "peak mem 0.5GiB | time 12.3s"
    )
    skipped = format_summary(
        steps=1, tokens=1, losses=[1.0], tokens_per_s=[1.0], mfu=[40.0, 42.0], peak_mem=None, seconds=1,
        skipped_steps=2,
    )  # fmt: skip
    assert "| mfu 41.0% |" in skipped and skipped.endswith("| skipped 2")


def test_logger_eta_and_summary_over_a_resumed_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """ETA = steps left x the mean wall time per step of recent intervals; the summary covers only
    this run (resumed at step 4), with the CPU's MFU from the override."""
    clock = iter([0.0, 0.0, 100.0, 106.0, 110.0, 120.0])  # __init__ and begin, each log, the summary
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    logger = MetricsLogger(flops_per_token=1e9, device=_CPU, total_steps=10, tb_folder=None, peak_tflops_override=2)
    logger.begin(TrainState(step=4, tokens_seen=400, skipped_steps=1))
    first = logger.log(6, loss=5.0, grad_norm=1.0, lr=1e-3, tokens=2000, seconds=5.0, data_seconds=0.5)
    assert first.tokens_per_s == 400 and first.tflops == pytest.approx(0.4) and first.mfu == pytest.approx(20)
    assert first.step_seconds == 2.5 and first.data_pct == pytest.approx(10)
    assert first.eta_seconds == pytest.approx(4 * 50)  # 100 s of wall time over 2 steps (a slow first interval)
    second = logger.log(8, loss=4.0, grad_norm=1.0, lr=1e-3, tokens=2000, seconds=5.0)
    assert second.eta_seconds == pytest.approx(2 * 106 / 4)
    third = logger.log(10, loss=3.0, grad_norm=1.0, lr=1e-3, tokens=4000, seconds=5.0)
    assert third.eta_seconds == 0
    summary = logger.log_summary(TrainState(step=10, tokens_seen=1000, skipped_steps=3))
    assert summary.startswith("summary | steps 6 | tokens 600 | loss 5.0000 -> 3.0000 | tok/s (median) 400 | mfu 20.0%")
    assert summary.endswith("| time 2m00s | skipped 2")


def test_tensorboard_and_summary_from_a_2_rank_run(tmp_path: Path) -> None:
    """A real 3-step FSDP(2) run with TensorBoard on (and a CPU peak override, so MFU is a number):
    rank 0's event files hold the line's scalars at steps 1..3, and the run ends with the summary."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    argv = [*_SHORT_DEBUG_JOB, "--job.dump_folder", str(tmp_path), "--metrics.enable_tensorboard", "true",
            "--metrics.peak_tflops", "0.01"]  # fmt: skip
    lines = run_world(_train_rank, 2, argv)
    steps = [line for line in lines[0] if line.startswith("step ")]
    assert len(steps) == 3 and all(" | mfu " in s and "mfu n/a" not in s for s in steps), steps
    assert lines[0][-1].startswith("summary | steps 3 | tokens 768 | loss "), lines[0]  # 3 x 2 ranks x 2 x 64
    assert not any(line.startswith("summary") for line in lines[1])  # only LOG_RANK ranks log it

    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1  # rank 0's only
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    want = {"loss_metrics/global_avg_loss", "grad_norm", "lr", "throughput(tps)", "tflops", "mfu(%)",
            "memory/max_rss(GiB)", "time_metrics/data_loading(%)", "time_metrics/end_to_end(s)"}  # fmt: skip
    assert want <= tags, tags
    loss = events.Scalars("loss_metrics/global_avg_loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx(_losses(steps), abs=1e-4)  # the line shows 4 decimals
    assert all(0 < e.value < 100 for e in events.Scalars("time_metrics/data_loading(%)"))


def test_tokens_per_device_follow_torchtitan_under_tp() -> None:
    """tok/s per device = local tokens / (tp x cp x pp): under TP(2) each of the two ranks that read
    the same 2 x 4 x 8 tokens is credited half of them (it read 2x before)."""
    from parallelisms.parallel_dims import ParallelDims
    from trainer.step import tokens_per_device

    micro = [(torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long))] * 2
    fsdp = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, world_size=2)
    tp = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, world_size=2)
    fsdp_tp = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, world_size=4)
    assert (tokens_per_device(micro, fsdp), tokens_per_device(micro, tp), tokens_per_device(micro, fsdp_tp)) == (
        64,
        32,
        32,
    )
