"""`__torch_dispatch__` for DTensor: unwrap -> rule (cached) -> redistribute -> local op -> wrap.

The steady state of an op is one pass over its args building the cache key and the local args, a
dict lookup, the local op, and wrapping the outputs. On a cache miss the op's rule chooses the
cheapest legal Sharding (fewest bytes moved), and the op runs once on meta tensors of the global
shapes to learn the output shapes, strides and dtypes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import OpOverload

from .dtensor import DTensor
from .ops import RULES, OpCall, Sharding, rule_file_for
from .ops import random as random_ops
from .ops.registry import LOCAL_SHAPE, LocalImpl
from .placements import Partial, Placement, Replicate, Shard
from .redistribute import plan_transitions, redistribute_local
from .spec import DTensorSpec, TensorMeta

logger = logging.getLogger(__name__)
DEBUG = os.environ.get("MESHTRAIN_DEBUG", "0") not in ("", "0")


@dataclass(frozen=True, slots=True)
class Plan:
    """A cached decision: where inputs must go and what the outputs are."""

    input_placements: tuple[tuple[Placement, ...] | None, ...]  # per flat DTensor input; None: as is
    output_specs: tuple[DTensorSpec | None, ...]  # per tensor output leaf
    redistributes: bool
    random: bool
    returns: str  # "new" (wrap outputs), "self" (in-place: args[0]) or "out" (kwargs["out"])
    local_op: OpOverload | None = None  # run this instead of the op on the local tensors
    local_args: tuple | None = None  # positional args of the local call; a DTensorSpec: that arg's local
    local_impl: LocalImpl | None = None  # runs instead of the local op (Sharding.local_impl)
    input_specs: tuple[DTensorSpec, ...] = ()  # input specs after redistribution, for local_impl
    local_tensor_positions: tuple[int, ...] = ()  # where local_args holds a DTensorSpec placeholder
    plain: bool = True  # the local op is the op itself, on the op's own args (no special case)


PLANS: dict[tuple, Plan] = {}
_fallback_enabled = False
_plain_as_replicate: frozenset[OpOverload] = frozenset()  # see plain_tensors_as_replicate
_fallback_warned: set[OpOverload] = set()


def dispatch(op: OpOverload, args: tuple, kwargs: dict | None) -> Any:
    kwargs = kwargs or {}
    dtensors: list[DTensor] = []
    key_args, local_args = _unwrap_all(op, args, dtensors)
    if kwargs:
        key_kwargs, local_kwargs = _unwrap_kwargs(op, kwargs, dtensors)
    else:
        key_kwargs, local_kwargs = (), kwargs
    key = (op, key_args, key_kwargs)
    try:
        plan = PLANS.get(key)
    except TypeError:  # an unhashable static arg: decide without caching
        plan = None
    if plan is None:
        plan = build_plan(op, key_args, dict(key_kwargs) if key_kwargs else {}, dtensors)
        try:
            PLANS[key] = plan
        except TypeError:  # unhashable, as above
            pass
    if plan.redistributes:
        local_args, local_kwargs = _redistribute_inputs(op, args, kwargs, dtensors, plan)
    if plan.plain:
        out = op(*local_args, **local_kwargs)
    else:
        out = _run_special(op, plan, local_args, local_kwargs)
    if plan.returns == "new":
        if type(out) is torch.Tensor:  # a tensor output always has a spec (None marks non-tensor outputs)
            return DTensor(out, plan.output_specs[0])  # type: ignore[arg-type]
        return _wrap(out, plan.output_specs)
    return args[0] if plan.returns == "self" else kwargs["out"]


def _run_special(op: OpOverload, plan: Plan, local_args: list, local_kwargs: dict) -> Any:
    """Ops whose local call differs from the global one: local sizes, a local_impl, or RNG."""
    local_op = op
    if plan.local_op is not None or plan.local_args is not None:  # e.g. view sizes made local
        local_op, local_args = _local_call(op, plan, local_args)
    if plan.random:
        return random_ops.run_seeded(local_op, local_args, local_kwargs, plan.output_specs)
    if plan.local_impl is not None:
        return plan.local_impl(local_args, local_kwargs, plan.input_specs, plan.output_specs)
    return local_op(*local_args, **local_kwargs)


# --------------------------------------------------------------------------------------------------
# unwrap
# --------------------------------------------------------------------------------------------------


def _unwrap_one(op: OpOverload, a: Any, dtensors: list[DTensor]) -> tuple[Any, Any]:
    if isinstance(a, DTensor):
        dtensors.append(a)
        return a._spec, a._local_tensor
    if isinstance(a, torch.Tensor):
        if a.ndim == 0:  # a plain 0-d tensor acts as a replicated scalar
            return ("scalar_tensor", a.dtype, a.device.type), a
        if op in _plain_as_replicate and dtensors:  # e.g. loss targets under loss_parallel()
            mesh = dtensors[0]._spec.mesh
            wrapped = DTensor.from_local(a, mesh, [Replicate()] * mesh.ndim)
            dtensors.append(wrapped)
            return wrapped._spec, a
        # ValueError, not TypeError: Tensor.__add__ & co. turn a TypeError into NotImplemented,
        # which would replace this message with Python's generic one
        raise ValueError(
            f"{op}: got a plain torch.Tensor of shape {tuple(a.shape)} mixed with DTensors; convert it with "
            f"distribute_tensor(t, mesh, placements) or DTensor.from_local(t, mesh, placements) first"
        )
    if isinstance(a, (list, tuple)):
        for x in a:  # a plain loop: `any(genexpr)` costs a microsecond on every view(...) call
            if isinstance(x, torch.Tensor):
                keys, locals_ = zip(*(_unwrap_one(op, y, dtensors) for y in a))
                return tuple(keys), list(locals_)
        return tuple(a), a
    return a, a


_INT = frozenset({int})
_STATIC_TYPES = frozenset(
    {int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout}
)


def _unwrap_all(op: OpOverload, args: tuple, dtensors: list[DTensor]) -> tuple[tuple, list]:
    keys: list[Any] = []
    locals_: list[Any] = []
    for a in args:
        if type(a) is DTensor:  # the common cases first, without the generic checks
            dtensors.append(a)
            keys.append(a._spec)
            locals_.append(a._local_tensor)
        elif type(a) in _STATIC_TYPES:
            keys.append(a)
            locals_.append(a)
        elif type(a) is list and _INT.issuperset(map(type, a)):  # sizes: view(8, 4, 4), sum([0])
            keys.append(tuple(a))
            locals_.append(a)
        else:
            k, local = _unwrap_one(op, a, dtensors)
            keys.append(k)
            locals_.append(local)
    return tuple(keys), locals_


def _unwrap_kwargs(op: OpOverload, kwargs: dict, dtensors: list[DTensor]) -> tuple[tuple, dict]:
    keys, locals_ = [], {}
    for name, a in kwargs.items():
        k, local = _unwrap_one(op, a, dtensors)
        keys.append((name, k))
        locals_[name] = local
    return tuple(keys), locals_


def _redistribute_inputs(op: OpOverload, args: tuple, kwargs: dict, dtensors: list[DTensor], plan: Plan):
    """Local args with every DTensor input moved to the plan's placements (no autograd here)."""
    new_locals: dict[int, torch.Tensor] = {}
    for i, (dt, target) in enumerate(zip(dtensors, plan.input_placements)):
        if target is None or target == dt._spec.placements:
            continue
        if DEBUG:
            _log_redistribute(op, i, dt._spec, target)
        new_locals[id(dt)] = new_locals[id(dt._local_tensor)] = redistribute_local(dt._local_tensor, dt._spec, target)

    def local_of(a: Any) -> Any:
        if isinstance(a, DTensor):
            return new_locals.get(id(a), a._local_tensor)
        if isinstance(a, torch.Tensor):  # a plain tensor taken as Replicate (plain_tensors_as_replicate)
            return new_locals.get(id(a), a)
        if isinstance(a, (list, tuple)) and any(isinstance(x, DTensor) for x in a):
            return [local_of(x) for x in a]
        return a

    return [local_of(a) for a in args], {k: local_of(v) for k, v in kwargs.items()}


