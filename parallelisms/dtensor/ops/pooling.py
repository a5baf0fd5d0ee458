"""Sharding rules: pooling and edge padding (max / avg / adaptive pools, max_unpool, reflection and replication
padding, 1-D to 3-D, and their backward ops) on (*leading, *spatial) tensors: (N, C, L) / (N, C, H, W) /
(N, C, D, H, W), or unbatched (C, ...).

An output element reads a window of its own plane, so on one mesh dim:

    S(leading dim)    -> the same S      planes are independent (uneven shards too; indices are plane-local)
    S(spatial)        -> gather to R     a window can cross shard edges (forward: gathered, not moved to a
                                       leading dim, so outputs are placed as torch's DTensor places them)
    P(sum | avg)      -> the same P      avg pools are linear in their input, every backward in grad_output
    P(any)            -> the same P      edge padding only copies elements
    R                 -> R

Every tensor argument (input, grad_output, indices) takes the same placement. The kernels refuse an empty
plane, which an uneven shard can hold (3 channels over 4 ranks): such a rank makes its empty outputs.
"""

from __future__ import annotations

import functools
import re

import torch
from torch._ops import OpOverload

from ..placements import Shard
from .registry import OpCall, Sharding, register
from .tensor_ops import R, Row, expand, partials, skip_empty, skip_empty_shards

_FAMILY = re.compile(
    r"^_?(?P<kind>max_pool|avg_pool|adaptive_avg_pool|adaptive_max_pool|max_unpool|reflection_pad|replication_pad)"
    r"(?P<spatial>[123])d(_with_indices)?(?P<backward>_backward)?$"
)
_AVERAGING = ("avg_pool", "adaptive_avg_pool")
_COPYING = ("reflection_pad", "replication_pad")


def discover_pooling_ops() -> list[OpOverload]:
    """Every functional op of the family (`default` overloads: not the out= forms)."""
    found = []
    for qualified in torch._C._dispatch_get_all_op_names():
        name, _, overload = qualified.removeprefix("aten::").partition(".")
        if qualified.startswith("aten::") and not overload and _FAMILY.match(name):
            found.append(getattr(torch.ops.aten, name).default)
    return found


@register(*discover_pooling_ops())
def pooling_rule(call: OpCall) -> list[Sharding]:
    """The table in the module docstring."""
    family = _FAMILY.match(call.op._schema.name.removeprefix("aten::"))
    assert family is not None
    kind, spatial, backward = family["kind"], int(family["spatial"]), family["backward"] is not None
    names = [name for name, _ in call.bound.named_specs()]
    num_outputs = len(call.op._schema.returns)
    leading = call.specs[0].ndim - spatial
    rows = [Row(dict.fromkeys(names, R), (R,) * num_outputs)]
    rows += [Row(dict.fromkeys(names, Shard(d)), (Shard(d),) * num_outputs) for d in range(leading)]
    linear = kind in _AVERAGING or kind in _COPYING
    if linear and num_outputs == 1:
        reduce_ops = None if kind in _COPYING and not backward else ("sum", "avg")
        for p in partials(call, reduce_ops):
            # backward: linear in grad_output, the input (read for its shape) replicated
            rows.append(Row({n: p if i == 0 else R for i, n in enumerate(names)}, (p,)))
    run = functools.partial(skip_empty, call.op)
    candidates = expand(call, rows)
    if not backward:  # a shard is kept or gathered, never moved to another dim: outputs placed as torch's are
        candidates = [c for c in candidates if not _moves_a_shard(call, c)]
    return [skip_empty_shards(c, None, run) for c in candidates]


def _moves_a_shard(call: OpCall, candidate: Sharding) -> bool:
    """Whether the candidate would move some input's shard to another dim (an all-to-all). Not expand's
    `reshard=False`, which also forbids reduce-scattering a Partial input to a shard, as torch's pools do."""
    for spec, targets in zip(call.specs, candidate.inputs):
        for current, target in zip(spec.placements, targets or ()):
            if isinstance(current, Shard) and isinstance(target, Shard) and current.dim != target.dim:
                return True
    return False
