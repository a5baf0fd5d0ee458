"""Sharding rules: convolution (`aten.convolution` and `aten.convolution_backward`: F.conv1d/2d/3d and their
transposed forms) on (N, C, *spatial) inputs.

On one mesh dim, with the weight's out- and in-channel dims `wo`, `wi` ((C_out, C_in/groups, *k): 0, 1;
transposed, (C_in, C_out/groups, *k): 1, 0):

    input  weight  bias  -> output   backward -> grad_input  grad_weight  grad_bias
    R      R       R        R                    R           R            R
    S(0)   R       R        S(0)                 S(0)        P(sum)       P(sum)     images are independent
    R      S(wo)   S(0)     S(1)                 P(sum)      S(wo)        S(0)       groups == 1
    S(1)   S(wi)   P(sum)   P(sum)               S(1)        S(wi)        R          groups == 1
    P      R       P        P                    P           P            P          linear in input / grad_output
    R      P       P        P                    P           R            R          linear in weight
    S(d)   R       R        S(d)                 S(d)        P(sum)       P(sum)     d spatial, not transposed

A spatial shard keeps the output sharded along the same dim (torch's tensor-parallel convolution). Each rank
computes its chunk of the output positions from the input positions that chunk reads: it receives them from
the ranks that hold them, point to point (a halo exchange; the zero padding is laid in, not exchanged), and
convolves without padding along that dim. Backward sends the gradient of every received position back to its
owner, which adds it. Unlike torch's `_tp_conv`, any stride, dilation, padding and kernel size, uneven shards,
a halo wider than a neighbour's shard and spatial shards on several mesh dims (one dim each) are exact.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch._ops import OpOverload
from torch.ops import aten

from ..placements import Partial, Shard, chunk_size_and_offset
from ..spec import DTensorSpec
from .registry import BoundArgs, LocalComm, LocalImpl, OpCall, Sharding, register
from .tensor_ops import R, Row, expand, partials

P_SUM = Partial("sum")


def _channel_dims(call: OpCall) -> tuple[bool, tuple[int, int] | None]:
    """(transposed, the weight's (out, in) channel dims), the dims None when groups > 1: a channel shard
    would then have to split along group boundaries."""
    transposed = call.bound["transposed"]
    if call.bound["groups"] != 1:
        return transposed, None
    return transposed, ((1, 0) if transposed else (0, 1))


@register(aten.convolution.default)
def convolution_rule(call: OpCall) -> list[Sharding]:
    """The forward half of the table in the module docstring."""
    transposed, channel_dims = _channel_dims(call)
    rows = [
        Row({"input": R, "weight": R, "bias": R}, (R,)),
        Row({"input": Shard(0), "weight": R, "bias": R}, (Shard(0),)),
    ]
    if channel_dims is not None:
        wo, wi = channel_dims
        rows.append(Row({"input": R, "weight": Shard(wo), "bias": Shard(0)}, (Shard(1),)))
        rows.append(Row({"input": Shard(1), "weight": Shard(wi), "bias": P_SUM}, (P_SUM,)))
    for p in partials(call, ("sum", "avg")):
        rows += [Row({"input": p, "weight": R, "bias": p}, (p,)), Row({"input": R, "weight": p, "bias": p}, (p,))]
    ndim = call.specs[0].ndim
    if not transposed:
        rows += [Row({"input": Shard(d), "weight": R, "bias": R}, (Shard(d),)) for d in range(2, ndim)]
    return _with_halo_exchange(expand(call, rows), call.op, spatial_convolution)


@register(aten.convolution_backward.default)
def convolution_backward_rule(call: OpCall) -> list[Sharding]:
    """The backward half of the table: (grad_input, grad_weight, grad_bias), any of them masked off."""
    transposed, channel_dims = _channel_dims(call)
    rows = [
        Row({"grad_output": R, "input": R, "weight": R}, (R, R, R)),
        Row({"grad_output": Shard(0), "input": Shard(0), "weight": R}, (Shard(0), P_SUM, P_SUM)),
    ]
    if channel_dims is not None:
        wo, wi = channel_dims
        rows.append(Row({"grad_output": Shard(1), "input": R, "weight": Shard(wo)}, (P_SUM, Shard(wo), Shard(0))))
        rows.append(Row({"grad_output": R, "input": Shard(1), "weight": Shard(wi)}, (Shard(1), Shard(wi), R)))
    for p in partials(call, ("sum", "avg")):
        rows.append(Row({"grad_output": p, "input": R, "weight": R}, (p, p, p)))
        rows.append(Row({"grad_output": R, "input": p, "weight": R}, (R, p, R)))
        rows.append(Row({"grad_output": R, "input": R, "weight": p}, (p, R, R)))
    ndim = call.specs[1].ndim
    if not transposed:
        rows += [
            Row({"grad_output": Shard(d), "input": Shard(d), "weight": R}, (Shard(d), P_SUM, P_SUM))
            for d in range(2, ndim)
        ]
    return _with_halo_exchange(expand(call, rows), call.op, spatial_convolution_backward)


def _with_halo_exchange(candidates: list[Sharding], op: OpOverload, local_impl: LocalImpl) -> list[Sharding]:
    """Candidates whose first output is sharded along a spatial dim run `local_impl`, the others
    `convolution_on_shards`; those that would shard one spatial dim on two mesh dims (nested chunks) are
    dropped: the input is gathered on one first."""
    kept, on_shards = [], functools.partial(convolution_on_shards, op)
    for c in candidates:
        spatial = [p.dim for p in c.outputs[0] or () if isinstance(p, Shard) and p.dim >= 2]
        if len(spatial) != len(set(spatial)):
            continue
        kept.append(Sharding(c.inputs, c.outputs, local_impl=local_impl if spatial else on_shards))
    return kept


def convolution_on_shards(
    op: OpOverload, local_args: list, local_kwargs: dict, input_specs, output_specs, comm: LocalComm
) -> object:
    """`op` itself, unless a shard it reads is empty (3 channels over 4 ranks), which the kernels refuse:
    then its result by arithmetic, as empty_shard_result says."""
    b = BoundArgs(op, tuple(local_args), local_kwargs)
    if b["input"].numel() and b["weight"].numel():
        return op(*local_args, **local_kwargs)
    return empty_shard_result(b, [s.local_shape_and_offset()[0] if s is not None else None for s in output_specs])


def empty_shard_result(b: BoundArgs, local_shapes: list) -> object:
    """The convolution of an empty input or weight shard: every product sum is empty, so the forward is the
    bias alone (zeros without one) and the backward's grad_input and grad_weight are zeros; grad_bias, which
    reads only grad_output, is its sum over every dim but channels."""
    if b.get("grad_output") is None:  # the forward
        out = b["weight"].new_zeros(local_shapes[0])
        bias = b["bias"]
        return out if bias is None or out.numel() == 0 else out + bias.view(1, -1, *[1] * (out.ndim - 2))
    grad_out, mask = b["grad_output"], b["output_mask"]
    grad_x = grad_out.new_zeros(local_shapes[0]) if mask[0] else None
    grad_w = grad_out.new_zeros(local_shapes[1]) if mask[1] else None
    grad_b = grad_out.sum([d for d in range(grad_out.ndim) if d != 1]) if mask[2] else None
    return grad_x, grad_w, grad_b


# --------------------------------------------------------------------------------------------------
# the halo exchange
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """One spatial dim of a convolution: which input positions an output position reads."""

    size_in: int
    kernel: int
    stride: int
    padding: int
    dilation: int

    @property
    def size_out(self) -> int:
        return (self.size_in + 2 * self.padding - self.dilation * (self.kernel - 1) - 1) // self.stride + 1

    def reads(self, start: int, length: int) -> tuple[int, int]:
        """[lo, hi): the input positions that outputs start .. start + length - 1 read, padding included
        (lo < 0 or hi > size_in there); empty for no outputs."""
        if length == 0:
            return 0, 0
        lo = start * self.stride - self.padding
        return lo, lo + (length - 1) * self.stride + self.dilation * (self.kernel - 1) + 1


@dataclass(frozen=True)
class HaloPlan:
    """Who sends which input positions to whom along one spatial dim of one mesh dim's group (pure)."""

    me: int
    held: tuple[tuple[int, int], ...]  # [start, stop) of each group rank's input chunk
    read: tuple[tuple[int, int], ...]  # [lo, hi) each group rank's output chunk reads

    @staticmethod
    def build(window: Window, n: int, me: int) -> HaloPlan:
        held, read = [], []
        for q in range(n):
            length, start = chunk_size_and_offset(window.size_in, n, q)
            held.append((start, start + length))
            read.append(window.reads(*reversed(chunk_size_and_offset(window.size_out, n, q))))
        return HaloPlan(me, tuple(held), tuple(read))

    def overlap(self, holder: int, reader: int) -> tuple[int, int] | None:
        """The positions `holder` holds that `reader` reads, if any."""
        lo = max(self.held[holder][0], self.read[reader][0])
        hi = min(self.held[holder][1], self.read[reader][1])
        return (lo, hi) if lo < hi else None


def _narrow(t: torch.Tensor, dim: int, span: tuple[int, int], origin: int) -> torch.Tensor:
    return t.narrow(dim, span[0] - origin, span[1] - span[0])


def gather_reads(x: torch.Tensor, dim: int, plan: HaloPlan, group, comm: LocalComm) -> torch.Tensor:
    """This rank's input chunk -> the slab its output chunk reads, neighbours' positions received, padding
    zeros laid in."""
    me, (lo, hi), origin = plan.me, plan.read[plan.me], plan.held[plan.me][0]
    shape = list(x.shape)
    shape[dim] = hi - lo
    slab = x.new_zeros(shape)
    sends, receives = [], []
    for q in range(len(plan.held)):
        if (mine := plan.overlap(me, q)) is not None and q != me:
            sends.append((q, _narrow(x, dim, mine, origin)))
        if (theirs := plan.overlap(q, me)) is not None:
            if q == me:
                _narrow(slab, dim, theirs, lo).copy_(_narrow(x, dim, theirs, origin))
            else:
                receives.append((q, _narrow(slab, dim, theirs, lo).contiguous()))
    comm.exchange(sends, receives, group)
    for q, buffer in receives:
        _narrow(slab, dim, plan.overlap(q, me), lo).copy_(buffer)  # type: ignore[arg-type]
    return slab


def scatter_reads(
    grad_slab: torch.Tensor, local_shape: list[int], dim: int, plan: HaloPlan, group, comm: LocalComm
) -> torch.Tensor:
    """The adjoint of gather_reads: each position's gradient goes back to the rank holding it and is summed."""
    me, lo, origin = plan.me, plan.read[plan.me][0], plan.held[plan.me][0]
    grad = grad_slab.new_zeros(local_shape)
    sends, receives = [], []
    for q in range(len(plan.held)):
        if (theirs := plan.overlap(q, me)) is not None:
            if q == me:
                _narrow(grad, dim, theirs, origin).add_(_narrow(grad_slab, dim, theirs, lo))
            else:
                sends.append((q, _narrow(grad_slab, dim, theirs, lo)))
        if (mine := plan.overlap(me, q)) is not None and q != me:
            shape = list(local_shape)
            shape[dim] = mine[1] - mine[0]
            receives.append((q, grad_slab.new_empty(shape)))
    comm.exchange(sends, receives, group)
    for q, buffer in receives:
        _narrow(grad, dim, plan.overlap(me, q), origin).add_(buffer)  # type: ignore[arg-type]
    return grad


def _spatial_plans(spec: DTensorSpec, weight: torch.Tensor, b: BoundArgs) -> list[tuple[int, int, HaloPlan]]:
    """(mesh dim, tensor dim, plan) of each spatial shard of the input `spec`."""
    coordinate = spec.mesh.get_coordinate()
    assert coordinate is not None, "a rank off the mesh runs no local convolution"
    plans = []
    for m, p in enumerate(spec.placements):
        if isinstance(p, Shard) and p.dim >= 2:
            j = p.dim - 2
            window = Window(spec.shape[p.dim], weight.shape[p.dim], b["stride"][j], b["padding"][j], b["dilation"][j])
            plans.append((m, p.dim, HaloPlan.build(window, spec.mesh.size(m), coordinate[m])))
    return plans


def _unpadded(b: BoundArgs, plans: list) -> list[int]:
    padding = list(b["padding"])
    for _, d, _ in plans:
        padding[d - 2] = 0  # the slab carries its padding zeros
    return padding


def spatial_convolution(local_args: list, local_kwargs: dict, input_specs, output_specs, comm: LocalComm) -> object:
    """The forward on a spatial shard: gather the slab, convolve it unpadded along the sharded dims."""
    b = BoundArgs(aten.convolution.default, tuple(local_args), local_kwargs)
    x, weight = b["input"], b["weight"]
    plans = _spatial_plans(input_specs[0], weight, b)
    for m, d, plan in plans:
        x = gather_reads(x, d, plan, input_specs[0].mesh.get_group(m), comm)
    local_shape = output_specs[0].local_shape_and_offset()[0]
    if 0 in local_shape or x.numel() == 0:  # an empty chunk (uneven shards): the kernel refuses an empty window
        return empty_shard_result(b, [local_shape])
    padding = _unpadded(b, plans)
    return aten.convolution(
        x, weight, b["bias"], b["stride"], padding, b["dilation"], False, b["output_padding"], b["groups"]
    )


def spatial_convolution_backward(
    local_args: list, local_kwargs: dict, input_specs, output_specs, comm: LocalComm
) -> tuple:
    """The backward on a spatial shard: the forward's slab again, the kernel's backward on it, and the slab's
    gradient scattered back to the ranks holding its positions."""
    b = BoundArgs(aten.convolution_backward.default, tuple(local_args), local_kwargs)
    grad_out, x, weight, mask = b["grad_output"], b["input"], b["weight"], b["output_mask"]
    spec = input_specs[1]
    plans = _spatial_plans(spec, weight, b)
    local_shape = list(x.shape)
    for m, d, plan in plans:
        x = gather_reads(x, d, plan, spec.mesh.get_group(m), comm)
    if grad_out.numel() == 0 or x.numel() == 0:
        grad_x, grad_w, grad_b = empty_shard_result(b, [x.shape, weight.shape])  # type: ignore[misc]
    else:
        padding = _unpadded(b, plans)
        grad_x, grad_w, grad_b = aten.convolution_backward(
            grad_out, x, weight, b["bias_sizes"], b["stride"], padding, b["dilation"], False,
            b["output_padding"], b["groups"], mask,
        )  # fmt: skip
    if grad_x is not None:
        for m, d, plan in reversed(plans):
            shape = list(grad_x.shape)
            shape[d] = plan.held[plan.me][1] - plan.held[plan.me][0]
            grad_x = scatter_reads(grad_x, shape, d, plan, spec.mesh.get_group(m), comm)
        assert list(grad_x.shape) == local_shape
    return grad_x, grad_w, grad_b