def _log_redistribute(op: OpOverload, index: int, spec: DTensorSpec, target: tuple[Placement, ...]) -> None:
    names = spec.mesh.mesh_dim_names or tuple(str(i) for i in range(spec.mesh.ndim))
    comms = [f"{_collective_name(t.src, t.dst)} on {names[t.mesh_dim]}" for t in plan_transitions(spec, target)]
    src = ",".join(map(str, spec.placements))
    dst = ",".join(map(str, target))
    logger.info("%s arg%d (%s)->(%s): %s", op, index, src, dst, "; ".join(comms) or "local")


def _collective_name(src: Placement, dst: Placement) -> str:
    if isinstance(dst, Replicate):
        return "all_gather" if isinstance(src, Shard) else "all_reduce"
    if isinstance(dst, Shard):
        return {Replicate: "local chunk", Partial: "reduce_scatter", Shard: "all_to_all"}[type(src)]
    return "local partition"


# --------------------------------------------------------------------------------------------------
# planning (cache misses only)
# --------------------------------------------------------------------------------------------------


def build_plan(op: OpOverload, key_args: tuple, key_kwargs: dict, dtensors: list[DTensor]) -> Plan:
    call = OpCall(op, key_args, key_kwargs)
    specs = call.specs
    _check_same_mesh(op, specs)
    rule = RULES.get(op)
    if rule is None:
        if _fallback_enabled:
            return _fallback_plan(op, call)
        raise NotImplementedError(
            f"no sharding rule for {op} with placements "
            f"{tuple(tuple(str(p) for p in s.placements) for s in specs)}; rules for this family live in "
            f"{rule_file_for(op)} (or wrap the call in parallelisms.dtensor.dispatch.replicate_fallback())"
        )
    choice = choose(call, rule(call))
    return _finish_plan(call, choice)


