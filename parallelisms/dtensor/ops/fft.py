"""Rules for the FFT family (torch.fft's aten forms `_fft_r2c`, `_fft_c2r`, `_fft_c2c`).

A transform reads every element along each of its `dim`s, so a shard of a transformed dim is gathered first;
a shard of any other dim stays, the transform running on each shard as it is (its sizes args name only the
transformed dims; a rank whose shard is empty returns its empty output). A Partial(sum | avg) stays Partial:
the transform is linear.
"""

from __future__ import annotations

import functools

from torch.ops import aten

from ..placements import Shard
from .registry import OpCall, Sharding, register
from .tensor_ops import R, Row, expand, partials, skip_empty, skip_empty_shards


@register(aten._fft_r2c.default, aten._fft_c2r.default, aten._fft_c2c.default)
def fft_rule(call: OpCall) -> list[Sharding]:
    ndim = call.specs[0].ndim
    transformed = {d % ndim for d in call.args[1]}
    rows = [Row({"self": R}, (R,))]
    rows += [Row({"self": Shard(d)}, (Shard(d),)) for d in range(ndim) if d not in transformed]
    rows += [Row({"self": p}, (p,)) for p in partials(call, ("sum", "avg"))]
    run = functools.partial(skip_empty, call.op)  # MKL refuses an empty batch: a rank with no rows skips
    return [skip_empty_shards(c, None, run) for c in expand(call, rows)]
