"""parallelize_module: apply a ParallelStyle, or a plan {module path: style}, to a module tree."""

from __future__ import annotations

import fnmatch
import warnings

import torch.nn as nn

from ..dtensor import DeviceMesh, current_mesh
from .style import ParallelStyle


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Shard `module` over a 1-D `device_mesh` following `parallelize_plan`.

    Plan keys are dotted submodule paths relative to `module`; each path component may be an
    fnmatch pattern (`"layers.*.attention"`). As torch, a key that matches no submodule, or no plan,
    warns and is skipped (a typo in a key leaves that part unsharded: read the warning).
    """
    device_mesh = device_mesh or current_mesh()  # `with tp_mesh:` as torch
    if device_mesh is None:
        raise ValueError(
            "parallelize_module needs a device_mesh (the 1-D tensor-parallel mesh): pass one, or call it inside "
            "`with tp_mesh:`"
        )
    if device_mesh.ndim != 1:
        raise ValueError(
            f"parallelize_module needs a 1-D mesh, got {device_mesh.ndim}-D {device_mesh.mesh_dim_names}; "
            f"pass the tensor-parallel submesh, e.g. world_mesh['tp']"
        )
    if not parallelize_plan:  # None or {}
        warnings.warn(
            "parallelize_module got no parallelize_plan, so this call does nothing; pass a ParallelStyle "
            "or a dict {submodule path: ParallelStyle}",
            stacklevel=2,
        )
        return module
    if isinstance(parallelize_plan, ParallelStyle):
        parallelize_plan.src_data_rank = src_data_rank
        return parallelize_plan.apply(module, device_mesh)
    if not isinstance(parallelize_plan, dict):
        raise TypeError(
            f"parallelize_plan must be a ParallelStyle or a dict of them, got {type(parallelize_plan).__name__}"
        )
    for path, style in parallelize_plan.items():
        matches = _match(module, path)
        if not matches:
            children = [name for name, _ in module.named_modules() if name][:20]
            warnings.warn(
                f"parallelize_plan key {path!r} matches no submodule of {type(module).__name__}, skipping it; "
                f"submodules: {children}",
                stacklevel=2,
            )
        for submodule in matches:
            parallelize_module(submodule, device_mesh, style, src_data_rank=src_data_rank)
    return module


def _match(module: nn.Module, path: str) -> list[nn.Module]:
    """Submodules at `path`, where each dotted component may be an fnmatch pattern."""
    if path == "":
        return [module]
    head, _, rest = path.partition(".")
    found = []
    for name, child in module.named_children():
        if fnmatch.fnmatchcase(name, head):
            found.extend(_match(child, rest) if rest else [child])
    return found