def choose(call: OpCall, candidates: Sharding | list[Sharding]) -> Sharding:
    """The candidate that moves the fewest bytes; ties keep more outputs sharded."""
    if isinstance(candidates, Sharding):
        return candidates
    if not candidates:
        raise NotImplementedError(f"the rule for {call.op} found no legal sharding for these placements")
    specs = call.specs
    return min(candidates, key=lambda s: (redistribute_cost(specs, s.inputs), -_sharded_outputs(s)))


def _sharded_outputs(s: Sharding) -> int:
    return sum(isinstance(p, Shard) for out in s.outputs if out for p in out)


COLLECTIVE_COST_BYTES = 1024  # a collective's latency, in bytes: among equal volumes, fewer calls win


def redistribute_cost(specs: list[DTensorSpec], targets: tuple) -> float:
    """Bytes a rank sends to move every input to its target (ring volumes), plus a fixed cost per
    collective.

    Volumes assume even shards (global numel over the mesh dims sharding the tensor at each step)
    rather than this rank's uneven shard: every rank must compute the same cost and so pick the
    same candidate, or their collectives would not match.
    """
    total = 0.0
    for spec, target in zip(specs, targets):
        if target is None or target == spec.placements:
            continue
        elsize = spec.dtype.itemsize
        current = list(spec.placements)
        for t in plan_transitions(spec, target):
            n = spec.mesh.size(t.mesh_dim)
            numel: float = spec.shape.numel()  # the tensor this mesh dim's group works on: sharded by the others
            for m, p in enumerate(current):
                if m != t.mesh_dim and isinstance(p, Shard):
                    numel /= spec.mesh.size(m)
            current[t.mesh_dim] = t.dst
            volume = numel * elsize * (n - 1) / n
            if isinstance(t.src, Replicate):
                total += 1e-3 * numel  # local chunk / partition: no traffic, a little copying
                continue
            total += COLLECTIVE_COST_BYTES
            if isinstance(t.dst, Replicate) and isinstance(t.src, Partial):
                total += 2 * volume  # all_reduce = reduce_scatter + all_gather
            elif isinstance(t.src, Shard) and isinstance(t.dst, Shard):
                total += volume / n
            else:
                total += volume
    return total


