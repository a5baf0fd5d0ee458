"""FlatBuffers: the flat buffer layout of one fully_shard group and the collectives that move it.

Layout (the same on every rank): parameter i owns a slot of `slot_i = rows_i * row_numel_i` elements per
rank (its largest `torch.chunk` piece along dim 0, flattened; param.py) at `offset_i` of a buffer of
`numel = sum(slot_i)` elements per rank.

    copy-in            this rank's shards, each zero-padded to its slot, concatenated        (numel,)
    all-gather         over the shard dim, rank-major                                         (world, numel)
    copy-out           parameter i takes the column block [:, offset_i : offset_i + slot_i]   (world, slot_i)
                       into its unsharded storage with one strided copy (param.py)
    reduce-scatter     each gradient chunked and zero-padded to (world, slot_i) the same way, the blocks
      input            of the parameters that got one concatenated column-wise                (world, numel')
    reduce-scatter     "avg" over the shard dim; parameter i's sharded gradient is the first local_numel_i
                       elements of its slot                                                   (numel',)
    HSDP all-reduce    on a (replicate, shard) mesh the reduced shards are then averaged over the replicate dim
    post-forward shard reshard_after_forward=k: member j of a k-rank block keeps the slots of shard ranks
                       [j * world / k, (j + 1) * world / k), cut from the unsharded storages  (world / k, numel);
                       the all-gather of those over the block is the (world, numel) buffer again

A group with a cast all-gather parameter (param.py: float8) gathers bytes instead: each slot holds its
parameter's shard in its own gather dtype (the cast's, or the group's), viewed as uint8 and padded to a
multiple of 16 bytes so that every slot views back as its dtype; the layout is otherwise the same, and it
is still one all-gather. Before it, the shards whose scale is stale report their amaxes in one MAX
all-reduce (`refresh_scales`; `precompute_scales` does it for many groups at once).

Every collective is a flat function of parallelisms/dtensor/collectives.py (the only file that calls
torch.distributed); this module builds their inputs and takes their outputs apart.
"""

from __future__ import annotations

import torch

from parallelisms.dtensor import DeviceMesh, DTensor, Partial, Replicate, collectives
from parallelisms.dtensor.collectives import InFlight

from .param import FSDPParam


