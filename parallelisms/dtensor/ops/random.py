"""Random ops on DTensors: their sharding rules and the seeding that makes them SPMD-correct.

Guarantees (every rank must have seeded torch alike, e.g. `torch.manual_seed(s)` everywhere, and must
run the same random ops in the same order, as SPMD programs do):

1. Replicas agree. Ranks whose coordinates differ only on mesh dims where the output is Replicate
   draw identical values, so a replicated dropout mask is the same everywhere without communication.
2. Shards are independent. Ranks at different coordinates on a mesh dim that shards the output
   draw from differently seeded streams, so no two shards repeat one mask pattern.
3. Lockstep. Each random op consumes exactly one draw from the default CPU generator (or from the
   `generator=` the caller passed), whatever the mesh, placements and local shapes, so the default
   generator's state stays identical on all ranks and later random calls stay in step.
4. Reproducible. The same seed, mesh and placements give the same values. A tensor sharded the same
   way over the same number of shards (e.g. S(0) on (4,) and (S(0), S(0)) on (2, 2) with even
   shapes) gets the same values; other meshes give other (equally distributed) values: unlike
   `parallelisms.dtensor.rand`, random ops here are not independent of the mesh.

How: `run_seeded` takes one 63-bit draw `base` from the generator, mixes it with the linear index of
this rank's shard over the mesh dims that shard the output (coordinates on Replicate mesh dims never
enter), seeds the local device's default generator with the result inside `torch.random.fork_rng`
and runs the local op there; the fork restores the generator afterwards.

Placements: random ops keep their input's placements, except that Partial becomes Replicate (a
dropout of a partial sum is not the sum of dropouts; a fresh sample is not partial). `*_like` ops do
not read their input, so it stays where it is; multinomial keeps only row shards of its probabilities.
In-place fills (`uniform_`, `bernoulli_`, ...) of a Partial tensor are refused: the tensor cannot
change placements in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._ops import OpOverload

from ..placements import Partial, Replicate, Shard, _StridedShard
from ..spec import DTensorSpec
from .registry import OpCall, Placements, Role, Sharding, argument_role, positional_index, register
from .tensor_ops import Row, broadcast_placement, expand, partials

aten = torch.ops.aten

_MASK64 = (1 << 64) - 1


def is_random(op: OpOverload) -> bool:
    """Ops that draw from a generator (the dispatcher routes them through `run_seeded`)."""
    return torch.Tag.nondeterministic_seeded in op.tags


# --------------------------------------------------------------------------------------------------
# rules
# --------------------------------------------------------------------------------------------------


def _no_partial(placements: Placements) -> Placements:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


@register(
    aten.native_dropout.default,
    aten.bernoulli.default,
    aten.bernoulli.p,
    aten.bernoulli.Tensor,
    aten.bernoulli_.Tensor,
    aten.poisson.default,
    aten.normal.Tensor_float,
    aten.normal.float_Tensor,
    aten.normal.Tensor_Tensor,
)
def random_from_input(call: OpCall) -> Sharding:
    """The first tensor input keeps its placements, Partial -> Replicate; every output takes them.

    Other tensor inputs (probabilities, std) follow it, replicated along dims they broadcast; when
    the output is larger than the first input (it broadcasts), everything replicates.
    """
    first, *others = call.specs
    _check_inplace(call, first)
    replicated = (Replicate(),) * call.mesh_ndim
    n_outputs = sum("Tensor" in str(r.type) for r in call.op._schema.returns)
    if tuple(torch.broadcast_shapes(*(s.shape for s in call.specs))) != tuple(first.shape):
        return Sharding((replicated,) * len(call.specs), (replicated,) * n_outputs)
    placements = _no_partial(first.placements)
    inputs = [placements] + [
        tuple(broadcast_placement(first, s, p.dim) if isinstance(p, Shard) else Replicate() for p in placements)
        for s in others
    ]
    return Sharding(tuple(inputs), (placements,) * n_outputs)


@register(
    aten.bernoulli_.float,
    aten.uniform_.default,
    aten.normal_.default,
    aten.exponential_.default,
    aten.log_normal_.default,
    aten.geometric_.default,
    aten.cauchy_.default,
    aten.random_.default,
    aten.random_.to,
    getattr(aten.random_, "from"),
)
def random_fill_(call: OpCall) -> Sharding:
    """In-place fills: self keeps its placements (values are not read); Partial is refused."""
    (spec,) = call.specs
    _check_inplace(call, spec)
    return Sharding((None,), (spec.placements,))


@register(
    aten.rand_like.default,
    aten.rand_like.generator,
    aten.randn_like.default,
    aten.randn_like.generator,
    aten.randint_like.default,
    aten.randint_like.Tensor,
    aten.randint_like.low_dtype,
    aten.randint_like.generator,
    aten.randint_like.Tensor_generator,
    aten.randint_like.low_generator_dtype,
)
def random_like(call: OpCall) -> Sharding:
    """A fresh sample in the input's layout; the input is not read (a tensor `high` replicates)."""
    first, *others = call.specs
    replicated = (Replicate(),) * call.mesh_ndim
    return Sharding((None, *(replicated for _ in others)), (_no_partial(first.placements),))


