"""fully_shard and FSDPModule: the public face of FSDP2-style sharding (mirrors torch 2.13).

`fully_shard(module)` shards every parameter of `module` that no nested fully_shard already manages
into one group, swaps the module's class for a subclass of (FSDPModule, original class), and hooks the
module so the group is all-gathered around its forward and backward and reduce-scattered after it.
Apply it bottom-up: blocks first, then the root. `fully_shard([a, b])` makes one group of several
modules (torchtitan's `[norm, output]`). Parameters that tensor parallelism already made DTensors on
a slice of the same root mesh are sharded again on dim 0 of their TP shard (FSDP x TP, param.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from parallelisms.dtensor import DeviceMesh, DTensor, Replicate, Shard, init_device_mesh
from parallelisms.module_class import with_mixin

from .flat_buffers import precompute_scales
from .group import ParamGroup
from .param import FSDPParam
from .policy import MixedPrecisionPolicy
from .state import FSDPState, TrainingState


class FSDPModule:
    """Mixin every fully_shard module gets (placed first in its class's bases)."""

    _fsdp_state: FSDPState

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters and register them unsharded (not recursive). With
        `async_op`, return a handle at once; its `wait()` (or this module's forward) finishes it."""
        group = self._fsdp_state.group
        group.unshard(async_op=async_op)
        return UnshardHandle(group) if async_op else None

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones (not recursive). Not while this
        module's forward or backward runs: autograd still reads the unsharded parameters."""
        state = self._fsdp_state
        state._expect((TrainingState.IDLE, TrainingState.POST_BACKWARD), "reshard")
        state.group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether backward reduce-scatters gradients. False accumulates unsharded gradients
        locally (gradient accumulation without communication); the next synced backward reduces
        them together with its own."""
        for state in _states(self, recurse):
            state.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether backward frees the unsharded parameters. False keeps them for the next
        micro-batch (no all-gather); set it True again before the optimizer step's backward, as the
        step changes only the sharded parameters."""
        for state in _states(self, recurse):
            state.reshard_after_backward = reshard_after_backward

    def finish_backward(self) -> None:
        """End, as the end of a backward does, a backward whose gradients were put into `.grad` outside
        autograd's AccumulateGrad (a pipeline's split weight pass): every group of this module's tree reduces
        the gradients it holds (with gradient sync; otherwise it keeps them for the next synced backward)
        and reshards if asked (`set_reshard_after_backward`)."""
        state = self._fsdp_state
        root = state.root or state
        root._lazy_init()
        for member in root.tree:
            member._expect(TrainingState.IDLE, "finish_backward")
        root._end_of_backward()

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's reduced gradients by `factor` instead of averaging them over the mesh (torch's
        name): expert parallelism shards its experts over fewer ranks than the data-parallel ones whose
        contributions each expert's gradient already sums (parallel_dims.py: expert_gradient_divide_factor)."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor({factor!r}): the factor must be > 0")
        self._fsdp_state.group.buffers.gradient_divide_factor = float(factor)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters in flight when this one's forward starts (instead
        of the next module in the recorded forward order)."""
        self._fsdp_state.forward_prefetch = [_state_of(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters in flight when this one's backward starts (instead
        of the previous module in the recorded forward order)."""
        self._fsdp_state.backward_prefetch = [_state_of(m, "set_modules_to_backward_prefetch") for m in modules]

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether forward frees the unsharded parameters (backward then all-gathers them again)."""
        for state in _states(self, recurse):
            state.reshard_after_forward = reshard_after_forward
            state.auto_reshard = False


class UnshardHandle:
    """What `FSDPModule.unshard(async_op=True)` returns: `wait()` lands the all-gather."""

    def __init__(self, group: ParamGroup) -> None:
        self._group = group

    def wait(self) -> None:
        self._group.wait_unshard()


def _state_of(module: object, where: str) -> FSDPState:
    if not isinstance(module, FSDPModule):
        raise ValueError(
            f"{where} takes fully_shard modules; {type(module).__name__} is not one (fully_shard it first)"
        )
    return module._fsdp_state


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
) -> nn.Module | list[nn.Module]:
    """Shard `module`'s parameters `Shard(0)` over `mesh`, in place; returns `module`.

    A 1-D mesh shards over all its ranks (FSDP). A 2-D mesh is (replicate, shard) by position,
    whatever its dim names (HSDP, as torch): parameters are `(Replicate(), Shard(0))`, gathered and
    reduce-scattered over dim 1 and averaged over dim 0.

    Parameters that are DTensors on a TP mesh (a slice of the same root mesh as `mesh`, on other
    dims) become DTensors on the (dp..., tp...) mesh: FSDP shards their TP shards (param.py).

    Args:
        module: the module, or a list of modules sharing one group (gathered before the first of
            them runs forward, resharded after the last); parameters managed by a nested
            fully_shard are left to it.
        mesh: 1-D mesh of the data-parallel ranks, or 2-D (replicate, shard); default: all ranks on
            "cuda" if available, else "cpu".
        reshard_after_forward: free the unsharded parameters after forward (all-gather them again
            in backward). An int k reshards onto groups of k consecutive shard ranks instead
            (1 / k of the parameters stay, backward gathers over k ranks); it must divide the
            shard dim's size and lie strictly between 1 and it. None (the default, as in torch):
            True, except for the root module.
        mp_policy: dtypes of the unsharded parameters, gradient reduction and outputs.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard got an empty list of modules; pass at least one")
    for m in modules:
        _check_shardable(m)
    mesh = mesh if mesh is not None else _default_mesh()
    _check_mesh(mesh)
    managed = _managed_params(modules)
    spec_mesh = _spec_mesh(mesh, managed)
    params = [FSDPParam(owners, param, mesh, spec_mesh) for param, owners in managed]
    _check_dtypes(params, mp_policy)
    group = ParamGroup(params, mesh, mp_policy)
    if _partial_reshard_size(reshard_after_forward, mesh):
        group.reshard_after_forward_to(int(reshard_after_forward))  # type: ignore[arg-type]
    for p in params:
        p.register(p.sharded)
    for original, _ in managed:  # a module outside this group may still hold it (a shared parameter)
        original._fsdp_sharded_elsewhere = True  # type: ignore[attr-defined]
    state = FSDPState(modules, group, reshard_after_forward, mp_policy)
    for m in modules:
        m._fsdp_state = state  # type: ignore[assignment]
        m.__class__ = with_mixin(FSDPModule, type(m), "FSDP")
    return module


