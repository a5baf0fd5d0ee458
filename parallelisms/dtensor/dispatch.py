"""`__torch_dispatch__` for DTensor, the hot path: unwrap -> cached plan -> redistribute inputs ->
local op -> wrap.

The steady state of an op is one pass over its args building the cache key and the local args, a
dict lookup, the local op (through its cheapest Python binding, fast_call.py), and wrapping the
outputs. A cache miss asks planning.build_plan (the
rule, the cheapest Sharding, the output metadata) and stores the plan after its first run, whose
local outputs show how their kernel lays them out (`_cache_plan`).

DispatchOptions holds what the context managers below switch on; PLANS is the PlanCache.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import OpOverload

from . import collectives
from .cost import cost_model
from .device_mesh import DeviceMesh
from .dtensor import DTensor
from .fast_call import fast_call
from .ops import random as random_ops
from .ops.registry import ScalarTensor, iter_flat
from .placements import Placement, Replicate
from .planning import Plan, PlanCache, build_plan
from .redistribute import conform_layout, redistribute_local
from .spec import DTensorSpec, TensorMeta
from .transitions import layout_mismatch, plan_transitions

logger = logging.getLogger(__name__)
DEBUG = os.environ.get("MESHTRAIN_DEBUG", "0") not in ("", "0")


@dataclass(frozen=True, slots=True)
class DispatchOptions:
    """What the context managers below switch on for the ops dispatched inside them: context-local
    (a contextvar), so a thread (the async checkpoint writer, a data loader) never sees another's."""

    # plain_tensors_as_replicate(ops); always is_same_size, which reads only shapes (a plain
    # tensor's global shape is its shape: torch.equal(dt, t) asks it first, as torch's DTensor)
    plain_as_replicate: frozenset[OpOverload] = frozenset({torch.ops.aten.is_same_size.default})
    implicit_replication: bool = False  # experimental.implicit_replication(): every plain tensor is R
    replicate_fallback: bool = False  # replicate_fallback(): ops without a rule run on Replicate inputs


PLANS = PlanCache()
# a frozen record, replaced (never mutated) by the context managers below
_OPTIONS: ContextVar[DispatchOptions] = ContextVar("meshtrain_dispatch_options", default=DispatchOptions())  # noqa: B039
_cached = PLANS.plans.get  # bound once: the lookup of every op (PLANS.plans is never replaced)
_wrap_one = DTensor._wrap


def dispatch(op: OpOverload, args: tuple, kwargs: dict | None) -> Any:
    dtensors: list[DTensor] = []
    key_args, local_args, floats = _unwrap_all(op, args, dtensors)
    if kwargs:
        key_kwargs, local_kwargs, kw_floats = _unwrap_kwargs(op, args, kwargs, dtensors)
        floats = floats or kw_floats
    else:
        key_kwargs, local_kwargs = (), {}
    # Equal meshes of different roots (a second init_device_mesh) must not share plans: the outputs
    # would carry the first root's mesh (its groups), and fully_shard checks roots by identity. Plans
    # made under another cost model (use_cost_model) may choose differently: its identity is keyed too.
    root = id(dtensors[0]._spec.mesh._root) if dtensors else None
    key: tuple = (op, key_args, key_kwargs, root, id(cost_model()))
    if floats:
        key = _value_free_key(key)
    try:
        plan = _cached(key)
    except TypeError:  # an unhashable static arg: decide without caching
        plan = None
    if plan is not None and plan.steady:  # the steady state: the local op, one output to wrap
        return _wrap_one(plan.fast(*local_args, **local_kwargs), plan.output_specs[0])  # type: ignore[arg-type, misc]
    fresh = plan is None
    if plan is None:
        plan = _plan_miss(op, key_args, key_kwargs)  # planned on the values, cached by `key`
    if plan.redistributes:
        local_args, local_kwargs = _redistribute_inputs(op, args, kwargs or {}, dtensors, plan)
    if plan.plain:
        fast = plan.fast
        out = (fast or op)(*local_args, **local_kwargs)
    elif plan.decomposition is not None:  # its sub-ops dispatch (and wrap their outputs) themselves
        if fresh:
            _cache_plan(key, plan, None, local_args, local_kwargs)
        return plan.decomposition(*args, **(kwargs or {}))
    else:
        out = _run_special(op, plan, local_args, local_kwargs)
    if fresh:  # cache after the first run, whose local outputs show their kernel's layout
        plan, out = _cache_plan(key, plan, out, local_args, local_kwargs)
    returns = plan.returns
    if returns == "new":
        if type(out) is torch.Tensor:  # a tensor output always has a spec (None marks non-tensor outputs)
            return _wrap_one(out, plan.output_specs[0])  # type: ignore[arg-type]
        return _wrap(out, plan.output_specs)
    return args[0] if returns == "self" else kwargs["out"]  # type: ignore[index]


