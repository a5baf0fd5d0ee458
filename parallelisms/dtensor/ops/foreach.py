"""Sharding rules: foreach ops (`_foreach_*`) and fused optimizers (`_fused_adam(w)_`).

A foreach op is its pointwise op applied per list index (`_foreach_add_(xs, ys, alpha=a)` is
`xs[i].add_(ys[i], alpha=a)` for every i), so each index is planned on its own with the pointwise
planner (pointwise.elementwise_candidates) and keeps its cheapest candidate: lists may mix
placements freely. A single tensor shared by every index (`_foreach_mul_(grads, clip_coef)`) must
be Replicate. In-place lists (and every list a fused optimizer writes) keep their placements.

_foreach_norm / _foreach_max / _foreach_powsum reduce each list index like linalg_vector_norm
(reductions.py: a sharded norm becomes P(norm<p>)), so clip_grad_norm_ over sharded grads moves one
scalar per norm instead of the gradients.

Lists may hold DTensors of several meshes (parameters of pipeline stages, or of an FSDP and a TP
mesh): the dispatcher then runs the op once per mesh on the indices of that mesh (`run_per_mesh`),
so each index's result lives on its own index's mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch._ops import OpOverload

from ..placements import Replicate
from ..spec import DTensorSpec
from ..transitions import candidate_rank
from .pointwise import (
    PartialRule,
    broadcast_shape,
    elementwise_candidates,
    identity,
    num_tensor_outputs,
    overwritten,
    partial_rule_for,
    placements_str,
)
from .reductions import Candidate, reduction_candidates, vector_norm_candidates
from .registry import OpCall, Placements, Role, Sharding, register

aten = torch.ops.aten


# --------------------------------------------------------------------------------------------------
# foreach: plan each list index with the pointwise planner
# --------------------------------------------------------------------------------------------------


def base_of(op: OpOverload) -> str:
    """`aten._foreach_add_.List` -> "add"; fused optimizers keep their name."""
    return op._schema.name.split("::")[-1].removeprefix("_foreach_").rstrip("_")


def base_arg_names(base: str, fallback: Sequence[str]) -> list[str]:
    """Positional argument names of the per-index op (foreach names `scalars`, `tensors1`...)."""
    for overload in ("Tensor", "default", "Tensor_Tensor"):
        try:
            schema = torch._C._get_schema(f"aten::{base}", overload)
        except RuntimeError:
            continue
        names = [a.name for a in schema.arguments if not a.kwarg_only]
        return names + list(fallback[len(names) :])
    return list(fallback)


def _partial_rule(base: str) -> PartialRule:
    return identity("self") if base == "clone" else partial_rule_for(base)


def index_candidates(
    call: OpCall, i: int, base: str, names: dict[str, str]
) -> tuple[list[DTensorSpec], list[Candidate]]:
    """The DTensor operands list index `i` reads (its own elements and the shared tensors) and their
    candidates. Roles as in pointwise_rule: "out" lists are only written, "keep" lists are written
    and read (they may not move), "shared" tensors must be Replicate."""
    inputs, in_names, written, roles = [], [], [], []
    static: dict[str, Any] = {}
    for arg, index, value, _, arg_role in call.bound.slots:  # index: the list item; None: shared by every index
        if index is not None and index != i:
            continue
        name = names.get(arg.name, arg.name)
        static.setdefault(name, value)
        if not isinstance(value, DTensorSpec):
            continue
        is_write = arg_role is not Role.IN
        role = "shared" if index is None else "out" if overwritten(arg_role, base) else "keep" if is_write else "in"
        roles.append(role)
        if is_write:
            written.append(value)
        if role != "out":
            inputs.append(value)
            in_names.append(name)
    fixed = written[0].placements if written else None
    if any(w.placements != fixed for w in written):
        raise ValueError(
            f"{call.op} writes list index {i} of several lists with different placements "
            f"{[placements_str(w.placements) for w in written]}; a fused update needs the parameter, its grad and "
            f"its states laid out alike (e.g. grads sharded like their parameters)"
        )
    active = [r for r in roles if r != "out"]
    keep = [j for j, r in enumerate(active) if r == "keep"]
    candidates = elementwise_candidates(
        inputs, in_names, _partial_rule(base), static, mesh_ndim=call.mesh_ndim,
        out_shape=broadcast_shape([*inputs, *written]), fixed=fixed, keep=keep,
    )  # fmt: skip
    replicate = tuple(Replicate() for _ in range(call.mesh_ndim))
    shared = [j for j, r in enumerate(active) if r == "shared"]
    candidates = [c for c in candidates if all(c[1][j] == replicate for j in shared)]
    return inputs, candidates


def cheapest(inputs: Sequence[DTensorSpec], candidates: Sequence[Candidate]) -> Candidate:
    """The cheapest candidate, ranked as the dispatcher ranks a rule's (transitions.candidate_rank)."""
    return min(candidates, key=lambda c: candidate_rank(inputs, c[1], [c[0]]))


def list_length(call: OpCall) -> int:
    return max((s.item + 1 for s in call.bound.slots if s.item is not None), default=0)


def foreach_rule(call: OpCall) -> Sharding:
    """Every index planned alone (see the module docstring); returns one Sharding for the lists."""
    base = base_of(call.op)
    positional = [a.name for a in call.op._schema.arguments if not a.kwarg_only]
    names = dict(zip(positional, base_arg_names(base, positional)))
    chosen: list[Candidate] = []
    for i in range(list_length(call)):
        if base in NORMS:
            chosen.append(cheapest([call.args[0][i]], _norm_candidates(call, base, i)))
            continue
        inputs, candidates = index_candidates(call, i, base, names)
        if not candidates:
            raise RuntimeError(
                f"{call.op}: list index {i} with placements {[placements_str(s.placements) for s in inputs]} cannot "
                f"run without changing a tensor it writes; redistribute that tensor out of place first"
            )
        chosen.append(cheapest(inputs, candidates))
    return _assemble(call, base, chosen)


