"""Sharding rules: the types a rule speaks and the registry that maps aten ops to rules.

A rule is a pure function `rule(call: OpCall) -> Sharding | list[Sharding]`. It reads the input
specs (placements, global shapes) and the static args, and says which placements each DTensor input
must have and which placements the outputs then have. Output shapes, strides and dtypes are not the
rule's business: the dispatcher gets them by running the op once on meta tensors of the global shapes.
When a rule offers several Shardings the dispatcher takes the one that moves the fewest bytes.
Rules never touch process groups, so they are tested without ranks. A Sharding's local_impl may
communicate, but only through the LocalComm the dispatcher hands it: nothing here imports collectives.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from typing import Any, NamedTuple, Protocol

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch.distributed import ProcessGroup

from ..placements import Placement, Replicate, Shard
from ..spec import DTensorSpec

Placements = tuple[Placement, ...]


class LocalComm(Protocol):
    """The collectives a local_impl may issue, handed in by the dispatcher (the `collectives` module), so
    that no rule imports what communicates (docs/architecture.md §1). Signatures as in collectives.py."""

    def all_reduce(self, local: torch.Tensor, reduce_op: str, group: ProcessGroup, group_size: int) -> torch.Tensor:
        """`local` reduced over `group` into a new tensor."""

    def all_ranks_agree(self, flag: bool, device: torch.device, group: ProcessGroup | None = None) -> bool:
        """The logical AND of `flag` over every rank of `group` (default: the world)."""

    def exchange(
        self, sends: list[tuple[int, torch.Tensor]], receives: list[tuple[int, torch.Tensor]], group: ProcessGroup
    ) -> None:
        """Point to point within `group`: each tensor sent to its group rank, each buffer filled from its own."""


# local_impl(local_args, local_kwargs, input_specs, output_specs, comm) -> the op's local output(s)
LocalImpl = Callable[[list, dict, tuple[DTensorSpec, ...], tuple[DTensorSpec | None, ...], LocalComm], Any]

# local_impls that issue a collective over the whole world: ranks outside the DTensor's mesh must
# run them too (on their empty shards), or the ranks on it would wait for them forever
WORLD_LOCAL_IMPLS: set[LocalImpl] = set()


class Role(enum.Enum):
    """What an op does with an argument, read from its schema's alias annotations."""

    IN = "in"  # reads it
    KEEP = "keep"  # writes into it in place (add_'s self, each tensor of _foreach_add_'s list)
    OUT = "out"  # writes its result into it (an out= tensor)


def argument_role(argument: torch.Argument) -> Role:
    info = argument.alias_info
    if info is None or not info.is_write:
        return Role.IN
    return Role.OUT if argument.is_out else Role.KEEP


@cache
def positional_index(op: OpOverload, name: str) -> int | None:
    """Where argument `name` of `op` sits among the positional args, or None if it is keyword-only
    or absent. An argument is given positionally when the call passes that many positional args."""
    for i, a in enumerate(op._schema.arguments):
        if a.name == name:
            return None if a.kwarg_only else i
    return None


class Slot(NamedTuple):
    """One value of an op call, in the flat order of its DTensor inputs (args, then kwargs; the
    items of a list one by one)."""

    argument: torch.Argument  # the schema argument it is, or is an item of
    item: int | None  # its index in that list argument; None for a value that is not a list item
    value: Any
    spec_index: int | None  # its index in `call.specs` (and `Sharding.inputs`) if it is a DTensorSpec
    role: Role


class Written(NamedTuple):
    """A DTensor input the op writes into."""

    spec_index: int  # in `call.specs` (and `Sharding.inputs`)
    spec: DTensorSpec
    name: str  # the schema argument it is, or is an item of
    role: Role  # KEEP or OUT


