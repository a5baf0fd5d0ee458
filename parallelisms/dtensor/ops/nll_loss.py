"""Sharding rules: the negative log-likelihood loss (nll_loss, nll_loss2d; cross_entropy decomposes into
_log_softmax + nll_loss_forward before dispatch).

`nll_loss_forward(x (N, C, *), target (N, *), weight (C,)?)` picks `-w[t] * x[n, t]` per row (0 for
ignored rows) and returns (loss, total_weight = sum of w[t] over kept rows). One mesh dim at a time:

    rows     x S(d), target S(d'), d not the class dim   none -> S(d'); sum -> P(sum), total P(sum)
                                                          mean -> P(sum) of local_sum / GLOBAL total
    classes  x S(1), target R   (vocabulary-parallel)    -> P(sum): a rank adds only the rows whose
                                                            target class it owns; total is local
    partial  x P(sum), target R                          -> P(sum): the loss is linear in x
    all Replicate                                        -> R

The mean over sharded rows must divide by the total weight of ALL rows, which depends on the
data (ignore_index, class weights), so `nll_forward_impl` all-reduces that one scalar over the mesh
dims that shard rows and returns total_weight Replicate. Backward (`nll_loss_backward`) writes
`-w[t] * grad / total` into the target column of each row: rows and classes shard grad_input like
x; a P(sum) grad_output gives a P(sum) grad_input. With classes sharded, both directions run the op
on targets shifted into the local class range (`local_targets`), the others ignored.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import torch
from torch.ops import aten

from ..placements import Partial, Placement, Replicate, Shard
from ..spec import DTensorSpec
from .norms import remember_row_sums
from .registry import LocalComm, OpCall, Sharding, register

R = Replicate()
PARTIAL_SUM = Partial("sum")
NONE, MEAN, SUM = 0, 1, 2  # at::Reduction
LOCAL_IGNORE = -1  # shifted targets of owned classes are >= 0, so -1 never collides


class Option(NamedTuple):
    """One mesh dim's layout: kind ('rows', 'classes', 'partial', 'replicate'), x's and target's."""

    kind: str
    x: Placement
    target: Placement


def class_dim(x: DTensorSpec) -> int:
    return 1 if x.ndim >= 2 else 0


def target_dim(dim: int) -> int:
    """Target dim of x's non-class dim `dim` (x (N, C, d1, ...) vs target (N, d1, ...))."""
    return dim if dim == 0 else dim - 1


def loss_options(x: Placement, target: Placement, cdim: int, partial_input: Placement) -> list[Option]:
    """Layouts on one mesh dim; `partial_input` is the linear input (x forward, grad_output backward)."""
    options = [Option("replicate", R, R)]
    if isinstance(x, Shard) and x.dim != cdim:
        options.append(Option("rows", x, Shard(target_dim(x.dim))))
    elif isinstance(target, Shard):
        options.append(Option("rows", Shard(target.dim if target.dim == 0 else target.dim + 1), target))
    if x == Shard(cdim):
        options.append(Option("classes", x, R))
    if partial_input == PARTIAL_SUM:
        options.append(Option("partial", PARTIAL_SUM, R))
    return options


# --------------------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------------------


