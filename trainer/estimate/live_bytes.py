"""Live tensor bytes of one rank through a training step, by category; the estimator's accounting.

`LiveBytes` is a TorchDispatchMode that sees every op on plain tensors (real or fake; a DTensor's op
is left to the DTensor, whose ops on its local tensors come back here) and accounts each distinct
storage an op's outputs use from the moment it appears until it is freed (a `weakref.finalize` on
the storage) or resized (FSDP frees an unsharded parameter with `storage.resize_(0)` and refills it
with `resize_`). Its total is the live tensor bytes; its maximum is the peak, and the storages alive
at the peak are snapshot so that they can be put in categories once the step is over:

    params          this rank's sharded parameters        grads        their gradients
    optimizer       the optimizer's state                 params_unsharded  FSDP's gathered parameters
    activations     saved for backward, or made in the forward and alive at the peak
    comm_buffers    a collective's input or output        temporaries  everything else (backward's, the batch)

The same accounting runs on the fake step (the estimate) and on a real gloo run (the check): the
tests compare the two. It also counts the FLOPs of the ops it sees (torch's flop formulas on this
rank's local shapes), so recomputation under activation checkpointing is counted as executed.
Allocator caching and fragmentation are not tensor bytes and are not counted.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop

from parallelisms.dtensor.debug import _COLLECTIVES, _defers_to_subclass

from .allocator import CachingAllocator

CATEGORIES = (
    "params", "grads", "optimizer", "params_unsharded", "activations", "comm_buffers", "temporaries",
)  # fmt: skip


# a live storage: (serial, nbytes, stage it appeared in); the serial is unique over the step (an address is
# reused once freed). Immutable, so a snapshot is a shallow copy of the live dict.
_Entry = tuple[int, int, str]


# torch's flop formulas, plus the CPU flash attention (the formulas are the same as the GPU kernels') and the
# grouped GEMM of an MoE's experts
_aten = torch.ops.aten


def grouped_mm_flop(a: torch.Tensor, b: torch.Tensor, *args: Any, out_val: torch.Tensor, **kwargs: Any) -> int:
    """`_grouped_mm`'s FLOPs: every row of a 2-D operand is multiplied once, whatever the groups. (M, K) x (E, K, N)
    -> (M, N) and batched (E, M, K) x (E, K, N) cost 2 x out x K; (K, M) x (M, N) -> (E, K, N), the weights'
    gradient with the M rows split among the groups, costs 2 x K x M x N."""
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * out_val.numel() * a.shape[-1]


FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    **flop_registry,
    _aten._scaled_dot_product_flash_attention_for_cpu: sdpa_flop,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_backward_flop,
    _aten._grouped_mm: grouped_mm_flop,
}


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per category at the peak, the peak and where it happened, the end-of-step bytes, and the peak the
    CUDA caching allocator reserves for the same allocations (`estimate_allocator`; what torch reports)."""

    at_peak: dict[str, int]
    peak: int
    peak_where: str
    steady: dict[str, int]  # what outlives the step: params, grads (until zero_grad), optimizer state
    reserved: int

    def as_dict(self) -> dict[str, int]:
        """docs/architecture.md §7's memory_bytes: the categories at the peak (unsharded params count as params in
        flight under "params_unsharded"; the contract's six keys plus the peak)."""
        return {**self.at_peak, "peak": self.peak}


