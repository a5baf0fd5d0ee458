"""The fixed metrics line."""

from __future__ import annotations

from trainer.metrics import format_metrics


def test_metrics_line_format() -> None:
    line = format_metrics(10, 3.21449, 1.0234, 3e-4, 12345.4, 41.23, 1.234)
    assert line == "step 10 | loss 3.2145 | grad_norm 1.02 | lr 3.0e-4 | tok/s 12,345 | mfu 41.2% | mem 1.2GiB"
    assert "mfu n/a" in format_metrics(1, 1.0, 1.0, 1e-3, 1.0, None, 0.1)


def test_tokens_per_device_follow_torchtitan_under_tp() -> None:
    """tok/s per device = local tokens / (tp x cp x pp): under TP(2) each of the two ranks that read
    the same 2 x 4 x 8 tokens is credited half of them (it read 2x before)."""
    import torch

    from parallelisms.parallel_dims import ParallelDims
    from trainer.train import tokens_per_device

    micro = [(torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long))] * 2
    fsdp = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, world_size=2)
    tp = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, world_size=2)
    fsdp_tp = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, world_size=4)
    assert (tokens_per_device(micro, fsdp), tokens_per_device(micro, tp), tokens_per_device(micro, fsdp_tp)) == (
        64,
        32,
        32,
    )