def _plan_miss(op: OpOverload, key_args: tuple, key_kwargs: tuple) -> Plan:
    plan = build_plan(op, key_args, dict(key_kwargs), PLANS, fallback=_OPTIONS.get().replicate_fallback)
    if DEBUG and plan.note:
        logger.info("%s: %s", op, plan.note)
    return plan


def _cache_plan(key: tuple, plan: Plan, out: Any, local_args: list, local_kwargs: dict) -> tuple[Plan, Any]:
    """Store `plan` after its first run, and make the local outputs agree with the global strides.

    Global strides come from the op on meta tensors, but a kernel may lay out its real output
    differently (CPU flash attention, some backward kernels). A DTensor whose reported strides
    disagree with its shard's sends reshape/view decompositions down the wrong path (a global
    `view` of a shard that needs a copy). The global strides must be the same on every rank (they
    decide which decomposition runs, and so which collectives), so the shard is the one to move:
    outputs laid out otherwise are copied into the global dim order, on this and later calls.
    A plan that stays plain runs its later calls through the op's cheapest binding (fast_call.py).
    """
    if out is not None and plan.returns == "new" and not _aliases(key[0]):
        leaves = out if isinstance(out, (tuple, list)) else (out,)
        relayout = tuple(
            i
            for i, (spec, leaf) in enumerate(zip(plan.output_specs, leaves))
            if spec is not None and isinstance(leaf, torch.Tensor) and layout_mismatch(leaf, spec)
        )
        if relayout:
            plan = dataclasses.replace(plan, relayout=relayout, plain=False)
            out = _relayout(out, plan)
    if plan.plain and out is not None:
        fast = fast_call(key[0], local_args, local_kwargs)
        if fast is not None:
            steady = not plan.redistributes and plan.returns == "new" and type(out) is torch.Tensor
            plan = dataclasses.replace(plan, fast=fast, steady=steady)
    PLANS.store(key, plan)
    return plan, out


def _aliases(op: OpOverload) -> bool:
    """Outputs that are views of inputs keep their layout (copying them would break aliasing)."""
    return any(r.alias_info is not None for r in op._schema.returns)


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
        return plan.local_impl(local_args, local_kwargs, plan.input_specs, plan.output_specs, collectives)
    return local_op(*local_args, **local_kwargs)


def _local_call(op: OpOverload, plan: Plan, local_args: list) -> tuple[OpOverload, list]:
    """The op and positional args to run on this rank's local tensors."""
    if plan.local_args is not None:
        args = list(plan.local_args)
        for i in plan.local_tensor_positions:
            args[i] = local_args[i]
        local_args = args
    return plan.local_op or op, local_args


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
        if (
            a.numel() == 1
            or (options := _OPTIONS.get()).implicit_replication
            or op in options.plain_as_replicate
            or torch._C._get_dtensor_allow_implicit_replication()
        ):
            # single-element tensors count as replicated, as in torch (a tensor lr in fused AdamW);
            # others only under implicit_replication(), for the ops of plain_tensors_as_replicate, or
            # while torch's own implicit-replication flag is set: functorch's batch rules set it
            # around the helper tensors they make (vmap of embedding offsets the ids by an arange)
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


# Plans keyed by scalar *values* are a leak when the values change every call: AdamW passes new bias
# corrections each step (`_foreach_div_(exp_avg_sq, [c1, c2, ...])`, or `addcdiv_(..., value=-lr_t)`
# without foreach), which planned every step again and grew the cache by plans per step. Where a
# rule cannot depend on the values, plans are cached by their presence instead:
#   "list"    foreach ScalarList overloads: by how many scalars there are
#   "scalar"  pointwise ops: Python floats, unless an input is Partial (whose rules read values:
#             `P + 0` stays Partial, `P + 1` does not)
_SCALAR_KIND: dict[OpOverload, str] = {}
_FLOAT = ("float",)  # what a float arg becomes in a value-free key


def _scalar_kind(op: OpOverload) -> str:
    if op.__name__.startswith("_foreach_") and op._overloadname == "ScalarList":
        return "list"
    if torch.Tag.pointwise in op.tags and torch.Tag.nondeterministic_seeded not in op.tags:
        return "scalar"
    return ""