@register(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_forward_rule(call: OpCall) -> list[Sharding]:
    named = call.bound.named_specs()
    x, target = named[0][1], named[1][1]
    reduction, cdim = call.bound["reduction"], class_dim(x)
    per_dim = [loss_options(p, t, cdim, p) for p, t in zip(x.placements, target.placements)]
    return [_forward_sharding(combo, len(named), reduction) for combo in itertools.product(*per_dim)]


def _forward_sharding(combo: tuple[Option, ...], n_inputs: int, reduction: int) -> Sharding:
    x = tuple(o.x for o in combo)
    target = tuple(o.target for o in combo)
    weight = tuple(R for _ in combo)
    row_dims = tuple(m for m, o in enumerate(combo) if o.kind == "rows")
    out: tuple[Placement, ...]
    total: tuple[Placement, ...]
    if reduction == NONE:
        out = tuple(o.target if o.kind == "rows" else _reduced(o) for o in combo)
        total = tuple(R for _ in combo)
    else:
        out = tuple(_reduced(o) for o in combo)
        rows_partial = reduction == SUM  # mean all-reduces the total, sum leaves it partial
        total = tuple(PARTIAL_SUM if o.kind == "rows" and rows_partial else R for o in combo)
    needs_impl = any(o.kind == "classes" for o in combo) or (reduction == MEAN and bool(row_dims))
    impl = functools.partial(nll_forward_impl, row_dims=row_dims) if needs_impl else None
    return Sharding((x, target, weight)[:n_inputs], (out, total), local_impl=impl)


def _reduced(o: Option) -> Placement:
    """A sum over rows: R stays R, every sharded or partial layout leaves one term per rank."""
    return R if o.kind == "replicate" else PARTIAL_SUM


def local_targets(target: torch.Tensor, ignore_index: int, classes: int, start: int) -> torch.Tensor:
    """Targets shifted into the local class range [start, start+classes); all others LOCAL_IGNORE."""
    shifted = target - start
    mine = (target != ignore_index) & (shifted >= 0) & (shifted < classes)
    return shifted.masked_fill(~mine, LOCAL_IGNORE)


def total_weight(target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int, dtype) -> torch.Tensor:
    """Sum of w[t] (or the count) over the rows not ignored: the denominator of the mean."""
    kept = target != ignore_index
    if weight is None:
        return kept.sum().to(dtype)
    return (weight[target.masked_fill(~kept, 0)] * kept).sum().to(dtype)


def class_range(x_spec: DTensorSpec) -> tuple[int, int]:
    """(classes, start) of this rank's piece of the class dim."""
    shape, offset = x_spec.local_shape_and_offset()
    cdim = class_dim(x_spec)
    return shape[cdim], offset[cdim]


def _nll_args(local_args: list, local_kwargs: dict, names: tuple[str, ...]) -> list:
    return [*local_args, *(local_kwargs[n] for n in names[len(local_args) :])]


FORWARD_ARGS = ("self", "target", "weight", "reduction", "ignore_index")
BACKWARD_ARGS = ("grad_output", "self", "target", "weight", "reduction", "ignore_index", "total_weight")


def nll_forward_impl(
    local_args, local_kwargs, input_specs, output_specs, comm: LocalComm, *, row_dims: tuple[int, ...]
):
    """nll over this rank's rows and classes, with the mean taken over the GLOBAL total weight.

    Runs the op with reduction=sum (or none) on local targets (classes outside this rank's range
    ignored), computes the total weight of this rank's rows over all classes, and for 'mean'
    all-reduces it over `row_dims` before dividing. Outputs match `_forward_sharding`.
    """
    x, target, weight, reduction, ignore_index = _nll_args(local_args, local_kwargs, FORWARD_ARGS)
    x_spec = input_specs[0]
    classes, start = class_range(x_spec)
    op = aten.nll_loss_forward.default if x.ndim <= 2 else aten.nll_loss2d_forward.default
    local_weight = weight.narrow(0, start, classes) if weight is not None else None
    local_reduction = NONE if reduction == NONE else SUM
    out, _ = op(x, local_targets(target, ignore_index, classes, start), local_weight, local_reduction, LOCAL_IGNORE)
    total = total_weight(target, weight, ignore_index, x.dtype)
    if reduction == NONE:
        return out, torch.zeros_like(total)
    if reduction == MEAN:
        mesh = x_spec.mesh
        for m in row_dims:
            total = comm.all_reduce(total, "sum", mesh.get_group(m), mesh.size(m))
        out = out / total
    return out, total


# --------------------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------------------


@register(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_backward_rule(call: OpCall) -> list[Sharding]:
    named = dict(call.bound.named_specs())
    grad, x, target = named["grad_output"], named["self"], named["target"]
    reduction, cdim = call.bound["reduction"], class_dim(x)
    per_dim = [loss_options(p, t, cdim, g) for p, t, g in zip(x.placements, target.placements, grad.placements)]
    return [_backward_sharding(combo, named, reduction) for combo in itertools.product(*per_dim)]


def _backward_sharding(combo: tuple[Option, ...], named: dict, reduction: int) -> Sharding:
    target = tuple(o.target for o in combo)
    grad: tuple[Placement, ...]
    if reduction == NONE:  # grad_output has the target's shape (one grad per row)
        grad = tuple(o.target if o.kind == "rows" else o.x if o.kind == "partial" else R for o in combo)
    else:  # a scalar
        grad = tuple(PARTIAL_SUM if o.kind == "partial" else R for o in combo)
    x = tuple(R if o.kind == "partial" else o.x for o in combo)  # only x's shape is read
    targets: dict[str, tuple[Placement, ...] | None]
    targets = {"grad_output": grad, "self": x, "target": target, "weight": tuple(R for _ in combo)}
    # the mean divides by the total: it must be the global one; otherwise total is not read
    targets["total_weight"] = tuple(R for _ in combo) if reduction == MEAN else None
    inputs = tuple(targets[name] for name in named)
    grad_input = tuple(o.x for o in combo)
    classes = any(o.kind == "classes" for o in combo)
    return Sharding(inputs, (grad_input,), local_impl=nll_backward_impl if classes else None)


def nll_backward_impl(local_args, local_kwargs, input_specs, output_specs, comm: LocalComm):
    """grad_input for this rank's classes: targets of other classes are ignored (zero rows)."""
    grad, x, target, weight, reduction, ignore_index, total = _nll_args(local_args, local_kwargs, BACKWARD_ARGS)
    classes, start = class_range(output_specs[0])
    op = aten.nll_loss_backward.default if x.ndim <= 2 else aten.nll_loss2d_backward.default
    local_weight = weight.narrow(0, start, classes) if weight is not None else None
    local = local_targets(target, ignore_index, classes, start)
    out = op(grad, x, local, local_weight, reduction, LOCAL_IGNORE, total)
    # Each row of the global grad_input holds one value, -w[t] * grad (/ total), at its target's
    # column, on the rank that owns it. log_softmax's backward needs the row sums; the same kernel
    # on one class per row, times w[t], gives them here bit for bit on every rank, which saves that
    # backward its all_reduce (torch's loss_parallel fuses the two backwards for the same saving).
    one_class = x.new_empty(*x.shape[:1], 1, *x.shape[2:]) if x.ndim >= 2 else x.new_empty(1)
    ignored = target == ignore_index
    row_sums = op(grad, one_class, target.masked_fill(~ignored, 0), None, reduction, ignore_index, total)
    if weight is not None:
        w = weight[target.masked_fill(ignored, 0)]  # an ignored row's sum is already 0
        row_sums = row_sums * (w.unsqueeze(1) if x.ndim >= 2 else w)
    remember_row_sums(out, row_sums)
    return out
