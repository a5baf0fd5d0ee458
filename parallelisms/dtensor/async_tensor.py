"""PendingTensor: the result of a collective still in flight, waited for on first real use.

`redistribute(..., async_op=True)` and the TP styles issue their collective and return at once;
the shard they hand back is a PendingTensor over the output buffer. Compute that does not touch
it overlaps the communication (gloo runs collectives on its own threads, NCCL on its stream).
The first op that reads the values waits (and finishes the reduction, e.g. the division of an
"avg"); view ops stay lazy, sharing one `_Pending` with their base, as torch's
AsyncCollectiveTensor does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map_only


class _Pending:
    """One collective in flight: its work handle and what to do to its output once it lands."""

    __slots__ = ("buffer", "finish", "work")

    def __init__(self, work: Any, buffer: torch.Tensor, finish: Callable[[torch.Tensor], Any] | None) -> None:
        self.work, self.buffer, self.finish = work, buffer, finish

    def wait(self) -> None:
        if self.work is not None:
            work, self.work = self.work, None
            work.wait()
            if self.finish is not None:
                self.finish(self.buffer)  # in place: views of the buffer see the finished values


class PendingTensor(torch.Tensor):
    """A tensor whose values a collective is still writing; see the module doc."""

    elem: torch.Tensor
    pending: _Pending
    __slots__ = ("elem", "pending")

    @staticmethod
    def __new__(cls, elem: torch.Tensor, pending: _Pending) -> PendingTensor:
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=elem.device,
            requires_grad=elem.requires_grad,
        )
        r.elem = elem
        r.pending = pending
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def wait(self) -> torch.Tensor:
        """The finished plain tensor."""
        self.pending.wait()
        return self.elem

    def __repr__(self) -> str:  # type: ignore[override]
        return f"PendingTensor({self.wait()})"

    def tolist(self) -> Any:  # not an aten op: wait here
        return self.wait().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        return self.wait().numpy(force=force)

    def __tensor_flatten__(self) -> tuple[list[str], _Pending]:
        return ["elem"], self.pending

    @staticmethod
    def __tensor_unflatten__(inner: dict, pending: _Pending, outer_size: Any, outer_stride: Any) -> PendingTensor:
        return PendingTensor(inner["elem"], pending)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func.is_view and len(args) and isinstance(args[0], PendingTensor):
            # a view of the buffer stays lazy and shares its wait
            pending = args[0].pending
            unwrapped = tree_map_only(PendingTensor, lambda t: t.elem, (args, kwargs or {}))
            out = func(*unwrapped[0], **unwrapped[1])
            return tree_map_only(torch.Tensor, lambda t: PendingTensor(t, pending), out)
        args, kwargs = tree_map_only(PendingTensor, PendingTensor.wait, (args, kwargs or {}))
        return func(*args, **kwargs)


def pending(work: Any, buffer: torch.Tensor, finish: Callable[[torch.Tensor], Any] | None = None) -> torch.Tensor:
    """`buffer` as a PendingTensor of `work` (or `buffer` itself, finished, when there is no work)."""
    if work is None:
        if finish is not None:
            finish(buffer)
        return buffer
    return PendingTensor(buffer, _Pending(work, buffer, finish))


def wait_all(t: torch.Tensor) -> torch.Tensor:
    """`t` as a plain tensor (waits if it is pending)."""
    return t.wait() if isinstance(t, PendingTensor) else t
