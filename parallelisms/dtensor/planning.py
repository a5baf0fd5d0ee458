"""Planning: how an op call on DTensors runs, decided once per cache key (op, input specs, static
args) and kept in a PlanCache.

After the split of torch's OpDispatcher (dispatch.py: unwrap, run, wrap) and ShardingPropagator
(here: rule -> Sharding -> Plan), without its special cases. `build_plan` asks the op's rule for
its Shardings (ops/), keeps the cheapest under the cost model (`choose`), runs the op once on meta
tensors of the global shapes for the output metadata (`_output_metas`) and checks that in-place
ops keep their placements. An op without a rule runs its decomposition (ops/decompositions.py) or,
inside replicate_fallback(), on inputs gathered to Replicate. Nothing here touches a process group
or a local tensor: planning is pure spec math, identical on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import OpOverload

from .errors import ShardingError
from .ops import RULES, OpCall, Sharding, rule_file_for
from .ops import foreach as foreach_ops
from .ops import random as random_ops
from .ops.decompositions import Decomposition, find_decomposition
from .ops.registry import (
    LOCAL_SHAPE,
    LOCAL_STRIDE,
    STRIDED_RULES,
    WORLD_LOCAL_IMPLS,
    LocalComm,
    LocalImpl,
    Role,
    ScalarTensor,
)
from .placements import Placement, Replicate, Shard, _StridedShard, is_strided
from .spec import DTensorSpec, TensorMeta, dense_stride_like
from .transitions import candidate_rank

logger = logging.getLogger(__name__)
aten = torch.ops.aten


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
    fast: Callable[..., Any] | None = None  # a plain plan's local call, the op's cheapest binding (fast_call.py)
    steady: bool = False  # `fast` on the args as they are, one tensor output: dispatch's shortest path
    note: str = ""  # how a plan without a rule runs, for the MESHTRAIN_DEBUG log


class PlanCache:
    """The plans decided so far, by dispatch's cache key, and the ops replicate_fallback() has
    warned about (each once). The dispatcher reads `plans` directly: one dict lookup per op."""

    __slots__ = ("plans", "warned")

    def __init__(self) -> None:
        self.plans: dict[tuple, Plan] = {}
        self.warned: set[OpOverload] = set()

    def store(self, key: tuple, plan: Plan) -> None:
        """Keep `plan` for `key`; a key with an unhashable static arg is decided again each call."""
        try:
            self.plans[key] = plan
        except TypeError:
            pass

    def __len__(self) -> int:
        return len(self.plans)

    def __iter__(self) -> Iterator[tuple]:
        return iter(self.plans)

    def __delitem__(self, key: tuple) -> None:
        del self.plans[key]


def build_plan(op: OpOverload, key_args: tuple, key_kwargs: dict, cache: PlanCache, *, fallback: bool = False) -> Plan:
    """Decide how `op` runs on inputs with these specs and static args (dispatch's cache key).

    The op's rule offers Shardings and `choose` keeps the cheapest; an op without a rule runs its
    decomposition, or (with `fallback`, inside replicate_fallback()) on inputs gathered to
    Replicate, warning once per op through `cache`; otherwise it raises, naming its rule file.
    """
    call = OpCall(op, key_args, key_kwargs)
    specs = call.specs
    groups = _check_same_mesh(op, call)
    if groups is not None:  # a foreach op over several meshes: once per mesh (each then plans its own placements)
        run = functools.partial(foreach_ops.run_per_mesh, op, groups)
        return _decomposition_plan(call, run, f"lists on {len(groups)} meshes: one call per mesh")
    if op not in STRIDED_RULES and any(is_strided(s.placements) for s in specs):
        return _strided_plan(call, cache, fallback)
    rule = RULES.get(op)
    if rule is None:
        decomposition = find_decomposition(op)
        if decomposition is not None:
            return _decomposition_plan(call, decomposition, "no sharding rule: running its decomposition")
        if fallback:
            return _fallback_plan(op, call, cache)
        raise NotImplementedError(  # torch's sentence: ported code and tests match on it
            f"Operator {op} does not have a sharding strategy registered: no rule for placements "
            f"{tuple(tuple(str(p) for p in s.placements) for s in specs)}; rules for this family live in "
            f"{rule_file_for(op)} (or wrap the call in parallelisms.dtensor.dispatch.replicate_fallback())"
        )
    choice = choose(call, _run_rule(rule, call))
    return _finish_plan(call, choice)


def _run_rule(rule: Any, call: OpCall) -> Any:
    """The rule's shardings; its refusal worded as torch's DTensor words one ("Sharding propagation
    failed"), which ported code and tests match on."""
    try:
        return rule(call)
    except ShardingError as e:
        raise type(e)(f"Sharding propagation failed for {call.op}: {e}") from None


# Ops that put each output element at the index of the input elements it reads (or reduce all of
# them): shard order cannot change their result, so `_StridedShard` inputs run as they are.
_ORDER_FREE: frozenset[OpOverload] = frozenset(
    {
        aten.clone.default,
        aten.detach.default,
        aten.alias.default,
        aten.copy_.default,
        aten._to_copy.default,
        aten.zeros_like.default,
        aten.ones_like.default,
        aten.empty_like.default,
        aten.full_like.default,
        aten.fill_.Scalar,
        aten.zero_.default,
        aten.uniform_.default,
        aten.normal_.default,
        aten.sum.default,
        aten.linalg_vector_norm.default,
        aten.max.default,
        aten.min.default,
    }
)


def _order_free(op: OpOverload, call: OpCall) -> bool:
    if op in _ORDER_FREE or torch.Tag.pointwise in op.tags or op in foreach_ops.FOREACH_OPS:
        return op is not aten.linalg_vector_norm.default or call.bound.get("dim") in (None, [], ())
    return False


def _strided_plan(call: OpCall, cache: PlanCache, fallback: bool) -> Plan:
    """A plan for inputs with `_StridedShard` placements, for ops whose rules do not read them
    (all but STRIDED_RULES: views and matmul).

    An order-free op whose tensors at each position hold the same elements (one placement for
    every same-index input, see `_aligned`) plans as if the strided dims were plain `Shard`s, and
    its outputs take those inputs' placements back: the shards hold the same elements either way.
    Every other op plans on the inputs with their strided dims gathered (Replicate), which
    redistribution then does first, so rules only ever see mesh-order placements.
    """
    op, specs = call.op, call.specs
    aligned = _aligned(call) if _order_free(op, call) else None
    if aligned is not None:
        as_shard = _map_specs(call, lambda s: s.with_placements(_unstride(s.placements, Shard)))
        plan = build_plan(op, as_shard.args, as_shard.kwargs, cache, fallback=fallback)
        moves = any(t is not None and t != _unstride(s.placements, Shard) for s, t in zip(specs, plan.input_placements))
        if not moves and plan.decomposition is None and len(plan.output_specs) <= len(aligned):
            outputs = tuple(
                o if o is None or o.ndim == 0 else o.with_placements(ref) for o, ref in zip(plan.output_specs, aligned)
            )
            return dataclasses.replace(plan, input_placements=(None,) * len(specs), output_specs=outputs)
    _check_strided_mutation(call)
    gathered = _map_specs(call, lambda s: s.with_placements(_unstride(s.placements, None)))
    plan = build_plan(op, gathered.args, gathered.kwargs, cache, fallback=fallback)
    if plan.decomposition is not None:
        return plan  # its sub-ops see the strided inputs and plan themselves
    targets = tuple(
        (_unstride(s.placements, None) if t is None else t) if is_strided(s.placements) else t
        for s, t in zip(specs, plan.input_placements)
    )
    return dataclasses.replace(plan, input_placements=targets, redistributes=True)


def _check_strided_mutation(call: OpCall) -> None:
    """An op that must gather a strided input cannot write into it (lists of foreach ops included)."""
    for w in call.bound.written():
        if is_strided(w.spec.placements):
            raise NotImplementedError(
                f"{call.op} writes into {w.name} placed {tuple(map(str, w.spec.placements))} (FSDP "
                f"over TP shard order) but must gather it to run; run it out of place (x = op(x, ...)), or on "
                f"x.full_tensor()"
            )


def _aligned(call: OpCall) -> list[tuple[Placement, ...]] | None:
    """Per output position, the one placement its inputs share (0-d inputs aside), or None when
    inputs at a position differ (a strided and a plain shard hold different elements). Foreach ops
    pair list items by index; other ops have one position."""
    lists = [a for a in call.args if isinstance(a, tuple) and a and isinstance(a[0], DTensorSpec)]
    if lists:
        positions = [[lst[i] for lst in lists if i < len(lst)] for i in range(len(lists[0]))]
        singles = [a for a in call.args if isinstance(a, DTensorSpec)]
    else:
        positions, singles = [[a for a in call.specs]], []
    out = []
    for items in positions:
        placements = {s.placements for s in [*items, *singles] if s.ndim > 0}
        if len(placements) > 1:
            return None
        out.append(placements.pop() if placements else items[0].placements)
    return out


def _unstride(placements: tuple[Placement, ...], as_type: type | None) -> tuple[Placement, ...]:
    """`_StridedShard(d)` -> `Shard(d)` (as_type Shard) or Replicate() (as_type None)."""
    return tuple(
        (Shard(p.dim) if as_type is Shard else Replicate()) if isinstance(p, _StridedShard) else p for p in placements
    )


def _map_specs(call: OpCall, fn: Any) -> OpCall:
    def walk(a: Any) -> Any:
        if isinstance(a, DTensorSpec):
            return fn(a)
        if isinstance(a, tuple):
            return tuple(walk(x) for x in a)
        return a

    return OpCall(call.op, walk(call.args), {k: walk(v) for k, v in call.kwargs.items()})


def _decomposition_plan(call: OpCall, decomposition: Decomposition, how: str) -> Plan:
    """A plan that hands the op's DTensor args to `decomposition` (ops/decompositions.py)."""
    inputs = (None,) * len(call.specs)
    return Plan(
        inputs, (), redistributes=False, random=False, returns="new", plain=False, decomposition=decomposition, note=how
    )


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
    return min(candidates, key=lambda s: candidate_rank(specs, s.inputs, s.outputs))


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
    _check_mutation(op, call, choice)
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
            local_impl=_off_mesh_impl(op, choice, output_specs),
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


def _off_mesh_outputs(
    local_args: list, local_kwargs: dict, input_specs: tuple, output_specs: tuple, comm: LocalComm
) -> Any:
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


def _off_mesh_impl(op: OpOverload, choice: Sharding, output_specs: tuple) -> LocalImpl:
    """What runs on a rank outside the mesh: a world collective the op needs (torch.equal's), else
    nothing but default outputs."""
    if choice.local_impl in WORLD_LOCAL_IMPLS:
        return choice.local_impl
    return _off_mesh_outputs if output_specs else functools.partial(_off_mesh_scalar, op)


def _off_mesh_scalar(op: OpOverload, *_: Any) -> Any:
    """A Python-value result (torch.equal, item()) on a rank outside the mesh: True for a bool, as
    torch's logical-and of the participants' answers reads there, else 0."""
    return True if str(op._schema.returns[0].type) == "bool" else 0


def _resolve_local_args(local_args: tuple | None, output_specs: tuple) -> tuple | None:
    """Sharding.local_args with LOCAL_SHAPE / LOCAL_STRIDE made this rank's shape / strides of output 0."""
    if local_args is None:
        return None
    if not any(a is LOCAL_SHAPE or a is LOCAL_STRIDE for a in local_args):
        return tuple(local_args)
    local_shape = list(output_specs[0].local_shape_and_offset()[0])
    local_stride = list(dense_stride_like(output_specs[0].stride, local_shape))
    return tuple(local_shape if a is LOCAL_SHAPE else local_stride if a is LOCAL_STRIDE else a for a in local_args)


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


def _check_mutation(op: OpOverload, call: OpCall, choice: Sharding) -> None:
    """In-place and out= ops write into an existing DTensor: its placements may not change."""
    for w in call.bound.written():
        target = choice.inputs[w.spec_index]
        if target is not None and target != w.spec.placements:
            name = w.name
            raise RuntimeError(  # torch's first sentence, word for word
                f"{op}: in-place operations that require placement changes are not supported. It writes into "
                f"{name} with placements {tuple(map(str, w.spec.placements))}, but running it needs "
                f"{tuple(map(str, target))}; redistribute {name} out of place first (x = x.redistribute(...))"
            )


def _fallback_plan(op: OpOverload, call: OpCall, cache: PlanCache) -> Plan:
    """Every input gathered to Replicate, every output Replicate (replicate_fallback())."""
    if op not in cache.warned:
        cache.warned.add(op)
        logger.warning("no sharding rule for %s: gathering its inputs to Replicate (replicate_fallback)", op)
    r = (Replicate(),) * call.mesh_ndim
    if op._schema.is_mutable:
        raise NotImplementedError(f"replicate_fallback cannot run in-place op {op}; it needs a sharding rule")
    n_out = len(_output_metas(call, [s.with_placements(r) for s in call.specs]))
    return _finish_plan(call, Sharding(tuple(r for _ in call.specs), tuple(r for _ in range(n_out))))


def _returns(op: OpOverload, call: OpCall) -> str:
    """What the op hands back: fresh outputs, its mutated self (`add_`), or its out= tensor."""
    if not op._schema.is_mutable or not op._schema.returns:
        return "new"
    slots = call.bound.slots
    if any(s.role is Role.OUT and s.spec_index is not None for s in slots):
        return "out"
    first = slots[0] if slots else None
    if first is not None and first.role is Role.KEEP and first.item is None and first.spec_index is not None:
        return "self"
    return "new"
