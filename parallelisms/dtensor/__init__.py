"""meshtrain's distributed tensor; public names and semantics mirror torch's DTensor (torch 2.13)."""

from typing import Any

import torch
from torch.optim.optimizer import _foreach_supported_types as _optim_foreach_types
from torch.utils._foreach_utils import _foreach_supported_types as _util_foreach_types

from . import dispatch as _dispatch  # noqa: F401  (registers every op rule before the first DTensor op)
from .device_mesh import DeviceMesh, _unpickle_mesh, current_mesh, init_device_mesh
from .dtensor import DTensor, _rebuild_dtensor, distribute_module, distribute_tensor
from .factories import empty, full, ones, rand, randn, zeros
from .placements import Partial, Placement, Replicate, Shard, _StridedShard
from .traceable import register_constants

# torch.optim and clip_grad_norm_ take their fast foreach paths only for tensor types on these lists
# (torch's own DTensor registers itself the same way); our foreach rules keep those paths sharded.
# (torch leaves the lists unannotated, so mypy infers Tensor's constructor type for their items)
_foreach_type_lists: tuple[list[Any], ...] = (_optim_foreach_types, _util_foreach_types)
for _types in _foreach_type_lists:
    if DTensor not in _types:
        _types.append(DTensor)

# torch.load(weights_only=True) rebuilds only allow-listed globals; torch's DTensor lists its own
# classes at import the same way, so a saved DTensor loads without weights_only=False.
torch.serialization.add_safe_globals(
    [DTensor, _rebuild_dtensor, _unpickle_mesh, Shard, _StridedShard, Replicate, Partial]
)

register_constants()  # meshes and placements are torch.compile constants (traceable.py)

__all__ = [
    "DTensor",
    "DeviceMesh",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "current_mesh",
    "distribute_module",
    "distribute_tensor",
    "empty",
    "full",
    "init_device_mesh",
    "ones",
    "rand",
    "randn",
    "zeros",
]
