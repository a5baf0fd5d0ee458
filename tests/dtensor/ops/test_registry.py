"""OpCall.bound: one binding of an op call's args to its schema, shared by every rule family."""

from __future__ import annotations

import pytest
import torch

from parallelisms.dtensor import Partial, Replicate, Shard
from parallelisms.dtensor.ops import OpCall
from parallelisms.dtensor.ops.registry import Role, positional_index
from parallelisms.dtensor.transitions import UNREACHABLE, transition_kind
from tests.dtensor.harness import make_spec

aten = torch.ops.aten
S0, R = Shard(0), Replicate()


def test_bound_args_fill_schema_defaults_by_name() -> None:
    x = make_spec((4, 6), S0)
    amax = OpCall(aten.amax.default, (x,), {}).bound
    assert amax["dim"] == () and amax["keepdim"] is False  # list defaults come as tuples, like the args
    slice_ = OpCall(aten.slice.Tensor, (x, 1, 2), {}).bound
    assert (slice_["dim"], slice_["start"], slice_["end"], slice_["step"]) == (1, 2, None, 1)
    to_copy = OpCall(aten._to_copy.default, (x,), {"dtype": torch.float16}).bound
    assert to_copy["dtype"] == torch.float16 and to_copy["device"] is None
    with pytest.raises(KeyError, match="no argument 'nope'"):
        amax["nope"]
    assert amax.get("nope") is None


def test_bound_slots_index_every_dtensor_input_in_flat_order() -> None:
    a, b, c, out = (make_spec((2, 3), p) for p in (S0, R, Partial(), S0))
    call = OpCall(aten.cat.out, ((a, b, c), 0), {"out": out})
    slots = [s for s in call.bound.slots if s.spec_index is not None]
    assert [s.value for s in slots] == call.specs
    assert [(s.argument.name, s.item, s.spec_index) for s in slots] == [
        ("tensors", 0, 0), ("tensors", 1, 1), ("tensors", 2, 2), ("out", None, 3),
    ]  # fmt: skip
    assert call.bound.named_specs()[-1] == ("out", out)
    assert call.bound is call.bound  # bound once, on first use


def test_bound_args_give_each_written_dtensor_its_role() -> None:
    a, b, out = (make_spec((2, 3), p) for p in (S0, R, S0))
    inplace = OpCall(aten.add_.Tensor, (a, b), {}).bound
    assert [(s.role, s.argument.name) for s in inplace.slots] == [(Role.KEEP, "self"), (Role.IN, "other")]
    assert inplace.written() == [(0, a, "self", Role.KEEP)]
    into = OpCall(aten.add.out, (a, b), {"out": out}).bound
    assert into.written() == [(2, out, "out", Role.OUT)]
    fused = OpCall(aten._foreach_add_.List, ((a, out), (b, b)), {}).bound
    assert [(w.spec_index, w.role) for w in fused.written()] == [(0, Role.KEEP), (1, Role.KEEP)]
    assert OpCall(aten.mm.default, (a, b), {}).bound.written() == []
    assert (
        positional_index(aten.add.Tensor, "other") == 1 and positional_index(aten.normal_.default, "generator") is None
    )
    assert positional_index(aten.add.out, "out") is None and positional_index(aten.add.out, "nope") is None


def test_transition_table_names_every_step_once() -> None:
    assert transition_kind(S0, R) == "all_gather" and transition_kind(Partial(), R) == "all_reduce"
    assert transition_kind(S0, Shard(1)) == "all_to_all" and transition_kind(Partial(), S0) == "reduce_scatter"
    assert transition_kind(R, S0) == "local chunk" and transition_kind(R, Partial()) == "local partition"
    assert transition_kind(S0, Partial()) == UNREACHABLE == transition_kind(Partial("sum"), Partial("max"))
