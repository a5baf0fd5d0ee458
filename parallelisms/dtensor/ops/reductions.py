"""Sharding rules: the reduction family (sum, mean, amax/amin, max/min, var/std, all/any, argmax/argmin,
prod, logsumexp), the scans (cumsum, cumprod, logcumsumexp, cummax, cummin), written once from a small table, histc
and the vector norms.

Per mesh dim, for a reduction `f` over dims D:

    S(d), d not in D   -> S(d')       rows are independent; d' is d shifted left past the dropped dims
    S(d), d in D       -> P(op)       when f over the pieces, combined by op, is f over the whole:
                                      sum -> P(sum); mean -> P(avg) (equal shards only: a mean of
                                      means needs equal counts); amax/max -> P(max), amin/min -> P(min)
                                      (non-empty shards only: the max of an empty piece raises)
                       -> otherwise   gather it (R); as torch, never move the shard to a kept dim
    P(op)              -> P(op)       when f commutes with op (sum and mean are linear: P(sum), P(avg)
                                      pass; amax passes P(max)); otherwise reduce first (R)
    R                  -> R

A rule returns the product of these per-mesh-dim options; the dispatcher keeps the cheapest.
Scans keep every dim (keepdim) and treat the scanned dim like a reduced one that never becomes Partial.

Vector norms (linalg_vector_norm) are reductions whose pieces combine without moving the data:

    ||x||_p over S(d) pieces, d reduced   -> P(norm<p>)   global = (sum_r ||x_r||_p ** p) ** (1/p)
    p = 1 (and 0: count of non-zeros)     -> P(sum)
    p = inf / -inf                        -> P(max) / P(min)   (no piece may be empty: max() of none)
    ||.||_p of P(norm<p>) pieces          -> R, reduced first  (as torch)

P(norm<p>) is reduced by all_reduce(sum) of x**p and a p-th root (collectives.py). A norm of
P(norm<p>) norms could stay P(norm<p>) (the same sum of p-th powers), but such a norm is read
more than once (clip_grad_norm_'s total norm: its clip coefficient, then the log), and every read
of a Partial value reduces it: reducing once here, as torch does, is the cheaper plan.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.ops import aten

from ..placements import Partial, Placement, Replicate, Shard, nested_chunk_sizes, norm_reduce_op
from ..spec import DTensorSpec
from .pointwise import mixes_reduce_ops
from .registry import OpCall, Placements, Sharding, register


@dataclass(frozen=True, slots=True)
class Reduction:
    """How a reduction treats a sharded reduced dim and a Partial input."""

    shard_becomes: str | None  # Partial reduce op a sharded reduced dim turns into; None: un-shard it
    passes_partials: tuple[str, ...] = ()  # Partial inputs carried through unchanged
    needs_even: bool = False  # every shard of the reduced dims must be equally long (avg)
    needs_nonempty: bool = False  # no shard of the reduced dims may be empty (max / min raise on empty)
    scan: bool = False  # cumsum-like: output keeps every dim; the dim is scanned, not dropped


SUM = Reduction("sum", ("sum", "avg"))
NANSUM = Reduction("sum")  # a NaN in one partial term is not a NaN of the sum: no Partial inputs
MEAN = Reduction("avg", ("sum", "avg"), needs_even=True)
MAX = Reduction("max", ("max",), needs_nonempty=True)
MIN = Reduction("min", ("min",), needs_nonempty=True)
GATHER = Reduction(None)  # var/std/argmax/prod/all/any/logsumexp/max.dim/median/mode: only unsharded dims reduce
LINEAR_SCAN = Reduction(None, ("sum", "avg"), scan=True)  # cumsum is linear in its input
SCAN = Reduction(None, scan=True)

REDUCTIONS: dict[Any, Reduction] = {
    aten.sum.default: SUM,
    aten.sum.dim_IntList: SUM,
    aten.nansum.default: NANSUM,
    aten.mean.default: MEAN,
    aten.mean.dim: MEAN,
    aten.amax.default: MAX,
    aten.max.default: MAX,
    aten.amin.default: MIN,
    aten.min.default: MIN,
    aten.cumsum.default: LINEAR_SCAN,
    aten.cumprod.default: SCAN,
    aten.logcumsumexp.default: SCAN,
    aten.cummax.default: SCAN,  # (values, indices) along the scanned dim
    aten.cummin.default: SCAN,
}
for _op in (
    aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default,
    aten.var.default, aten.var.dim, aten.var.correction, aten.std.default, aten.std.dim, aten.std.correction,
    aten.var_mean.default, aten.var_mean.dim, aten.var_mean.correction,
    aten.std_mean.default, aten.std_mean.dim, aten.std_mean.correction,
    aten.all.default, aten.all.dim, aten.all.dims, aten.any.default, aten.any.dim, aten.any.dims,
    aten.prod.default, aten.prod.dim_int, aten.logsumexp.default,
    aten.median.default, aten.median.dim, aten.nanmedian.default, aten.nanmedian.dim, aten.mode.default,
    aten.kthvalue.default,
):  # fmt: skip
    REDUCTIONS[_op] = GATHER

# all.dims / any.dims read `dim=[]` as "reduce nothing"; every other op reads it as "reduce everything"
_EMPTY_DIMS_REDUCE_NOTHING = (aten.all.dims, aten.any.dims)


# --------------------------------------------------------------------------------------------------
# pure math
# --------------------------------------------------------------------------------------------------


def reduced_dims(call: OpCall, ndim: int) -> tuple[tuple[int, ...], bool]:
    """(normalized reduced dims, keepdim) read from the op's `dim` / `keepdim` args by schema name."""
    dim = call.bound.get("dim")
    keepdim = bool(call.bound.get("keepdim", False)) or REDUCTIONS[call.op].scan
    if isinstance(dim, int):
        dim = (dim,)
    if dim is None or (dim == () and call.op not in _EMPTY_DIMS_REDUCE_NOTHING):
        return tuple(range(ndim)), keepdim
    return tuple(sorted({d % max(ndim, 1) for d in dim if ndim})), keepdim


