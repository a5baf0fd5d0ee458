"""`ExpertParallel`: the parallel style that shards an MoE layer's routed experts over the ranks of an ep mesh and
moves each routed token to the rank holding its expert (torchtitan's ExpertParallel / ExpertTensorParallel).

Applied from outside the model, like the TP styles, to a `GroupedExperts` (models/common/moe.py: stacked w1, w3
(E, H, D) and w2 (E, D, H), called as `experts(rows sorted by expert, counts per expert)`):

- the weights become DTensors `Shard(0)` over ep (rank r holds experts [r E/ep, (r + 1) E/ep)), so checkpoints
  reshard them as every other parameter; on a 2-D (ep, tp) mesh (expert tensor parallelism, etp = tp) they are
  also sharded on their hidden dim over tp, `(Shard(0), Shard(1))` for w1 / w3 and `(Shard(0), Shard(2))` for w2;
- a forward pre-hook dispatches the rows to their experts' ranks and a forward hook brings the outputs home
  (dispatch.py): two all-to-alls of rows and one of counts per layer, their mirror images in the backward.

Under tensor parallelism every rank of a tp group routes the same (all-gathered) tokens. With etp = tp each tp rank
holds a hidden-dim slice of its experts: the rows' gradient is a partial sum over tp and is all-reduced there, as
`GroupedExpertsParallel`'s. With etp = 1, ep spans the tp ranks too (`token_split_mesh` = the tp mesh): each tp rank
sends only its 1/tp of the rows (`token_slice`) and returns zeros for the others', so the layer's output is a
partial sum over tp that TP's reduce-scatter completes, and the rows' gradient is all-reduced over tp likewise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from parallelisms.dtensor import DeviceMesh, Placement, Shard, distribute_module
from parallelisms.tensor_parallel.moe_styles import distribute_params, partial_grad
from parallelisms.tensor_parallel.style import ParallelStyle

from .dispatch import Dispatched, combine, dispatch, token_slice

_HIDDEN_DIM = {"w1": 1, "w2": 2, "w3": 1}  # each stacked weight's hidden dim (the one tp shards under etp = tp)


@dataclass
class _InFlight:
    """One forward's dispatch, from the pre-hook to the hook: what combining and un-splitting need."""

    dispatched: Dispatched
    rows: int  # the rows the layer routed (before a tp split)
    lo: int  # this tp rank's first row of them
    hi: int


@dataclass(kw_only=True)
class ExpertParallel(ParallelStyle):
    """Shard stacked experts `Shard(0)` over a 1-D ep mesh, or `(Shard(0), Shard(hidden))` over a 2-D (ep, tp)
    mesh, and dispatch routed tokens to them by all-to-all (see the module docstring).

    `token_split_mesh`: under TP with etp = 1, the tp mesh (whose ranks route the same tokens and are part of ep);
    each of its ranks dispatches 1/tp of the rows."""

    token_split_mesh: DeviceMesh | None = None
    _in_flight: list[_InFlight] = field(default_factory=list, init=False, repr=False)

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        return {name: Shard(0) for name in _HIDDEN_DIM}

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim not in (1, 2):
            raise ValueError(f"ExpertParallel takes a 1-D ep mesh or a 2-D (ep, tp) mesh, not {device_mesh}")
        if device_mesh.ndim == 2 and self.token_split_mesh is not None:
            raise ValueError(
                "ExpertParallel: token_split_mesh is for etp = 1 (ep spans tp); on an (ep, tp) mesh (etp = tp) the "
                "tp ranks share their experts' tokens instead; pass one or the other"
            )
        names = device_mesh.mesh_dim_names or ()
        if device_mesh.ndim == 2 and len(names) != 2:
            raise ValueError(f"ExpertParallel takes a named (ep, tp) mesh (world_mesh['ep', 'tp']), not {device_mesh}")
        ep_mesh = device_mesh[names[0]] if device_mesh.ndim == 2 else device_mesh
        tp_mesh = device_mesh[names[1]] if device_mesh.ndim == 2 else None
        _check_divisible(module, ep_mesh.size(), tp_mesh.size() if tp_mesh is not None else 1)
        placements: dict[str, tuple[Placement, ...]] = {
            n: (Shard(0), Shard(h)) if tp_mesh is not None else (Shard(0),) for n, h in _HIDDEN_DIM.items()
        }
        ep_group = ep_mesh.get_group()

        def inputs(mod: nn.Module, args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            routed, counts = args
            rows, lo, hi = routed.shape[0], 0, routed.shape[0]
            if tp_mesh is not None:  # every tp rank holds a hidden slice of these experts: the same rows, partial grads
                routed = partial_grad(routed, tp_mesh)
            elif self.token_split_mesh is not None:  # the tp ranks share the rows out
                split = self.token_split_mesh
                routed = partial_grad(routed, split)
                lo, hi, counts = token_slice(counts, split.get_local_rank(), split.size(), total=rows)
                routed = routed[lo:hi]
            local_rows, local_counts, dispatched = dispatch(routed, counts, ep_group)
            self._in_flight.append(_InFlight(dispatched, rows, lo, hi))
            return local_rows, local_counts

        def output(mod: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
            flight = self._in_flight.pop()
            out = combine(out, flight.dispatched)
            if (flight.lo, flight.hi) != (0, flight.rows):  # the other tp ranks' rows: zeros here (a partial sum)
                out = F.pad(out, (0, 0, flight.lo, flight.rows - flight.hi))
            return out

        return distribute_module(
            module,
            device_mesh,
            lambda name, mod, mesh: distribute_params(mod, mesh, placements, self.src_data_rank) if not name else None,
            inputs,
            output,
        )


def _check_divisible(module: nn.Module, ep: int, tp: int) -> None:
    num_experts = module.get_parameter("w1").shape[0]
    if num_experts % ep:
        raise ValueError(
            f"expert parallelism over {ep} ranks needs a number of experts divisible by {ep}, not {num_experts}: each "
            f"rank holds an equal share; set parallelism.expert_parallel_degree to a divisor of {num_experts}"
        )
    hidden = module.get_parameter("w1").shape[1]
    if hidden % tp:
        raise ValueError(
            f"the experts' hidden dim ({hidden}) must be divisible by the expert tensor-parallel degree ({tp}); set "
            f"parallelism.expert_tensor_parallel_degree=1 or change the flavor's moe_inter_dim"
        )
