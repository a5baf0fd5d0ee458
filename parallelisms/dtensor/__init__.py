"""meshtrain's distributed tensor; public names and semantics mirror torch's DTensor (torch 2.13)."""

from .device_mesh import DeviceMesh, init_device_mesh
from .placements import Partial, Placement, Replicate, Shard
from .dtensor import DTensor, distribute_module, distribute_tensor
from .factories import empty, full, ones, rand, randn, zeros
from . import dispatch as _dispatch  # noqa: F401  (binds __torch_dispatch__ and registers op rules)

__all__ = [
    "DTensor",
    "DeviceMesh",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
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