def output_dim(d: int, dims: Sequence[int], keepdim: bool) -> int:
    """Where input dim `d` (not reduced) lands in the output: dropped dims before it shift it left."""
    return d if keepdim else d - sum(1 for r in dims if r < d)


def shards_ok(
    kind: Reduction, shape: Sequence[int], mesh_shape: Sequence[int], placements: Placements, dims: Sequence[int]
) -> bool:
    """Whether the reduced dims' shards meet `kind`'s needs (equal lengths, none empty)."""
    for d in dims:
        splits = [mesh_shape[m] for m, p in enumerate(placements) if isinstance(p, Shard) and p.dim == d]
        sizes = nested_chunk_sizes(shape[d], splits)
        if kind.needs_even and len(set(sizes)) > 1:
            return False
        if kind.needs_nonempty and min(sizes) == 0:
            return False
    return True


def reduction_shardings(
    kind: Reduction,
    shape: Sequence[int],
    placements: Placements,
    mesh_shape: Sequence[int],
    dims: Sequence[int],
    keepdim: bool,
    num_outputs: int,
) -> list[Sharding]:
    """Every legal Sharding of a one-input reduction (all outputs share the placements)."""
    becomes = None if kind.scan else kind.shard_becomes
    candidates = reduction_candidates(shape, placements, mesh_shape, becomes, kind.passes_partials, dims, keepdim)
    return [
        Sharding((inputs,), (output,) * num_outputs)
        for inputs, output in candidates
        if shards_ok(kind, shape, mesh_shape, inputs, dims)
    ]


# --------------------------------------------------------------------------------------------------
# the rule
# --------------------------------------------------------------------------------------------------


@register(*REDUCTIONS)
def reduction_rule(call: OpCall) -> list[Sharding]:
    """Reductions and scans of one tensor: the table in the module docstring."""
    (spec,) = call.specs
    dims, keepdim = reduced_dims(call, spec.ndim)
    num_outputs = len(call.op._schema.returns)
    return reduction_shardings(
        REDUCTIONS[call.op], spec.shape, spec.placements, spec.mesh.shape, dims, keepdim, num_outputs
    )


HISTC = Reduction("sum")  # counts of pieces add up; a Partial input's pieces are not values to count


@register(aten.histc.default)
def histc_rule(call: OpCall) -> list[Sharding]:
    """histc counts every element into `bins` fixed bins: a shard's counts are one term of the total,
    S(d) -> P(sum). With min == max the bin range is the data's (global) min and max, which no
    shard knows: gather first. Partial inputs are reduced first (counting is not linear)."""
    (spec,) = call.specs
    kind = GATHER if call.bound["min"] == call.bound["max"] else HISTC
    dims = tuple(range(spec.ndim))
    return reduction_shardings(kind, spec.shape, spec.placements, spec.mesh.shape, dims, False, 1)


