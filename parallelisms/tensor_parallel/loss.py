"""loss_parallel: cross-entropy on logits sharded on the class (vocabulary) dim, without gathering them.

Our `_log_softmax` and `nll_loss` rules (parallelisms/dtensor/ops/norms.py, loss.py) always keep a
sharded class dim sharded: the log-softmax all-reduces each row's max and sum of exponentials, and
the shard that owns a row's target class contributes its loss (P(sum)). So unlike torch, the math
needs no switch. What this context adds is torch's calling convention: the targets may be plain
tensors (taken as replicated), so `F.cross_entropy(dtensor_logits, labels)` works as ported. As with
torch, run the backward inside the context too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch.ops import aten

from ..dtensor.dispatch import plain_tensors_as_replicate

LOSS_OPS = frozenset(
    {
        aten.nll_loss_forward.default,
        aten.nll_loss_backward.default,
        aten.nll_loss2d_forward.default,
        aten.nll_loss2d_backward.default,
    }
)


@contextmanager
def loss_parallel() -> Iterator[None]:
    with plain_tensors_as_replicate(LOSS_OPS):
        yield
