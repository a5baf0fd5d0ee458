"""fast_call.py: the binding the dispatcher's steady state calls instead of an OpOverload must run
exactly that op (checked here on real tensors, where fast_call checked on meta copies) and give
bitwise the op's results; where no binding does, there is none."""

from __future__ import annotations

import pytest
import torch

from parallelisms.dtensor import Partial, Replicate, Shard, distribute_tensor
from parallelisms.dtensor import dispatch as dispatch_module
from parallelisms.dtensor.fast_call import _RecordOps, fast_call
from tests.dtensor.harness import as_partial, get_mesh
from tests.world import run_world

aten = torch.ops.aten


def _t(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


CALLS = {  # name -> (op, args, kwargs); args are cloned per use
    "add": (aten.add.Tensor, (_t(4, 3), _t(4, 3, seed=1)), {}),
    "add alpha": (aten.add.Tensor, (_t(4, 3), _t(4, 3, seed=1)), {"alpha": 2}),
    "mul float": (aten.mul.Tensor, (_t(4, 3), 2.5), {}),
    "sum dims": (aten.sum.dim_IntList, (_t(4, 3), [0]), {}),
    "sum keepdim": (aten.sum.dim_IntList, (_t(4, 3), [1], True), {}),
    "sum all": (aten.sum.default, (_t(4, 3),), {}),
    "mean dtype": (aten.mean.dim, (_t(4, 3), [0]), {"dtype": torch.float64}),
    "mm": (aten.mm.default, (_t(4, 3), _t(3, 2, seed=1)), {}),
    "addmm": (aten.addmm.default, (_t(2), _t(4, 3), _t(3, 2, seed=1)), {"beta": 0.5, "alpha": 2.0}),
    "relu": (aten.relu.default, (_t(4, 3),), {}),
    "in-place add_": (aten.add_.Tensor, (_t(4, 3), _t(4, 3, seed=1)), {}),
    "div rounding": (aten.div.Tensor_mode, (_t(4, 3), _t(4, 3, seed=1)), {"rounding_mode": "floor"}),
    "clamp": (aten.clamp.default, (_t(4, 3), -0.5, 0.5), {}),
    "to_copy dtype": (aten._to_copy.default, (_t(4, 3),), {"dtype": torch.bfloat16}),
    "t (a view)": (aten.t.default, (_t(4, 3),), {}),
    "cat": (aten.cat.default, ([_t(2, 3), _t(1, 3, seed=1)], 0), {}),
    "where": (aten.where.self, (_t(4, 3) > 0, _t(4, 3), _t(4, 3, seed=1)), {}),
    "pow scalar": (aten.pow.Tensor_Scalar, (_t(4, 3), 3), {}),
    "softmax": (aten._softmax.default, (_t(4, 3), 1, False), {}),
    "embedding": (aten.embedding.default, (_t(5, 3), torch.tensor([0, 4, 2])), {}),
    # a binding of the same name that runs another overload: torch.add(t, 2) runs add.Tensor
    "add.Scalar": (aten.add.Scalar, (_t(4, 3), 2), {}),
}
NONE = {  # the OpOverload stays the call
    "add.Scalar": "torch.add(t, 2) runs aten.add.Tensor, not aten.add.Scalar",
    "to_copy dtype": "torch has no generated binding named _to_copy (Tensor.to reaches it)",
}


def _clone(a):
    if isinstance(a, torch.Tensor):
        return a.clone()
    if isinstance(a, list):
        return [_clone(x) for x in a]
    return a


@pytest.mark.parametrize("name", CALLS)
def test_the_binding_runs_exactly_the_op_with_its_results(name: str) -> None:
    op, args, kwargs = CALLS[name]
    fn = fast_call(op, list(args), dict(kwargs))
    if name in NONE:
        assert fn is None, NONE[name]
        return
    assert fn is not None, f"{op} has a generated binding of its own name"
    mine, theirs = [_clone(a) for a in args], [_clone(a) for a in args]
    record = _RecordOps()
    with record:
        got = fn(*mine, **kwargs)
    assert record.ops == [op]
    want = op(*theirs, **kwargs)
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
    assert torch.equal(got, want)
    assert all(torch.equal(m, t) for m, t in zip(mine, theirs) if isinstance(m, torch.Tensor))  # in place alike


def test_no_binding_under_a_dispatch_mode() -> None:
    op, args, kwargs = CALLS["add"]
    with _RecordOps():
        assert fast_call(op, list(args), kwargs) is None


def _repeated_ops() -> list[str]:
    """Each op twice on DTensors: the first call plans (through the OpOverload), the second is
    steady (through the binding); both must give the single-device result, and a steady plan must
    exist."""
    mesh = get_mesh((2,))
    x_full, w_full, p_full = _t(6, 4), _t(4, 5, seed=1), _t(6, 4, seed=2)
    x = distribute_tensor(x_full, mesh, [Shard(0)])
    w = distribute_tensor(w_full, mesh, [Replicate()])
    p = as_partial(distribute_tensor(p_full, mesh, [Replicate()]), [Partial()])
    failures = []
    cases = {  # name -> (DTensor call, single-device call)
        "mm": (lambda: torch.mm(x, w), lambda: torch.mm(x_full, w_full)),
        "sum": (lambda: x.sum(0), lambda: x_full.sum(0)),
        "relu": (lambda: torch.relu(x), lambda: torch.relu(x_full)),
        "mul P": (lambda: p * 3.0, lambda: p_full * 3.0),
        "softmax": (lambda: torch.softmax(x, -1), lambda: torch.softmax(x_full, -1)),
    }
    for name, (fn, reference) in cases.items():
        dispatch_module.PLANS.plans.clear()
        first, second = fn(), fn()
        if not any(plan.steady for plan in dispatch_module.PLANS.plans.values()):
            failures.append(f"{name}: no steady plan")
        want = reference()
        for which, got in (("first", first), ("steady", second)):
            if not torch.allclose(got.full_tensor(), want, atol=1e-6, rtol=1e-5):
                failures.append(f"{name}: the {which} call differs from one device")
    return failures


def test_steady_calls_give_the_single_device_result() -> None:
    assert run_world(_repeated_ops, 2) == [[], []]
