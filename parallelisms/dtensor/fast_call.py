"""The cheapest Python entry to an aten op, for the local call of the dispatcher's hot path.

Calling an OpOverload (`aten.sum.dim_IntList(t, [0])`) binds its args against the schema in
Python-facing C++ that is 2-4 µs slower than torch's generated bindings (`torch.sum(t, [0])`,
`t.sum([0])`), which parse with the PythonArgParser. On small shards that is a third of an op's
dispatch. A binding of the same name may pick another overload for the same args, though, so
one is used only after it was seen to run exactly `op`: once per cached plan, on meta copies of
the local args (no data is touched, in-place ops mutate nothing real).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

_BINDINGS = (torch._C._VariableFunctions, torch._C.TensorBase)


class _RecordOps(TorchDispatchMode):
    """Runs ops as they are and notes which reached the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[OpOverload] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _meta(a: Any) -> Any:
    if type(a) is torch.Tensor:
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
    if isinstance(a, (list, tuple)) and any(type(x) is torch.Tensor for x in a):
        return type(a)(_meta(x) for x in a)
    if isinstance(a, torch.Tensor):  # a tensor subclass (a fake tensor under tracing): not ours to copy
        raise TypeError
    return a


def fast_call(op: OpOverload, args: list, kwargs: dict) -> Callable[..., Any] | None:
    """A generated torch binding that runs exactly `op` on args of these types, or None."""
    if op.namespace != "aten" or torch._C._len_torch_dispatch_stack():  # under a mode: leave it be
        return None
    name = op._opname
    try:
        meta_args, meta_kwargs = [_meta(a) for a in args], {k: _meta(v) for k, v in kwargs.items()}
    except TypeError:
        return None
    for binding in _BINDINGS:
        fn = getattr(binding, name, None)
        if fn is None:
            continue
        record = _RecordOps()
        try:
            with record:
                fn(*meta_args, **meta_kwargs)
        except Exception:  # no meta kernel, or the binding takes other args: the op it is
            continue
        if record.ops == [op]:
            return fn
    return None
