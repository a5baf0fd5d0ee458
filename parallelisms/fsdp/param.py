"""FSDPParam: one parameter's two forms under fully_shard, and the size of its slot in the flat buffers.

Sharded form: an `nn.Parameter` wrapping a DTensor placed `Shard(0)` on a 1-D mesh, or
`(Replicate(), Shard(0))` on a 2-D (replicate, shard) mesh (HSDP); its local tensor is exactly this
rank's `torch.chunk` piece over the shard dim (uneven dim 0 leaves short or empty trailing shards). The
optimizer and the state dict only ever see this form.

Unsharded form: a plain leaf `nn.Parameter` of the global shape, created once and kept for the life
of the module. Its storage is padded to `n * rows` rows (`rows` = the largest chunk) so that the
all-gather output of every rank copies in with a single strided copy, and it is freed between uses by
resizing the storage to 0 bytes. Keeping the *same* tensor matters: autograd saved it (and views of
it, e.g. `weight.t()` in linear) during forward, so backward must find the data back in that very
storage after the pre-backward re-gather. Refilling it does not bump the version counter
(`_unsafe_preserve_version_counter`), otherwise autograd would report an in-place modification.

Over tensor parallelism (FSDP x TP) a parameter arrives as a DTensor on the TP mesh. FSDP then works
on its TP-local shard exactly as on a plain parameter: it chunks that along dim 0 over the dp ranks,
and the unsharded form is again the TP DTensor (its local tensor viewing the padded storage), so the
TP module code runs unchanged. The sharded form is one DTensor on the (dp..., tp...) slice of the
root mesh with placements (dp..., tp...). When TP already shards dim 0 (ColwiseParallel, a
vocabulary-parallel embedding), FSDP's dim-0 split applies *inside* the TP shard, against mesh
order, and its placement is `_StridedShard(0, split_factor=tp)`: each rank's rows are still one
contiguous range at an exact global offset (see placements._StridedShard).

Slot: in the group's flat buffers every rank contributes `rows * row_numel` elements per parameter
(its shard flattened and zero-padded), so buffer offsets are identical on every rank; collectives.py
lays the slots out and moves them.

Cast all-gather: a parameter whose module names it in `fsdp_all_gather_casts` ({parameter name: an object
with a `dtype` and `scales(amax, source_dtype) -> (scale, inverse)`}, e.g. models.float8.Float8AllGather;
on the module, so it survives TP replacing the parameter) is gathered in that dtype with one scale for the
whole tensor: the max of the shards' amaxes, over the dp shard dim and any TP dim that shards it (one
all-reduce for the group at each forward's all-gather; a backward's gathers the same bytes with that
scale). Each shard is multiplied by the scale and rounded, and the low-precision slots are all-gathered.
The unsharded parameter then holds no data: it keeps the global shape and the gather's high-precision
dtype (a TP DTensor under TP) as the leaf that receives the gradient, and its `precast` attribute is the
(gathered data, inverse scale) pair its module reads instead (models.float8). Only a parameter of one
module qualifies: a tied weight's other reader would read the missing data.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import cast

import torch
import torch.nn as nn

from parallelisms.dtensor import DeviceMesh, DTensor, Placement, Replicate, Shard
from parallelisms.dtensor.placements import _StridedShard, local_chunk
from parallelisms.dtensor.spec import DTensorSpec, contiguous_stride


class FSDPParam:
    """One managed parameter: where it is registered, its sharded and unsharded forms."""

    def __init__(
        self,
        owners: list[tuple[nn.Module, str]],
        param: nn.Parameter,
        mesh: DeviceMesh,
        spec_mesh: DeviceMesh | None = None,
    ) -> None:
        """`mesh`: the dp mesh the collectives run on; `spec_mesh`: the (dp..., tp...) mesh of the
        sharded DTensor when the group holds TP DTensors (fully_shard builds it). A plain parameter
        in such a group is replicated over tp, so every parameter of the group shares one mesh."""
        self.owners = owners  # (module, attribute name) pairs; several when a parameter is shared
        self.mesh = mesh
        self.shard_mesh_dim = mesh.ndim - 1  # the last mesh dim shards; a leading one replicates (HSDP)
        self.world = mesh.size(self.shard_mesh_dim)  # ranks one parameter is split over
        self.tp_spec: DTensorSpec | None = param._spec if isinstance(param, DTensor) else None
        tp_placements: tuple[Placement, ...] = () if self.tp_spec is None else self.tp_spec.placements
        split = (
            math.prod(
                self.tp_spec.mesh.size(m) for m, p in enumerate(tp_placements) if isinstance(p, Shard) and p.dim == 0
            )
            if self.tp_spec is not None
            else 1
        )
        dp_shard: Placement = _StridedShard(0, split_factor=split) if split > 1 else Shard(0)
        if self.tp_spec is None and spec_mesh is not None:
            tp_placements = (Replicate(),) * (spec_mesh.ndim - mesh.ndim)
        self.placements = (Replicate(),) * (mesh.ndim - 1) + (dp_shard, *tp_placements)
        self.global_shape = param.shape
        unsharded = param.to_local() if isinstance(param, DTensor) else param
        self.unsharded_shape = unsharded.shape  # what FSDP chunks: the TP shard under TP
        dim0 = self.unsharded_shape[0]
        self.rows = -(-dim0 // self.world)  # the largest torch.chunk piece along dim 0
        self.row_numel = math.prod(self.unsharded_shape[1:])
        self.slot_numel = self.rows * self.row_numel  # this parameter's per-rank span in flat buffers
        index = mesh.get_local_rank(self.shard_mesh_dim)
        local = _local_chunk(unsharded.detach(), self.world, index, _mesh_device(mesh))
        self.local_numel = local.numel()
        stride = contiguous_stride(param.shape)
        self.spec_mesh = spec_mesh or mesh
        sharded = DTensor.from_local(local, self.spec_mesh, self.placements, shape=param.shape, stride=stride)
        self.sharded = nn.Parameter(sharded, requires_grad=param.requires_grad)
        self.unsharded: nn.Parameter | None = None  # built at the first unshard, in the gather dtype
        self._padded: torch.Tensor | None = None  # (world * rows, *rest) storage behind `unsharded`
        self.accumulated_grad: torch.Tensor | None = None  # unsynced grads (set_requires_gradient_sync)
        self.on_grad_ready: Callable[[FSDPParam], None] | None = None  # set by the owning group
        casts = getattr(owners[0][0], "fsdp_all_gather_casts", None) if len(owners) == 1 else None
        self.cast = casts.get(owners[0][1]) if casts else None
        self.scale: torch.Tensor | None = None  # the cast's scale and inverse scale (see the module doc)
        self.inverse: torch.Tensor | None = None
        self.precomputed = False  # the scale was computed after the last optimizer step: the next forward takes it

    def local_shard(self) -> torch.Tensor:
        """This rank's torch.chunk piece of the sharded parameter (what the optimizer updates)."""
        return cast(DTensor, self.sharded).to_local()

    @property
    def requires_grad(self) -> bool:
        return self.sharded.requires_grad

    # ------------------------------------------------------------------------------ unsharded form
    def fill_unsharded(self, gathered: torch.Tensor) -> None:
        """Copy this parameter's slot of every rank, `gathered` (world, slot_numel), into the
        unsharded storage (allocating it first). Rows past dim 0 are the padding and stay hidden."""
        if self.unsharded is None or self._padded is None or self._padded.dtype != gathered.dtype:
            self._build_unsharded(gathered.dtype, gathered.device)
        self._refill(gathered)

    def _refill(self, gathered: torch.Tensor) -> None:
        """Copy `gathered` (world, slot_numel) into the padded storage, allocating it again if it was freed."""
        assert self._padded is not None
        storage = self._padded.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self._padded.numel() * self._padded.element_size())
        # The refill must not look like an in-place edit to the tensors autograd saved in forward.
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self._padded):
            self._padded.view(self.world, self.slot_numel).copy_(gathered)

    def _as_module_tensor(self, local: torch.Tensor) -> torch.Tensor:
        """`local` (this TP rank's rows) as the module code sees the parameter: the TP DTensor under TP."""
        if self.tp_spec is None:
            return local
        tp = self.tp_spec
        return DTensor.from_local(local, tp.mesh, tp.placements, shape=tp.shape, stride=tp.stride)

    def fill_precast(self, gathered: torch.Tensor, dtype: torch.dtype) -> None:
        """Cast all-gather: keep the gathered low-precision slots (world, slot_numel) and hand them, with
        the inverse scale, to the unsharded parameter of `dtype` (which stays without data) as `precast`."""
        if self.unsharded is None or self.unsharded.dtype != dtype:
            self._build_unsharded(dtype, gathered.device, data=False)
        if self._padded is None or self._padded.dtype != gathered.dtype:
            self._padded = torch.empty(self.world * self.rows, *self.unsharded_shape[1:], dtype=gathered.dtype,
                                       device=gathered.device)  # fmt: skip
        self._refill(gathered)
        assert self.unsharded is not None
        data = self._as_module_tensor(self._padded[: self.unsharded_shape[0]])
        self.unsharded.precast = (data, self.inverse)  # type: ignore[attr-defined]

    def _build_unsharded(self, dtype: torch.dtype, device: torch.device, *, data: bool = True) -> None:
        padded = torch.empty(self.world * self.rows, *self.unsharded_shape[1:], dtype=dtype, device=device)
        data_view = self._as_module_tensor(padded[: self.unsharded_shape[0]])  # over this storage
        if data:
            self._padded = padded
        else:  # a precast parameter's leaf: the shape and dtype of the weight, no bytes
            padded.untyped_storage().resize_(0)
        self.unsharded = nn.Parameter(data_view, requires_grad=self.requires_grad)
        if self.requires_grad and self.on_grad_ready is not None:
            # weakly: gc does not traverse a tensor's hooks, so a strong reference here would keep
            # this parameter, its state and the whole model alive after the model is dropped
            this = weakref.ref(self)
            self.unsharded.register_post_accumulate_grad_hook(lambda _: _grad_ready(this))

    def unsharded_slots(self) -> torch.Tensor:
        """The unsharded storage as (world, slot_numel): row r is rank r's padded shard."""
        assert self._padded is not None and self._padded.untyped_storage().size() > 0, "not unsharded"
        return self._padded.view(self.world, self.slot_numel)

    # ------------------------------------------------------------------------------ cast all-gather
    def local_amax(self) -> torch.Tensor:
        """max |shard| in float64, 0-d (0 for an empty shard)."""
        local = self.local_shard().detach()
        if local.numel() == 0:
            return local.new_zeros((), dtype=torch.float64)
        return torch.linalg.vector_norm(local, float("inf"), dtype=torch.float64)

    def set_scale(self, amax: torch.Tensor) -> None:
        """The cast's scale from the whole parameter's amax (the max over the shard group)."""
        assert self.cast is not None
        self.scale, self.inverse = self.cast.scales(amax, self.local_shard().dtype)

    def cast_shard(self) -> torch.Tensor:
        """(local_numel,) this rank's shard times the scale, rounded to the cast's dtype."""
        assert self.cast is not None and self.scale is not None
        return torch.mul(self.local_shard().detach().reshape(-1), self.scale).to(self.cast.dtype)

    def free_unsharded(self) -> None:
        """Release the unsharded data (the tensor object survives for autograd's saved references)."""
        if self._padded is not None:
            self._padded.untyped_storage().resize_(0)

    # ------------------------------------------------------------------------------ registration
    def register(self, form: torch.Tensor) -> None:
        """Make every owner module see `form` under the parameter's name. Writing `_parameters`
        directly skips `__setattr__`'s checks and keeps the name a parameter (not a plain attribute),
        so module code, `named_parameters()` and state-dict hooks keep working in both states."""
        for module, name in self.owners:
            module._parameters[name] = form  # type: ignore[assignment]

    # ------------------------------------------------------------------------------ gradient side
    def take_unsharded_grad(self, reduce_dtype: torch.dtype | None) -> torch.Tensor | None:
        """The unsharded gradient (plus unsynced accumulations), in `reduce_dtype`; clears it."""
        grad = None if self.unsharded is None else self.unsharded.grad
        if self.unsharded is not None:
            self.unsharded.grad = None
        if isinstance(grad, DTensor):  # TP: a Partial grad (of a replicated weight) is reduced first
            assert self.tp_spec is not None
            if grad.placements != self.tp_spec.placements:
                grad = grad.redistribute(placements=self.tp_spec.placements)
            grad = grad.to_local()
        if grad is not None and reduce_dtype is not None:
            grad = grad.to(reduce_dtype)
        if self.accumulated_grad is not None:
            grad = self.accumulated_grad if grad is None else self.accumulated_grad.add_(grad)
            self.accumulated_grad = None
        return grad

    def stash_unsharded_grad(self, reduce_dtype: torch.dtype | None) -> None:
        """No gradient sync this backward: keep the unsharded grad (in `reduce_dtype`) for later."""
        grad = self.take_unsharded_grad(reduce_dtype)
        if grad is not None:
            self.accumulated_grad = grad

    def holds_grad(self) -> bool:
        """Whether an unsharded gradient (this backward's, or stashed without sync) awaits reduction."""
        return self.accumulated_grad is not None or (self.unsharded is not None and self.unsharded.grad is not None)

    def accumulate_sharded_grad(self, reduced: torch.Tensor) -> None:
        """Add this rank's reduced shard (local_numel,) to the sharded parameter's DTensor grad."""
        local = self.local_shard()
        local_grad = reduced.view(local.shape).to(local.dtype)
        if self.sharded.grad is None:
            self.sharded.grad = DTensor.from_local(
                local_grad, self.spec_mesh, self.placements, shape=self.global_shape, stride=self.sharded.stride()
            )
        else:
            cast(DTensor, self.sharded.grad).to_local().add_(local_grad)


def _grad_ready(ref: weakref.ref[FSDPParam]) -> None:
    param = ref()
    if param is not None and param.on_grad_ready is not None:
        param.on_grad_ready(param)


def _local_chunk(full: torch.Tensor, world: int, index: int, device: torch.device) -> torch.Tensor:
    """This rank's `torch.chunk` piece of dim 0 (placements.local_chunk), on `device`; on meta when `full`
    is (meta-device init allocates shards later, with to_empty)."""
    piece = local_chunk(full, 0, world, index)
    return piece if full.is_meta else piece.to(device)


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)