class BoundArgs:
    """An OpCall's arguments bound to the op's schema, once (`call.bound`).

    `bound[name]` is the argument's value: given positionally or by keyword, else the schema's
    default (lists as tuples, like the rest of an OpCall); an argument with neither is absent
    (`bound.get(name)` is None, `bound[name]` raises KeyError). `slots` holds every given value in
    flat order, with the index in `call.specs` of each DTensor input and the op's role for it;
    `written()` the DTensors the op writes into.
    """

    __slots__ = ("op", "values", "slots")

    def __init__(self, op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        schema_args = op._schema.arguments
        by_name = {a.name: a for a in schema_args}
        self.op = op
        self.values: dict[str, Any] = {}
        given: list[tuple[torch.Argument, Any]] = []
        for i, a in enumerate(schema_args):
            if i < len(args) and not a.kwarg_only:
                given.append((a, args[i]))
                self.values[a.name] = args[i]
            elif a.name in kwargs:
                self.values[a.name] = kwargs[a.name]
            elif a.has_default_value():
                default = a.default_value
                self.values[a.name] = tuple(default) if isinstance(default, list) else default
        given += [(by_name[name], v) for name, v in kwargs.items()]
        slots: list[Slot] = []
        specs = 0
        for a, value in given:
            role = argument_role(a)
            items = enumerate(value) if isinstance(value, (list, tuple)) else ((None, value),)
            for item, v in items:
                is_spec = isinstance(v, DTensorSpec)
                slots.append(Slot(a, item, v, specs if is_spec else None, role))
                specs += is_spec
        self.slots: tuple[Slot, ...] = tuple(slots)

    def __getitem__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise KeyError(f"{self.op} has no argument {name!r}, or it was not given and has no default") from None

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)

    def written(self) -> list[Written]:
        """The DTensor inputs the op writes into (in place or as out=), in flat order: the order of
        the op's outputs for ops that return what they write."""
        return [
            Written(s.spec_index, s.value, s.argument.name, s.role)
            for s in self.slots
            if s.spec_index is not None and s.role is not Role.IN
        ]

    def named_specs(self) -> list[tuple[str, DTensorSpec]]:
        """(argument name, spec) of every DTensor input, in flat order (that of Sharding.inputs)."""
        return [(s.argument.name, s.value) for s in self.slots if s.spec_index is not None]


@dataclass(frozen=True, slots=True)
class OpCall:
    """An op call as rules see it: every DTensor arg replaced by its DTensorSpec, lists as tuples."""

    op: OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    _bound: BoundArgs | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def bound(self) -> BoundArgs:
        """The args bound to the schema by name (see BoundArgs); computed on first use, for rules
        only (cache misses), never on the dispatch hot path."""
        bound = self._bound
        if bound is None:
            bound = BoundArgs(self.op, self.args, self.kwargs)
            object.__setattr__(self, "_bound", bound)  # a cache on a frozen dataclass
        return bound

    @property
    def specs(self) -> list[DTensorSpec]:
        """Input specs in flat order (the order of `Sharding.inputs`)."""
        return [a for a in iter_flat(self.args, self.kwargs) if isinstance(a, DTensorSpec)]

    @property
    def mesh_ndim(self) -> int:
        return self.specs[0].mesh.ndim

    @property
    def name(self) -> str:
        return op_name(self.op)


@dataclass(frozen=True, slots=True)
class Sharding:
    """One way to run an op.

    inputs:  placements each DTensor input must have (flat order; None keeps the input as it is).
    outputs: placements of each tensor the op returns (flat pytree order); None for non-tensors.
    local_op / local_args: how to run the op on the local tensors when the global call would be wrong
        there (a size arg is global: `view(8, 4, 4)` of a (4, 16) shard). The local call is
        `(local_op or op)(*local_args, **kwargs)`; in `local_args` a DTensorSpec stands for the local
        tensor of the DTensor arg at that same position, LOCAL_SHAPE for this rank's shape of output 0
        and LOCAL_STRIDE for its strides.
        None (default): the op's own positional args.
    local_impl: a function run instead of the op on the local tensors, for ops whose local math
        differs from the global one (vocabulary-sharded embedding masks out-of-range ids). Called as
        `local_impl(local_args, local_kwargs, input_specs, output_specs, comm)` with the specs the
        inputs have after redistribution and the output specs; returns what the op would. It may
        issue collectives, only through `comm` (a LocalComm: dispatch.py hands in collectives.py),
        never by importing them. None (default): the plain op.
        Random ops (tagged nondeterministic_seeded) ignore it: random.run_seeded runs them.
    """

    inputs: tuple[Placements | None, ...]
    outputs: tuple[Placements | None, ...]
    local_op: OpOverload | None = None
    local_args: tuple[Any, ...] | None = None
    local_impl: LocalImpl | None = None


