"""`__torch_dispatch__` for DTensor: unwrap -> rule (cached) -> redistribute -> local op -> wrap.

The steady state of an op is one pass over its args building the cache key and the local args, a
dict lookup, the local op, and wrapping the outputs. On a cache miss the op's rule chooses the
cheapest legal Sharding (fewest bytes moved), and the op runs once on meta tensors of the global
shapes to learn the output shapes, strides and dtypes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import OpOverload

from .cost import redistribute_seconds
from .device_mesh import DeviceMesh
from .dtensor import DTensor
from .ops import RULES, OpCall, Sharding, rule_file_for
from .ops import foreach as foreach_ops
from .ops import random as random_ops
from .ops.decompositions import Decomposition, find_decomposition
from .ops.registry import LOCAL_SHAPE, LOCAL_STRIDE, LocalImpl, ScalarTensor, iter_flat
from .placements import Partial, Placement, Replicate, Shard
from .redistribute import conform_layout, plan_transitions, redistribute_local
from .spec import DTensorSpec, TensorMeta, dense_stride_like

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
    relayout: tuple[int, ...] = ()  # outputs whose kernel lays them out unlike their global strides
    decomposition: Decomposition | None = None  # run this on the op's own DTensor args instead (no rule)


@dataclass(slots=True)
class DispatchOptions:
    """What the context managers below switch on for the ops dispatched inside them."""

    plain_as_replicate: frozenset[OpOverload] = frozenset()  # plain_tensors_as_replicate(ops)
    implicit_replication: bool = False  # experimental.implicit_replication(): every plain tensor is R


PLANS: dict[tuple, Plan] = {}
OPTIONS = DispatchOptions()
_fallback_enabled = False
_fallback_warned: set[OpOverload] = set()


def dispatch(op: OpOverload, args: tuple, kwargs: dict | None) -> Any:
    kwargs = kwargs or {}
    dtensors: list[DTensor] = []
    key_args, local_args = _unwrap_all(op, args, dtensors)
    if kwargs:
        key_kwargs, local_kwargs = _unwrap_kwargs(op, args, kwargs, dtensors)
    else:
        key_kwargs, local_kwargs = (), kwargs
    key = (op, key_args, key_kwargs)
    try:
        plan = PLANS.get(key)
    except TypeError:  # an unhashable static arg: decide without caching
        plan = None
    fresh = plan is None
    if plan is None:
        plan = build_plan(op, key_args, dict(key_kwargs) if key_kwargs else {}, dtensors)
    if plan.redistributes:
        local_args, local_kwargs = _redistribute_inputs(op, args, kwargs, dtensors, plan)
    if plan.plain:
        out = op(*local_args, **local_kwargs)
    elif plan.decomposition is not None:  # its sub-ops dispatch (and wrap their outputs) themselves
        if fresh:
            _cache_plan(key, plan, None)
        return plan.decomposition(*args, **kwargs)
    else:
        out = _run_special(op, plan, local_args, local_kwargs)
    if fresh:  # cache after the first run, whose local outputs show their kernel's layout
        plan, out = _cache_plan(key, plan, out)
    if plan.returns == "new":
        if type(out) is torch.Tensor:  # a tensor output always has a spec (None marks non-tensor outputs)
            return DTensor(out, plan.output_specs[0])  # type: ignore[arg-type]
        return _wrap(out, plan.output_specs)
    return args[0] if plan.returns == "self" else kwargs["out"]


def _cache_plan(key: tuple, plan: Plan, out: Any) -> tuple[Plan, Any]:
    """Store `plan` after its first run, and make the local outputs agree with the global strides.

    Global strides come from the op on meta tensors, but a kernel may lay out its real output
    differently (CPU flash attention, some backward kernels). A DTensor whose reported strides
    disagree with its shard's sends reshape/view decompositions down the wrong path (a global
    `view` of a shard that needs a copy). The global strides must be the same on every rank (they
    decide which decomposition runs, and so which collectives), so the shard is the one to move:
    outputs laid out otherwise are copied into the global dim order, on this and later calls.
    """
    if out is not None and plan.returns == "new" and not _aliases(key[0]):
        leaves = out if isinstance(out, (tuple, list)) else (out,)
        relayout = tuple(
            i
            for i, (spec, leaf) in enumerate(zip(plan.output_specs, leaves))
            if spec is not None and isinstance(leaf, torch.Tensor) and _disagrees(spec, leaf)
        )
        if relayout:
            plan = dataclasses.replace(plan, relayout=relayout, plain=False)
            out = _relayout(out, plan)
    try:
        PLANS[key] = plan
    except TypeError:  # an unhashable static arg: decide without caching
        pass
    return plan, out


def _aliases(op: OpOverload) -> bool:
    """Outputs that are views of inputs keep their layout (copying them would break aliasing)."""
    return any(r.alias_info is not None for r in op._schema.returns)


def _disagrees(spec: DTensorSpec, local: torch.Tensor) -> bool:
    return conform_layout(local, spec) is not local


def _relayout(out: Any, plan: Plan) -> Any:
    """The outputs `plan.relayout` names, laid out in the dim order of their global strides."""
    if isinstance(out, torch.Tensor):
        return conform_layout(out, plan.output_specs[0])  # type: ignore[arg-type]
    leaves = list(out)
    for i in plan.relayout:
        leaves[i] = conform_layout(leaves[i], plan.output_specs[i])  # type: ignore[arg-type]
    return type(out)(leaves) if isinstance(out, tuple) else leaves


def _run_special(op: OpOverload, plan: Plan, local_args: list, local_kwargs: dict) -> Any:
    """Ops whose local call differs from the global one (local sizes, a local_impl, RNG) or whose
    outputs need a relayout (see _cache_plan)."""
    out = _run_local(op, plan, local_args, local_kwargs)
    return _relayout(out, plan) if plan.relayout else out


def _run_local(op: OpOverload, plan: Plan, local_args: list, local_kwargs: dict) -> Any:
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


def _unwrap_one(op: OpOverload, a: Any, dtensors: list[DTensor], call: tuple[tuple, dict]) -> tuple[Any, Any]:
    if isinstance(a, DTensor):
        dtensors.append(a)
        return a._spec, a._local_tensor
    if isinstance(a, torch.Tensor):
        if a.ndim == 0:  # a plain 0-d tensor acts as a replicated scalar
            return ScalarTensor(a.dtype, a.device.type), a
        if a.numel() == 1 or OPTIONS.implicit_replication or op in OPTIONS.plain_as_replicate:
            # single-element tensors count as replicated, as in torch (a tensor lr in fused AdamW);
            # others only under implicit_replication() or for the ops of plain_tensors_as_replicate
            mesh = _first_mesh(*call)
            r = (Replicate(),) * mesh.ndim
            wrapped = DTensor(a, DTensorSpec(mesh, r, TensorMeta(a.shape, tuple(a.stride()), a.dtype)))
            dtensors.append(wrapped)
            return wrapped._spec, a
        # ValueError, not TypeError: Tensor.__add__ & co. turn a TypeError into NotImplemented,
        # which would replace this message with Python's generic one
        raise ValueError(
            f"{op}: got a plain torch.Tensor of shape {tuple(a.shape)} mixed with DTensors; convert it with "
            f"distribute_tensor(t, mesh, placements) or DTensor.from_local(t, mesh, placements) first, "
            f"or run the op under parallelisms.dtensor.experimental.implicit_replication()"
        )
    if isinstance(a, (list, tuple)):
        for x in a:  # a plain loop: `any(genexpr)` costs a microsecond on every view(...) call
            if isinstance(x, torch.Tensor):
                keys, locals_ = zip(*(_unwrap_one(op, y, dtensors, call) for y in a))
                return tuple(keys), list(locals_)
        return tuple(a), a
    return a, a


def _first_mesh(args: tuple, kwargs: dict) -> DeviceMesh:
    """The mesh of the first DTensor among an op's args: where implicitly replicated tensors go."""
    for a in iter_flat(args, kwargs):
        if isinstance(a, DTensor):
            return a._spec.mesh
    raise AssertionError("an op reached DTensor dispatch without a DTensor argument")


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
            k, local = _unwrap_one(op, a, dtensors, (args, {}))
            keys.append(k)
            locals_.append(local)
    return tuple(keys), locals_


