"""layout_invariant_init(): random initialization whose global values do not depend on the layout.

A model built on the meta device, parallelized (TP, FSDP, any mesh) and then allocated with
`to_empty` must get the weights one process would have, or runs on different layouts train
different models and a seed checkpoint becomes necessary (torchtitan's). Inside the context,
`Tensor.uniform_` and `Tensor.normal_` (and so `nn.init.uniform_`, `normal_`, `trunc_normal_`, ...,
which call them) fill each element from the blocked counter-based stream behind `rand`/`randn`
(factories.py): the value at a global index depends only on the seed and the index. A DTensor
draws only its shard's blocks, at its exact global offset (uneven and `_StridedShard` shards
included); a plain tensor is its own global tensor. Later pointwise steps of an init (erfinv, mul,
clamp in trunc_normal_) are elementwise, so they agree bit for bit too.

Every rank must be seeded alike and run the same fills in the same order (each fill draws one base
seed from the default CPU generator), as SPMD programs do. Fills given an explicit `generator=` are
left to torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .dtensor import DTensor
from .factories import _base_seed, _blocked


class layout_invariant_init(TorchFunctionMode):  # noqa: N801  (used like a function: `with layout_invariant_init():`)
    """Context manager: uniform_/normal_ fills give the same global values on any layout."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _FILLS and kwargs.get("generator") is None:
            return _FILLS[func](*args, **kwargs)
        return func(*args, **kwargs)


def _uniform_(tensor: torch.Tensor, a: float = 0.0, b: float = 1.0, **_: Any) -> torch.Tensor:
    values = _draw(tensor, torch.rand)
    if values is not None:
        _local(tensor).copy_(values.mul_(b - a).add_(a))
    return tensor


def _normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, **_: Any) -> torch.Tensor:
    values = _draw(tensor, torch.randn)
    if values is not None:
        _local(tensor).copy_(values.mul_(std).add_(mean))
    return tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _draw(tensor: torch.Tensor, draw: Any) -> torch.Tensor | None:
    """This rank's part of the global stream, or None for a rank outside the tensor's mesh."""
    base = _base_seed()  # drawn on every rank, shard or not, so the generators stay in step
    if isinstance(tensor, DTensor):
        if tensor.device_mesh.get_coordinate() is None:
            return None
        shape, offset = tensor._spec.local_shape_and_offset()
    else:
        shape, offset = tuple(tensor.shape), (0,) * tensor.ndim
    local = _local(tensor)
    with torch.no_grad():
        return _blocked(draw, base, shape, offset, local.dtype, local.device, tuple(tensor.shape))


_FILLS = {torch.Tensor.uniform_: _uniform_, torch.Tensor.normal_: _normal_}
