"""Training metrics that mean what torchtitan's mean: tok/s, TFLOPS and MFU per device, peak memory,
data-loading share and ETA; the one fixed log line, the same scalars in TensorBoard, and the summary.

One fixed line per log step (`step N | loss X` first: tests and benches parse it):
`step 10 | loss 3.2145 | grad_norm 1.02 | lr 3.0e-4 | tok/s 12,345 | tflops 123.4 | mfu 41.2% | mem 1.2GiB (12%) |
data 1.3% | eta 3m10s`, and one summary line when the run ends:
`summary | steps 10 | tokens 40,960 | loss 6.1900 -> 2.9900 | tok/s (median) 1,234 | mfu n/a | peak mem 0.5GiB |
time 12.3s`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .train_state import TrainState

if TYPE_CHECKING:
    from .moe_balance import ExpertLoad

logger = logging.getLogger(__name__)

# Dense bf16 peak TFLOPS of one GPU, as torchtitan's get_peak_flops: (substring of
# torch.cuda.get_device_name(), TFLOPS), the first match wins, so the PCIe/NVL H100s precede "H100".
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("A100", 312.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM
    ("H800", 989.0),
    ("H200", 989.0),
    ("B200", 2250.0),
)
ETA_WINDOW = 5  # log intervals whose mean step time estimates the time left


def lookup_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named like `torch.cuda.get_device_name()`; None if not in the table."""
    name = device_name.lower()
    return next((tflops for key, tflops in PEAK_TFLOPS if key.lower() in name), None)


def peak_tflops(device: torch.device, override: float = 0.0) -> float | None:
    """Peak TFLOPS of one `device` for MFU: `override` (metrics.peak_tflops) when > 0, else the table's
    bf16 figure for a CUDA device (the trainer computes in bf16 there); None for an unknown GPU and for
    the CPU, whose fp32 peak depends on the part and its thread count (set the override to have one)."""
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    return lookup_peak_tflops(torch.cuda.get_device_name(device))


def achieved_tflops(tokens_per_s: float, flops_per_token: float) -> float:
    """TFLOPS one device achieves at `tokens_per_s` (its tp x cp x pp share of the tokens)."""
    return tokens_per_s * flops_per_token / 1e12


def mfu_pct(tflops: float, peak: float | None) -> float | None:
    """Model FLOPs utilization in percent of `peak` TFLOPS; None when there is no peak."""
    return None if peak is None else 100 * tflops / peak


def data_share_pct(data_seconds: float, seconds: float) -> float:
    """Share of the step time spent fetching batches and copying them to the device, in percent."""
    return 100 * data_seconds / max(seconds, 1e-9)


def format_duration(seconds: float) -> str:
    """Compact durations for the log: 12.3s, 3m10s, 1h02m (seconds dropped once past an hour)."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


@dataclass(frozen=True)
class MemoryStats:
    """Peak memory of this rank over a log interval: CUDA reserved/allocated, or the process's max RSS
    on CPU (there `allocated_gib` is the RSS too, and the percentages None)."""

    reserved_gib: float
    allocated_gib: float
    reserved_pct: float | None = None
    allocated_pct: float | None = None
    cuda: bool = False


def read_memory(device: torch.device) -> MemoryStats:
    """This rank's peak memory since the last call; on CUDA it resets the peaks, as torchtitan does,
    so each log line shows its own interval (max RSS on CPU only grows)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        reserved, allocated = torch.cuda.max_memory_reserved(device), torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return MemoryStats(reserved / 2**30, allocated / 2**30, 100 * reserved / total, 100 * allocated / total, True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    gib = rss / (2**30 if sys.platform == "darwin" else 2**20)
    return MemoryStats(gib, gib)


@dataclass(frozen=True)
class StepMetrics:
    """The scalars of one log step; every rate is per device over the log interval."""

    step: int
    loss: float  # the global mean token loss
    grad_norm: float
    lr: float
    tokens_per_s: float
    tflops: float
    mfu: float | None  # percent; None = n/a
    memory: MemoryStats
    step_seconds: float  # mean training time per step
    data_seconds: float  # mean data-loading time per step
    eta_seconds: float

    @property
    def data_pct(self) -> float:
        return data_share_pct(self.data_seconds, self.step_seconds)


def _format_lr(lr: float) -> str:
    mantissa, exponent = f"{lr:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"  # 3.0e-4, not 3.0e-04


def _format_norm(norm: float) -> str:
    return f"{norm:.2f}" if norm >= 0.01 or norm == 0 else f"{norm:.1e}"


def _format_tflops(tflops: float) -> str:
    return f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.3f}"  # CPU runs reach hundredths


