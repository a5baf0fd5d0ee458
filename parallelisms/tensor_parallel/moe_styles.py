"""Tensor-parallel styles for mixture-of-experts layers (expert parallelism off): a replicated router whose
gradients are partial sums, and the experts sharded on their hidden dim (torchtitan's `NoParallel` and
`TensorParallel` for experts).

Under TP an MoE layer runs on the whole (all-gathered) sequence on every rank. Each rank holds a hidden-dim slice of
every expert (w1 / w3 by column, w2 by row, as a dense SwiGLU's), so an expert's output is a partial sum over the
ranks, reduce-scattered back to sequence shards after the layer. Two gradients then arrive as partial sums and must
be completed before they reach replicated tensors:
- the routed tokens' gradient (each rank's slice of w1 / w3 sees one part of it): `GroupedExpertsParallel` marks
  the experts' input so;
- the routing scores' gradient, where a score scales an expert's output (a partial sum; `score_before_experts`
  false): `NoParallel` with `local_output_grad_placements=(Partial(),)` on the router's gate. A score that scales
  the experts' input gets its gradient from the completed one and stays whole.
Each is one all-reduce in the backward; the forward communicates nothing beyond the layer's all-gather and
reduce-scatter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parallelisms.dtensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)

from .apply_order import check_param_layout
from .style import ParallelStyle


def partial_grad(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """`x` itself, whose gradient is taken to be a partial sum over `mesh` and all-reduced in the backward: for a
    replicated tensor that feeds computations each rank holds a slice of."""
    return DTensor.from_local(x, mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))


def distribute_params(
    module: nn.Module, mesh: DeviceMesh, placements: dict[str, tuple[Placement, ...]], src: int | None
) -> None:
    """`module`'s own parameters as DTensors on `mesh` with `placements[name]` (one per mesh dim); parameters that
    are DTensors already must have them."""
    for key, param in list(module.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            check_param_layout(key, param, mesh, list(placements[key]))
            continue
        sharded = distribute_tensor(param.data, mesh, list(placements[key]), src_data_rank=src)
        module.register_parameter(key, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _one_dim(placements: dict[str, Placement]) -> dict[str, tuple[Placement, ...]]:
    return {key: (p,) for key, p in placements.items()}


@dataclass(kw_only=True)
class NoParallel(ParallelStyle):
    """Replicate a module's parameters over the TP mesh and run it on replicated local inputs: every rank computes
    the same. `local_output_grad_placements=(Partial(),)` says the gradient arriving at the output is a partial
    sum over the ranks (an MoE router's: see the module docstring), which backward all-reduces."""

    use_local_output: bool = True
    local_output_grad_placements: tuple[Placement, ...] | None = None

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        return {key: Replicate() for key, _ in module.named_parameters(recurse=False)}

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def inputs(mod: nn.Module, args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            return tuple(
                DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in args
            )

        def output(mod: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
            if not (self.use_local_output and isinstance(out, DTensor)):
                return out
            return out.to_local(grad_placements=self.local_output_grad_placements)

        return distribute_module(
            module,
            device_mesh,
            lambda name, mod, mesh: distribute_params(
                mod, mesh, _one_dim(self.param_placements(mod)), self.src_data_rank
            ),
            inputs,
            output,
        )


@dataclass(kw_only=True)
class GroupedExpertsParallel(ParallelStyle):
    """Shard stacked SwiGLU experts (models/common/moe.py: GroupedExperts) on their hidden dim: w1, w3 (E, H, D)
    as S(1), w2 (E, D, H) as S(2). The experts compute on their local slices and return a partial sum; the routed
    tokens' gradient is completed by an all-reduce (`partial_grad`)."""

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        return {"w1": Shard(1), "w2": Shard(2), "w3": Shard(1)}

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        placements = self.param_placements(module)
        hidden = module.get_parameter("w1").shape[1]
        if hidden % device_mesh.size():
            raise ValueError(
                f"the experts' hidden dim ({hidden}) must be divisible by the tensor-parallel degree "
                f"({device_mesh.size()}): each rank holds an equal slice of every expert; change "
                f"parallelism.tensor_parallel_degree or the flavor's moe_inter_dim"
            )

        def inputs(mod: nn.Module, args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            routed, counts = args
            return partial_grad(routed, mesh), counts

        return distribute_module(
            module,
            device_mesh,
            lambda name, mod, mesh: distribute_params(mod, mesh, _one_dim(placements), self.src_data_rank),
            inputs,
            None,
        )
