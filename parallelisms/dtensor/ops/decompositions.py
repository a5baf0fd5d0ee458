"""Decompositions: how an op without a sharding rule runs as a short program of DTensor ops.

The dispatcher asks `find_decomposition(op)` before it gives up on an op without a rule (and
before replicate_fallback gathers it). In order of preference:

1. DECOMPOSITIONS, ours: in-place views (`squeeze_`), whose result is their input with new
   metadata, which no Sharding can say (a Sharding never changes an input's spec);
2. the op's CompositeImplicitAutograd kernel: the program autograd runs anyway (torch's DTensor does
   the same). Under torch.inference_mode, `linear`, `matmul` and friends reach the dispatcher whole;
3. torch._decomp.decomposition_table: aten ops written in simpler aten ops.

The decomposition runs on the op's DTensor args, so every sub-op goes through its own rule and
keeps what sharding that rule keeps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch._decomp import decomposition_table
from torch._ops import OpOverload
from torch.ops import aten
from torch.utils._mode_utils import no_dispatch

from ..placements import Shard
from ..spec import DTensorSpec, TensorMeta
from .view_dims import squeezed_dims

Decomposition = Callable[..., Any]


class ShardedTensor(Protocol):
    """The DTensor fields an in-place view rewrites (typed structurally: dtensor.py imports the
    dispatcher, which imports this module)."""

    _spec: DTensorSpec
    _local_tensor: torch.Tensor


def find_decomposition(op: OpOverload) -> Decomposition | None:
    """A function that runs `op` on its DTensor args through other ops, or None (see the module docstring)."""
    fn = DECOMPOSITIONS.get(op)
    if fn is None and torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), torch._C.DispatchKey.CompositeImplicitAutograd
    ):
        fn = op.decompose
    if fn is None:
        fn = decomposition_table.get(op)
    return None if fn is None else functools.partial(run_decomposition, op, fn)


def run_decomposition(op: OpOverload, fn: Decomposition, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`; a failure inside it names `op` (the op the user called)."""
    try:
        out = fn(*args, **kwargs)
    except Exception as e:
        e.add_note(f"(raised inside the decomposition of {op}, which has no sharding rule of its own)")
        raise
    if out is NotImplemented:
        raise NotImplementedError(
            f"no sharding rule for {op}, and its decomposition does not handle these arguments; "
            f"redistribute the inputs to Replicate and call it on full tensors"
        )
    return out


# --------------------------------------------------------------------------------------------------
# in-place views
# --------------------------------------------------------------------------------------------------


def squeeze_(self: ShardedTensor, dim: int | Sequence[int] | None = None) -> ShardedTensor:
    """`self.squeeze_(dim)`: drop the global size-1 dims among `dim` (all when None), in place.

    Shards of later dims shift down (S(2) -> S(1)); Partial stays. The local tensor is squeezed on
    exactly those dims: a shard whose local size is 1 keeps that dim. A sharded size-1 dim cannot be
    dropped in place (its element lives on one rank): that raises, as in torch.
    """
    spec = self._spec
    dropped = squeezed_dims(spec.shape, (dim,) if isinstance(dim, int) else dim)
    sharded = [str(p) for p in spec.placements if isinstance(p, Shard) and p.dim in dropped]
    if sharded:
        raise RuntimeError(
            f"squeeze_ would drop dims {list(dropped)} of a DTensor with placements "
            f"{tuple(map(str, spec.placements))}, but {', '.join(sharded)} shards a dropped dim; use the out-of-place "
            f"squeeze(), or redistribute that dim to Replicate first"
        )
    placements = tuple(
        Shard(p.dim - sum(d < p.dim for d in dropped)) if isinstance(p, Shard) else p for p in spec.placements
    )
    meta = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta").squeeze(dropped)
    if spec.mesh.get_coordinate() is not None:  # off the mesh the local tensor is an empty stand-in
        aten.squeeze_.dims(self._local_tensor, list(dropped))
    self._spec = DTensorSpec(spec.mesh, placements, TensorMeta(meta.shape, tuple(meta.stride()), spec.dtype))
    _restride_wrapper(self, aten.squeeze_.dims, list(dropped))
    return self


def _restride_wrapper(self: Any, op: OpOverload, *args: Any) -> None:
    """Run in-place view `op` on the wrapper tensor's own sizes and strides (it has no data), as
    torch's return_and_correct_aliasing does for wrapper subclasses: as a meta op, below dispatch."""
    with no_dispatch():
        meta_before = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            op(self, *args)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_before)


DECOMPOSITIONS: dict[OpOverload, Decomposition] = {
    aten.squeeze_.default: squeeze_,
    aten.squeeze_.dim: squeeze_,
    aten.squeeze_.dims: squeeze_,
}
