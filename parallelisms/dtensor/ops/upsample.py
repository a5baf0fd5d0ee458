"""Sharding rules: the upsample family (F.interpolate's nearest, linear, bilinear, bicubic, trilinear
and antialiased modes, and their backward ops) on (N, C, *spatial) tensors.

An output pixel reads a few input pixels of its own (n, c) plane, with weights fixed by the sizes
alone. On one mesh dim:

    S(0) / S(1)        -> S(0) / S(1)   planes are independent (uneven shards too)
    S(spatial)         -> gather to R   a pixel's neighbourhood crosses shard edges
    P(sum) / P(avg)    -> same P        interpolation is linear in its input (so is every backward)
    P(max|min|norm)    -> same P        nearest forward only: it copies input pixels
    R                  -> R

The backward ops' `input_size` arg is the global (N, C, *spatial) size: a sharded call gets this
rank's shape instead (LOCAL_SHAPE). Forward size args name spatial sizes only, which stay whole.
The kernels refuse empty input, which an uneven shard can be (3 planes over 4 ranks): such a rank
makes its empty output without them (`skip_empty`).
"""

from __future__ import annotations

import functools

import torch
from torch._ops import OpOverload

from ..placements import Shard
from .registry import LOCAL_SHAPE, OpCall, Sharding, register
from .tensor_ops import R, Row, expand, partials, skip_empty, skip_empty_shards

LINEAR = ("sum", "avg")


def discover_upsample_ops() -> list[OpOverload]:
    """Every functional upsample op and backward (`default` and `vec`; not the out= forms)."""
    found = []
    for qualified in torch._C._dispatch_get_all_op_names():
        name, _, overload = qualified.removeprefix("aten::").partition(".")
        if qualified.startswith("aten::") and "upsample_" in name and overload in ("", "vec"):
            found.append(getattr(getattr(torch.ops.aten, name), overload or "default"))
    return found


@register(*discover_upsample_ops())
def upsample_rule(call: OpCall) -> list[Sharding]:
    """The table in the module docstring."""
    schema_args = call.op._schema.arguments
    name = schema_args[0].name  # self / input / grad_output
    backward = call.op._schema.name.endswith("_backward")
    copies = "nearest" in call.op._schema.name and not backward
    rows = [Row({name: R}, (R,))]
    names = [a.name for a in schema_args]
    size_at = names.index("input_size") if backward else None
    if size_at is None or size_at < len(call.args):  # a keyword input_size could not be made local
        rows += [Row({name: Shard(d)}, (Shard(d),)) for d in (0, 1)]
    rows += [Row({name: p}, (p,)) for p in partials(call, None if copies else LINEAR)]
    local_args = None if size_at is None else tuple(LOCAL_SHAPE if i == size_at else a for i, a in enumerate(call.args))
    run = functools.partial(skip_empty, call.op)
    return [skip_empty_shards(c, local_args, run) for c in expand(call, rows)]