def _partial_reshard_size(reshard_after_forward: bool | int | None, mesh: DeviceMesh) -> bool:
    """Whether `reshard_after_forward` is a valid k (an int, not a bool); raises on a bad one."""
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return False
    world = mesh.size(mesh.ndim - 1)
    k = reshard_after_forward
    if not isinstance(k, int) or not 1 < k < world or world % k:
        raise ValueError(
            f"reshard_after_forward={k!r}: an int must divide the shard dim's size {world} and lie strictly "
            f"between 1 and {world} (use True to reshard over all {world} ranks, False to keep the parameters)"
        )
    return True


def _check_shardable(module: nn.Module) -> None:
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError(
            f"fully_shard got a {type(module).__name__}, which has no forward to hook; shard its "
            f"children one by one (for block in model.blocks: fully_shard(block)), then the parent"
        )
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}; apply it once per module")


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


def _managed_params(modules: list[nn.Module]) -> list[tuple[nn.Parameter, list[tuple[nn.Module, str]]]]:
    """Parameters of the modules' subtrees outside nested fully_shard modules, each with every
    (owner module, name) it is registered under, in registration order."""
    found: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    stack: list[tuple[str, nn.Module]] = [("", m) for m in reversed(modules)]
    while stack:
        prefix, sub = stack.pop()
        for name, param in sub._parameters.items():
            if param is None:
                continue
            _check_param(f"{prefix}{name}", param)
            found.setdefault(id(param), (param, []))[1].append((sub, name))
        children = [(f"{prefix}{n}.", c) for n, c in sub._modules.items() if c is not None]
        stack.extend(reversed([(fqn, c) for fqn, c in children if not isinstance(c, FSDPModule)]))
    return list(found.values())


