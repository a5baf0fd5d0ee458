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

Expert parallelism (torchtitan v0.2's "dp2ep") borrows its ranks from the others: `ep` is a slice of
dp_shard x cp, and of tp too when the experts are not also tensor-parallel (`etp = 1`; with `etp = tp` the
experts are sharded over tp as well, and ep leaves tp alone). dp_shard is then cut in two mesh dims,

    dp_shard = dp_shard_mod_ep x dp_shard_in_ep     dp_shard_in_ep: the dp_shard ranks inside ep

and one more flattened submesh is registered:

    "ep"           dp_shard_in_ep x cp (x tp when etp = 1)    the all-to-all of routed tokens

Every other flattened name spans the same ranks as without EP. FSDP shards the routed experts over
`dp_shard_mod_ep` (kept as a mesh dim even of size 1, so that FSDP handles the experts' mixed precision
and gradient reduction as everyone else's; with dp_replicate it is HSDP over both).
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
    "ep": "expert_parallel_degree",
    "etp": "expert_tensor_parallel_degree",
}
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EP_MESH_ORDER = ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


def _split_dp_shard(dims: tuple[str, ...]) -> tuple[str, ...]:
    """A flattened name's dims with dp_shard cut in its two EP dims."""
    return tuple(d for name in dims for d in (("dp_shard_mod_ep", "dp_shard_in_ep") if name == "dp_shard" else (name,)))


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
    ep: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        self._validate()
        self._validate_ep()

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

    def _validate_ep(self) -> None:
        """torchtitan v0.2's constraints: etp is 1 or tp; ep divides the ranks it borrows and spans whole cp
        (and, with etp = 1, whole tp) groups."""
        for name in ("ep", "etp"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"{name}_degree({getattr(self, name)}) must be >= 1; set parallelism.{CONFIG_KEYS[name]}=1"
                )
        if self.ep == 1:
            if self.etp != 1:
                raise ValueError(
                    f"expert_tensor_parallel_degree({self.etp}) without expert parallelism: it says how the experts "
                    f"of an expert-parallel layout are tensor-parallel; set "
                    f"parallelism.expert_tensor_parallel_degree=1 (without EP the experts follow "
                    f"tensor_parallel_degree)"
                )
            return
        if self.etp not in (1, self.tp):
            raise ValueError(
                f"expert_tensor_parallel_degree({self.etp}) must be 1 (expert parallelism borrows the tp ranks too) "
                f"or tensor_parallel_degree({self.tp}) (the experts are tensor-parallel as the rest); set "
                f"parallelism.expert_tensor_parallel_degree to 1 or {self.tp}"
            )
        borrowed = {"dp_shard": self.dp_shard, "cp": self.cp} | ({"tp": self.tp} if self.etp == 1 else {})
        pool = math.prod(borrowed.values())
        whole = math.prod(d for n, d in borrowed.items() if n != "dp_shard")
        terms = " * ".join(f"{n}_degree({d})" for n, d in borrowed.items() if d > 1 or n == "dp_shard")
        if pool % self.ep or self.ep % whole:
            inner = " * ".join(f"{n}_degree({d})" for n, d in borrowed.items() if n != "dp_shard" and d > 1)
            raise ValueError(
                f"expert_parallel_degree({self.ep}) must divide {terms} = {pool}, the ranks expert parallelism "
                f"borrows{f', and be a multiple of {inner} = {whole}' if whole > 1 else ''}; pick one of "
                f"{[e for e in range(2, pool + 1) if pool % e == 0 and e % whole == 0]} for "
                f"parallelism.expert_parallel_degree, or 1"
            )

    # ------------------------------------------------------------------------------------ mesh
    @property
    def dp_shard_in_ep(self) -> int:
        """The dp_shard ranks inside one ep group (1 without EP)."""
        return self.ep // (self.cp * (self.tp if self.etp == 1 else 1)) if self.ep > 1 else 1

    @property
    def dp_shard_mod_ep(self) -> int:
        """dp_shard / dp_shard_in_ep: the ranks that FSDP shards the routed experts over."""
        return self.dp_shard // self.dp_shard_in_ep

    def mesh_dims(self) -> tuple[dict[str, int], dict[str, tuple[str, ...]]]:
        """Every dim of the world mesh in mesh order with its degree (`MESH_ORDER`, or `EP_MESH_ORDER` under EP),
        and each flattened name with the dims it spans: what `build_mesh` builds (less the dims of degree 1) and
        what the dry run prices a group by."""
        if not self.ep_enabled:
            return {n: getattr(self, n) for n in MESH_ORDER}, dict(FLATTENED)
        degrees = {n: getattr(self, n) for n in EP_MESH_ORDER}
        flattened = {flat: _split_dp_shard(dims) for flat, dims in FLATTENED.items()}
        flattened["ep"] = ("dp_shard_in_ep", "cp", "tp") if self.etp == 1 else ("dp_shard_in_ep", "cp")
        return degrees, flattened

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """World mesh over the dims of degree > 1 (see the module docstring), with the flattened
        "dp", "dp_shard_cp", "dp_cp" (and under EP "ep") submeshes registered on it. Collective: call
        on every rank."""
        from parallelisms.dtensor import init_device_mesh

        degrees, flattened = self.mesh_dims()
        if self.ep_enabled:
            names = [n for n in degrees if degrees[n] > 1 or n == "dp_shard_mod_ep"]
        else:
            names = [n for n in degrees if degrees[n] > 1] or ["dp_shard"]
        world_mesh = init_device_mesh(device_type, [degrees[n] for n in names], mesh_dim_names=names)
        for flat_name, dims in flattened.items():
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
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def etp_enabled(self) -> bool:
        return self.etp > 1

    @property
    def expert_gradient_divide_factor(self) -> int:
        """What the routed experts' gradients are divided by: the data-parallel ranks, dp_replicate x dp_shard x cp,
        as every other gradient (FSDP shards the experts over fewer ranks, dp_shard_mod_ep; the all-to-all has
        already summed the other data ranks' contributions into each expert's gradient)."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def seq_len_divisor(self) -> int:
        return sequence_divisor(self.tp, self.cp)
