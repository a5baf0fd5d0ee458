"""fully_shard and FSDPModule: the public face of FSDP2-style sharding (mirrors torch 2.13).

`fully_shard(module)` shards every parameter of `module` that no nested fully_shard already manages
into one group, swaps the module's class for a subclass of (FSDPModule, original class), and hooks the
module so the group is all-gathered around its forward and backward and reduce-scattered after it.
Apply it bottom-up: blocks first, then the root.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from parallelisms.dtensor import DeviceMesh, DTensor, init_device_mesh

from .group import ParamGroup
from .param import FSDPParam
from .policy import MixedPrecisionPolicy
from .state import FSDPState


class FSDPModule:
    """Mixin every fully_shard module gets (placed first in its class's bases)."""

    _fsdp_state: FSDPState

    def unshard(self) -> None:
        """All-gather this module's parameters and register them unsharded (not recursive)."""
        self._fsdp_state.group.unshard()

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones (not recursive)."""
        self._fsdp_state.group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether backward reduce-scatters gradients. False accumulates unsharded gradients
        locally (gradient accumulation without communication); the next synced backward reduces
        them together with its own."""
        for state in _states(self, recurse):
            state.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether forward frees the unsharded parameters (backward then all-gathers them again)."""
        for state in _states(self, recurse):
            state.reshard_after_forward = reshard_after_forward
            state.auto_reshard = False


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
) -> nn.Module:
    """Shard `module`'s parameters `Shard(0)` over `mesh`, in place; returns `module`.

    A 1-D mesh shards over all its ranks (FSDP). A 2-D mesh is (replicate, shard) by position,
    whatever its dim names (HSDP, as torch): parameters are `(Replicate(), Shard(0))`, gathered and
    reduce-scattered over dim 1 and averaged over dim 0.

    Args:
        module: the module; parameters managed by a nested fully_shard are left to it.
        mesh: 1-D mesh of the data-parallel ranks, or 2-D (replicate, shard); default: all ranks on
            "cuda" if available, else "cpu".
        reshard_after_forward: free the unsharded parameters after forward (all-gather them again
            in backward). None (the default, as in torch): True, except for the root module.
        mp_policy: dtypes of the unsharded parameters, gradient reduction and outputs.
    """
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError(
            f"fully_shard got a {type(module).__name__}, which has no forward to hook; shard its "
            f"children one by one (for block in model.blocks: fully_shard(block)), then the parent"
        )
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}; apply it once per module")
    mesh = mesh if mesh is not None else _default_mesh()
    _check_mesh(mesh)
    params = [FSDPParam(owners, param, mesh) for param, owners in _managed_params(module, mesh)]
    _check_dtypes(params, mp_policy)
    group = ParamGroup(params, mesh, mp_policy)
    for p in params:
        p.register(p.sharded)
    module._fsdp_state = FSDPState(module, group, reshard_after_forward, mp_policy)  # type: ignore[assignment]
    module.__class__ = _fsdp_class(type(module))
    return module


def _default_mesh() -> DeviceMesh:
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    world = dist.get_world_size() if dist.is_initialized() else 1
    return init_device_mesh(device_type, (world,))


def _check_mesh(mesh: DeviceMesh) -> None:
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard got a {mesh.ndim}-D mesh {mesh}; it takes a 1-D mesh (FSDP) or a 2-D "
            f"(replicate, shard) mesh (HSDP), e.g. world_mesh['dp_replicate', 'dp_shard']"
        )


def _managed_params(module: nn.Module, mesh: DeviceMesh) -> list[tuple[nn.Parameter, list[tuple[nn.Module, str]]]]:
    """Parameters of `module`'s subtree outside nested fully_shard modules, each with every
    (owner module, name) it is registered under, in registration order."""
    found: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        prefix, sub = stack.pop()
        for name, param in sub._parameters.items():
            if param is None:
                continue
            _check_not_distributed(f"{prefix}{name}", param, mesh)
            found.setdefault(id(param), (param, []))[1].append((sub, name))
        children = [(f"{prefix}{n}.", c) for n, c in sub._modules.items() if c is not None]
        stack.extend(reversed([(fqn, c) for fqn, c in children if not isinstance(c, FSDPModule)]))
    return list(found.values())


def _check_not_distributed(fqn: str, param: nn.Parameter, mesh: DeviceMesh) -> None:
    if not isinstance(param, DTensor):
        if param.ndim == 0:
            raise NotImplementedError(f"fully_shard cannot shard the 0-d parameter {fqn!r}; give it shape (1,)")
        return
    if param.device_mesh != mesh:
        raise ValueError(
            f"parameter {fqn!r} is already a DTensor on {param.device_mesh} with placements "
            f"{[str(p) for p in param.placements]}, but fully_shard got {mesh}; FSDP on top of another "
            f"parallelism (e.g. TP) is not supported yet: pass plain parameters, or shard with one mesh"
        )
    raise ValueError(
        f"parameter {fqn!r} is already a DTensor on the fully_shard mesh {mesh} (placements "
        f"{[str(p) for p in param.placements]}); was it sharded by another fully_shard? apply fully_shard "
        f"once per module, children before parents"
    )


def _check_dtypes(params: list[FSDPParam], policy: MixedPrecisionPolicy) -> None:
    dtypes = {p.sharded.dtype for p in params}
    if policy.param_dtype is None and len(dtypes) > 1:
        raise NotImplementedError(
            f"fully_shard groups parameters of dtypes {sorted(map(str, dtypes))} into one all-gather; "
            f"set MixedPrecisionPolicy(param_dtype=...) or fully_shard the differing submodules separately"
        )


def _fsdp_class(cls: type) -> type:
    """The (FSDPModule, cls) subclass; one per original class so isinstance and pickling agree."""
    fsdp_cls = _FSDP_CLASSES.get(cls)
    if fsdp_cls is None:
        fsdp_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
        _FSDP_CLASSES[cls] = fsdp_cls
    return fsdp_cls


_FSDP_CLASSES: dict[type, type] = {}  # a type cache, like torch's: never holds modules or groups


def _states(module: FSDPModule, recurse: bool) -> list[FSDPState]:
    if not recurse:
        return [module._fsdp_state]
    return [m._fsdp_state for m in module.modules() if isinstance(m, FSDPModule)]  # type: ignore[attr-defined]