def _finish_plan(call: OpCall, choice: Sharding) -> Plan:
    op, specs = call.op, call.specs
    if len(choice.inputs) != len(specs):
        raise AssertionError(f"rule for {op} returned {len(choice.inputs)} input placements for {len(specs)} inputs")
    input_specs = [
        spec if target is None else spec.with_placements(target) for spec, target in zip(specs, choice.inputs)
    ]
    metas = _output_metas(call, input_specs)
    if len(metas) != len(choice.outputs):
        raise AssertionError(f"rule for {op} returned {len(choice.outputs)} output placements for {len(metas)} outputs")
    mesh = specs[0].mesh
    output_specs = tuple(
        None if meta is None or placements is None else DTensorSpec(mesh, tuple(placements), meta)
        for meta, placements in zip(metas, choice.outputs)
    )
    _check_mutation(op, call, specs, choice, output_specs)
    redistributes = any(t is not None and t != s.placements for s, t in zip(specs, choice.inputs))
    local_args = _resolve_local_args(choice.local_args, output_specs)
    random = random_ops.is_random(op)
    return Plan(
        input_placements=tuple(choice.inputs),
        output_specs=output_specs,
        redistributes=redistributes,
        random=random,
        returns=_returns(op, call),
        local_op=choice.local_op,
        local_args=local_args,
        local_impl=choice.local_impl,
        input_specs=tuple(input_specs) if choice.local_impl is not None else (),
        local_tensor_positions=tuple(i for i, a in enumerate(local_args or ()) if isinstance(a, DTensorSpec)),
        plain=choice.local_op is None and local_args is None and choice.local_impl is None and not random,
    )


def _resolve_local_args(local_args: tuple | None, output_specs: tuple) -> tuple | None:
    """Sharding.local_args with LOCAL_SHAPE replaced by this rank's shape of output 0 (per-rank plan)."""
    if local_args is None:
        return None
    if not any(a is LOCAL_SHAPE for a in local_args):
        return tuple(local_args)
    local_shape = list(output_specs[0].local_shape_and_offset()[0])
    return tuple(local_shape if a is LOCAL_SHAPE else a for a in local_args)


def _local_call(op: OpOverload, plan: Plan, local_args: list) -> tuple[OpOverload, list]:
    """The op and positional args to run on this rank's local tensors."""
    if plan.local_args is not None:
        args = list(plan.local_args)
        for i in plan.local_tensor_positions:
            args[i] = local_args[i]
        local_args = args
    return plan.local_op or op, local_args


def _output_metas(call: OpCall, input_specs: list[DTensorSpec]) -> list[TensorMeta | None]:
    """Global output metadata: run the op on meta tensors of the global shapes."""
    if not any("Tensor" in str(r.type) for r in call.op._schema.returns):
        return []
    it = iter(input_specs)

    def to_meta(a: Any) -> Any:
        if isinstance(a, DTensorSpec):
            spec = next(it)
            return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta")
        if isinstance(a, tuple) and a and a[0] == "scalar_tensor":
            return torch.zeros((), dtype=a[1], device="meta")
        if isinstance(a, tuple) and any(isinstance(x, (DTensorSpec, tuple)) for x in a):
            return [to_meta(x) for x in a]
        return a

    meta_args = [to_meta(a) for a in call.args]
    meta_kwargs = {k: to_meta(v) for k, v in call.kwargs.items()}
    if meta_kwargs.get("device") is not None:  # `_to_copy(..., device=cpu)` would copy out of meta
        meta_kwargs["device"] = "meta"
    out = call.op(*meta_args, **meta_kwargs)
    leaves = out if isinstance(out, (tuple, list)) else [out]
    return [TensorMeta(o.shape, tuple(o.stride()), o.dtype) if isinstance(o, torch.Tensor) else None for o in leaves]