@dataclass(frozen=True, slots=True)
class ScalarTensor:
    """What a rule sees for a plain 0-d tensor arg (`x * torch.tensor(2.0)`): a replicated scalar."""

    dtype: torch.dtype
    device_type: str


class LocalShape:
    """Sentinel type of LOCAL_SHAPE (see `Sharding.local_args`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "LOCAL_SHAPE"


LOCAL_SHAPE = LocalShape()


class LocalStride:
    """Sentinel type of LOCAL_STRIDE: dense strides of this rank's shape of output 0, in the dim
    order of the output's global strides (`new_empty_strided` of a shard)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "LOCAL_STRIDE"


LOCAL_STRIDE = LocalStride()


Rule = Callable[[OpCall], "Sharding | list[Sharding]"]

RULES: dict[OpOverload, Rule] = {}
# Ops whose rules read `_StridedShard` placements themselves (the view and matmul families); every
# other op's strided inputs go through planning's `_strided_plan` (run as they are, or gathered).
STRIDED_RULES: set[OpOverload] = set()


def register(*ops: OpOverload | OpOverloadPacket, strided: bool = False) -> Callable[[Rule], Rule]:
    """Register `rule` for ops; a packet (`aten.add`) registers every overload it has. `strided`:
    the rule handles `_StridedShard` inputs (see STRIDED_RULES)."""

    def wrap(rule: Rule) -> Rule:
        for op in ops:
            for overload in _overloads(op):
                RULES[overload] = rule
                if strided:
                    STRIDED_RULES.add(overload)
        return rule

    return wrap


def _overloads(op: OpOverload | OpOverloadPacket) -> Iterator[OpOverload]:
    if isinstance(op, OpOverload):
        yield op
        return
    for name in op.overloads():
        yield getattr(op, name)


def iter_flat(args: tuple, kwargs: dict) -> Iterator[Any]:
    """Args then kwargs values, one level of lists/tuples flattened (the order of DTensor inputs)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def op_name(op: OpOverload) -> str:
    """`aten.add.Tensor` style name."""
    return str(op)


# --------------------------------------------------------------------------------------------------
# helpers shared by many families
# --------------------------------------------------------------------------------------------------


def replicate(ndim: int) -> Placements:
    return (Replicate(),) * ndim


def is_shard(p: Placement, dim: int | None = None) -> bool:
    return isinstance(p, Shard) and (dim is None or p.dim == dim)


RULE_FILES = (
    ("_foreach_", "foreach.py"),
    ("embedding", "embedding.py"),
    ("attention", "attention.py"),
    ("loss", "nll_loss.py"),
    ("norm", "norms.py"),
    ("softmax", "norms.py"),
    ("mm", "matmul.py"),
    ("linear", "matmul.py"),
    ("matmul", "matmul.py"),
    ("dot", "matmul.py"),
    ("index", "indexing.py"),
    ("aten::gather", "indexing.py"),
    ("aten::scatter", "indexing.py"),
)


def rule_file_for(op: OpOverload) -> str:
    """The file where the rules of `op`'s family live (named in missing-rule errors)."""
    name = op.name()
    for needle, file in RULE_FILES:
        if needle in name:
            return f"parallelisms/dtensor/ops/{file}"
    if torch.Tag.nondeterministic_seeded in op.tags:
        return "parallelisms/dtensor/ops/random.py"
    if torch.Tag.pointwise in op.tags:
        return "parallelisms/dtensor/ops/pointwise.py"
    if op.is_view:
        return "parallelisms/dtensor/ops/views.py"
    if torch.Tag.reduction in op.tags:
        return "parallelisms/dtensor/ops/reductions.py"
    return "parallelisms/dtensor/ops/tensor_ops.py"
