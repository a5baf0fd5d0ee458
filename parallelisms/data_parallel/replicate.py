"""`replicate`: data parallelism as torch's DDP does it, on our stack.

Every rank holds the whole model (or, under TP, its whole TP shard). Backward all-reduces the gradients
in buckets: as soon as every gradient of a bucket has been accumulated, its values are copied into the
bucket's flat buffer, scaled by 1/n, and the buffer's SUM all-reduce starts asynchronously, so it runs
while backward computes the rest; buckets start in a fixed order on every rank (a bucket whose
gradients are ready waits for the ones before it), since collectives pair up by order. At the end of
backward (an autograd callback) every bucket is waited on and copied back into the gradients, so
`loss.backward()` returns with averaged gradients, as DDP's.

Buckets first follow the reverse of the parameters' definition order (`buckets.assign_buckets`: a 1 MiB
first bucket, then `bucket_cap_mb`); after the first synced backward they are rebuilt once from the order
the gradients actually became ready (rank 0's, broadcast, so every rank agrees). Parameters and buffers
are broadcast from the group's rank 0 at construction, or, for a model still on the meta device (built,
parallelized, then materialized and initialized), before its first forward. `set_requires_gradient_sync
(False)` (or `no_sync()`) accumulates gradients locally for gradient accumulation; the next synced
backward reduces the sum. A parameter that gets no gradient in a synced backward is reduced as zeros
(it may have one on another rank).

DTensor parameters (DDP x TP) are reduced by their local shards over the data-parallel group: the
ranks of that group hold the same shard.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallelisms.dtensor import DeviceMesh, DTensor
from parallelisms.dtensor.collectives import InFlight, broadcast, start_all_reduce_flat
from parallelisms.dtensor.dtensor import local_tensor
from parallelisms.module_class import with_mixin

from .buckets import MIB, assign_buckets


@dataclass
class _Bucket:
    """Gradients reduced together: one flat buffer, one all-reduce."""

    params: list[nn.Parameter]
    numels: list[int]
    buffer: torch.Tensor | None = None  # allocated at the first launch (the parameters may be on meta before)
    ready: int = 0
    inflight: InFlight | None = None
    launched: bool = False
    missing: set[int] = field(default_factory=set)  # positions of params without a grad at launch

    def launch(self, group: dist.ProcessGroup, scale: float) -> None:
        grads = [p.grad for p in self.params]
        if self.buffer is None:
            first = next((g for g in grads if g is not None), None)
            device = local_tensor(first).device if first is not None else local_tensor(self.params[0]).device
            self.buffer = torch.empty(sum(self.numels), dtype=self.params[0].dtype, device=device)
        offset = 0
        for i, (grad, n) in enumerate(zip(grads, self.numels)):
            view = self.buffer[offset : offset + n]
            if grad is None:  # unused in this backward here; a peer may have a gradient for it
                view.zero_()
                self.missing.add(i)
            else:  # DDP's pre-division: copy and scale in one pass (x * (1/n), exactly as torch's reducer)
                torch.mul(local_tensor(grad).reshape(-1), scale, out=view)
            offset += n
        self.inflight = start_all_reduce_flat(self.buffer, group, async_op=True)
        self.launched = True

    def finish(self) -> None:
        assert self.inflight is not None and self.buffer is not None
        self.inflight.wait()
        offset = 0
        for i, (param, n) in enumerate(zip(self.params, self.numels)):
            view = self.buffer[offset : offset + n]
            offset += n
            if i not in self.missing:
                grad = local_tensor(param.grad)  # type: ignore[arg-type]
                grad.copy_(view.view_as(grad))
                continue
            local = view.view_as(local_tensor(param)).clone()
            param.grad = (
                DTensor.from_local(local, param.device_mesh, param.placements) if isinstance(param, DTensor) else local
            )
        self.ready, self.inflight, self.launched, self.missing = 0, None, False, set()


class ReplicateState:
    """The reducer of one `replicate`d module: its buckets, their launch order and the rebuild."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, bucket_cap_bytes: int) -> None:
        # held weakly, as DeviceMesh holds its groups: a model that outlives destroy_process_group() must not
        # keep the group alive into interpreter exit, where gloo's workers can abort the process
        self._group, self.module, self.bucket_cap_bytes = weakref.ref(group), module, bucket_cap_bytes
        self.requires_gradient_sync = True
        self.all_reduces = 0  # launched all-reduces, for tests and the estimator
        self._in_backward = False
        self.params: list[nn.Parameter] = []
        self.track_parameters()

    @property
    def group(self) -> dist.ProcessGroup:
        group = self._group()
        if group is None:
            raise RuntimeError(
                "replicate's process group was destroyed (dist.destroy_process_group()); the module cannot "
                "reduce gradients any more: replicate a model again in a live process group"
            )
        return group

    def track_parameters(self) -> bool:
        """Keep the gradient hooks on the module's current parameters; returns whether they changed.

        `to_empty()` (a meta model materialized) and `.to(device)` replace plain Parameters with new
        objects, which get hooked afresh; a DTensor Parameter is swapped in place instead
        (`torch.utils.swap_tensors`), which leaves its hooks registered on the old TensorImpl, so they are
        installed again on the new one (re-setting the hooks dict installs it)."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        if len(params) != len(self.params) or any(a is not b for a, b in zip(params, self.params)):
            self.params = params
            self.index = {id(p): i for i, p in enumerate(params)}
            self.rebuilt = False
            self.ready_order: list[int] = []  # positions in self.params, in the first synced backward
            self._set_buckets(list(range(len(params)))[::-1])
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
            self._impls = [weakref.ref(local_tensor(p)) for p in params]
            return True
        swapped = [p for p, before in zip(params, self._impls) if before() is not local_tensor(p)]
        for p in swapped:
            hooks = p._post_accumulate_grad_hooks
            p._post_accumulate_grad_hooks = None  # type: ignore[assignment]
            p._post_accumulate_grad_hooks = hooks
        if swapped:
            self._impls = [weakref.ref(local_tensor(p)) for p in params]
        return bool(swapped)

    # ----------------------------------------------------------------------------- buckets
    def _set_buckets(self, order: list[int]) -> None:
        """Buckets over the parameters at positions `order` (the order their gradients are expected)."""
        numels = [local_tensor(self.params[i]).numel() for i in order]
        nbytes = [n * self.params[i].element_size() for n, i in zip(numels, order)]
        kinds = [self.params[i].dtype for i in order]
        self.buckets = [
            _Bucket([self.params[order[j]] for j in bucket], [numels[j] for j in bucket])
            for bucket in assign_buckets(nbytes, kinds, cap_bytes=self.bucket_cap_bytes)
        ]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.next_bucket = 0

    def _rebuild(self) -> None:
        """Once, after the first synced backward: buckets in the order gradients became ready (rank 0's)."""
        seen = set(self.ready_order)
        order = self.ready_order + [i for i in reversed(range(len(self.params))) if i not in seen]
        agreed = torch.tensor(order, dtype=torch.int64, device=self.buckets[0].buffer.device)  # type: ignore[union-attr]
        broadcast(agreed, self.group, 0)
        self._set_buckets(agreed.tolist())
        self.rebuilt = True

    # ---------------------------------------------------------------------------- backward
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.requires_gradient_sync:
            return
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if not self.rebuilt:
            self.ready_order.append(self.index[id(param)])
        self.bucket_of[id(param)].ready += 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Start every bucket whose gradients are all in, in bucket order (the same order on every rank)."""
        while self.next_bucket < len(self.buckets):
            bucket = self.buckets[self.next_bucket]
            if bucket.ready < len(bucket.params):
                return
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.launch(self.group, 1.0 / self.group.size())
        self.all_reduces += 1
        self.next_bucket += 1

    def _end_of_backward(self) -> None:
        """Reduce what is left (buckets with an unused parameter), land every bucket, then rebuild once."""
        self._in_backward = False
        for bucket in self.buckets[self.next_bucket :]:
            self._launch(bucket)
        for bucket in self.buckets:
            bucket.finish()
        self.next_bucket = 0
        if not self.rebuilt:
            self._rebuild()

    # ----------------------------------------------------------------------------- start-up
    def sync_module_states(self) -> None:
        """Every parameter and buffer becomes the group rank 0's (one broadcast per dtype)."""
        tensors = [local_tensor(t) for t in (*self.module.parameters(), *self.module.buffers())]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for group in by_dtype.values():
                flat = torch.cat([t.reshape(-1) for t in group])
                broadcast(flat, self.group, 0)
                pieces = flat.split([t.numel() for t in group])
                torch._foreach_copy_(group, [piece.view_as(t) for piece, t in zip(pieces, group)])


class ReplicateModule:
    """Mixin every `replicate`d module gets (placed first in its class's bases)."""

    _replicate_state: ReplicateState

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Whether backward all-reduces gradients. False accumulates them locally (gradient accumulation
        without communication); the next synced backward reduces the sum."""
        self._replicate_state.requires_gradient_sync = requires_gradient_sync

    def finish_backward(self) -> None:
        """End, as the end of a backward does, a backward whose gradients were put into `.grad` outside
        autograd's AccumulateGrad (a pipeline's split weight pass, which no gradient hook sees): with
        gradient sync every bucket is all-reduced now; without, the gradients stay local."""
        state = self._replicate_state
        if state.requires_gradient_sync:
            state._end_of_backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's context: backward inside it does not all-reduce."""
        state = self._replicate_state
        before, state.requires_gradient_sync = state.requires_gradient_sync, False
        try:
            yield
        finally:
            state.requires_gradient_sync = before


