"""The DTensor class and the ways into and out of it: from_local, to_local, full_tensor,
redistribute, distribute_tensor and distribute_module, with the autograd Functions that make them
differentiable (_FromLocal, _ToLocal, Redistribute).

A DTensor is a `torch.Tensor` wrapper subclass: autograd and module code see a tensor of the global
shape; the data is this rank's shard (`_local_tensor`) and `_spec` says how the shards make up the
global tensor. Every aten op on it goes through `dispatch.dispatch`.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.nn as nn

from . import collectives
from .device_mesh import DeviceMesh, current_mesh
from .errors import ArgumentTypeError, UsageError
from .placements import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
    application_order,
    interleaved_chunk,
    local_chunk,
    normalize_placements,
    strided_pieces,
)
from .redistribute import (
    CastRedistribute,
    Redistribute,
    conform_layout,
    partition_value,
    redistribute_local,
)
from .spec import DTensorSpec, TensorMeta, contiguous_stride
from .traceable import constant_tuple, from_local_in_graph
from .transitions import check_target

_make_wrapper = torch.Tensor._make_wrapper_subclass


class DTensor(torch.Tensor):
    """A global tensor sharded, replicated or partially reduced over a DeviceMesh."""

    _local_tensor: torch.Tensor
    _spec: DTensorSpec
    __slots__ = ("_local_tensor", "_spec")

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool = False) -> DTensor:
        meta = spec.tensor_meta
        offset = local_tensor.storage_offset()  # as torch: views of shards report the shard's
        if local_tensor.layout != torch.strided or requires_grad or offset or not meta.contiguous:
            r = torch.Tensor._make_wrapper_subclass(
                cls,
                meta.shape,
                strides=meta.stride,
                storage_offset=offset,
                dtype=local_tensor.dtype,
                device=local_tensor.device,
                layout=local_tensor.layout,
                requires_grad=requires_grad,
            )
        else:  # the common case, with only the keywords that differ from the defaults (see _wrap)
            r = _make_wrapper(cls, meta.shape, dtype=local_tensor.dtype, device=local_tensor.device)
        r._local_tensor = local_tensor
        r._spec = spec
        return r

    @staticmethod
    def _wrap(local_tensor: torch.Tensor, spec: DTensorSpec) -> DTensor:
        """`DTensor(local_tensor, spec)` for the dispatcher's outputs (strided, never requiring grad:
        autograd wraps them itself), without the keywords that hold their defaults: each keyword
        _make_wrapper_subclass parses costs on every op."""
        meta, device = spec.tensor_meta, local_tensor.device
        offset = local_tensor.storage_offset()
        if offset:
            r = _make_wrapper(
                DTensor, meta.shape, strides=meta.stride, storage_offset=offset, dtype=meta.dtype, device=device
            )
        elif meta.contiguous:  # the default strides: not parsing them halves the wrapper's cost
            r = _make_wrapper(DTensor, meta.shape, dtype=meta.dtype, device=device)
        else:
            r = _make_wrapper(DTensor, meta.shape, strides=meta.stride, dtype=meta.dtype, device=device)
        r._local_tensor = local_tensor
        r._spec = spec
        return r

    # torch's stub types this C function without the class argument it is called with (torch's
    # SparseSemiStructuredTensor ignores the same error)
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        return _dispatch(func, args, kwargs)

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"DTensor(local_tensor={self._local_tensor}, device_mesh={self._spec.mesh}, "
            f"placements={self.placements}, shape={tuple(self.shape)})"
        )

    def __tensor_flatten__(self) -> tuple[list[str], DTensorSpec]:
        return ["_local_tensor"], self._spec

    @staticmethod
    def __tensor_unflatten__(inner: dict, spec: DTensorSpec, outer_size, outer_stride) -> DTensor:
        local = inner["_local_tensor"]
        meta = TensorMeta(torch.Size(outer_size), tuple(outer_stride), local.dtype)
        return DTensor(local, DTensorSpec(spec.mesh, spec.placements, meta), requires_grad=local.requires_grad)

    def __reduce_ex__(self, protocol: Any) -> tuple:
        """Pickle / torch.save as (shard, mesh, placements, global shape and stride).

        torch's DTensor pickles through Tensor.__reduce_ex__ (an empty wrapper plus its slots, as
        they are); ours rebuilds the spec on load instead, since the spec caches a hash of string
        hashes (the mesh dim names), which differ between processes. The shard pickles as a plain
        tensor, the mesh without its process groups (it reattaches on load: DeviceMesh.__reduce__).
        """
        spec, local = self._spec, self._local_tensor
        args = (local.detach(), local.requires_grad, spec.mesh, spec.placements, tuple(spec.shape), spec.stride)
        return (_rebuild_dtensor, (*args, self.requires_grad, dict(self.__dict__)))

    # ------------------------------------------------------------------------------ public API
    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        run_check: bool = False,
        shape: torch.Size | Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
        grad_placements: Sequence[Placement] | None = None,
    ) -> DTensor:
        """Wrap every rank's `local_tensor` as the shards of one global tensor.

        Without `shape`, shards are assumed even (global size = local size * mesh dim size); pass
        `shape` and `stride` together (as torch requires) for uneven shards. `run_check=True` verifies
        the local shapes against the global shape and broadcasts replicated data from the first rank
        of each mesh dim.
        In backward the grad is moved to `grad_placements` (default: ours with Partial -> Replicate,
        as torch does) and this rank's shard of it is returned.
        """
        if torch.compiler.is_dynamo_compiling():  # one node of the graph; it runs this code on fake shards
            mesh = device_mesh or _require_mesh("from_local")
            return from_local_in_graph(
                local_tensor,
                mesh,
                tuple(placements or [Replicate()] * mesh.ndim),
                run_check,
                constant_tuple(shape),
                constant_tuple(stride),
                constant_tuple(grad_placements),
            )
        if isinstance(local_tensor, DTensor):
            raise ArgumentTypeError(
                f"the local_tensor argument only accepts torch.Tensor but got {type(local_tensor)} value; "
                f"a DTensor is already distributed: call .redistribute() or pass its .to_local()"
            )
        if (shape is None) != (stride is None):
            raise UsageError(
                f"Please pass both shape and stride at the same time (got shape={shape}, stride={stride}); "
                f"for a contiguous global tensor stride is torch.empty(shape).stride()"
            )
        mesh = device_mesh or _require_mesh("from_local")
        placements = normalize_placements(
            placements or [Replicate()] * mesh.ndim, local_tensor.ndim, mesh.ndim, mesh.shape
        )
        spec = _spec_from_local(local_tensor, mesh, placements, shape, stride)
        if mesh.get_coordinate() is None:  # off the mesh: an empty shard, as torch
            local_tensor = local_tensor.new_empty(0).requires_grad_(local_tensor.requires_grad)
        elif run_check:
            local_tensor = _check_and_sync_local(local_tensor, spec, given_shape=shape is not None)
        if torch.is_grad_enabled() and local_tensor.requires_grad:
            grads = _grad_placements(grad_placements, placements, local_tensor.ndim, mesh.ndim)
            return _FromLocal.apply(local_tensor, spec, grads)
        return DTensor(local_tensor, spec, requires_grad=local_tensor.requires_grad)

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's shard. In backward the local grad is taken to have `grad_placements`
        (default: ours with Partial -> Replicate, as torch does)."""
        if not (torch.is_grad_enabled() and self.requires_grad):
            return self._local_tensor
        grads = _grad_placements(grad_placements, self._spec.placements, self.ndim, self._spec.mesh.ndim)
        return _ToLocal.apply(self, grads)

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> DTensor:
        """Same global tensor with new placements (differentiable).

        The same placements return `self` unless autograd records the call: then, as in torch, the
        result's grad is moved back to our placements (e.g. a Partial grad is reduced).
        `async_op=True` returns before the last collective completes: the shard is waited for when
        an op first reads it (as torch's AsyncCollectiveTensor), so compute in between overlaps it.
        `forward_dtype` casts before the collectives (they move that dtype) and is the result's
        dtype; in backward the grad is cast to `backward_dtype` (default: our dtype) before its
        collectives, and our grad always ends in our dtype (as torch).
        """
        spec = self._spec
        if device_mesh is not None and device_mesh != spec.mesh:
            raise NotImplementedError(
                f"redistribute across meshes ({spec.mesh} -> {device_mesh}) is not supported; "
                f"to_local() and from_local() on the new mesh instead"
            )
        if placements is None:
            raise ValueError("redistribute() needs placements, e.g. [Replicate()] * mesh.ndim")
        target = normalize_placements(placements, self.ndim, spec.mesh.ndim, spec.mesh.shape)
        needs_grad = torch.is_grad_enabled() and self.requires_grad
        if forward_dtype is not None or backward_dtype is not None:
            check_target(spec, target)
            return CastRedistribute.apply(self, target, async_op, forward_dtype, backward_dtype)
        if target == spec.placements and not needs_grad:
            return self
        check_target(spec, target)
        if needs_grad:  # even to the same placements: backward moves the grad back to ours (as torch)
            return Redistribute.apply(self, target, async_op)
        local = redistribute_local(self._local_tensor, spec, target, async_op=async_op)
        return DTensor(local, spec.with_placements(target))

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole global tensor on every rank (all-gathers / all-reduces as needed)."""
        replicated = self.redistribute(placements=[Replicate()] * self._spec.mesh.ndim)
        return replicated.to_local(grad_placements=grad_placements)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of `t`: a DTensor's shard itself (no autograd, writes reach the DTensor), a plain
    tensor as it is. For code that reads or fills shards in place (optimizer-side copies, bucket views)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _rebuild_dtensor(
    local: torch.Tensor,
    local_requires_grad: bool,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    state: dict[str, Any],
) -> DTensor:
    """Unpickle a DTensor (see DTensor.__reduce_ex__)."""
    spec = DTensorSpec(mesh, placements, TensorMeta(torch.Size(shape), stride, local.dtype))
    out = DTensor(local.requires_grad_(local_requires_grad), spec, requires_grad=requires_grad)
    out.__dict__.update(state)
    return out


def _dispatch(func, args, kwargs):
    from .dispatch import dispatch  # dispatch imports this module; bind late

    global _dispatch
    _dispatch = dispatch
    return dispatch(func, args, kwargs)


def _grad_placements(
    grad_placements: Sequence[Placement] | None, forward: tuple[Placement, ...], ndim: int, mesh_ndim: int
) -> tuple[Placement, ...]:
    """The placements a local<->DTensor boundary's grad takes: the ones given, else the forward ones
    with Partial -> Replicate (torch 2.13's guarantee: the grad of a partial value is replicated)."""
    if grad_placements is not None:
        return normalize_placements(grad_placements, ndim, mesh_ndim)
    return tuple(Replicate() if isinstance(p, Partial) else p for p in forward)


class _FromLocal(torch.autograd.Function):
    """local -> DTensor; backward hands each rank its shard of the grad in `grad_placements`."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec, grad_placements: tuple[Placement, ...]) -> DTensor:
        ctx.grad_placements = grad_placements
        return DTensor(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if not isinstance(grad, DTensor):
            raise TypeError(f"from_local backward expects a DTensor grad, got {type(grad).__name__}")
        local = redistribute_local(grad._local_tensor, grad._spec, ctx.grad_placements)
        return local.view_as(local), None, None


class _ToLocal(torch.autograd.Function):
    """DTensor -> local; backward wraps the local grad with `grad_placements`."""

    @staticmethod
    def forward(ctx, input: DTensor, grad_placements: tuple[Placement, ...]) -> torch.Tensor:
        ctx.spec = input._spec
        ctx.grad_placements = grad_placements
        local = input._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[DTensor, None]:
        spec: DTensorSpec = ctx.spec
        grad_spec = DTensorSpec(spec.mesh, ctx.grad_placements, TensorMeta(spec.shape, spec.stride, grad.dtype))
        return DTensor(conform_layout(grad, grad_spec), grad_spec), None


def _require_mesh(what: str) -> DeviceMesh:
    """The mesh of the innermost `with mesh:` block, for calls given no device_mesh (as torch)."""
    mesh = current_mesh()
    if mesh is None:
        raise ValueError(
            f"{what} needs a device_mesh; pass one built with init_device_mesh(...), or call it inside `with mesh:`"
        )
    return mesh


def _spec_from_local(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    shape: Sequence[int] | None,
    stride: Sequence[int] | None,
) -> DTensorSpec:
    if shape is not None:
        global_shape = torch.Size(shape)
        global_stride = tuple(stride) if stride is not None else contiguous_stride(global_shape)
    else:
        if stride is not None:
            raise ValueError("from_local got stride= without shape=; pass both for uneven shards")
        sizes, strides = list(local.shape), list(local.stride())
        for m, p in enumerate(placements):
            if isinstance(p, (Shard, _StridedShard)):  # even shards: scale the dim and the strides above it
                n = mesh.size(m)
                for i in range(len(sizes)):
                    if i != p.dim and strides[i] >= strides[p.dim]:
                        strides[i] *= n
                sizes[p.dim] *= n
        global_shape, global_stride = torch.Size(sizes), tuple(strides)
    return DTensorSpec(mesh, placements, TensorMeta(global_shape, global_stride, local.dtype))


def _check_and_sync_local(local: torch.Tensor, spec: DTensorSpec, *, given_shape: bool) -> torch.Tensor:
    """from_local(run_check=True): every rank checks every rank's metadata, then replicas are synced.

    Checked, as torch: dtype and requires_grad everywhere; without `shape=`, the local shape and
    strides too (even shards look alike on every rank); with it, that each rank's shard has the
    shape the placements give it. Facts are gathered along each mesh dim in turn (gathering what the
    previous dims gathered), so every rank ends up with every mesh rank's facts and raises the same
    error instead of leaving some ranks hanging in the next collective.
    """
    mesh = spec.mesh
    expected, _ = spec.local_shape_and_offset()
    mine = (str(local.dtype), local.requires_grad, tuple(spec.shape), () if given_shape else tuple(local.stride()))
    facts = [(mesh.get_rank(), tuple(local.shape), mine, expected)]
    for m in range(mesh.ndim):
        gathered = collectives.all_gather_object(facts, mesh.get_group(m))
        facts = [f for part in gathered for f in cast(list, part)]
    facts.sort()
    first = facts[0]
    names = ("dtype", "requires_grad", "global shape", "stride")
    for rank, local_shape, meta, want in facts:
        if meta != first[2]:
            diff = ", ".join(f"{n} {a} vs {b}" for n, a, b in zip(names, meta, first[2]) if a != b)
            raise ValueError(
                f"from_local: inconsistent tensor metadata across ranks: rank {rank} vs rank {first[0]}: {diff}; "
                f"every rank must pass the same dtype and requires_grad, and uneven shards need shape=/stride= "
                f"of the global tensor"
            )
        if local_shape != want:
            raise ValueError(
                f"from_local: rank {rank} holds a shard of shape {local_shape} but placements "
                f"{[str(p) for p in spec.placements]} of global shape {tuple(spec.shape)} give it {want}"
            )
    for m, p in enumerate(spec.placements):
        if isinstance(p, Replicate):
            local = collectives.broadcast(local.contiguous(), mesh.get_group(m), 0)
    return local


# --------------------------------------------------------------------------------------------------
# distribute_tensor / distribute_module
# --------------------------------------------------------------------------------------------------


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Split a global tensor into a leaf DTensor.

    Shards are scattered and replicas broadcast from group rank `src_data_rank` of each mesh dim, so
    only that rank's data matters; with `src_data_rank=None` every rank chunks its own copy locally
    (no communication; the copies must agree).
    """
    if not tensor.is_leaf:
        raise UsageError(
            "`distribute_tensor` should be used to distribute leaf tensors! but found non-leaf tensor! "
            "(its autograd history would be cut); distribute the leaf, or use DTensor.from_local on each rank's part"
        )
    mesh = device_mesh or _require_mesh("distribute_tensor")
    placements = normalize_placements(placements or [Replicate()] * mesh.ndim, tensor.ndim, mesh.ndim, mesh.shape)
    if isinstance(tensor, DTensor):
        return _already_distributed(tensor, mesh, placements)
    spec = DTensorSpec(mesh, placements, TensorMeta(tensor.shape, tuple(tensor.stride()), tensor.dtype))
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # not on the mesh: an empty shard, as torch
        return DTensor(tensor.new_empty(0, device=mesh.device_type), spec, requires_grad=tensor.requires_grad)
    if tensor.is_meta:  # meta-device init: no data to scatter, only this rank's shard shape
        local_shape, _ = spec.local_shape_and_offset()
        local = tensor.new_empty(local_shape)
        return DTensor(local.requires_grad_(tensor.requires_grad), spec, requires_grad=tensor.requires_grad)
    if tensor.device.type != mesh.device_type:
        tensor = tensor.to(mesh.device_type)
    local = tensor.detach()
    for m in application_order(placements, mesh.shape):
        pieces = strided_pieces(placements, mesh.shape, m)
        local = _distribute_on_mesh_dim(local, mesh, m, coordinate[m], placements[m], src_data_rank, pieces)
    if local is tensor or local._base is tensor or local.data_ptr() == tensor.data_ptr():
        local = local.clone()  # the DTensor owns its shard; never alias the caller's tensor
    return DTensor(local.requires_grad_(tensor.requires_grad), spec, requires_grad=tensor.requires_grad)


def _already_distributed(tensor: DTensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> DTensor:
    """distribute_tensor of a DTensor: itself when mesh and placements match (as torch), else an error."""
    if tensor.device_mesh != mesh:
        raise ValueError(
            f"Cannot distribute a DTensor with device mesh {tensor.device_mesh} to a different device mesh "
            f"{mesh}; use to_local() and from_local() on the new mesh"
        )
    if tensor.placements != placements:
        raise ValueError(
            f"Cannot distribute a DTensor with placements {tensor.placements} to a different placements "
            f"{placements}; call tensor.redistribute(placements=...) instead"
        )
    return tensor


def _distribute_on_mesh_dim(
    local: torch.Tensor, mesh: DeviceMesh, m: int, index: int, p: Placement, src: int | None, pieces: int = 1
) -> torch.Tensor:
    n = mesh.size(m)
    if src is not None and not 0 <= src < n:
        raise ValueError(f"src_data_rank={src} is out of range for mesh dim {m} of size {n}")
    if isinstance(p, _StridedShard) and pieces > 1:  # interleaved: the source's copy, then this rank's pieces
        if src is not None and n > 1:
            local = collectives.broadcast(local.contiguous().clone(), mesh.get_group(m), src)
        return interleaved_chunk(local, p.dim, pieces, n, index)
    if isinstance(p, (Shard, _StridedShard)):
        if src is None or n == 1:
            return local_chunk(local, p.dim, n, index)
        return collectives.scatter_chunks(local, p.dim, mesh.get_group(m), index, src)
    if src is not None and n > 1:
        local = collectives.broadcast(local.contiguous().clone(), mesh.get_group(m), src)
    if isinstance(p, Partial):
        local = partition_value(local, p.reduce_op, n, index)
    return local


ModuleFn = Callable[[nn.Module, Any, DeviceMesh], Any]


def distribute_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    partition_fn: Callable[[str, nn.Module, DeviceMesh], None] | None = None,
    input_fn: ModuleFn | None = None,
    output_fn: ModuleFn | None = None,
) -> nn.Module:
    """Turn a module's parameters and buffers into DTensors and hook its inputs/outputs.

    `partition_fn(name, submodule, mesh)` runs on every submodule; parameters and buffers it leaves
    as plain tensors are replicated. `input_fn(module, inputs, mesh)` runs before forward and may
    return new inputs; `output_fn(module, outputs, mesh)` runs after and may return new outputs.
    """
    mesh = device_mesh or _require_mesh("distribute_module")
    if getattr(module, "_distribute_module_applied", False):
        raise RuntimeError(
            f"distribute_module should only be called once on a module, but it was already applied to "
            f"{type(module).__name__}"
        )
    for name, submodule in list(module.named_modules()):
        if partition_fn is not None:
            partition_fn(name, submodule, mesh)
        _replicate_params_and_buffers(submodule, mesh)
    if input_fn is not None:
        if _legacy_hook(input_fn, "input_fn", "inputs"):
            module.register_forward_pre_hook(lambda mod, inputs: input_fn(inputs, mesh))  # type: ignore[call-arg]
        else:
            module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, mesh))
    if output_fn is not None:
        if _legacy_hook(output_fn, "output_fn", "outputs"):
            module.register_forward_hook(lambda mod, inputs, outputs: output_fn(outputs, mesh))  # type: ignore[call-arg]
        else:
            module.register_forward_hook(lambda mod, inputs, outputs: output_fn(mod, outputs, mesh))
    module._distribute_module_applied = True  # type: ignore[assignment]
    return module


def _legacy_hook(fn: Callable, what: str, values: str) -> bool:
    """Whether `fn` has the old two-argument signature ({values}, device_mesh): warns, as torch."""
    n = len(inspect.signature(fn).parameters)
    if n == 2:
        warnings.warn(
            f"Deprecating {what} that takes two arguments ({values}, device_mesh), please use {what} that "
            f"takes in (module, {values}, device_mesh) instead!",
            FutureWarning,
            stacklevel=3,
        )
        return True
    if n != 3:
        raise ValueError(f"{what} should take in 3 arguments (module, {values}, device_mesh), but got {n} arguments!")
    return False


def _replicate_params_and_buffers(module: nn.Module, mesh: DeviceMesh) -> None:
    replicate = [Replicate()] * mesh.ndim
    for key, param in module._parameters.items():
        if param is not None and not isinstance(param, DTensor):
            module.register_parameter(
                key, nn.Parameter(distribute_tensor(param.data, mesh, replicate), requires_grad=param.requires_grad)
            )
    for key, buffer in module._buffers.items():
        if buffer is not None and not isinstance(buffer, DTensor):
            module._buffers[key] = distribute_tensor(buffer, mesh, replicate)
