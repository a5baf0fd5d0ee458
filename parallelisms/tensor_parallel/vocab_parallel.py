"""The vocabulary-parallel embedding: RowwiseParallel's Embedding, whose weight gradient comes out sharded
like the weight.

DTensor's rule for a lookup's backward sees only the output's gradient and the ids, both Replicate, so it
cannot know whether the table is replicated or split by vocabulary rows; like torch's, it computes the
whole table's gradient (Replicate), which is free for a replicated table. For a table split by rows that
would be the whole (vocab, dim) table on every rank, later sliced: a 128K x 4096 table is 2 GiB of
gradient per rank where 2 GiB / tp would do. RowwiseParallel knows the layout, so it makes its Embedding
a `VocabParallelEmbedding`: the lookup's backward accumulates only this rank's rows (Megatron's
VocabParallelEmbedding), with no communication, and the gradient is Shard(0) like the weight.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..dtensor import DTensor, Replicate, Shard
from ..dtensor.ops.embedding import masked_embedding_backward
from ..dtensor.spec import DTensorSpec

ROWS, R = Shard(0), Replicate()


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding whose weight, a DTensor split by rows (S(0)) on a 1-D mesh, gets an S(0) gradient.

    Only the forward differs; parameters, state-dict keys and `isinstance(m, nn.Embedding)` are nn.Embedding's.
    Any other layout (or `max_norm`, which renormalizes rows in place) takes nn.Embedding's forward."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (
            isinstance(weight, DTensor)
            and isinstance(input, DTensor)
            and weight.placements == (ROWS,)
            and input.placements == (R,)
            and input.device_mesh == weight.device_mesh
            and self.max_norm is None
        ):
            padding_idx = -1 if self.padding_idx is None else self.padding_idx
            return _VocabParallelLookup.apply(weight, input, padding_idx, self.scale_grad_by_freq)
        return super().forward(input)


def make_vocab_parallel(module: nn.Embedding) -> nn.Module:
    """Swap a plain nn.Embedding's class in place (a subclass of it keeps its own forward, and the
    Replicate gradient of the generic rule)."""
    if type(module) is nn.Embedding:
        module.__class__ = VocabParallelEmbedding
    return module


class _VocabParallelLookup(torch.autograd.Function):
    """Forward: DTensor's masked lookup (P(sum)). Backward: this rank's rows of the gradient, S(0)."""

    @staticmethod
    def forward(ctx: Any, weight: DTensor, ids: DTensor, padding_idx: int, by_freq: bool) -> DTensor:
        ctx.save_for_backward(ids)
        ctx.weight_spec = weight._spec
        ctx.padding_idx, ctx.by_freq = padding_idx, by_freq
        return F.embedding(ids, weight)  # type: ignore[return-value]  # padding_idx and by_freq act in backward

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None, None, None]:
        (ids,) = ctx.saved_tensors
        spec: DTensorSpec = ctx.weight_spec
        if grad.placements != (R,):  # e.g. Partial from a consumer that left it pending
            grad = grad.redistribute(placements=(R,))
        local = masked_embedding_backward(grad.to_local(), ids.to_local(), spec, ctx.padding_idx, ctx.by_freq)
        weight_grad = DTensor.from_local(local, spec.mesh, (ROWS,), shape=spec.shape, stride=spec.stride)
        return weight_grad, None, None, None