def _format_mfu(mfu: float | None) -> str:
    return "n/a" if mfu is None else f"{mfu:.1f}%"


def _format_memory(memory: MemoryStats) -> str:
    pct = "" if memory.reserved_pct is None else f" ({memory.reserved_pct:.0f}%)"
    return f"{memory.reserved_gib:.1f}GiB{pct}"


def format_metrics(m: StepMetrics) -> str:
    """The fixed metrics line; `mem` is CUDA max reserved (and its share of the device) or max RSS."""
    return (
        f"step {m.step} | loss {m.loss:.4f} | grad_norm {_format_norm(m.grad_norm)} | lr {_format_lr(m.lr)} | "
        f"tok/s {m.tokens_per_s:,.0f} | tflops {_format_tflops(m.tflops)} | mfu {_format_mfu(m.mfu)} | "
        f"mem {_format_memory(m.memory)} | data {m.data_pct:.1f}% | eta {format_duration(m.eta_seconds)}"
    )


def tensorboard_scalars(m: StepMetrics) -> dict[str, float]:
    """The line's scalars under torchtitan's TensorBoard names (ours where it has none: max_allocated
    is torch's max_memory_allocated, max_rss the CPU's peak)."""
    scalars = {
        "loss_metrics/global_avg_loss": m.loss,
        "grad_norm": m.grad_norm,
        "lr": m.lr,
        "throughput(tps)": m.tokens_per_s,
        "tflops": m.tflops,
        "time_metrics/end_to_end(s)": m.step_seconds,
        "time_metrics/data_loading(s)": m.data_seconds,
        "time_metrics/data_loading(%)": m.data_pct,
    }
    if m.mfu is not None:
        scalars["mfu(%)"] = m.mfu
    mem = m.memory
    if mem.cuda:
        assert mem.reserved_pct is not None and mem.allocated_pct is not None
        scalars |= {
            "memory/max_reserved(GiB)": mem.reserved_gib, "memory/max_reserved(%)": mem.reserved_pct,
            "memory/max_allocated(GiB)": mem.allocated_gib, "memory/max_allocated(%)": mem.allocated_pct,
        }  # fmt: skip
    else:
        scalars["memory/max_rss(GiB)"] = mem.reserved_gib
    return scalars


def format_summary(
    *, steps: int, tokens: int, losses: list[float], tokens_per_s: list[float], mfu: list[float],
    peak_mem: MemoryStats | None, seconds: float, skipped_steps: int,
) -> str:  # fmt: skip
    """The end-of-run line: global tokens of this run, first -> last logged loss, median per-device
    tok/s and MFU over the log intervals (robust to the warm-up interval), the run's peak memory."""
    loss = f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "n/a"
    toks = f"{statistics.median(tokens_per_s):,.0f}" if tokens_per_s else "n/a"
    mem = "n/a" if peak_mem is None else _format_memory(peak_mem)
    line = (
        f"summary | steps {steps} | tokens {tokens:,} | loss {loss} | tok/s (median) {toks} | "
        f"mfu {_format_mfu(statistics.median(mfu) if mfu else None)} | peak mem {mem} | time {format_duration(seconds)}"
    )
    return line + (f" | skipped {skipped_steps}" if skipped_steps else "")