@register(aten.multinomial.default)
def multinomial(call: OpCall) -> Sharding:
    """Rows of (B, n) probabilities draw independently: S(0) stays (samples (B, k) S(0), each shard
    from its own stream); the categories must be whole and summed, so S(1) and Partial gather."""
    (spec,) = call.specs
    rows = spec.ndim == 2
    placements = tuple(p if rows and isinstance(p, Shard) and p.dim == 0 else Replicate() for p in spec.placements)
    return Sharding((placements,), (placements,))


def _check_inplace(call: OpCall, spec: DTensorSpec) -> None:
    if argument_role(call.op._schema.arguments[0]) is Role.KEEP and spec.has_partial():
        raise NotImplementedError(
            f"{call.op} fills a DTensor with placements {tuple(map(str, spec.placements))} in place, but a "
            f"random sample cannot be Partial; redistribute it to Replicate first (x = x.redistribute(...))"
        )


@register(aten.native_dropout_backward.default)
def native_dropout_backward(call: OpCall) -> list[Sharding]:
    """grad * mask * scale, pointwise: S(d) x S(d) -> S(d); linear in grad: P(sum|avg) x R -> P."""
    grad = call.specs[0]
    rows = [Row({"grad_output": Replicate(), "mask": Replicate()}, (Replicate(),))]
    rows += [Row({"grad_output": Shard(d), "mask": Shard(d)}, (Shard(d),)) for d in range(grad.ndim)]
    rows += [Row({"grad_output": p, "mask": Replicate()}, (p,)) for p in partials(call, ("sum", "avg"))]
    return expand(call, rows)


# --------------------------------------------------------------------------------------------------
# seeding
# --------------------------------------------------------------------------------------------------


def run_seeded(op: OpOverload, args: list, kwargs: dict, output_specs: tuple) -> Any:
    """Run the local random op seeded for this rank's shard (see the module docstring)."""
    spec = next(s for s in output_specs if s is not None)
    args, kwargs, generator = _take_generator(op, args, kwargs)
    seed = mix_seed(_draw_base(generator), shard_index(spec))
    device = _local_device(args, kwargs)
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            return _match_dtypes(op(*args, **kwargs), output_specs)
    index = device.index if device.index is not None else torch.get_device_module(device.type).current_device()
    with torch.random.fork_rng(devices=[index], device_type=device.type):
        module = torch.get_device_module(device.type)
        with module.device(index):
            module.manual_seed(seed)
            return _match_dtypes(op(*args, **kwargs), output_specs)


def _match_dtypes(out: Any, output_specs: tuple) -> Any:
    """Local outputs in the global dtypes: native_dropout of an EMPTY shard returns a float mask, not
    bool, and a rank whose dtype differs would break the next collective on that mask."""
    if not isinstance(out, tuple):
        return out
    return tuple(
        o.to(s.dtype) if isinstance(o, torch.Tensor) and s is not None and o.dtype != s.dtype else o
        for o, s in zip(out, output_specs)
    )


def shard_index(spec: DTensorSpec) -> int:
    """Linear index of this rank's shard over the mesh dims that shard `spec` (0 when none do)."""
    coordinate = spec.mesh.get_coordinate() or [0] * spec.mesh.ndim
    index = 0
    for m, p in enumerate(spec.placements):
        if isinstance(p, (Shard, _StridedShard)):
            index = index * spec.mesh.size(m) + coordinate[m]
    return index


def mix_seed(base: int, index: int) -> int:
    """A 63-bit seed from (base, shard index): splitmix64, so neighbouring indices give unrelated seeds."""
    z = (base + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _draw_base(generator: torch.Generator | None) -> int:
    """The one draw this op consumes: from `generator` if given, else from the default CPU generator."""
    if generator is None:
        return int(torch.randint(0, 2**62, (1,)).item())
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())


def _take_generator(op: OpOverload, args: list, kwargs: dict) -> tuple[list, dict, torch.Generator | None]:
    """Remove a caller's `generator=` (it seeds `base`; the local op runs on the seeded default one)."""
    i = positional_index(op, "generator")
    if i is not None and i < len(args):
        return [*args[:i], None, *args[i + 1 :]], kwargs, args[i]
    if kwargs.get("generator") is not None:
        return args, {**kwargs, "generator": None}, kwargs["generator"]
    return args, kwargs, None


def _local_device(args: list, kwargs: dict) -> torch.device:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")