def _unwrap_kwargs(op: OpOverload, args: tuple, kwargs: dict, dtensors: list[DTensor]) -> tuple[tuple, dict]:
    keys, locals_ = [], {}
    for name, a in kwargs.items():
        k, local = _unwrap_one(op, a, dtensors, (args, kwargs))
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
    groups = _check_same_mesh(op, call)
    if groups is not None:  # a foreach op over several meshes: once per mesh
        run = functools.partial(foreach_ops.run_per_mesh, op, groups)
        return _decomposition_plan(call, run, f"lists on {len(groups)} meshes: one call per mesh")
    rule = RULES.get(op)
    if rule is None:
        decomposition = find_decomposition(op)
        if decomposition is not None:
            return _decomposition_plan(call, decomposition, "no sharding rule: running its decomposition")
        if _fallback_enabled:
            return _fallback_plan(op, call)
        raise NotImplementedError(
            f"no sharding rule for {op} with placements "
            f"{tuple(tuple(str(p) for p in s.placements) for s in specs)}; rules for this family live in "
            f"{rule_file_for(op)} (or wrap the call in parallelisms.dtensor.dispatch.replicate_fallback())"
        )
    choice = choose(call, rule(call))
    return _finish_plan(call, choice)


def _decomposition_plan(call: OpCall, decomposition: Decomposition, how: str) -> Plan:
    """A plan that hands the op's DTensor args to `decomposition` (ops/decompositions.py)."""
    if DEBUG:
        logger.info("%s: %s", call.op, how)
    inputs = (None,) * len(call.specs)
    return Plan(inputs, (), redistributes=False, random=False, returns="new", plain=False, decomposition=decomposition)


