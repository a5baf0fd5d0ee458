"""Sharding rules: softmax and normalization (softmax, log_softmax, layer_norm, rms_norm).

These ops normalize each "row" of their input over some dims (the softmax dim; the trailing
`normalized_shape` dims of a norm) and treat every other dim independently. One mesh dim at a time:

    input S(d), d not normalized   -> outputs S(d)     rows are independent (uneven shards too)
    input S(d), d normalized       -> gather to R      a row's statistics need the whole row
                                                        (log_softmax: or stay sharded, below)
    input P                        -> gather to R      normalization is not linear
    norm weight / bias             -> R                they span the normalized dims

Backward ops take the forward's tensors (grad, output/input, mean, rstd) and must see them with one
common layout `c`. Their parameter gradients sum over the rows: `grad_weight = sum_rows(g * xhat)`,
so a row-sharded `c` leaves each rank one term of that sum, P(sum). Every backward here is linear in
the incoming grad, so a P(sum) grad with everything else Replicate gives P(sum) gradients.

log_softmax over a sharded dim may instead stay sharded: it all-reduces each row's max and sum of
exponentials (one value per row, Megatron's vocabulary-parallel cross-entropy), so the logits of a
column-parallel output layer never gather; with nll_loss's class-sharded rule (nll_loss.py) this is
`loss_parallel`. Plain softmax keeps the simple rule (gather the dim).

`F.rms_norm` and `nn.RMSNorm` decompose on CPU (torch 2.13) into pow / mean / add / rsqrt / mul
(pointwise.py and reductions.py rules); `_fused_rms_norm(_backward)` is covered for backends that
keep the fused kernel.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence

import torch
from torch.ops import aten

from ..placements import Partial, Placement, Replicate, Shard
from ..spec import DTensorSpec
from .registry import LocalComm, LocalImpl, OpCall, Sharding, register

R = Replicate()
LINEAR_PARTIALS = (Partial("sum"), Partial("avg"))


def row_options(placements: Iterable[Placement], keeps: Callable[[Shard], bool]) -> list[Placement]:
    """One mesh dim's choices for a common row layout: R, plus every legal shard an input has."""
    return [R] + list(dict.fromkeys(p for p in placements if isinstance(p, Shard) and keeps(p)))


# --------------------------------------------------------------------------------------------------
# softmax family
# --------------------------------------------------------------------------------------------------


def _normalized_dim(call: OpCall, ndim: int) -> int:
    dim = call.bound["dim"]
    return dim + ndim if dim < 0 else dim


@register(aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default)
def softmax_rule(call: OpCall) -> list[Sharding]:
    """S(d) on a non-softmax dim stays; the softmax dim and Partial are gathered (R).

    log_softmax may also keep its dim sharded (vocabulary-parallel, see `sharded_log_softmax`).
    """
    (spec,) = call.specs
    dim = _normalized_dim(call, spec.ndim)
    target = tuple(p if isinstance(p, Shard) and p.dim != dim else R for p in spec.placements)
    candidates = [Sharding((target,), (target,))]
    if call.op == aten._log_softmax.default and Shard(dim) in spec.placements:
        keep = tuple(p if isinstance(p, Shard) else R for p in spec.placements)
        candidates.append(Sharding((keep,), (keep,), local_impl=sharded_log_softmax))
    return candidates