def _value_free_key(key: tuple) -> tuple:
    """`key` (of an op call with float args) with the floats replaced where its rule ignores them."""
    op, key_args, key_kwargs, *scope = key
    kind = _SCALAR_KIND.get(op)
    if kind is None:
        kind = _SCALAR_KIND[op] = _scalar_kind(op)
    if not kind:
        return key
    for a in key_args:  # plain loops and list comprehensions: the optimizer step calls this per op
        if _has_partial(a):
            return key
    if kind == "list":
        args = tuple([("scalars", len(a)) if type(a) is tuple and a and type(a[0]) is float else a for a in key_args])
        return (op, args, key_kwargs, *scope)
    args = tuple([_FLOAT if type(a) is float else a for a in key_args])
    kwargs = tuple([(n, _FLOAT if type(v) is float else v) for n, v in key_kwargs]) if key_kwargs else key_kwargs
    return (op, args, kwargs, *scope)


def _has_partial(a: Any) -> bool:
    """A Partial spec, or a list holding one (rules read scalar values for Partial inputs)."""
    t = type(a)
    if t is DTensorSpec:
        return a._partial
    if t is tuple:
        for x in a:
            if type(x) is DTensorSpec and x._partial:
                return True
    return False


_STATIC_TYPES = frozenset(
    {int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout}
)


def _unwrap_all(op: OpOverload, args: tuple, dtensors: list[DTensor]) -> tuple[tuple, list, bool]:
    """The cache key's args, the local args, and whether a float (or a list of them) is among them."""
    keys: list[Any] = []
    locals_: list[Any] = []
    floats = False
    for a in args:
        t = type(a)
        if t is DTensor:  # the common cases first, without the generic checks
            dtensors.append(a)
            keys.append(a._spec)
            locals_.append(a._local_tensor)
        elif t in _STATIC_TYPES:
            floats = floats or t is float
            keys.append(a)
            locals_.append(a)
        elif t is list and (not a or type(a[0]) is int):  # sizes: view(8, 4, 4), sum([0]) (typed lists)
            keys.append(tuple(a))
            locals_.append(a)
        else:
            k, local = _unwrap_one(op, a, dtensors, (args, {}))
            floats = floats or (type(k) is tuple and bool(k) and type(k[0]) is float)
            keys.append(k)
            locals_.append(local)
    return tuple(keys), locals_, floats


def _unwrap_kwargs(op: OpOverload, args: tuple, kwargs: dict, dtensors: list[DTensor]) -> tuple[tuple, dict, bool]:
    keys, locals_ = [], {}
    floats = False
    for name, a in kwargs.items():
        k, local = _unwrap_one(op, a, dtensors, (args, kwargs))
        floats = floats or type(k) is float
        keys.append((name, k))
        locals_[name] = local
    return tuple(keys), locals_, floats


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
    """MESHTRAIN_DEBUG: `aten.mm arg0 (S(0),R)->(R,R): all_gather on tp` (step names: transitions.TRANSITIONS)."""
    names = spec.mesh.mesh_dim_names or tuple(str(i) for i in range(spec.mesh.ndim))
    comms = [f"{t.kind} on {names[t.mesh_dim]}" for t in plan_transitions(spec, target)]
    src = ",".join(map(str, spec.placements))
    dst = ",".join(map(str, target))
    logger.info("%s arg%d (%s)->(%s): %s", op, index, src, dst, "; ".join(comms) or "local")


# --------------------------------------------------------------------------------------------------
# the context managers of DispatchOptions
# --------------------------------------------------------------------------------------------------


def options() -> DispatchOptions:
    """The dispatch options in force in this context."""
    return _OPTIONS.get()


@contextmanager
def _option(name: str, value: Any) -> Iterator[None]:
    """The option `name` = value within the context, in this thread / task only (nests: the previous
    value comes back)."""
    token = _OPTIONS.set(dataclasses.replace(_OPTIONS.get(), **{name: value}))
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def plain_tensors_as_replicate(ops: frozenset[OpOverload]) -> AbstractContextManager[None]:
    """Within the context, plain tensor args of `ops` count as Replicate DTensors on the mesh of
    the op's first DTensor arg, instead of raising (torch's loss_parallel takes plain targets so)."""
    return _option("plain_as_replicate", _OPTIONS.get().plain_as_replicate | ops)


def implicit_replication() -> AbstractContextManager[None]:
    """Within the context, every plain tensor mixed with DTensors counts as Replicate (torch's
    experimental `implicit_replication`, of the same name and behaviour)."""
    return _option("implicit_replication", True)


def replicate_fallback() -> AbstractContextManager[None]:
    """Ops without a rule gather their inputs to Replicate and return Replicate outputs.

    Correct but communication-heavy; a warning names each op once so a rule can be written.
    """
    return _option("replicate_fallback", True)


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
