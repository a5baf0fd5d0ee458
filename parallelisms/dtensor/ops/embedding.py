"""Sharding rules: the embedding family (aten.embedding, aten.embedding_dense_backward).

`embedding(weight (V, D), indices (*I)) -> (*I, D)` looks up rows. One mesh dim at a time:

    weight R,      indices S(k) -> S(k)     each rank looks up its own ids (batch / sequence)
    weight S(1),   indices R    -> S(-1)    column-wise: each rank owns D/n features of every row
    weight S(0),   indices R    -> P(sum)   vocabulary-parallel: a rank owns rows [start, start+rows),
                                            looks up only ids in that range and zeroes the others
                                            (the "masked partial" of Megatron's VocabParallelEmbedding)
    weight P(sum), indices R    -> P(sum)   a lookup is linear in the weight
    weight R,      indices R    -> R

The vocabulary-parallel lookup is not the plain op on the local shard, so it runs through
`Sharding.local_impl` (`masked_embedding`). Backward, `embedding_dense_backward(grad (*I, D),
indices) -> (V, D)` scatter-adds grad rows into the rows the ids name:

    grad S(k),   indices S(k) -> P(sum)     each rank adds up its own ids' rows
    grad S(-1),  indices R    -> S(1)       column-wise
    grad P(sum), indices R    -> P(sum)     linear in grad
    grad R,      indices R    -> R          the whole table's gradient, as torch's rule: the rule cannot
                                            see whether the weight is replicated (then this is free) or
                                            split by rows (then slicing it to S(0) is free, but every
                                            rank held the whole table's gradient first). RowwiseParallel
                                            knows, and its Embedding computes only this rank's rows
                                            (`masked_embedding_backward`, tensor_parallel/vocab_parallel.py)

`scale_grad_by_freq` divides by each id's count over ALL ids, so it forbids sharding the ids.
A rule offers the product of the per-mesh-dim options; the dispatcher keeps the cheapest.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
from torch.ops import aten

from ..placements import Partial, Placement, Replicate, Shard
from ..spec import DTensorSpec
from .registry import LocalComm, LocalImpl, OpCall, Placements, Sharding, register

R = Replicate()
PARTIAL_SUM = Partial("sum")


class Option(NamedTuple):
    """One mesh dim's layout: targets of the two DTensor inputs, the output, and whether masked."""

    first: Placement  # weight (forward) or grad_output (backward)
    indices: Placement
    output: Placement
    masked: bool = False


# --------------------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------------------


def lookup_options(weight: Placement, indices: Placement, out_ndim: int) -> list[Option]:
    """Legal layouts of `embedding` on one mesh dim, given the inputs' current placements there."""
    ids = indices if isinstance(indices, Shard) else R  # int ids are never Partial
    options = [Option(R, ids, ids)]  # indices S(k): output dim k is indices dim k
    if weight == Shard(1):
        options.append(Option(weight, R, Shard(out_ndim - 1)))
    elif weight == Shard(0):
        options.append(Option(weight, R, PARTIAL_SUM, masked=True))
    elif weight == PARTIAL_SUM:
        options.append(Option(weight, R, PARTIAL_SUM))
    return options


@register(aten.embedding.default)
def embedding_rule(call: OpCall) -> list[Sharding]:
    """Product over mesh dims of `lookup_options`; masked on any mesh dim -> `masked_embedding`."""
    weight, indices = call.specs
    per_dim = [lookup_options(w, i, indices.ndim + 1) for w, i in zip(weight.placements, indices.placements)]
    return [_sharding(combo, masked_embedding) for combo in itertools.product(*per_dim)]


def _sharding(combo: tuple[Option, ...], impl: LocalImpl | None) -> Sharding:
    first: Placements = tuple(o.first for o in combo)
    ids: Placements = tuple(o.indices for o in combo)
    out: Placements = tuple(o.output for o in combo)
    masked = any(o.masked for o in combo)
    return Sharding((first, ids), (out,), local_impl=impl if masked else None)


def vocab_range(spec: DTensorSpec) -> tuple[int, int]:
    """(rows, start) of this rank's piece of dim 0 (nested S(0) included; empty pieces give rows 0)."""
    shape, offset = spec.local_shape_and_offset()
    return shape[0], offset[0]


def local_ids(indices: torch.Tensor, rows: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids relative to the local row range, and the mask of ids outside it."""
    shifted = indices - start
    outside = (shifted < 0) | (shifted >= rows)
    return shifted, outside


def masked_embedding(local_args: list, local_kwargs: dict, input_specs, output_specs, comm: LocalComm) -> torch.Tensor:
    """Vocabulary-parallel lookup: rows this rank owns, zeros elsewhere (one term of a P(sum)).

    Out-of-range ids are pointed at local row 0 for the lookup, then their rows are zeroed.
    `padding_idx` and `scale_grad_by_freq` only matter in backward, so the local call drops them.
    """
    weight, indices = local_args[:2]
    rows, start = vocab_range(input_specs[0])
    if rows == 0:  # an empty shard of the vocabulary owns no id
        return weight.new_zeros((*indices.shape, weight.shape[1]))
    shifted, outside = local_ids(indices, rows, start)
    out = aten.embedding.default(weight, shifted.masked_fill(outside, 0))
    return out.masked_fill_(outside.unsqueeze(-1), 0)


# --------------------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------------------


def scatter_options(grad: Placement, indices: Placement, ids_ndim: int, by_freq: bool) -> list[Option]:
    """Legal layouts of `embedding_dense_backward` on one mesh dim (grad is (*I, D))."""
    options = [Option(R, R, R)]
    batch_dim = next((p.dim for p in (indices, grad) if isinstance(p, Shard) and p.dim < ids_ndim), None)
    if batch_dim is not None and not by_freq:  # per-id counts must see every id
        options.append(Option(Shard(batch_dim), Shard(batch_dim), PARTIAL_SUM))
    if grad == Shard(ids_ndim):
        options.append(Option(grad, R, Shard(1)))
    elif grad == PARTIAL_SUM:
        options.append(Option(grad, R, PARTIAL_SUM))
    return options


@register(aten.embedding_dense_backward.default)
def embedding_backward_rule(call: OpCall) -> list[Sharding]:
    """Product over mesh dims of `scatter_options` (the plain op on the local tensors in every one)."""
    grad, indices = call.specs
    by_freq = bool(call.bound["scale_grad_by_freq"])
    per_dim = [scatter_options(g, i, indices.ndim, by_freq) for g, i in zip(grad.placements, indices.placements)]
    return [_sharding(combo, None) for combo in itertools.product(*per_dim)]


def masked_embedding_backward(
    grad: torch.Tensor, indices: torch.Tensor, weight: DTensorSpec, padding_idx: int, by_freq: bool
) -> torch.Tensor:
    """The weight gradient's rows [start, start+rows) of this rank's vocabulary shard of `weight`, from the
    local (replicated) output gradient and ids: what RowwiseParallel's Embedding computes in backward.

    Out-of-range ids are sent to a spare row `rows` (dropped afterwards), so they neither add to nor
    count toward (`scale_grad_by_freq`) any real row; `padding_idx` is made local the same way.
    """
    rows, start = vocab_range(weight)
    shifted, outside = local_ids(indices, rows, start)
    local_padding = padding_idx - start if padding_idx >= 0 and start <= padding_idx < start + rows else -1
    out = aten.embedding_dense_backward.default(
        grad, shifted.masked_fill(outside, rows), rows + 1, local_padding, by_freq
    )
    return out.narrow(0, 0, rows)
