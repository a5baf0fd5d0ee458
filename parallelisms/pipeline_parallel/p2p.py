"""Point-to-point transfers between pipeline stages: the only file of the package calling torch.distributed.

A send or receive is posted at once (isend / irecv) and waited where its data is needed. Between one pair of
ranks, transfers match in the order both post them (c10d's untagged p2p), which the schedules guarantee.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .stage import BoundaryMeta


@dataclass
class PendingRecv:
    buffer: torch.Tensor
    work: Any

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.buffer


@dataclass
class PendingSend:
    tensor: torch.Tensor  # referenced until the send completes: the backend reads it
    work: Any

    def wait(self) -> None:
        self.work.wait()


def post_recv(meta: BoundaryMeta, src: int, device: torch.device) -> PendingRecv:
    """Receive a `meta`-shaped tensor from global rank `src`."""
    buffer = torch.empty(meta.shape, dtype=meta.dtype, device=device)
    return PendingRecv(buffer, dist.irecv(buffer, src=src))


def post_send(tensor: torch.Tensor, dst: int) -> PendingSend:
    """Send `tensor` to global rank `dst`."""
    tensor = tensor.contiguous()
    return PendingSend(tensor, dist.isend(tensor, dst=dst))
