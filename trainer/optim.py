"""The optimizer: AdamW (foreach) over the model's parameters, plain or DTensor alike."""

from __future__ import annotations

import torch
from torch import nn


def build_optimizer(
    model: nn.Module, *, name: str, lr: float, eps: float, weight_decay: float
) -> torch.optim.Optimizer:
    """AdamW over every trainable parameter of `model`; foreach keeps DTensor params sharded."""
    if name != "AdamW":
        raise ValueError(f"optimizer.name={name!r}: only 'AdamW' is supported")
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, eps=eps, weight_decay=weight_decay, betas=(0.9, 0.95), foreach=True)
