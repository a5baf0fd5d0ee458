"""Partial gradients reduced once per step, coalesced.

A replicated weight that reads a sharded activation gets a Partial gradient: under sequence parallelism the
norms' weights (their backward sums over this rank's tokens only). Left Partial, every op that reads the
gradient all-reduces it again: the gradient norm for clipping, then each optimizer kernel that reads it
(foreach AdamW's `lerp_` and `addcmul_`), several all-reduces per tensor per step, each a synchronization
point. `reduce_partial_grads` makes them Replicate before clipping with one all-reduce per mesh dim for all of
them together (their shards flattened into one buffer), so the optimizer step issues no collective.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn

from parallelisms.dtensor import DeviceMesh, DTensor, Partial, Replicate, collectives
from parallelisms.dtensor.dtensor import local_tensor
from parallelisms.dtensor.placements import Placement


def reduce_partial_grads(params: Iterable[nn.Parameter]) -> int:
    """Turn every Partial DTensor gradient of `params` into its reduced value (Partial -> Replicate on each
    partial mesh dim, the other placements kept), coalescing gradients of one mesh, placements and dtype into
    one buffer. Returns the number of all-reduces issued (one per group and partial mesh dim)."""
    groups: dict[tuple[DeviceMesh, tuple[Placement, ...], torch.dtype], list[nn.Parameter]] = defaultdict(list)
    for p in params:
        grad = p.grad
        if isinstance(grad, DTensor) and any(isinstance(q, Partial) for q in grad.placements):
            groups[(grad.device_mesh, tuple(grad.placements), grad.dtype)].append(p)  # equal meshes group
    issued = 0
    for (_, placements, _), members in groups.items():
        grads = [p.grad for p in members]
        mesh = grads[0].device_mesh  # type: ignore[union-attr]
        flat = torch.cat([local_tensor(g).reshape(-1) for g in grads])  # type: ignore[arg-type]
        for m, placement in enumerate(placements):
            if isinstance(placement, Partial):
                flat = collectives.all_reduce(flat, placement.reduce_op, mesh.get_group(m), mesh.size(m))
                issued += 1
        reduced = tuple(Replicate() if isinstance(q, Partial) else q for q in placements)
        for p, g, piece in zip(members, grads, flat.split([local_tensor(g).numel() for g in grads])):  # type: ignore[arg-type]
            local = piece.view(local_tensor(g).shape)  # type: ignore[arg-type]
            p.grad = DTensor.from_local(local, mesh, reduced, run_check=False, shape=g.shape, stride=g.stride())  # type: ignore[union-attr]
    return issued
