"""The optimizer: AdamW over the model's parameters, plain or DTensor alike."""

from __future__ import annotations

import torch
from torch import nn

# optimizer.implementation -> AdamW's kernel switches
_IMPLEMENTATIONS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def build_optimizer(
    model: nn.Module,
    *,
    name: str,
    lr: float,
    eps: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
    implementation: str = "fused",
) -> torch.optim.Optimizer:
    """AdamW over every trainable parameter of `model`, with the kernel `implementation` names (torchtitan's
    default, fused, runs one kernel per step; every kernel keeps DTensor parameters sharded)."""
    if name != "AdamW":
        raise ValueError(f"optimizer.name={name!r}: only 'AdamW' is supported")
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"optimizer.implementation={implementation!r}: expected one of {list(_IMPLEMENTATIONS)}")
    params = [p for p in model.parameters() if p.requires_grad]
    kernel = _IMPLEMENTATIONS[implementation]
    return torch.optim.AdamW(params, lr=lr, eps=eps, weight_decay=weight_decay, betas=betas, **kernel)
