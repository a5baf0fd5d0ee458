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

Every collective is a flat function of parallelisms/dtensor/collectives.py (the only file that calls
torch.distributed); this module builds their inputs and takes their outputs apart.
"""

from __future__ import annotations

import torch

from parallelisms.dtensor import DeviceMesh, collectives
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

    def use_blocks(self, k: int) -> None:
        """Gather post-forward shards over blocks of k ranks (creates the block groups on the root mesh
        the first time: every rank makes this call in the same order)."""
        self.mesh.block_group(self.shard_dim, k)
        self.block_size = k
        self.block_index = self.mesh.get_local_rank(self.shard_dim) % k

    # ------------------------------------------------------------------------------ all-gather
    def copy_in(self, dtype: torch.dtype | None) -> torch.Tensor:
        """(numel,): this rank's padded shards, in `dtype` (None: the shards' own)."""
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

    def start_all_gather(self, dtype: torch.dtype | None, *, async_op: bool) -> InFlight:
        """Copy in and all-gather over the shard dim: (world * numel,) once waited."""
        group = self.mesh.get_group(self.shard_dim)
        return collectives.start_all_gather_flat(self.copy_in(dtype), group, async_op=async_op)

    def start_block_all_gather(self, shard: torch.Tensor, *, async_op: bool) -> InFlight:
        """All-gather a post-forward shard (world / k, numel) over this rank's k-rank block."""
        group = self.mesh.block_group(self.shard_dim, self.block_size)
        return collectives.start_all_gather_flat(shard.reshape(-1), group, async_op=async_op)

    def copy_out(self, gathered: torch.Tensor) -> None:
        """Fill every parameter's unsharded storage from the gathered (world * numel,) buffer."""
        per_rank = gathered.view(self.world, self.numel)  # (world, numel)
        for p, offset in zip(self.params, self.offsets):
            p.fill_unsharded(per_rank[:, offset : offset + p.slot_numel])

    def post_forward_shard(self) -> torch.Tensor:
        """(world / k, numel): the slots of this rank's block position, cut from the unsharded storages."""
        rows = self.world // self.block_size
        start = self.block_index * rows
        return torch.cat([p.unsharded_slots()[start : start + rows] for p in self.params], dim=1)

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
        offset = 0
        for p in params:
            p.accumulate_sharded_grad(reduced[offset : offset + p.local_numel])
            offset += p.slot_numel