@register(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def softmax_backward_rule(call: OpCall) -> list[Sharding]:
    """grad and output share a layout that keeps the softmax dim whole.

    Both backwards are linear in grad (`y * (g - sum(g * y))`, `g - exp(y) * sum(g)`), so a
    P(sum) grad with a Replicate output gives a P(sum) grad_input. log_softmax's backward may
    keep its dim sharded (`sharded_log_softmax_backward`).
    """
    grad, output = call.specs
    dim = _normalized_dim(call, grad.ndim)
    vocab_parallel = call.op == aten._log_softmax_backward_data.default
    per_dim = []
    for g, y in zip(grad.placements, output.placements):
        options = [(c, c, c) for c in row_options((g, y), lambda p: p.dim != dim)]
        if g in LINEAR_PARTIALS:
            options.append((g, R, g))
        if vocab_parallel and Shard(dim) in (g, y):
            options.append((Shard(dim),) * 3)
        per_dim.append(options)
    candidates = []
    for combo in itertools.product(*per_dim):
        sharding = _combine(combo, n_inputs=2)
        if any(Shard(dim) == o[0] for o in combo):
            sharding = Sharding(sharding.inputs, sharding.outputs, local_impl=sharded_log_softmax_backward)
        candidates.append(sharding)
    return candidates


# Vocabulary-parallel log_softmax (Megatron's parallel cross-entropy): over a dim sharded on some
# mesh dims, log_softmax(x) = x - (m + log(sum(exp(x - m)))) needs only the global row max m and
# sum of exponentials, two all_reduces of one value per row, instead of gathering the rows.


def _all_reduce_over(
    t: torch.Tensor, reduce_op: str, spec: DTensorSpec, mesh_dims: list[int], comm: LocalComm
) -> torch.Tensor:
    for m in mesh_dims:
        t = comm.all_reduce(t, reduce_op, spec.mesh.get_group(m), spec.mesh.size(m))
    return t


def _compute_dtype(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def sharded_log_softmax(
    local_args: list, local_kwargs: dict, input_specs, output_specs, comm: LocalComm
) -> torch.Tensor:
    """log_softmax over a sharded dim: all_reduce the row max, then the row sum of exp(x - max)."""
    x, dim, _half_to_float = [*local_args, *local_kwargs.values()][:3]  # output dtype: output_specs
    spec = input_specs[0]
    dim = dim + x.ndim if dim < 0 else dim
    mesh_dims = spec.shard_mesh_dims(dim)
    xc = _compute_dtype(x)
    if xc.shape[dim]:
        local_max = xc.amax(dim, keepdim=True)
    else:  # an empty shard of the dim holds no candidate for the max
        local_max = xc.new_full((*xc.shape[:dim], 1, *xc.shape[dim + 1 :]), float("-inf"))
    row_max = _all_reduce_over(local_max, "max", spec, mesh_dims, comm)
    shifted = xc - row_max
    sum_exp = _all_reduce_over(shifted.exp().sum(dim, keepdim=True), "sum", spec, mesh_dims, comm)
    return (shifted - sum_exp.log()).to(output_specs[0].dtype)


def sharded_log_softmax_backward(
    local_args: list, local_kwargs: dict, input_specs, output_specs, comm: LocalComm
) -> torch.Tensor:
    """grad_input = g - exp(y) * sum(g) over a sharded dim: one all_reduce of the row sums of g."""
    grad, output, dim, _input_dtype = [*local_args, *local_kwargs.values()][:4]
    dim = dim + grad.ndim if dim < 0 else dim
    spec = input_specs[0]
    gc = _compute_dtype(grad)
    row_sum = known_row_sums(grad, dim)
    if row_sum is None:
        row_sum = _all_reduce_over(gc.sum(dim, keepdim=True), "sum", spec, spec.shard_mesh_dims(dim), comm)
    return (gc - _compute_dtype(output).exp() * _compute_dtype(row_sum)).to(output_specs[0].dtype)


def remember_row_sums(grad: torch.Tensor, row_sums: torch.Tensor) -> None:
    """Leave on `grad` (a fresh, dense backward output) its row sums over the sharded class dim, for
    `known_row_sums`. They are kept on its storage: the grad may reach log_softmax's backward as a
    reshape (cross_entropy on (N, C, d) runs nll_loss2d on a (N, C, 1, d) view), and views made
    below autograd share their storage, not their Python object, base or version counter."""
    # torch.compile's traced tensors have no storage: compiled code all-reduces the sums
    if grad.is_contiguous() and not torch.compiler.is_compiling():
        grad.untyped_storage()._meshtrain_row_sums = (grad.data_ptr(), grad.shape, row_sums)  # type: ignore[attr-defined]


def known_row_sums(grad: torch.Tensor, dim: int) -> torch.Tensor | None:
    """The row sums over `dim` `remember_row_sums` left, if `grad` is that tensor or a reshape of it
    that keeps the dims up to `dim`. A sum of grads (log_softmax's output read twice) is a new
    tensor, autograd never accumulates DTensor grads in place, so it finds none and all-reduces.
    Not seen: a hook that edits the grad in place between the two backwards (shards' version
    counters do not move below autograd). torch's loss_parallel, which skips log_softmax's
    backward altogether, has the same blind spot."""
    known = None if torch.compiler.is_compiling() else getattr(grad.untyped_storage(), "_meshtrain_row_sums", None)
    if known is None:
        return None
    data_ptr, shape, row_sums = known
    same_rows = (
        grad.data_ptr() == data_ptr
        and grad.is_contiguous()
        and grad.shape[: dim + 1] == shape[: dim + 1]
        and grad.numel() == shape.numel()
    )
    return row_sums.reshape(*grad.shape[:dim], 1, *grad.shape[dim + 1 :]) if same_rows else None


def _combine(combo: Sequence[tuple[Placement, ...]], n_inputs: int) -> Sharding:
    """Per-mesh-dim tuples (input targets..., output placements...) -> one Sharding."""
    columns = list(zip(*combo))  # one tuple of per-mesh-dim placements per input / output
    return Sharding(tuple(columns[:n_inputs]), tuple(columns[n_inputs:]))


# --------------------------------------------------------------------------------------------------
# layer_norm / rms_norm
# --------------------------------------------------------------------------------------------------

# Which DTensor inputs hold rows (they share the layout `c`) and what each output is:
# "row" follows `c`; "param" is a weight/bias gradient, summed over rows.
ROW_ARGS = {"input", "grad_out", "mean", "rstd"}
NORM_OUTPUTS = {
    aten.native_layer_norm.default: ("row", "row", "row"),  # out, mean, rstd
    aten.native_layer_norm_backward.default: ("row", "param", "param"),  # grad input, weight, bias
    aten._fused_rms_norm.default: ("row", "row"),  # out, rstd
    aten._fused_rms_norm_backward.default: ("row", "param"),  # grad input, weight
}


def norm_axis(call: OpCall) -> int:
    """First normalized dim of the input: `input.ndim - len(normalized_shape)`."""
    input_spec = dict(call.bound.named_specs())["input"]
    return input_spec.ndim - len(call.bound["normalized_shape"])


def norm_options(named: Sequence[tuple[str, DTensorSpec]], mesh_dim: int, axis: int, backward: bool):
    """One mesh dim's layouts: (target per input..., placement per output kind 'row', 'param')."""
    rows = [spec.placements[mesh_dim] for name, spec in named if name in ROW_ARGS]
    options = []
    for c in row_options(rows, lambda p: p.dim < axis):
        targets = tuple(c if name in ROW_ARGS else R for name, _ in named)
        options.append((targets, c, Partial("sum") if isinstance(c, Shard) else R))
    grad = named[0][1].placements[mesh_dim]
    if backward and grad == Partial("sum"):  # linear in grad: the rest replicated (sum only: the
        # param grads are P(sum) on row-sharded mesh dims, and one spec cannot mix reduce ops)
        options.append(((grad,) + (R,) * (len(named) - 1), grad, grad))
    return options


@register(*NORM_OUTPUTS)
def norm_rule(call: OpCall) -> list[Sharding]:
    """Rows (dims before `normalized_shape`) may be sharded; weight and bias are replicated."""
    named = call.bound.named_specs()
    axis = norm_axis(call)
    kinds = NORM_OUTPUTS[call.op]
    backward = named[0][0] == "grad_out"
    per_dim = [norm_options(named, m, axis, backward) for m in range(call.mesh_ndim)]
    impl = contiguous_stats(call.op) if backward else None
    shardings = []
    for combo in itertools.product(*per_dim):
        inputs = tuple(zip(*(targets for targets, _, _ in combo)))
        by_kind = {"row": tuple(c for _, c, _ in combo), "param": tuple(p for _, _, p in combo)}
        shardings.append(Sharding(inputs, tuple(by_kind[k] for k in kinds), local_impl=impl))
    return shardings


def contiguous_stats(op) -> LocalImpl:
    """The backward op with contiguous `mean` / `rstd`.

    The CPU kernels read the saved statistics as flat buffers (on one device they always come
    contiguous from the forward), but a shard can be a strided view (e.g. a short uneven chunk of a
    padded scatter), which they would silently misread.
    """
    positions = [i for i, a in enumerate(op._schema.arguments) if a.name in ("mean", "rstd")]

    def impl(local_args: list, local_kwargs: dict, input_specs, output_specs, comm: LocalComm):
        args = [a.contiguous() if i in positions else a for i, a in enumerate(local_args)]
        kwargs = {k: v.contiguous() if k in ("mean", "rstd") else v for k, v in local_kwargs.items()}
        return op(*args, **kwargs)

    return impl