def _group_of(mesh: DeviceMesh | None) -> dist.ProcessGroup:
    if mesh is None:
        return dist.group.WORLD  # type: ignore[return-value]
    if mesh.ndim != 1:
        raise ValueError(
            f"replicate takes the 1-D data-parallel mesh, got a {mesh.ndim}-D mesh {mesh.mesh_dim_names}; pass "
            f"e.g. world_mesh['dp_replicate'] (DTensor parameters keep their own mesh, e.g. tp)"
        )
    return mesh.get_group()


def _on_meta(module: nn.Module) -> bool:
    return any(local_tensor(t).is_meta for t in (*module.parameters(), *module.buffers()))


def replicate(module: nn.Module, mesh: DeviceMesh | None = None, *, bucket_cap_mb: float = 25) -> nn.Module:
    """Make `module` data parallel over `mesh` (1-D; None: the default group), in place; returns it.

    Its gradients are all-reduced (averaged) in buckets of `bucket_cap_mb` MiB during backward. Its
    parameters and buffers are broadcast from the group's rank 0 now, or before its first forward when
    they are still on the meta device.
    """
    if isinstance(module, ReplicateModule):
        raise ValueError(f"{type(module).__name__} is already replicated; apply replicate once")
    if bucket_cap_mb <= 0:
        raise ValueError(f"replicate(bucket_cap_mb={bucket_cap_mb}): must be > 0")
    state = ReplicateState(module, _group_of(mesh), int(bucket_cap_mb * MIB))
    module._replicate_state = state  # type: ignore[assignment]
    module.__class__ = with_mixin(ReplicateModule, type(module), "Replicate")
    synced = not _on_meta(module)
    if synced:
        state.sync_module_states()

    def before_forward(mod: nn.Module, args: Any) -> None:
        nonlocal synced
        if state.track_parameters() and not synced:  # materialized since: take rank 0's weights once
            state.sync_module_states()
        synced = True

    module.register_forward_pre_hook(before_forward)
    return module
