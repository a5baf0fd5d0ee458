"""loss_parallel: cross-entropy on logits sharded on the class (vocabulary) dim, without gathering them.

Inside the context, `F.cross_entropy` on a DTensor whose class dim is sharded runs the
vocabulary-parallel rules of `parallelisms/dtensor/ops/loss.py` (global max and sum-exp by
all_reduce, the target logit from the shard that owns it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def loss_parallel() -> Iterator[None]:
    from ..dtensor.ops import loss as loss_ops

    enable = getattr(loss_ops, "vocab_parallel", None)
    if enable is None:
        raise NotImplementedError(
            "vocabulary-parallel cross entropy is not implemented yet (parallelisms/dtensor/ops/loss.py)"
        )
    with enable():
        yield