class LiveBytes(TorchDispatchMode):
    """Accounts live storages and the executed FLOPs of one rank."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, _Entry] = {}
        self.total = 0
        self.peak = 0
        self.peak_where = ""
        self.where: Callable[[], str] = lambda: "setup"  # names where the step is, asked at each new peak
        self.stage: Callable[[], str] = lambda: "setup"  # "forward", "backward", "optimizer": asked per storage
        self.flops = 0
        self.float8_flops = 0  # the part of `flops` in float8 matmuls (priced at the float8 peak)
        self.float8_casts = 0  # elements cast to float8 (models.float8), priced as memory traffic
        self._serial = 0
        self._dirty = False  # a new peak whose storages are not snapshot yet
        self._snapshot: dict[int, _Entry] = {}
        self._comm: set[int] = set()  # serials a collective read or wrote
        self._saved: set[int] = set()  # serials autograd saved for backward
        self._resized: set[int] = set()  # serials resized in place (FSDP's unsharded parameters)
        self.allocator = CachingAllocator()  # the same allocations and frees, by serial

    # ------------------------------------------------------------------------------ accounting
    def track(self, t: torch.Tensor) -> int:
        """Account `t`'s storage if it is new; returns its serial."""
        storage = t.untyped_storage()
        key = storage._cdata
        entry = self.live.get(key)
        if entry is not None:
            return entry[0]
        self._serial += 1
        nbytes = storage.nbytes()
        self.live[key] = (self._serial, nbytes, self.stage())
        weakref.finalize(storage, self._free, key, self._serial)
        self.allocator.malloc(self._serial, nbytes)
        self._grow(nbytes)
        return self._serial

    def _grow(self, nbytes: int) -> None:
        """Change the total; a fall right after a new peak first snapshots the peak's storages."""
        if nbytes < 0 and self._dirty:
            self._snapshot, self._dirty = dict(self.live), False
        self.total += nbytes
        if self.total > self.peak:
            self.peak, self.peak_where, self._dirty = self.total, self.where(), True

    def _free(self, key: int, serial: int) -> None:
        entry = self.live.get(key)
        if entry is None or entry[0] != serial:
            return
        self._grow(-entry[1])
        self.allocator.free(serial)
        del self.live[key]

    def resized(self, storage: torch.UntypedStorage) -> None:
        """After `storage.resize_`: account its new size (FSDP frees and refills unsharded parameters so)."""
        key = storage._cdata
        entry = self.live.get(key)
        if entry is None:
            return
        self._resized.add(entry[0])
        delta = storage.nbytes() - entry[1]
        if delta < 0 and self._dirty:
            self._snapshot, self._dirty = dict(self.live), False
        self.live[key] = (entry[0], entry[1] + delta, entry[2])
        self.allocator.free(entry[0])  # a resize is a new block (FSDP frees with resize_(0), refills after)
        self.allocator.malloc(entry[0], storage.nbytes())
        self._grow(delta)

    def reset_peak(self) -> None:
        """Start measuring the peak here (after setup: initialization's temporaries are not the step's)."""
        self.peak, self.peak_where, self._dirty = self.total, self.where(), True
        self.allocator.reset_peak()  # the segments setup cached stay reserved

    def saved(self, t: Any) -> Any:
        """saved_tensors_hooks' pack: the storage becomes an activation."""
        if isinstance(t, torch.Tensor) and not _defers_to_subclass(type(t)) and t.device.type != "meta":
            self._saved.add(self.track(t))
        return t

    # ------------------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(_defers_to_subclass(t) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        formula = FLOP_FORMULAS.get(packet)
        first = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
        if formula is not None and first is not None and first.device.type != "meta":  # meta: shape propagation
            flops = int(formula(*args, **kwargs, out_val=out))
            self.flops += flops
            if packet is _aten._scaled_mm:
                self.float8_flops += flops
        elif (
            packet is _aten._to_copy and kwargs.get("dtype") in FLOAT8_DTYPES
            and isinstance(out, torch.Tensor) and out.device.type != "meta"  # meta: a plan's shape propagation
        ):  # fmt: skip
            self.float8_casts += out.numel()
        is_comm = packet in _COLLECTIVES
        for t in tree_leaves((out, args) if is_comm else out):
            if isinstance(t, torch.Tensor) and not _defers_to_subclass(type(t)) and t.device.type != "meta":
                serial = self.track(t)
                if is_comm:
                    self._comm.add(serial)
        return out

    # ------------------------------------------------------------------------------ report
    def report(
        self, *, params: list[torch.Tensor], grads: list[torch.Tensor], optimizer: list[torch.Tensor]
    ) -> MemoryReport:
        """Categorize the peak's storages; `params`/`grads`/`optimizer`: this rank's local tensors at step end."""
        if self._dirty:
            self._snapshot, self._dirty = dict(self.live), False
        roles: dict[int, str] = {}
        for name, tensors in (("optimizer", optimizer), ("grads", grads), ("params", params)):  # later wins
            for t in tensors:
                entry = self.live.get(t.untyped_storage()._cdata)
                if entry is not None:
                    roles[entry[0]] = name
        at_peak = dict.fromkeys(CATEGORIES, 0)
        for serial, nbytes, stage in self._snapshot.values():
            at_peak[self._category(serial, stage, roles)] += nbytes
        steady = dict.fromkeys(("params", "grads", "optimizer"), 0)
        for serial, nbytes, _ in self.live.values():
            role = roles.get(serial)
            if role is not None:
                steady[role] += nbytes
        return MemoryReport(at_peak=at_peak, peak=self.peak, peak_where=self.peak_where, steady=steady,
                            reserved=self.allocator.peak_reserved)  # fmt: skip

    def _category(self, serial: int, stage: str, roles: dict[int, str]) -> str:
        """Activations: saved for backward, or made in the forward and still alive (activation checkpointing
        keeps its saved outputs away from saved_tensors_hooks)."""
        if serial in roles:
            return roles[serial]
        if serial in self._resized:
            return "params_unsharded"
        if serial in self._saved:
            return "activations"
        if serial in self._comm:
            return "comm_buffers"
        return "activations" if stage == "forward" else "temporaries"


@contextmanager
def track_live_bytes() -> Iterator[LiveBytes]:
    """LiveBytes active, with autograd's saved tensors and in-place storage resizes reported to it."""
    mode = LiveBytes()
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
        result = original(storage, size)
        mode.resized(storage)
        return result

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
    try:
        with mode, torch.autograd.graph.saved_tensors_hooks(mode.saved, lambda t: t):
            yield mode
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]
