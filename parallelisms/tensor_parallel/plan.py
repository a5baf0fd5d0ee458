"""parallelize_module: apply a ParallelStyle, or a plan {module path: style}, to a module tree."""

from __future__ import annotations

import fnmatch
import warnings

import torch.nn as nn

from ..dtensor import DeviceMesh, current_mesh
from .apply_order import check_not_fully_sharded, check_param_layout, join_path
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

    Apply it before fully_shard: a module fully_shard already sharded, or a parameter that is already
    a DTensor on another mesh, raises ValueError (TP -> AC -> FSDP).
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
    return _parallelize(module, "", module, device_mesh, parallelize_plan, src_data_rank)


def _parallelize(
    root: nn.Module,
    prefix: str,
    module: nn.Module,
    mesh: DeviceMesh,
    plan: ParallelStyle | dict[str, ParallelStyle],
    src_data_rank: int | None,
) -> nn.Module:
    """Apply `plan` to `module`, the submodule of `root` at path `prefix` (for error messages)."""
    if isinstance(plan, ParallelStyle):
        return _apply_style(root, prefix, module, mesh, plan, src_data_rank)
    if not isinstance(plan, dict):
        raise TypeError(f"parallelize_plan must be a ParallelStyle or a dict of them, got {type(plan).__name__}")
    for path, style in plan.items():
        matches = _match(module, path)
        if not matches:
            children = [name for name, _ in module.named_modules() if name][:20]
            warnings.warn(
                f"parallelize_plan key {path!r} matches no submodule of {type(module).__name__}, skipping it; "
                f"submodules: {children}",
                stacklevel=3,
            )
        for fqn, submodule in matches:
            _parallelize(root, join_path(prefix, fqn), submodule, mesh, style, src_data_rank)
    return module


def _apply_style(
    root: nn.Module, fqn: str, module: nn.Module, mesh: DeviceMesh, style: ParallelStyle, src_data_rank: int | None
) -> nn.Module:
    # checked here, where the full path is known, so the error names 'layers.0.attention.wq.weight'
    check_not_fully_sharded(root, fqn)
    _check_params(style, module, mesh, fqn)
    style.src_data_rank = src_data_rank
    return style.apply(module, mesh)


def _check_params(style: ParallelStyle, module: nn.Module, mesh: DeviceMesh, fqn: str) -> None:
    """Every parameter the style will lay out that is already a DTensor must be on `mesh` as wanted."""
    for name, submodule in module.named_modules():
        wanted = style.param_placements(submodule)  # None: the style leaves parameters alone
        for key, param in submodule.named_parameters(recurse=False):
            if wanted is not None and key in wanted:
                check_param_layout(join_path(join_path(fqn, name), key), param, mesh, [wanted[key]])


def _match(module: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    """(path, submodule) pairs at `path`, where each dotted component may be an fnmatch pattern."""
    if path == "":
        return [("", module)]
    head, _, rest = path.partition(".")
    found = []
    for name, child in module.named_children():
        if fnmatch.fnmatchcase(name, head):
            found.extend([(join_path(name, sub), m) for sub, m in _match(child, rest)] if rest else [(name, child)])
    return found
