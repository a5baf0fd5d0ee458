"""Point-to-point transfers between pipeline stages: the only file of the package calling torch.distributed.

The schedule's consecutive SEND/RECV actions are posted together, as one `batch_isend_irecv` (torch's
pipelining batches the same way): NCCL runs a batch's sends and receives as one group, where separately
posted sends that meet each other on two ranks can wait forever. Each transfer is waited where its data is
needed (a receive) or at the end of the step (a send); a send whose batch has finished is let go before each
compute action, so the tensor it read is freed then, not at the end of the step (NCCL reports completion;
gloo's send work reads as incomplete until waited, so there sends hold their tensors to the step's end).
Between one pair of ranks, transfers match in the order both post them (c10d's untagged p2p), which the
schedules guarantee.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from parallelisms.dtensor.collectives import wait_point_to_point

from .stage import BoundaryMeta


@dataclass
class _Posted:
    """One posted batch: waiting on any of its transfers waits for all of them (NCCL may return one work)."""

    works: list[Any] = field(default_factory=list)
    group: dist.ProcessGroup | None = None  # the pp group, once posted
    done: bool = False

    def wait(self) -> None:
        if not self.done:
            assert self.group is not None, "waiting on a batch that was never posted"
            wait_point_to_point(self.works, self.group, "a pipeline stage's send or receive")
            self.done = True

    def completed(self) -> bool:
        """Whether every transfer of the batch has finished, without waiting."""
        self.done = self.done or all(work.is_completed() for work in self.works)
        return self.done


@dataclass
class PendingRecv:
    buffer: torch.Tensor
    batch: _Posted

    def wait(self) -> torch.Tensor:
        self.batch.wait()
        return self.buffer


@dataclass
class PendingSend:
    tensor: torch.Tensor  # referenced until the send completes: the backend reads it
    batch: _Posted

    def wait(self) -> None:
        self.batch.wait()

    def completed(self) -> bool:
        return self.batch.completed()


class Transfers:
    """The transfers of a run of consecutive SEND/RECV actions, gathered by `recv` / `send` and posted by `post`
    (before the next compute action, and at the end of the step)."""

    def __init__(self) -> None:
        self._ops: list[dist.P2POp] = []
        self._batch = _Posted()
        self.batches = 0  # posted so far

    def recv(self, meta: BoundaryMeta, src: int, device: torch.device, group: dist.ProcessGroup) -> PendingRecv:
        """Receive a `meta`-shaped tensor from global rank `src` of `group` (the pp group)."""
        buffer = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        self._ops.append(dist.P2POp(dist.irecv, buffer, src, group))
        return PendingRecv(buffer, self._batch)

    def send(self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup) -> PendingSend:
        """Send `tensor` to global rank `dst` of `group` (the pp group)."""
        tensor = tensor.contiguous()
        self._ops.append(dist.P2POp(dist.isend, tensor, dst, group))
        return PendingSend(tensor, self._batch)

    def post(self) -> None:
        if not self._ops:
            return
        self._batch.works = list(dist.batch_isend_irecv(self._ops))
        self._batch.group = self._ops[0].group
        # the fake backend (the dry-run estimator's) moves nothing: a posted batch is complete, as NCCL reports it
        self._batch.done = all(dist.get_backend(op.group) == "fake" for op in self._ops)
        self._ops, self._batch = [], _Posted()
        self.batches += 1
