"""Learning-rate schedule: linear warmup, an optional stable phase, then linear, sqrt or cosine decay to
min_lr_factor (torchtitan's warmup-stable-decay, `lr_scheduler.decay_ratio`), via LambdaLR.

`plan_schedule` is pure and torch-free: the pre-flight runs it for its warnings, the trainer for the phases.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.optim.lr_scheduler import LambdaLR

DECAY_TYPES = ("linear", "sqrt", "cosine")


@dataclass(frozen=True)
class Schedule:
    """The phases, in optimizer steps: warmup, then stable at the peak, then decay to the last step."""

    warmup_steps: int
    stable_steps: int
    decay_steps: int
    decay_type: str
    min_lr_factor: float


def plan_schedule(
    *, warmup_steps: int, total_steps: int, decay_type: str, min_lr_factor: float, decay_ratio: float | None = None
) -> tuple[Schedule, list[str]]:
    """The phases of `total_steps` updates, and a warning for each phase clamped to fit (as torchtitan does)."""
    if decay_type not in DECAY_TYPES:
        raise ValueError(f"lr_scheduler.decay_type={decay_type!r}: expected one of {list(DECAY_TYPES)}")
    warnings = []
    if warmup_steps > total_steps - 1:  # the update at index warmup_steps is the first at the peak
        clamped = total_steps - 1
        warnings.append(
            f"lr_scheduler.warmup_steps({warmup_steps}) >= training.steps({total_steps}): the peak lr "
            f"(optimizer.lr) would never be reached; warming up over {clamped} steps instead, so the last step "
            f"trains at the peak (set lr_scheduler.warmup_steps <= {clamped} to silence this)"
        )
        warmup_steps = clamped
    decay_steps = total_steps - warmup_steps
    if decay_ratio is not None:
        asked = round(total_steps * decay_ratio)
        if asked > decay_steps:
            warnings.append(
                f"lr_scheduler.decay_ratio({decay_ratio}) x training.steps({total_steps}) = {asked} decay steps do "
                f"not fit after {warmup_steps} warmup steps; decaying over {decay_steps} steps instead"
            )
        decay_steps = min(asked, decay_steps)
    stable_steps = total_steps - warmup_steps - decay_steps
    return Schedule(warmup_steps, stable_steps, decay_steps, decay_type, min_lr_factor), warnings


def schedule_factor(step: int, schedule: Schedule) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based: the lr used by the step-th update).

    Warmup rises linearly to 1 over `warmup_steps` updates (never 0: the first update moves the weights);
    the factor stays 1 for `stable_steps`, then decays to `min_lr_factor` at the last step.
    """
    warmup, decay_start = schedule.warmup_steps, schedule.warmup_steps + schedule.stable_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if step < decay_start:
        return 1.0
    progress = min((step - decay_start) / max(schedule.decay_steps - 1, 1), 1.0)
    if schedule.decay_type == "linear":
        shape = 1.0 - progress
    elif schedule.decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return schedule.min_lr_factor + (1.0 - schedule.min_lr_factor) * shape


def lr_factor(step: int, **schedule_options: Any) -> float:
    """`schedule_factor` of the schedule `plan_schedule(**schedule_options)` plans (warmup clamped to fit)."""
    return schedule_factor(step, plan_schedule(**schedule_options)[0])


def build_lr_scheduler(optimizer: torch.optim.Optimizer, **schedule_options: Any) -> LambdaLR:
    """LambdaLR over `optimizer` following the schedule `plan_schedule(**schedule_options)` plans (warmup_steps,
    total_steps, decay_ratio, decay_type, min_lr_factor); call `.step()` after each optimizer step."""
    from torch.optim.lr_scheduler import LambdaLR

    schedule, _ = plan_schedule(**schedule_options)
    return LambdaLR(optimizer, functools.partial(schedule_factor, schedule=schedule))
