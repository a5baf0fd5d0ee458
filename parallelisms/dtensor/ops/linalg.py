"""Sharding rules: batched matrix ops on (*batch, m, n) tensors: the factorizations eigh and svd, and
the diagonal ops their gradients use (diagonal, diag_embed, diagonal_scatter).

Each matrix of the batch is factored alone, by the same LAPACK call whatever the batch around it,
so on one mesh dim:

    S(b), b a batch dim     -> every output S(b)   (eigenvalues (*batch, n), U (*batch, m, k), ...)
    S(m) / S(n)             -> gather to R, or move the shard to a batch dim (an all_to_all)
    P                       -> gather to R         a factorization is not linear
    R                       -> R

An output the call leaves empty (eigenvectors with compute_v=False, U and Vh with compute_uv=False:
shape (0,)) is Replicate. The dispatcher keeps the cheapest candidate.

The diagonal ops move a diagonal between two dims (dim1, dim2) and one trailing dim; the other dims
keep their shards, renumbered, and every Partial passes (they copy values and write zeros).
"""

from __future__ import annotations

import torch
from torch.ops import aten

from ..placements import Placement, Replicate, Shard
from ..spec import DTensorSpec
from .registry import OpCall, Sharding, register
from .tensor_ops import Row, expand, partials

R = Replicate()


def batched_outputs(call: OpCall) -> list[bool]:
    """Per output: whether it carries the input's batch dims (an empty (0,) output does not)."""
    spec = call.specs[0]
    batch = tuple(spec.shape[:-2])

    def meta(a: object) -> object:
        if isinstance(a, DTensorSpec):
            return torch.empty_strided(a.shape, a.stride, dtype=a.dtype, device="meta")
        return a

    outs = call.op(*map(meta, call.args), **call.kwargs)
    return [tuple(o.shape[: len(batch)]) == batch and o.ndim > len(batch) for o in outs]


@register(
    aten._linalg_eigh.default,
    aten.linalg_eigh.default,
    aten._linalg_svd.default,
    aten.linalg_svd.default,
    aten.svd.default,
)
def batched_factorization(call: OpCall) -> list[Sharding]:
    """eigh / svd: the table in the module docstring."""
    spec = call.specs[0]
    name = call.op._schema.arguments[0].name
    batched = batched_outputs(call)

    def outputs(p: Placement) -> tuple[Placement, ...]:
        return tuple(p if keeps else R for keeps in batched)

    rows = [Row({name: R}, outputs(R))]
    rows += [Row({name: Shard(b)}, outputs(Shard(b))) for b in range(spec.ndim - 2)]
    return expand(call, rows)


# --------------------------------------------------------------------------------------------------
# diagonals
# --------------------------------------------------------------------------------------------------


def off_diagonal_dims(ndim: int, dim1: int, dim2: int) -> list[int]:
    """The dims of an `ndim`-dim tensor other than (dim1, dim2), in order: a diagonal's leading dims."""
    return [d for d in range(ndim) if d not in (dim1 % ndim, dim2 % ndim)]


@register(aten.diagonal.default)
def diagonal(call: OpCall) -> list[Sharding]:
    """x.diagonal(offset, dim1, dim2) -> (*others, diag): S(others[k]) -> S(k)."""
    self = call.bound["self"]
    others = off_diagonal_dims(self.ndim, call.bound["dim1"], call.bound["dim2"])
    rows = [Row({"self": R}, (R,))] + [Row({"self": Shard(d)}, (Shard(k),)) for k, d in enumerate(others)]
    return expand(call, rows + [Row({"self": p}, (p,)) for p in partials(call)])


@register(aten.diag_embed.default)
def diag_embed(call: OpCall) -> list[Sharding]:
    """(*others, n) -> matrices with that diagonal at (dim1, dim2): S(k) -> S(others[k]) for k < ndim - 1."""
    self = call.bound["self"]
    others = off_diagonal_dims(self.ndim + 1, call.bound["dim1"], call.bound["dim2"])
    rows = [Row({"self": R}, (R,))] + [Row({"self": Shard(k)}, (Shard(d),)) for k, d in enumerate(others)]
    return expand(call, rows + [Row({"self": p}, (p,)) for p in partials(call)])


@register(aten.diagonal_scatter.default)
def diagonal_scatter(call: OpCall) -> list[Sharding]:
    """self with src written on its (dim1, dim2) diagonal: self S(others[k]) with src S(k) -> S(others[k])."""
    self = call.bound["self"]
    others = off_diagonal_dims(self.ndim, call.bound["dim1"], call.bound["dim2"])
    rows = [Row({"self": R, "src": R}, (R,))]
    rows += [Row({"self": Shard(d), "src": Shard(k)}, (Shard(d),)) for k, d in enumerate(others)]
    return expand(call, rows + [Row({"self": p, "src": p}, (p,)) for p in partials(call)])