def _check_param(fqn: str, param: nn.Parameter) -> None:
    if getattr(param, "_fsdp_sharded_elsewhere", False):
        raise ValueError(
            f"parameter {fqn!r} is shared with a module that an earlier fully_shard call already sharded (e.g. "
            f"tied embeddings); a shared parameter must live in one group: pass every module using it to one "
            f"fully_shard([...]) call, or leave them to a common parent"
        )
    if not isinstance(param, DTensor):
        if param.ndim == 0:
            raise NotImplementedError(f"fully_shard cannot shard the 0-d parameter {fqn!r}; give it shape (1,)")
        return
    bad = [str(p) for p in param.placements if not isinstance(p, (Shard, Replicate))]
    if bad:
        raise ValueError(
            f"parameter {fqn!r} is a DTensor with placements {[str(p) for p in param.placements]}; fully_shard "
            f"shards TP parameters placed Shard or Replicate only (found {bad}). Was fully_shard already "
            f"applied to a module holding it? apply it once per module, children before parents"
        )


def _spec_mesh(mesh: DeviceMesh, managed: list[tuple[nn.Parameter, list]]) -> DeviceMesh | None:
    """The (dp..., tp...) mesh of FSDP x TP parameters: the root's slice over both sets of dims."""
    tp_meshes = {p.device_mesh for p, _ in managed if isinstance(p, DTensor)}
    if not tp_meshes:
        return None
    if len(tp_meshes) > 1:
        raise ValueError(
            f"fully_shard got parameters on several meshes {sorted(map(str, tp_meshes))}; one group shards "
            f"parameters of one tensor-parallel mesh (shard the differing submodules separately)"
        )
    tp_mesh = tp_meshes.pop()
    if tp_mesh == mesh:
        raise ValueError(
            f"the parameters are already DTensors on the fully_shard mesh {mesh}: was fully_shard applied to "
            f"this module before (apply it once per module, children before parents)?"
        )
    if tp_mesh._root is not mesh._root or mesh.mesh_dim_names is None or tp_mesh.mesh_dim_names is None:
        raise ValueError(
            f"parameters are DTensors on {tp_mesh}, which is not a named slice of the fully_shard mesh's root "
            f"{mesh._root}; slice both from one init_device_mesh(...) world mesh, e.g. "
            f"fully_shard(m, mesh=world_mesh['dp_shard']) after parallelize_module(m, world_mesh['tp'], plan)"
        )
    try:
        return mesh._root[(*mesh.mesh_dim_names, *tp_mesh.mesh_dim_names)]
    except ValueError as e:
        raise ValueError(
            f"the fully_shard mesh {mesh} and the parameters' TP mesh {tp_mesh} share dims of the root mesh; "
            f"FSDP and TP need disjoint dims ({e})"
        ) from None


def _check_dtypes(params: list[FSDPParam], policy: MixedPrecisionPolicy) -> None:
    dtypes = {p.sharded.dtype for p in params}
    if policy.param_dtype is None and len(dtypes) > 1:
        raise NotImplementedError(
            f"fully_shard groups parameters of dtypes {sorted(map(str, dtypes))} into one all-gather; "
            f"set MixedPrecisionPolicy(param_dtype=...) or fully_shard the differing submodules separately"
        )


def precompute_all_gather_scales(modules: nn.Module | list[nn.Module]) -> None:
    """Compute the scales of every cast all-gather parameter (param.py; float8) under `modules` now, in one
    MAX all-reduce per layout (collectives.precompute_scales), for their next forward's all-gathers, which then
    issue none. Call it after each optimizer step on every rank (torchtitan's
    `precompute_float8_dynamic_scale_for_fsdp`)."""
    roots = modules if isinstance(modules, list) else [modules]
    states = {id(m._fsdp_state): m._fsdp_state for r in roots for m in r.modules() if isinstance(m, FSDPModule)}
    precompute_scales([s.group.buffers for s in states.values()])


def _states(module: FSDPModule, recurse: bool) -> list[FSDPState]:
    if not recurse:
        return [module._fsdp_state]
    states = {id(m._fsdp_state): m._fsdp_state for m in module.modules() if isinstance(m, FSDPModule)}  # type: ignore[attr-defined]
    return list(states.values())
