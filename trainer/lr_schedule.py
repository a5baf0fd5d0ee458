"""Learning-rate schedule: linear warmup, then linear or cosine decay to min_lr_factor, via LambdaLR."""

from __future__ import annotations

import functools
import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, decay_type: str, min_lr_factor: float) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based: the lr used by the step-th update).

    Warmup rises linearly to 1 over `warmup_steps` updates (never 0: the first update moves the weights);
    then the factor decays from 1 to `min_lr_factor` at the last step.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_steps = max(total_steps - warmup_steps - 1, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"lr_scheduler.decay_type={decay_type!r}: expected 'linear' or 'cosine'")
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, decay_type: str, min_lr_factor: float
) -> LambdaLR:
    """LambdaLR over `optimizer` following `lr_factor`; call `.step()` after each optimizer step."""
    if decay_type not in ("linear", "cosine"):
        raise ValueError(f"lr_scheduler.decay_type={decay_type!r}: expected 'linear' or 'cosine'")
    fn = functools.partial(
        lr_factor,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        decay_type=decay_type,
        min_lr_factor=min_lr_factor,
    )
    return LambdaLR(optimizer, fn)