def _check_same_mesh(op: OpOverload, specs: list[DTensorSpec]) -> None:
    if not specs:
        raise AssertionError(f"{op} reached DTensor dispatch without DTensor inputs")
    mesh = specs[0].mesh
    for s in specs[1:]:
        if s.mesh != mesh:
            raise ValueError(
                f"{op}: DTensor inputs live on different meshes ({mesh} and {s.mesh}); "
                f"redistribute them onto one mesh first"
            )


def _check_mutation(op: OpOverload, call: OpCall, specs, choice: Sharding, output_specs) -> None:
    """In-place and out= ops write into an existing DTensor: its placements may not change."""
    schema = op._schema
    if not schema.is_mutable:
        return
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = call.args[i] if i < len(call.args) and not arg.kwarg_only else call.kwargs.get(arg.name)
        if not isinstance(value, DTensorSpec):
            continue
        index = specs.index(value) if value in specs else None
        target = choice.inputs[index] if index is not None else None
        if target is not None and target != value.placements:
            raise RuntimeError(
                f"{op} writes into {arg.name} with placements {tuple(map(str, value.placements))}, but "
                f"running it needs {tuple(map(str, target))}; redistribute {arg.name} out of place first "
                f"(e.g. x = x.redistribute(...)) "
            )


def _fallback_plan(op: OpOverload, call: OpCall) -> Plan:
    if op not in _fallback_warned:
        _fallback_warned.add(op)
        logger.warning("no sharding rule for %s: gathering its inputs to Replicate (replicate_fallback)", op)
    r = (Replicate(),) * call.mesh_ndim
    mutated = [a for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if mutated:
        raise NotImplementedError(f"replicate_fallback cannot run in-place op {op}; it needs a sharding rule")
    n_out = len(_output_metas(call, [s.with_placements(r) for s in call.specs]))
    return _finish_plan(call, Sharding(tuple(r for _ in call.specs), tuple(r for _ in range(n_out))))


@contextmanager
def plain_tensors_as_replicate(ops: frozenset[OpOverload]) -> Iterator[None]:
    """Within the context, plain tensor args of `ops` count as Replicate DTensors on the mesh of
    the op's first DTensor arg, instead of raising (torch's loss_parallel takes plain targets so)."""
    global _plain_as_replicate
    previous, _plain_as_replicate = _plain_as_replicate, _plain_as_replicate | ops
    try:
        yield
    finally:
        _plain_as_replicate = previous


@contextmanager
def replicate_fallback() -> Iterator[None]:
    """Ops without a rule gather their inputs to Replicate and return Replicate outputs.

    Correct but communication-heavy; a warning names each op once so a rule can be written.
    """
    global _fallback_enabled
    previous, _fallback_enabled = _fallback_enabled, True
    try:
        yield
    finally:
        _fallback_enabled = previous


# --------------------------------------------------------------------------------------------------
# wrap
# --------------------------------------------------------------------------------------------------


def _wrap(out: Any, output_specs: tuple) -> Any:
    if isinstance(out, torch.Tensor):
        return DTensor(out, output_specs[0])
    if isinstance(out, (tuple, list)):
        wrapped = [
            DTensor(o, spec) if isinstance(o, torch.Tensor) and spec is not None else o
            for o, spec in zip(out, output_specs)
        ]
        return type(out)(wrapped) if isinstance(out, tuple) else wrapped
    return out


def _returns(op: OpOverload, call: OpCall) -> str:
    """What the op hands back: fresh outputs, its mutated self (`add_`), or its out= tensor."""
    schema = op._schema
    if not schema.is_mutable or not schema.returns:
        return "new"
    if "out" in call.kwargs and isinstance(call.kwargs["out"], DTensorSpec):
        return "out"
    first = schema.arguments[0]
    if first.alias_info is not None and first.alias_info.is_write and isinstance(call.args[0], DTensorSpec):
        return "self"
    return "new"