# --------------------------------------------------------------------------------------------------
# vector norms (linalg_vector_norm; foreach.py's _foreach_norm / _max / _powsum reuse them)
# --------------------------------------------------------------------------------------------------

Candidate = tuple[Placements, tuple[Placements, ...]]  # (output placements, required per input)


def norm_partial(ord: float) -> str | None:
    """The reduce op that combines per-piece `ord`-norms into the norm of the whole, if any."""
    if ord == math.inf:
        return "max"
    if ord == -math.inf:
        return "min"
    if ord in (0, 1):
        return "sum"
    return norm_reduce_op(ord) if ord > 0 else None  # negative p: empty pieces raise; reduce first


def reduction_candidates(
    shape: Sequence[int],
    placements: Placements,
    mesh_shape: Sequence[int],
    becomes: str | None,
    passes: tuple[str, ...],
    dims: Sequence[int],
    keepdim: bool,
) -> list[tuple[Placements, Placements]]:
    """(input placements, output placements) choices of a reduction over `dims`, per mesh dim:

        S(kept dim)             stays, shifted past the dropped dims
        S(reduced dim)          becomes P(`becomes`) (when given), or is gathered
        P(r), r in `passes`     passes through
        anything else           is gathered: Replicate in, Replicate out

    As torch's strategies, a shard of a reduced dim is gathered, never moved to a kept dim (an
    all-to-all would be cheaper, but the output would be sharded where torch's is Replicate, and a
    ported program's `to_local()` would see another shape).
    """
    per_dim: list[list[tuple[Placement, Placement]]] = []
    for p in placements:
        if isinstance(p, Shard) and p.dim not in dims:
            per_dim.append([(p, Shard(output_dim(p.dim, dims, keepdim)))])
        elif isinstance(p, Shard):
            per_dim.append(([(p, Partial(becomes))] if becomes else []) + [(Replicate(), Replicate())])
        elif isinstance(p, Partial) and p.reduce_op in passes:
            per_dim.append([(p, p)])
        else:
            per_dim.append([(Replicate(), Replicate())])
    out = []
    for combo in itertools.product(*per_dim):
        inputs, output = tuple(i for i, _ in combo), tuple(o for _, o in combo)
        if mixes_reduce_ops(output) or mixes_reduce_ops(inputs):
            continue
        if becomes in ("max", "min") and not shards_ok(MAX, shape, mesh_shape, inputs, dims):
            continue  # max() of an empty piece raises
        out.append((inputs, output))
    return out


def vector_norm_candidates(spec: DTensorSpec, ord: Any, dims: Sequence[int] | None, keepdim: bool) -> list[Candidate]:
    ord = float(ord)
    dims = tuple(range(spec.ndim)) if not dims else tuple(sorted(d % spec.ndim for d in dims))
    becomes = norm_partial(ord)
    return [
        (out, (inp,))
        for inp, out in reduction_candidates(spec.shape, spec.placements, spec.mesh.shape, becomes, (), dims, keepdim)
    ]


@register(aten.linalg__powsum.default)
def powsum_rule(call: OpCall) -> list[Sharding]:
    """linalg__powsum, sum(|x| ** ord) without the root: a sum, so a shard of a reduced dim becomes P(sum)."""
    spec, bound = call.specs[0], call.bound
    dims = bound["dim"]
    dims = tuple(range(spec.ndim)) if not dims else tuple(sorted(d % spec.ndim for d in dims))
    candidates = reduction_candidates(
        spec.shape, spec.placements, spec.mesh.shape, "sum", (), dims, bool(bound["keepdim"])
    )
    return [Sharding((inp,), (out,)) for inp, out in candidates]


@register(aten.linalg_vector_norm.default)
def vector_norm_rule(call: OpCall) -> list[Sharding]:
    """linalg_vector_norm: the norm table in the module docstring."""
    spec = call.specs[0]
    bound = call.bound
    dims = bound["dim"]
    dims = (dims,) if isinstance(dims, int) else dims
    candidates = vector_norm_candidates(spec, bound["ord"], dims, bool(bound["keepdim"]))
    return [Sharding(required, (out,)) for out, required in candidates]
