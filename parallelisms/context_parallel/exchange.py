"""How K/V blocks travel between the cp ranks: the only file of the package that communicates.

"allgather": every rank gathers every K/V block at once (one all-gather), and the backward returns each
block's gradient to its owner with one reduce-scatter. "alltoall" (torchtitan's name for the ring): K/V
passes to the next rank while the current block computes, cp-1 passes forward; the backward passes K/V
again and carries each block's gradient around the ring back to its owner (cp passes). The passes are
parallelisms/ring_pass.py's, shared with tensor parallelism's collective matmuls.
"""

from __future__ import annotations

import torch

from parallelisms.dtensor import collectives
from parallelisms.ring_pass import PendingPass, RingGroup, start_pass

from .sequence import SequenceSharding

__all__ = ["PendingPass", "RingGroup", "all_gather_blocks", "reduce_scatter_blocks", "start_pass", "whole_sequences"]


def whole_sequences(local: torch.Tensor, sharding: SequenceSharding, ring: RingGroup) -> torch.Tensor:
    """(B, T) from every rank's (B, T / cp) share of the same rows (e.g. the tokens: block-causal attention
    needs the whole rows' document ids)."""
    gathered = collectives.all_gather(local.contiguous(), 1, ring.group, [local.shape[1]] * ring.size)
    return sharding.unshard(list(gathered.chunk(ring.size, dim=1)))


def all_gather_blocks(kv: torch.Tensor, ring: RingGroup) -> torch.Tensor:
    """Every rank's `kv` stacked in rank order: (cp, *kv.shape)."""
    gathered = collectives.all_gather(kv.contiguous(), 0, ring.group, [kv.shape[0]] * ring.size)
    return gathered.view(ring.size, *kv.shape)


def reduce_scatter_blocks(grads: torch.Tensor, ring: RingGroup) -> torch.Tensor:
    """grads (cp, ...): entry r is this rank's gradient for rank r's block; returns the sum over ranks of
    the entries for this rank's block."""
    flat = grads.reshape(ring.size * grads.shape[1], *grads.shape[2:])
    return collectives.reduce_scatter(flat, 0, "sum", ring.group, ring.rank)
