"""input_reshard: keep a TP module's replicated inputs sharded while they wait for backward.

Under tensor parallelism every TP rank saves the same replicated input for backward. Between forward
and backward this registers saved-tensor hooks that store only this rank's shard along
`input_reshard_dim` and all-gather it back when backward (or activation recompute) unpacks it:
1/tp of the activation memory for one all_gather.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..dtensor import DeviceMesh, DTensor, Replicate, Shard


def input_reshard(module: nn.Module, tp_device_mesh: DeviceMesh, input_reshard_dim: int | None = None) -> nn.Module:
    if input_reshard_dim is None:
        return module
    hooks: list[torch.autograd.graph.saved_tensors_hooks] = []

    def pack(x: torch.Tensor) -> Any:
        if isinstance(x, DTensor) and all(p.is_replicate() for p in x.placements):
            return x.redistribute(placements=[Shard(input_reshard_dim)])
        if not isinstance(x, DTensor) and x.numel() >= tp_device_mesh.size():
            full = DTensor.from_local(x, tp_device_mesh, [Replicate()])
            return ("plain", full.redistribute(placements=[Shard(input_reshard_dim)]).to_local())
        return x

    def unpack(x: Any) -> torch.Tensor:
        if isinstance(x, tuple) and x and x[0] == "plain":
            sharded = DTensor.from_local(x[1], tp_device_mesh, [Shard(input_reshard_dim)], run_check=False)
            return sharded.redistribute(placements=[Replicate()]).to_local()
        if isinstance(x, DTensor) and x.placements == (Shard(input_reshard_dim),):
            return x.redistribute(placements=[Replicate()])
        return x

    def enter(_module: nn.Module, _inputs: Any) -> None:
        ctx = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        ctx.__enter__()
        hooks.append(ctx)

    def leave(_module: nn.Module, _inputs: Any, _outputs: Any) -> None:
        hooks.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)
    return module
