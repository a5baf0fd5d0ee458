"""loss_parallel: cross-entropy on logits sharded on the class (vocabulary) dim, without gathering them.

Our `_log_softmax` and `nll_loss` rules (parallelisms/dtensor/ops/norms.py, nll_loss.py) always keep a
sharded class dim sharded: the log-softmax all-reduces each row's max and sum of exponentials, and
the shard that owns a row's target class contributes its loss (P(sum)). So unlike torch, the math
needs no switch. What this context adds is torch's calling convention:
- the targets (and class weights) may be plain tensors, taken as replicated, so
  `F.cross_entropy(dtensor_logits, labels)` works as ported;
- torch's input check: the logits must be sharded on their class dim by exactly one mesh dim, the
  other mesh dims Shard or Replicate (torch raises the same ValueError; gathering the vocabulary
  silently would defeat the point);
- torch's result: the loss of `F.cross_entropy` / `F.nll_loss` is reduced over the class-sharding
  mesh dim in forward (Replicate there; Partial(sum) on mesh dims that shard rows, as torch's).
  That is the third all_reduce of torch's forward; its backward then needs no collective: the
  nll backward hands log_softmax's backward the row sums it would otherwise all-reduce.
As with torch, run the backward inside it too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.ops import aten
from torch.overrides import TorchFunctionMode

from ..dtensor import DTensor
from ..dtensor.dispatch import plain_tensors_as_replicate
from ..dtensor.placements import Partial, Placement, Replicate

LOSS_OPS = frozenset(
    {
        aten.nll_loss_forward.default,
        aten.nll_loss_backward.default,
        aten.nll_loss2d_forward.default,
        aten.nll_loss2d_backward.default,
    }
)

# the functions whose input torch's loss_parallel checks: log-softmaxes take the class dim as their
# second argument (`dim`), the losses have it at 1 (0 for a single row)
_LOG_SOFTMAXES = (F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax)
_LOSSES = (F.cross_entropy, F.nll_loss)


def check_class_dim_sharded(placements: tuple[Placement, ...], dim: int) -> int:
    """The mesh dim that shards tensor dim `dim`; ValueError (torch's) unless exactly one does and
    the other mesh dims are Shard or Replicate."""
    shard_mesh_dims = [i for i, p in enumerate(placements) if p.is_shard(dim)]
    if len(shard_mesh_dims) != 1:
        raise ValueError(
            f"loss_parallel() requires exactly one mesh dim to shard tensor dimension {dim}, but got "
            f"placements {placements} with {len(shard_mesh_dims)} such mesh dim(s); shard the logits on "
            f"their class dim (e.g. ColwiseParallel(output_layouts=Shard(-1))) or call the loss outside loss_parallel()"
        )
    for i, p in enumerate(placements):
        if i != shard_mesh_dims[0] and not (p.is_shard() or p.is_replicate()):
            raise ValueError(f"loss_parallel() expects non-TP mesh dims to be Shard or Replicate, got {p} at dim {i}.")
    return shard_mesh_dims[0]


class _LossParallelMode(TorchFunctionMode):
    """Checks the logits of the losses torch's loss_parallel checks, and reduces a loss over the
    mesh dim that shards the classes (torch's placements for the result)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        x = args[0] if args else kwargs.get("input")
        if not (isinstance(x, DTensor) and (func in _LOG_SOFTMAXES or func in _LOSSES)):
            return func(*args, **kwargs)
        if func in _LOG_SOFTMAXES:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if isinstance(dim, int):
                check_class_dim_sharded(x.placements, dim % max(x.ndim, 1))
            return func(*args, **kwargs)
        class_mesh_dim = check_class_dim_sharded(x.placements, 1 if x.ndim >= 2 else 0)
        loss = func(*args, **kwargs)
        if isinstance(loss, DTensor) and isinstance(loss.placements[class_mesh_dim], Partial):
            placements = list(loss.placements)
            placements[class_mesh_dim] = Replicate()
            loss = loss.redistribute(placements=placements)  # its backward moves nothing
        return loss


@contextmanager
def loss_parallel() -> Iterator[None]:
    with plain_tensors_as_replicate(LOSS_OPS), _LossParallelMode():
        yield