def _assemble(call: OpCall, base: str, chosen: list[Candidate]) -> Sharding:
    """Per flat DTensor input its required placements; per output tensor its placements."""
    replicate = tuple(Replicate() for _ in range(call.mesh_ndim))
    position = [0] * len(chosen)  # per list index: the next operand position in its candidate
    per_spec: list[Placements | None] = []
    for _, index, value, _, role in call.bound.slots:
        if not isinstance(value, DTensorSpec):
            continue
        if index is None:  # shared by every index, always Replicate
            per_spec.append(replicate)
            position = [j + 1 for j in position]
        elif overwritten(role, base):
            per_spec.append(None)  # overwritten: its placements are the output's
        else:
            per_spec.append(None if role is Role.KEEP else chosen[index][1][position[index]])
            position[index] += 1
    outputs = tuple(c[0] for c in chosen) if num_tensor_outputs(call.op) else ()
    return Sharding(tuple(per_spec), outputs)


# --------------------------------------------------------------------------------------------------
# foreach reductions: _foreach_norm, _foreach_max, _foreach_powsum
# --------------------------------------------------------------------------------------------------

NORMS = ("norm", "max", "powsum")


def _norm_candidates(call: OpCall, base: str, i: int) -> list[Candidate]:
    spec = call.args[0][i]
    every_dim = tuple(range(spec.ndim))
    if base == "max":
        raw = reduction_candidates(spec.shape, spec.placements, spec.mesh.shape, "max", ("max",), every_dim, False)
    elif base == "powsum":  # sum_j |x_j|**p adds up across pieces
        raw = reduction_candidates(spec.shape, spec.placements, spec.mesh.shape, "sum", (), every_dim, False)
    else:
        ord = call.bound["ord"]
        return vector_norm_candidates(spec, ord, None, False)
    return [(out, (inp,)) for inp, out in raw]


# --------------------------------------------------------------------------------------------------
# lists over several meshes: one call per mesh
# --------------------------------------------------------------------------------------------------


def mesh_groups(call: OpCall) -> list[list[int]]:
    """List indices grouped by the mesh of their tensors (in first-seen order), for a foreach call
    whose lists hold DTensors on several meshes (clip_grad_norm_ over parameters of several meshes).

    Each index pairs up its own tensors, which must share a mesh; a tensor shared by every index
    cannot follow them onto several meshes.
    """
    mesh_of: dict[int, Any] = {}
    for arg, index, value, _, _ in call.bound.slots:
        if not isinstance(value, DTensorSpec):
            continue
        if index is None:
            raise ValueError(
                f"{call.op}: its DTensors live on several meshes, so each list index runs on its own mesh, but "
                f"{arg.name} is one DTensor shared by every index; pass a Python number or a plain 0-d tensor"
            )
        if mesh_of.setdefault(index, value.mesh) != value.mesh:
            raise ValueError(
                f"{call.op}: list index {index} pairs DTensors on different meshes ({mesh_of[index]} and "
                f"{value.mesh}); move them onto one mesh first"
            )
    groups: dict[Any, list[int]] = {}
    for index in sorted(mesh_of):
        groups.setdefault(mesh_of[index], []).append(index)
    return list(groups.values())


def run_per_mesh(op: OpOverload, groups: list[list[int]], *args: Any, **kwargs: Any) -> Any:
    """`op` once per group of list indices (each on one mesh); outputs back in list order."""
    schema = op._schema
    length = sum(map(len, groups))
    per_index = {a.name for a in schema.arguments if isinstance(a.type, torch.ListType)}
    names = [a.name for a in schema.arguments]

    def pick(name: str, value: Any, indices: list[int]) -> Any:
        if name in per_index and isinstance(value, (list, tuple)) and len(value) == length:
            return [value[i] for i in indices]
        return value  # a shared arg, or an empty optional list (AdamW's max_exp_avg_sqs without amsgrad)

    results = []
    for indices in groups:
        sub_args = [pick(n, v, indices) for n, v in zip(names, args)]
        out = op(*sub_args, **{k: pick(k, v, indices) for k, v in kwargs.items()})
        results.append((indices, out))
    if not schema.returns:
        return None
    merged: list[list[Any]] = [[None] * length for _ in schema.returns]
    for indices, out in results:
        for column, values in zip(merged, (out,) if len(schema.returns) == 1 else out):
            for i, v in zip(indices, values):
                column[i] = v
    return merged[0] if len(schema.returns) == 1 else tuple(merged)


def discover_foreach_ops() -> list[OpOverload]:
    """Every `_foreach_*` overload (but matmul and out= forms of the norms), and the in-place fused
    Adam/AdamW updates."""
    found = []
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith(("aten::_foreach_", "aten::_fused_adam")):
            continue
        name, _, overload = qualified.removeprefix("aten::").partition(".")
        if name == "_foreach_mm" or (name.removeprefix("_foreach_") in NORMS and overload.endswith("out")):
            continue
        if name.startswith("_fused_") and not name.endswith("_"):
            continue  # functional fused updates return five lists (compile's functionalization only)
        found.append(getattr(getattr(aten, name), overload or "default"))
    return found


FOREACH_OPS = tuple(discover_foreach_ops())
register(*FOREACH_OPS)(foreach_rule)
