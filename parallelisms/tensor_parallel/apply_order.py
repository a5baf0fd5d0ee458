"""Checks that tensor parallelism is applied before fully_shard (TP -> AC -> FSDP).

fully_shard replaces a module's parameters with DTensors sharded on the data-parallel mesh and hooks
the module to swap them for unsharded ones around forward. A TP style applied afterwards would try to
re-distribute those FSDP shards on the TP mesh (and, if that succeeded, register parameters FSDP no
longer manages). So `parallelize_module` refuses fully_shard modules and parameters that are already
DTensors on another mesh, with an error that names the parameter and the fix, instead of failing deep
inside distribute_tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn

from ..dtensor import DeviceMesh, DTensor, Placement

ORDER_FIX = "Apply tensor parallelism first, then fully_shard (TP -> AC -> FSDP)"


def check_not_fully_sharded(root: nn.Module, fqn: str) -> None:
    """Raise if `root`, a module on the path to its submodule `fqn`, or any module under it is an
    FSDPModule: its parameters are already FSDP's shards."""
    # imported here: parallelisms.fsdp need not be loaded for TP alone, and it must never import us
    from ..fsdp import FSDPModule

    path = [("", root)]
    parts = fqn.split(".") if fqn else []
    for i in range(len(parts)):
        prefix = ".".join(parts[: i + 1])
        path.append((prefix, root.get_submodule(prefix)))
    target = path[-1][1]
    below = [(join_path(fqn, name), m) for name, m in target.named_modules() if name]
    for name, module in path + below:
        if isinstance(module, FSDPModule):
            what = f"submodule {name!r}" if name else "the module passed to parallelize_module"
            raise ValueError(
                f"{what} ({type(module).__name__}) is already an FSDPModule: fully_shard was applied before "
                f"parallelize_module, so its parameters are FSDP shards. {ORDER_FIX}"
            )


def check_param_layout(
    fqn: str, param: nn.Parameter, mesh: DeviceMesh, wanted: Sequence[Placement] | None = None
) -> None:
    """Raise if `param` is a DTensor on a mesh other than the TP `mesh`, or, when the style's `wanted`
    placements are given, on `mesh` with other placements. A DTensor already laid out as wanted (a
    weight tied to one an earlier style sharded) passes: distribute_tensor returns it unchanged."""
    if not isinstance(param, DTensor):
        return
    found = tuple(str(p) for p in param.placements)
    if param.device_mesh != mesh:
        raise ValueError(
            f"parameter {fqn!r} is already a DTensor on mesh {param.device_mesh} with placements {found}, "
            f"not on the tensor-parallel mesh {mesh}; was fully_shard applied before parallelize_module? "
            f"{ORDER_FIX}"
        )
    if wanted is not None and param.placements != tuple(wanted):
        raise ValueError(
            f"parameter {fqn!r} is already a DTensor on the tensor-parallel mesh {mesh} with placements "
            f"{found}, but this style shards it as {tuple(str(p) for p in wanted)}; was fully_shard applied "
            f"on this mesh before parallelize_module ({ORDER_FIX}), or is it parallelized twice?"
        )


def join_path(prefix: str, name: str) -> str:
    """Dotted module path of `name` under `prefix`; either may be "" (the root)."""
    return f"{prefix}.{name}" if prefix and name else prefix or name