class FlatBuffers:
    """Where every parameter of one group sits in the flat buffers, and the collectives over them."""

    def __init__(self, params: list[FSDPParam], mesh: DeviceMesh) -> None:
        self.params = params
        self.mesh = mesh
        self.shard_dim = mesh.ndim - 1  # the last mesh dim shards; a leading one replicates (HSDP)
        self.world = mesh.size(self.shard_dim)
        self.offsets: list[int] = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.slot_numel
        self.numel = total  # per-rank elements of the all-gather input
        self._pads: list[torch.Tensor | None] = [None] * len(params)  # zeros that fill each slot
        self.block_size = 0  # reshard_after_forward=k: k; 0 when groups reshard over every rank
        self.block_index = 0  # this rank's place in its k-rank block
        self.casts = any(p.cast is not None for p in params)  # gather bytes (module docstring)
        self._byte_offsets: list[int] = []  # byte mode: each slot's offset in bytes
        self._byte_slots: list[int] = []  # and its size in bytes
        self._byte_dtype: torch.dtype | None = None  # the gather dtype they were laid out for
        self.gradient_divide_factor: float | None = None  # None: average over the mesh (set_gradient_divide_factor)

    def use_blocks(self, k: int) -> None:
        """Gather post-forward shards over blocks of k ranks (creates the block groups on the root mesh
        the first time: every rank makes this call in the same order)."""
        self.mesh.block_group(self.shard_dim, k)
        self.block_size = k
        self.block_index = self.mesh.get_local_rank(self.shard_dim) % k

    # ------------------------------------------------------------------------------ all-gather
    def copy_in(self, dtype: torch.dtype | None, fresh_scales: bool = True) -> torch.Tensor:
        """(numel,): this rank's padded shards, in `dtype` (None: the shards' own); `fresh_scales`: see
        `refresh_scales`."""
        if self.casts:
            return self._copy_in_bytes(dtype, fresh_scales)
        pieces = []
        for i, p in enumerate(self.params):
            local = p.local_shard().detach().reshape(-1)  # (local_numel,)
            pieces.append(local)
            missing = p.slot_numel - local.numel()
            if missing:
                pad = self._pads[i]
                if pad is None or pad.device != local.device or pad.dtype != local.dtype:  # moved by to_empty
                    pad = self._pads[i] = local.new_zeros(missing)
                pieces.append(pad)
        flat = torch.cat(pieces)
        return flat if dtype is None else flat.to(dtype)

    def start_all_gather(self, dtype: torch.dtype | None, *, async_op: bool, fresh_scales: bool = True) -> InFlight:
        """Copy in and all-gather over the shard dim: (world * numel,) once waited."""
        group = self.mesh.get_group(self.shard_dim)
        return collectives.start_all_gather_flat(self.copy_in(dtype, fresh_scales), group, async_op=async_op)

    def start_block_all_gather(self, shard: torch.Tensor, *, async_op: bool) -> InFlight:
        """All-gather a post-forward shard (world / k, numel) over this rank's k-rank block."""
        group = self.mesh.block_group(self.shard_dim, self.block_size)
        return collectives.start_all_gather_flat(shard.reshape(-1), group, async_op=async_op)

    def copy_out(self, gathered: torch.Tensor) -> None:
        """Fill every parameter's unsharded storage from the gathered (world * numel,) buffer."""
        if self.casts:
            return self._copy_out_bytes(gathered)
        per_rank = gathered.view(self.world, self.numel)  # (world, numel)
        for p, offset in zip(self.params, self.offsets):
            p.fill_unsharded(per_rank[:, offset : offset + p.slot_numel])

    def post_forward_shard(self) -> torch.Tensor:
        """(world / k, numel): the slots of this rank's block position, cut from the unsharded storages."""
        rows = self.world // self.block_size
        start = self.block_index * rows
        if not self.casts:
            return torch.cat([p.unsharded_slots()[start : start + rows] for p in self.params], dim=1)
        pieces = []
        for p, size in zip(self.params, self._byte_slots):
            slots = p.unsharded_slots()[start : start + rows].view(torch.uint8)
            pieces += [slots, slots.new_zeros(rows, size - slots.shape[1])]
        return torch.cat(pieces, dim=1)

    # ------------------------------------------------------------------------------ cast all-gather
    def refresh_scales(self, fresh: bool) -> None:
        """The scales of the cast parameters: recomputed (one MAX all-reduce of their amaxes) when `fresh`
        (a forward: the optimizer may have changed the shards since) unless `precompute_scales` ran since
        the last forward; otherwise (a backward's gather) the forward's, the bytes it gathered."""
        stale = []
        for p in self.params:
            if p.cast is not None and (p.scale is None or (fresh and not p.precomputed)):
                stale.append(p)
            p.precomputed = p.precomputed and not fresh
        _all_reduce_scales(stale)

    def _lay_out_bytes(self, dtype: torch.dtype | None) -> None:
        if self._byte_offsets and self._byte_dtype == dtype:
            return
        self._byte_offsets, self._byte_slots, total = [], [], 0
        for p in self.params:
            item = _gather_dtype(p, dtype).itemsize
            size = -(-p.slot_numel * item // _SLOT_ALIGN) * _SLOT_ALIGN
            self._byte_offsets.append(total)
            self._byte_slots.append(size)
            total += size
        self._byte_dtype = dtype

    def _copy_in_bytes(self, dtype: torch.dtype | None, fresh_scales: bool) -> torch.Tensor:
        """(bytes,) uint8: each shard in its gather dtype (a cast one scaled and rounded), zero-padded to its slot."""
        self.refresh_scales(fresh_scales)
        self._lay_out_bytes(dtype)
        pieces = []
        with torch.no_grad():
            for p, size in zip(self.params, self._byte_slots):
                local = p.cast_shard() if p.cast is not None else p.local_shard().detach().reshape(-1)
                if p.cast is None and dtype is not None:
                    local = local.to(dtype)
                data = local.view(torch.uint8)
                pieces += [data, data.new_zeros(size - data.numel())] if size > data.numel() else [data]
        return torch.cat(pieces)

    def _copy_out_bytes(self, gathered: torch.Tensor) -> None:
        per_rank = gathered.view(self.world, -1)  # (world, bytes)
        for p, offset in zip(self.params, self._byte_offsets):
            item = _gather_dtype(p, self._byte_dtype)
            slots = per_rank[:, offset : offset + p.slot_numel * item.itemsize].view(item)  # (world, slot_numel)
            if p.cast is None:
                p.fill_unsharded(slots)
            else:
                p.fill_precast(slots, self._byte_dtype or p.local_shard().dtype)

    # ------------------------------------------------------------------------------ reduce-scatter
    def reduce_scatter_input(self, grads: list[tuple[FSDPParam, torch.Tensor]]) -> torch.Tensor:
        """(world * numel',): every unsharded gradient as (world, slot) blocks, concatenated column-wise."""
        blocks = []
        for p, grad in grads:
            flat = grad.reshape(-1)  # (global numel,)
            missing = self.world * p.slot_numel - flat.numel()
            if missing:
                flat = torch.cat([flat, flat.new_zeros(missing)])
            blocks.append(flat.view(self.world, p.slot_numel))
        dtype = blocks[0].dtype
        return torch.cat([b.to(dtype) for b in blocks], dim=1).reshape(-1)  # (world, numel') rank-major

    def start_reduce_scatter(self, grads: list[tuple[FSDPParam, torch.Tensor]], *, async_op: bool) -> InFlight:
        """Average the gradients over the shard dim; this rank's (numel',) once waited."""
        group = self.mesh.get_group(self.shard_dim)
        return collectives.start_reduce_scatter_flat(self.reduce_scatter_input(grads), "avg", group, async_op=async_op)

    def land_reduce_scatter(self, in_flight: InFlight, params: list[FSDPParam]) -> None:
        """Wait, average over the replicas (HSDP), and add each slot to its sharded gradient."""
        reduced = in_flight.wait()
        if self.mesh.ndim > 1:  # HSDP: every replica of this shard averages it with the others
            reduced = collectives.all_reduce(reduced, "avg", self.mesh.get_group(0), self.mesh.size(0))
        if self.gradient_divide_factor is not None:  # the sum over the mesh / the factor, not / the mesh's size
            reduced = reduced * (self.mesh.size() / self.gradient_divide_factor)
        offset = 0
        for p in params:
            p.accumulate_sharded_grad(reduced[offset : offset + p.local_numel])
            offset += p.slot_numel


_SLOT_ALIGN = 16  # bytes: every byte-mode slot starts where any dtype's view of it may start


def _gather_dtype(p: FSDPParam, dtype: torch.dtype | None) -> torch.dtype:
    """What parameter `p` is all-gathered in: its cast's dtype, else the group's, else its own."""
    if p.cast is not None:
        return p.cast.dtype
    return dtype if dtype is not None else p.local_shard().dtype


def precompute_scales(buffers: list[FlatBuffers]) -> None:
    """The cast scales of every cast parameter of these groups, from one MAX all-reduce per layout, for their
    next forward's all-gathers (torchtitan's `precompute_float8_dynamic_scale_for_fsdp`: after the optimizer
    step, one collective for the whole model instead of one per group). Every rank calls it."""
    params = [p for b in buffers for p in b.params if p.cast is not None]
    _all_reduce_scales(params)
    for p in params:
        p.precomputed = True


def _all_reduce_scales(params: list[FSDPParam]) -> None:
    """Each parameter's scale from the max of its shards' amaxes: an all-reduce (MAX) over the mesh dims that
    shard it (FSDP's, and TP's where it shards the weight), one for all the parameters laid out alike."""
    by_mesh: dict[tuple, list[FSDPParam]] = {}
    for p in params:
        by_mesh.setdefault((p.spec_mesh, tuple(p.placements)), []).append(p)
    for (mesh, placements), group in by_mesh.items():
        # every dim that splits the weight (Shard, or FSDP's _StridedShard inside TP's dim-0 shards) reduces
        partial = [Replicate() if isinstance(p, Replicate) else Partial("max") for p in placements]
        with torch.no_grad():
            amaxes = torch.stack([p.local_amax() for p in group])
            amaxes = DTensor.from_local(amaxes, mesh, partial, run_check=False).full_tensor()
        for p, amax in zip(group, amaxes):
            p.set_scale(amax)
