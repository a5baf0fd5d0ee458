"""Training metrics: throughput and MFU arithmetic, the one-line log format, optional tensorboard.

One fixed line per log step:
`step 10 | loss 3.2145 | grad_norm 1.02 | lr 3.0e-4 | tok/s 12,345 | mfu 41.2% | mem 1.2GiB`
"""

from __future__ import annotations

import logging
import resource
import sys
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Assumed dense bf16 peak of one accelerator, for MFU. Only CUDA has one; on CPU mfu prints "n/a".
CUDA_PEAK_FLOPS = 989e12  # H100/H200 SXM bf16 dense


def flops_per_token(model: nn.Module, *, n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N (non-embedding params, forward + backward; Kaplan et al. 2020)
    plus attention scores and values, 12 * L * H * Q * T (as torchtitan, PaLM appendix B).

    N counts global (not per-shard) parameter sizes: DTensor parameters report their global numel.
    """
    n_params = sum(p.numel() for p in model.parameters())
    n_embedding = model.get_parameter("tok_embeddings.weight").numel()
    return 6 * (n_params - n_embedding) + 12 * n_layers * n_heads * head_dim * seq_len


def peak_flops(device: torch.device) -> float | None:
    """Assumed peak FLOP/s of one `device`; None where there is no meaningful figure (CPU)."""
    return CUDA_PEAK_FLOPS if device.type == "cuda" else None


def max_memory_gib(device: torch.device) -> float:
    """Peak memory of this rank: CUDA max allocated, or the process's max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def _format_lr(lr: float) -> str:
    mantissa, exponent = f"{lr:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"  # 3.0e-4, not 3.0e-04


def _format_norm(norm: float) -> str:
    return f"{norm:.2f}" if norm >= 0.01 or norm == 0 else f"{norm:.1e}"


def format_metrics(
    step: int, loss: float, grad_norm: float, lr: float, tokens_per_s: float, mfu: float | None, mem_gib: float
) -> str:
    """The fixed metrics line; `mfu` is a percentage, or None for "n/a"."""
    mfu_str = "n/a" if mfu is None else f"{mfu:.1f}%"
    return (
        f"step {step} | loss {loss:.4f} | grad_norm {_format_norm(grad_norm)} | lr {_format_lr(lr)} | "
        f"tok/s {tokens_per_s:,.0f} | mfu {mfu_str} | mem {mem_gib:.1f}GiB"
    )


class MetricsLogger:
    """Logs the metrics line and, if enabled, writes the same scalars to tensorboard (rank 0 only)."""

    def __init__(self, *, flops_per_token: float, device: torch.device, tb_folder: Path | None) -> None:
        self.flops_per_token, self.device = flops_per_token, device
        self.peak = peak_flops(device)
        self.writer = None
        if tb_folder is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(tb_folder))

    def log(self, step: int, *, loss: float, grad_norm: float, lr: float, tokens: int, seconds: float) -> dict:
        """Log one step: `tokens` processed by this rank in `seconds`. Returns the scalars."""
        tokens_per_s = tokens / max(seconds, 1e-9)
        mfu = None if self.peak is None else 100 * tokens_per_s * self.flops_per_token / self.peak
        mem = max_memory_gib(self.device)
        logger.info(format_metrics(step, loss, grad_norm, lr, tokens_per_s, mfu, mem))
        scalars = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens_per_s": tokens_per_s, "mem_gib": mem}
        if mfu is not None:
            scalars["mfu_pct"] = mfu
        if self.writer is not None:
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, step)
        return scalars

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
