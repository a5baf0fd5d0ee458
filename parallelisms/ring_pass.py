"""A ring of ranks passing tensors to their next neighbour: context parallelism's K/V ring
(context_parallel/exchange.py) and tensor parallelism's collective matmuls (tensor_parallel/collective_matmul.py).

A pass is one batched send + receive (NCCL needs them batched: a ring of unbatched blocking sends deadlocks),
in flight while the caller computes; under torch.compile's tracing it is a functional all-to-all.
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
    """The ranks of a 1-D mesh in a ring: the group, its size, this rank's index, and its ring neighbours
    (global ranks: the next gets what we pass, the previous passes us its)."""

    group: ProcessGroup
    size: int
    rank: int
    next_peer: int
    prev_peer: int

    @classmethod
    def of(cls, mesh: DeviceMesh) -> RingGroup:
        group, size, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        return cls(
            group, size, rank,
            next_peer=dist.get_global_rank(group, (rank + 1) % size),
            prev_peer=dist.get_global_rank(group, (rank - 1) % size),
        )  # fmt: skip


@dataclass
class PendingPass:
    """A pass in flight: `received` (the previous rank's tensor) is valid after `wait`."""

    sent: torch.Tensor  # referenced until the send completes: the backend reads it
    received: torch.Tensor
    works: list[Any]
    group: dist.ProcessGroup

    def wait(self) -> torch.Tensor:
        collectives.wait_point_to_point(self.works, self.group, "a ring pass")
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
