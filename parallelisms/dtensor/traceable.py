"""How torch.compile traces our DTensor: a block of DTensor code becomes one graph (fullgraph=True).

Dynamo treats a DTensor as a tensor whose ops it runs on fake shards (through our dispatcher) to learn
their outputs. Three things keep it in one graph:

* **Meshes and placements are constants.** They are registered as opaque *value* types: dynamo guards
  on their equality, passes them to graph calls as they are, and writes them into the graph's code
  with `__fx_repr__` (a placement's constructor, a lookup of the mesh). The members that code inside a
  compiled region reads (`mesh.size()`, `placement.dim`, ...) are evaluated once, at compile time.
* **`DTensor.from_local` is one graph call** (`from_local_in_graph`). Traced line by line, dynamo would
  reach the subclass constructor inside an autograd Function, which it cannot record. `redistribute`,
  `to_local` and `full_tensor` need nothing: dynamo records a tensor's method call as one node.
* **Collectives are functional while tracing** (collectives.traced()).

AOT autograd then runs that graph with our own code on fake shards, once forward and backward
together: each DTensor flattens to its shard (`__tensor_flatten__`), every collective our rules
issue lands in the graph with its wait, and inductor sees plain tensors and c10d functional ops.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._library.opaque_object import MemberType, is_opaque_type, register_opaque_type

from .device_mesh import DeviceMesh
from .graph_constants import fx_repr_by_reference
from .placements import Partial, Placement, Replicate, Shard, _StridedShard

_PLACEMENT_MEMBERS = ("is_shard", "is_replicate", "is_partial", "__eq__")
_PLACEMENT_FIELDS = {Shard: ("dim",), _StridedShard: ("dim", "split_factor"), Replicate: (), Partial: ("reduce_op",)}
_MESH_MEMBERS = (
    "ndim",
    "shape",
    "size",
    "get_rank",
    "get_coordinate",
    "get_local_rank",
    "mesh_dim_names",
    "device_type",
    "__eq__",
    "__ne__",
)


def register_graph_constant(cls: type, members: Sequence[str] = ()) -> None:
    """Make instances of `cls` constants of compiled graphs: guarded on equality, held by reference
    (graph_constants.py) unless `cls` defines its own `__fx_repr__`; `members` are read at compile time."""
    if is_opaque_type(cls):
        return
    if not hasattr(cls, "__fx_repr__"):
        cls.__fx_repr__ = fx_repr_by_reference  # type: ignore[attr-defined]
    register_opaque_type(cls, typ="value", members=dict.fromkeys(members, MemberType.USE_REAL))


def register_constants() -> None:
    """Make meshes and placements constants of torch.compile's graphs (once per process)."""
    register_graph_constant(DeviceMesh, _MESH_MEMBERS)
    for cls, fields in _PLACEMENT_FIELDS.items():
        register_graph_constant(cls, _PLACEMENT_MEMBERS + fields)


@torch._dynamo.allow_in_graph
def from_local_in_graph(
    local_tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    run_check: bool,
    shape: tuple[int, ...] | None,
    stride: tuple[int, ...] | None,
    grad_placements: tuple[Placement, ...] | None,
) -> torch.Tensor:
    """DTensor.from_local as one node of a compiled graph; it runs the eager code on the traced shard."""
    from .dtensor import DTensor

    return DTensor.from_local(
        local_tensor,
        device_mesh,
        placements,
        run_check=run_check,
        shape=shape,
        stride=stride,
        grad_placements=grad_placements,
    )


def constant_tuple(values: Sequence | None) -> tuple | None:
    """`values` as a tuple (graph constants), None as None."""
    return None if values is None else tuple(values)


def landed(value: object) -> object:
    """`value` with its shard landed: a shard an async collective is still writing (a PendingTensor) is
    waited for. A compiled graph takes plain shards; it schedules its own collectives."""
    from .async_tensor import PendingTensor
    from .dtensor import DTensor

    if isinstance(value, DTensor) and isinstance(value._local_tensor, PendingTensor):
        value._local_tensor = value._local_tensor.wait()  # the same values; autograd sees the same wrapper
    elif isinstance(value, PendingTensor):
        return _Land.apply(value) if value.requires_grad else value.wait()
    return value


class _Land(torch.autograd.Function):
    """A pending local tensor's landed values, with its gradient passed through."""

    @staticmethod
    def forward(ctx: Any, pending: torch.Tensor) -> torch.Tensor:
        return pending.wait()  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def compile_whole(fn: Callable[..., Any], backend: str, name: str) -> Callable[..., Any]:
    """`fn` torch.compile'd as one graph (fullgraph=True: a graph break is an error, not a slow path), called on
    landed arguments. Shapes are static (dynamic=False): a new shape compiles a graph of its own rather than one
    with symbolic sizes, which a DTensor's spec (hashed, compared) does not hold. A failure to compile names
    `name` (the block) and the reason, and how to run eager instead."""
    # inductor may move each collective away from its wait, over independent compute (eager TP overlaps with async
    # collectives; a compiled graph only when the scheduler reorders)
    options: dict[str, str | int | bool | Callable[..., Any]] | None = (
        {"reorder_for_compute_comm_overlap": True} if backend == "inductor" else None
    )
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False, options=options)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return compiled(*map(landed, args), **{k: landed(v) for k, v in kwargs.items()})
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.BackendCompilerFailed) as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise RuntimeError(
                f"torch.compile of {name} failed ({type(error).__name__}: {reason}); it runs in every layout, so "
                f"this is a bug to report with the config; set compile.enable=false to train eager meanwhile"
            ) from error

    return call
