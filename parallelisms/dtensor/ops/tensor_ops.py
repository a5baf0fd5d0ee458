"""Rules for ops that keep their input's layout: detach, clone, copies, casts, *_like, fill."""

from __future__ import annotations

from torch.ops import aten

from ..placements import Partial
from .registry import OpCall, Sharding, register, replicate

@register(aten.detach, aten.alias, aten.clone, aten._to_copy, aten.contiguous, aten.lift_fresh)
def follow_input(call: OpCall) -> Sharding:
    """Output has the input's placements (Partial stays Partial: these ops are linear or identity)."""
    (spec,) = call.specs
    return Sharding((None,), (spec.placements,))


@register(aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like)
def like(call: OpCall) -> Sharding:
    """A fresh tensor with the input's layout; a Partial input gives Replicate (values are not partial)."""
    (spec,) = call.specs
    placements = tuple(p if not isinstance(p, Partial) else replicate(1)[0] for p in spec.placements)
    return Sharding((None,), (placements,))
