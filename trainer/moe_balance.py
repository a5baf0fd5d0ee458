"""Auxiliary-loss-free load balancing of MoE layers (Wang et al. 2024, DeepSeek-V3; torchtitan's
`load_balance_coeff`) and the expert-load metrics.

Each MoE layer counts the tokens routed to each expert during the step (models/common/moe.py: tokens_per_expert).
Before the optimizer steps, `ExpertBalancer.update` sums the counts over the data-parallel and context-parallel
ranks (one all-reduce for all layers: every rank then moves its bias alike), moves each expert's routing bias by
`load_balance_coeff` towards the mean load (up for an underloaded expert, down for an overloaded one; the update's
mean is removed so the biases do not drift together), and clears the counts. It runs as an optimizer step
pre-hook, so gradient accumulation and pipeline microbatches all count into one update. Tensor-parallel ranks
route the same tokens and need no sum; a pipeline stage balances its own layers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from models.common.moe import MoE
from parallelisms.dtensor import DeviceMesh

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertLoad:
    """One step's routing, per MoE layer (by block FQN): the most and the mean tokens per expert, and the largest
    routing bias in absolute value."""

    max_tokens: dict[str, float]
    mean_tokens: dict[str, float]
    max_abs_bias: dict[str, float]

    def console(self) -> str:
        """One line: the worst layer's imbalance (max / mean tokens per expert) and the largest bias."""
        imbalance = {k: self.max_tokens[k] / max(self.mean_tokens[k], 1e-9) for k in self.max_tokens}
        worst = max(imbalance, key=imbalance.__getitem__)
        bias = max(self.max_abs_bias.values(), default=0.0)
        mean = sum(imbalance.values()) / len(imbalance)
        return (
            f"load max/mean: mean over {len(imbalance)} layers {mean:.2f}, worst {imbalance[worst]:.2f} "
            f"({worst}) | routing bias max |b| {bias:.2e}"
        )

    def tensorboard(self) -> dict[str, float]:
        scalars: dict[str, float] = {}
        for k in self.max_tokens:
            scalars[f"moe/{k}/max_tokens_per_expert"] = self.max_tokens[k]
            scalars[f"moe/{k}/mean_tokens_per_expert"] = self.mean_tokens[k]
            scalars[f"moe/{k}/max_abs_bias"] = self.max_abs_bias[k]
        return scalars


class ExpertBalancer:
    """The MoE layers of this rank's model parts, balanced before each optimizer step (see the module docstring)."""

    def __init__(self, parts: list[nn.Module], mesh: DeviceMesh | None) -> None:
        self.layers = {
            name.removesuffix(".moe"): m for part in parts for name, m in part.named_modules() if isinstance(m, MoE)
        }
        # the mesh, not its group: a mesh holds its groups weakly, so destroy_process_group() frees them
        self.mesh = mesh
        self._stats: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return bool(self.layers)

    @torch.no_grad()
    def update(self) -> None:
        """Sum the step's counts over dp x cp, move the biases, clear the counts; keep the load for the metrics."""
        if not self.layers:
            return
        counts = torch.stack([m.tokens_per_expert for m in self.layers.values()])  # (L, E)
        if self.mesh is not None and self.mesh.size() > 1:
            dist.all_reduce(counts, group=self.mesh.get_group())
        for m, load in zip(self.layers.values(), counts):
            if m.expert_bias is not None and m.load_balance_coeff is not None:
                delta = m.load_balance_coeff * torch.sign(load.mean() - load)
                m.expert_bias.add_(delta - delta.mean())
            m.tokens_per_expert.zero_()
        biases = [m.expert_bias.abs().max() if m.expert_bias is not None else counts.new_zeros(()) for m in
                  self.layers.values()]  # fmt: skip
        # read by the host only when logged (`last`): no sync per step, and the dry run's fake tensors have no values
        self._stats = torch.stack([counts.max(1).values, counts.mean(1), torch.stack(biases)])

    @property
    def last(self) -> ExpertLoad | None:
        """The load of the last update, None before the first."""
        if self._stats is None:
            return None
        names = list(self.layers)
        return ExpertLoad(*(dict(zip(names, row)) for row in self._stats.tolist()))


def register_expert_balancing(
    model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh | None
) -> ExpertBalancer:
    """Balance `model`'s MoE layers (a pipeline's parts: each) before every step of `optimizer`; `mesh` is the
    dp x cp ranks' (None on one process). Returns the balancer (empty, and no hook, for a dense model)."""
    parts = list(getattr(model, "parts", [model]))
    balancer = ExpertBalancer(parts, mesh)
    if balancer:
        optimizer.register_step_pre_hook(lambda *_: balancer.update())
    return balancer
