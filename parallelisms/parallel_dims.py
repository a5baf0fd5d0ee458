"""ParallelDims: the parallelism degrees of a job, validated, and the world mesh built from them.

The world mesh has one named dim per parallelism of degree > 1, in the order
`pp, dp_replicate, dp_shard, cp, tp` (tp innermost, so tensor-parallel peers are neighbouring ranks).
Three flattened submeshes are then registered on it by name, for the consumers that need
several dims as one:

    "dp"           dp_replicate x dp_shard        data loading (which batch slice a rank reads)
    "dp_shard_cp"  dp_shard x cp                  FSDP parameter sharding
    "dp_cp"        dp_replicate x dp_shard x cp   loss / gradient-norm reduction

Each is registered when at least one of its dims exists, even a single one, so
`world_mesh["dp_shard_cp"]` resolves the same way whether or not cp is enabled. A world where every
degree is 1 (one rank) gets a 1-D mesh named "dp_shard" of size 1, and the three flattened names on
top of it, so single-process runs take the same code path as distributed ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the degree checks run in pre-flight, before torch is imported
    from parallelisms.dtensor import DeviceMesh

# mesh dim -> the [parallelism] config key that sets its degree (for error messages)
CONFIG_KEYS = {
    "pp": "pipeline_parallel_degree",
    "dp_replicate": "data_parallel_replicate_degree",
    "dp_shard": "data_parallel_shard_degree",
    "cp": "context_parallel_degree",
    "tp": "tensor_parallel_degree",
}
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


def sequence_divisor(tp: int, cp: int) -> int:
    """Sequence lengths must divide by this: tp for sequence parallelism, and under context parallelism
    2 * cp chunks (each rank's head and tail) that sequence parallelism cuts in tp again."""
    return 2 * cp * tp if cp > 1 else tp


@dataclass
class ParallelDims:
    """Degrees of each parallelism; `dp_shard=-1` takes whatever the others leave of `world_size`."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size({self.world_size}) must be >= 1")
        for name in ("pp", "dp_replicate", "cp", "tp"):
            degree = getattr(self, name)
            if degree < 1:
                raise ValueError(f"{name}_degree({degree}) must be >= 1; set parallelism.{CONFIG_KEYS[name]}=1")
        if self.dp_shard != -1 and self.dp_shard < 1:
            raise ValueError(
                f"dp_shard_degree({self.dp_shard}) must be >= 1, or -1 to infer it; "
                f"set parallelism.data_parallel_shard_degree=-1"
            )
        others = {name: getattr(self, name) for name in MESH_ORDER if name != "dp_shard"}
        others_product = math.prod(others.values())
        if self.dp_shard == -1:
            if self.world_size % others_product:
                product = " * ".join(f"{n}_degree({d})" for n, d in others.items() if d > 1)
                raise ValueError(
                    f"cannot infer dp_shard_degree: world_size({self.world_size}) is not divisible by "
                    f"{product} = {others_product}; pick degrees whose product divides the number of ranks"
                )
            self.dp_shard = self.world_size // others_product
        total = others_product * self.dp_shard
        if total != self.world_size:
            degrees = {name: getattr(self, name) for name in MESH_ORDER}
            product = " * ".join(f"{n}_degree({d})" for n, d in degrees.items() if d > 1 or n == "dp_shard")
            fix = (
                "set parallelism.data_parallel_shard_degree=-1"
                if self.world_size % others_product == 0
                else "make the degrees multiply to world_size"
            )
            raise ValueError(f"{product} = {total} != world_size({self.world_size}); {fix}")

    # ------------------------------------------------------------------------------------ mesh
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """World mesh over the dims of degree > 1 (see the module docstring), with the flattened
        "dp", "dp_shard_cp" and "dp_cp" submeshes registered on it. Collective: call on every rank."""
        from parallelisms.dtensor import init_device_mesh

        names = [name for name in MESH_ORDER if getattr(self, name) > 1] or ["dp_shard"]
        shape = [getattr(self, name) for name in names]
        world_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        for flat_name, dims in FLATTENED.items():
            present = tuple(d for d in dims if d in names)
            if present:
                world_mesh[present].flatten(flat_name)
        return world_mesh

    # ------------------------------------------------------------------------------ properties
    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate > 1 or self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded over dp_shard x cp (context parallel ranks shard them too)."""
        return self.dp_shard > 1 or self.cp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_cp_enabled(self) -> bool:
        return self.dp_enabled or self.cp_enabled

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that see the same data: cp * tp * pp."""
        return self.cp * self.tp * self.pp

    @property
    def seq_len_divisor(self) -> int:
        return sequence_divisor(self.tp, self.cp)