def choose(call: OpCall, candidates: Sharding | list[Sharding]) -> Sharding:
    """The candidate whose input redistributions cost least under the cost model (cost.py); ties
    keep more outputs sharded.

    A Partial output's later reduction is not added here: the op that consumes it prices that
    reduction as its own input redistribution, where the cheapest resolution (a reduce_scatter
    into a Shard, or an all_reduce) is known. Forecasting it here too counted it twice and, on the
    hand-sharded Llama of tests/dtensor/test_comm_cost.py, traded one deferred reduce for several
    eager gathers (198 collectives instead of 152 on 2 ranks).
    """
    if isinstance(candidates, Sharding):
        return candidates
    if not candidates:
        raise NotImplementedError(f"the rule for {call.op} found no legal sharding for these placements")
    if call.specs[0].mesh.get_coordinate() is None:  # off the mesh: nothing moves, any choice will do
        return candidates[0]
    specs = call.specs
    return min(candidates, key=lambda s: (redistribute_cost(specs, s.inputs), -_sharded_outputs(s)))


def _sharded_outputs(s: Sharding) -> int:
    return sum(isinstance(p, Shard) for out in s.outputs if out for p in out)


def redistribute_cost(specs: list[DTensorSpec], targets: tuple) -> float:
    """Seconds (cost.py's α–β model) to move every input to its target, even shards assumed:
    every rank must compute the same cost and so pick the same candidate, or their collectives
    would not match."""
    return sum(redistribute_seconds(spec, target) for spec, target in zip(specs, targets))


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
    if mesh.get_coordinate() is None:  # off the mesh: no shard to compute on, default outputs as torch
        return Plan(
            input_placements=(None,) * len(specs),
            output_specs=output_specs,
            redistributes=False,
            random=False,
            returns=_returns(op, call),
            local_impl=_off_mesh_outputs,
            plain=False,
        )
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


def _off_mesh_outputs(local_args: list, local_kwargs: dict, input_specs: tuple, output_specs: tuple) -> Any:
    """What an op gives on a rank outside its mesh: empty shards, and zero for 0-d outputs (as torch)."""
    outs = [
        None
        if spec is None
        else torch.zeros((), dtype=spec.dtype)
        if spec.ndim == 0
        else torch.empty(0, dtype=spec.dtype, device=spec.mesh.device_type)
        for spec in output_specs
    ]
    return outs[0] if len(outs) == 1 else tuple(outs)


def _resolve_local_args(local_args: tuple | None, output_specs: tuple) -> tuple | None:
    """Sharding.local_args with LOCAL_SHAPE / LOCAL_STRIDE made this rank's shape / strides of output 0."""
    if local_args is None:
        return None
    if not any(a is LOCAL_SHAPE or a is LOCAL_STRIDE for a in local_args):
        return tuple(local_args)
    local_shape = list(output_specs[0].local_shape_and_offset()[0])
    local_stride = list(dense_stride_like(output_specs[0].stride, local_shape))
    return tuple(local_shape if a is LOCAL_SHAPE else local_stride if a is LOCAL_STRIDE else a for a in local_args)


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
        if isinstance(a, ScalarTensor):
            return torch.zeros((), dtype=a.dtype, device="meta")
        if isinstance(a, tuple) and any(isinstance(x, (DTensorSpec, ScalarTensor)) for x in a):
            return [to_meta(x) for x in a]
        return a

    meta_args = [to_meta(a) for a in call.args]
    meta_kwargs = {k: to_meta(v) for k, v in call.kwargs.items()}
    if meta_kwargs.get("device") is not None:  # `_to_copy(..., device=cpu)` would copy out of meta
        meta_kwargs["device"] = "meta"
    out = call.op(*meta_args, **meta_kwargs)
    leaves = out if isinstance(out, (tuple, list)) else [out]
    return [TensorMeta(o.shape, tuple(o.stride()), o.dtype) if isinstance(o, torch.Tensor) else None for o in leaves]


def _check_same_mesh(op: OpOverload, call: OpCall) -> list[list[int]] | None:
    """None when every DTensor input shares one mesh. A foreach op may pair up list items on several
    meshes: its list indices grouped by mesh (foreach.mesh_groups). Any other op raises."""
    specs = call.specs
    if not specs:
        raise AssertionError(f"{op} reached DTensor dispatch without DTensor inputs")
    mesh = specs[0].mesh
    for s in specs[1:]:
        if s.mesh != mesh:
            if op in foreach_ops.FOREACH_OPS:
                return foreach_ops.mesh_groups(call)
            raise ValueError(
                f"{op}: DTensor inputs live on different meshes ({mesh} and {s.mesh}); "
                f"redistribute them onto one mesh first"
            )
    return None


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
    previous = OPTIONS.plain_as_replicate
    OPTIONS.plain_as_replicate = previous | ops
    try:
        yield
    finally:
        OPTIONS.plain_as_replicate = previous


@contextmanager
def implicit_replication() -> Iterator[None]:
    """Within the context, every plain tensor mixed with DTensors counts as Replicate (torch's
    `torch.distributed.tensor.experimental.implicit_replication`)."""
    previous = OPTIONS.implicit_replication
    OPTIONS.implicit_replication = True
    try:
        yield
    finally:
        OPTIONS.implicit_replication = previous


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
