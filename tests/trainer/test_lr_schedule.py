"""LR schedule: warmup rises linearly to the peak, then linear/cosine decay reaches min_lr_factor."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.lr_schedule import build_lr_scheduler, lr_factor


def _lrs(decay_type: str, steps: int = 20, warmup: int = 4, min_factor: float = 0.1) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_lr_scheduler(
        opt, warmup_steps=warmup, total_steps=steps, decay_type=decay_type, min_lr_factor=min_factor
    )
    lrs = []
    for _ in range(steps):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("decay_type", ["linear", "cosine"])
def test_warmup_then_decay(decay_type: str) -> None:
    lrs = _lrs(decay_type)
    assert 0 < lrs[0] < lrs[1] < lrs[2] < lrs[3] < lrs[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lrs[-1] == pytest.approx(0.1)


def test_linear_is_linear_and_cosine_is_above_it_early() -> None:
    lin, cos = _lrs("linear"), _lrs("cosine")
    diffs = [a - b for a, b in zip(lin[4:], lin[5:])]
    assert max(diffs) == pytest.approx(min(diffs))
    assert cos[6] > lin[6]
    mid = 4 + (20 - 4 - 1) / 2
    assert lr_factor(int(mid * 2) // 2, warmup_steps=4, total_steps=20, decay_type="cosine", min_lr_factor=0.0) == (
        pytest.approx(0.5 * (1 + math.cos(math.pi * (int(mid) - 4) / 15)))
    )


def test_unknown_decay_type_errors() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="expected one of"):
        build_lr_scheduler(opt, warmup_steps=1, total_steps=5, decay_type="step", min_lr_factor=0.0)