class MetricsLogger:
    """Turns what the loop measured into the metrics line and, if enabled, TensorBoard scalars (rank 0
    only), and keeps what the end-of-run summary needs. It owns the log cadence (`should_log`: every
    `log_freq` steps and the last) and the interval's counters: tokens (`count_step`), data time
    (`timing_data`) and the training clock, which `paused()` stops around checkpoint saves and validation."""

    def __init__(
        self, *, flops_per_token: float, device: torch.device, total_steps: int, tb_folder: Path | None,
        peak_tflops_override: float = 0.0, rank: int = 0, log_freq: int = 1,
    ) -> None:  # fmt: skip
        self.flops_per_token, self.device, self.total_steps = flops_per_token, device, total_steps
        self.log_freq = log_freq
        self.peak = peak_tflops(device, peak_tflops_override)
        if self.peak is None and device.type == "cuda" and rank == 0:
            logger.warning(
                "MFU n/a: no bf16 peak known for GPU %r; set metrics.peak_tflops to its dense bf16 TFLOPS",
                torch.cuda.get_device_name(device),
            )
        self.writer: Any = None
        if tb_folder is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(tb_folder))
        self.begin(TrainState())

    def begin(self, state: TrainState) -> None:
        """Start the run's clock at `state` (a resumed job continues after state.step)."""
        self.losses: list[float] = []  # every logged loss, in order
        self._start = TrainState(**state.state_dict())  # a copy: the loop advances `state`
        self._last_step, self._start_time = state.step, time.perf_counter()
        self._reset_interval(self._start_time)
        self._last_time = self._start_time
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=ETA_WINDOW)
        # what the summary needs, not every StepMetrics: a long run logs 10^5 times
        self._losses: list[float] = []
        self._tokens_per_s: list[float] = []
        self._mfu: list[float] = []
        self._peak_memory: MemoryStats | None = None

    def log(
        self, step: int, *, loss: float, grad_norm: float, lr: float, tokens: int, seconds: float,
        data_seconds: float = 0.0,
    ) -> StepMetrics:  # fmt: skip
        """Log the interval ending at `step`: `tokens` per device (tokens_per_device) in `seconds` of
        training, `data_seconds` of them fetching and copying batches. The ETA uses wall time between
        logs instead, so checkpoint saves and validation count in it."""
        steps = max(step - self._last_step, 1)
        now = time.perf_counter()
        self._recent.append((now - self._last_time, steps))
        self._last_step, self._last_time = step, now
        wall_per_step = sum(s for s, _ in self._recent) / sum(n for _, n in self._recent)
        tokens_per_s = tokens / max(seconds, 1e-9)
        tflops = achieved_tflops(tokens_per_s, self.flops_per_token)
        m = StepMetrics(
            step=step, loss=loss, grad_norm=grad_norm, lr=lr, tokens_per_s=tokens_per_s, tflops=tflops,
            mfu=mfu_pct(tflops, self.peak), memory=read_memory(self.device), step_seconds=seconds / steps,
            data_seconds=data_seconds / steps, eta_seconds=max(self.total_steps - step, 0) * wall_per_step,
        )  # fmt: skip
        logger.info(format_metrics(m))
        self._losses = [self._losses[0] if self._losses else loss, loss]  # the first and the last
        self._tokens_per_s.append(tokens_per_s)
        self._mfu += [] if m.mfu is None else [m.mfu]
        if self._peak_memory is None or m.memory.reserved_gib > self._peak_memory.reserved_gib:
            self._peak_memory = m.memory
        if self.writer is not None:
            for name, value in tensorboard_scalars(m).items():
                self.writer.add_scalar(name, value, step)
        return m

    def log_expert_load(self, step: int, load: ExpertLoad) -> None:
        """The MoE layers' routing at `step`: one console line, per-layer scalars in TensorBoard."""
        logger.info("moe | step %d | %s", step, load.console())
        if self.writer is not None:
            for name, value in load.tensorboard().items():
                self.writer.add_scalar(name, value, step)

    # ---------------------------------------------------------------------- cadence and counters
    def should_log(self, step: int) -> bool:
        return step % self.log_freq == 0 or step == self.total_steps

    def count_step(self, tokens: int) -> None:
        """One step of `tokens` per device (tokens_per_device) into the interval."""
        self._tokens += tokens

    def timing_data(self) -> contextlib.AbstractContextManager[None]:
        """Time spent fetching and copying batches: part of the step, reported as its data share."""
        return self._timed("_data_seconds")

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Not training (a checkpoint save, validation): tok/s leaves it out; the ETA keeps it."""
        return self._timed("_paused_seconds")

    @contextlib.contextmanager
    def _timed(self, counter: str) -> Iterator[None]:
        """Add the context's wall time to the interval counter `counter`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, counter, getattr(self, counter) + time.perf_counter() - start)

    def log_interval(self, step: int, *, loss: float, grad_norm: float, lr: float) -> StepMetrics:
        """Log the interval ending at `step` from its counters, then start the next one."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's kernels are in the time
        seconds = time.perf_counter() - self._interval_start - self._paused_seconds
        m = self.log(step, loss=loss, grad_norm=grad_norm, lr=lr, tokens=self._tokens, seconds=seconds,
                     data_seconds=self._data_seconds)  # fmt: skip
        self.losses.append(loss)
        self._reset_interval(self._last_time)  # the clock `log` read
        return m

    def _reset_interval(self, now: float) -> None:
        self._tokens, self._data_seconds, self._paused_seconds = 0, 0.0, 0.0
        self._interval_start = now

    def log_summary(self, state: TrainState) -> str:
        """Log the end-of-run summary line (over this run's logs; a resumed run starts at its resume)."""
        start = self._start
        line = format_summary(
            steps=state.step - start.step, tokens=state.tokens_seen - start.tokens_seen, losses=self._losses,
            tokens_per_s=self._tokens_per_s, mfu=self._mfu, peak_mem=self._peak_memory,
            seconds=time.perf_counter() - self._start_time, skipped_steps=state.skipped_steps - start.skipped_steps,
        )  # fmt: skip
        logger.info(line)
        return line

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
