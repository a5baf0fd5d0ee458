"""How K/V blocks travel between the cp ranks: the only file of the package calling torch.distributed.

"allgather": every rank gathers every K/V block at once (one all-gather), and the backward returns each
block's gradient to its owner with one reduce-scatter. "alltoall" (torchtitan's name for the ring): K/V
passes to the next rank while the current block computes, cp-1 passes forward; the backward passes K/V
again and carries each block's gradient around the ring back to its owner (cp passes). A pass is one
batched send + receive (NCCL needs them batched: a ring of unbatched blocking sends deadlocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from parallelisms.dtensor import collectives
from parallelisms.dtensor.device_mesh import DeviceMesh


@dataclass(frozen=True)
class RingGroup:
    """The cp ranks of one sequence: the group, its size, this rank's index, and its ring neighbours
    (global ranks: the next gets our K/V, the previous sends us its)."""

    group: ProcessGroup
    size: int
    rank: int
    next_peer: int
    prev_peer: int

    @classmethod
    def of(cls, cp_mesh: DeviceMesh) -> RingGroup:
        group, size, rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()
        return cls(
            group, size, rank,
            next_peer=dist.get_global_rank(group, (rank + 1) % size),
            prev_peer=dist.get_global_rank(group, (rank - 1) % size),
        )  # fmt: skip


def all_gather_blocks(kv: torch.Tensor, ring: RingGroup) -> torch.Tensor:
    """Every rank's `kv` stacked in rank order: (cp, *kv.shape)."""
    gathered = collectives.all_gather(kv.contiguous(), 0, ring.group, [kv.shape[0]] * ring.size)
    return gathered.view(ring.size, *kv.shape)


def reduce_scatter_blocks(grads: torch.Tensor, ring: RingGroup) -> torch.Tensor:
    """grads (cp, ...): entry r is this rank's gradient for rank r's block; returns the sum over ranks of
    the entries for this rank's block."""
    flat = grads.reshape(ring.size * grads.shape[1], *grads.shape[2:])
    return collectives.reduce_scatter(flat, 0, "sum", ring.group, ring.rank)


@dataclass
class PendingPass:
    """A pass in flight: `received` (the previous rank's tensor) is valid after `wait`."""

    sent: torch.Tensor  # referenced until the send completes: the backend reads it
    received: torch.Tensor
    works: list[Any]
    group: dist.ProcessGroup

    def wait(self) -> torch.Tensor:
        collectives.wait_point_to_point(self.works, self.group, "a ring attention pass")
        return self.received


def start_pass(tensor: torch.Tensor, ring: RingGroup) -> PendingPass:
    """Send `tensor` to the next rank and receive the previous rank's (same shape and dtype). Under
    torch.compile's tracing the pass is one functional all-to-all that sends only to the next rank
    (point-to-point calls have no functional form), complete when it returns."""
    sent = tensor.contiguous()
    if collectives.traced():
        n, numel = ring.size, sent.numel()
        sends = [numel if r == (ring.rank + 1) % n else 0 for r in range(n)]
        receives = [numel if r == (ring.rank - 1) % n else 0 for r in range(n)]
        received = collectives.functional_all_to_all(sent.view(-1), receives, sends, ring.group).view_as(sent)
        return PendingPass(sent, received, [], ring.group)
    received = torch.empty_like(sent)
    ops = [
        dist.P2POp(dist.isend, sent, ring.next_peer, ring.group),
        dist.P2POp(dist.irecv, received, ring.prev_peer, ring.group),
    ]
    return PendingPass(sent, received, dist.batch_isend_irecv(ops), ring.group)
