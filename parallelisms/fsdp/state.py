"""FSDPState: the hooks that run one fully_shard module's group through forward and backward.

    pre-forward    unshard (one all-gather); cast floating inputs to `param_dtype`
    post-forward   register a pre-backward hook on the outputs; reshard if asked; cast outputs
    pre-backward   (first output grad, `register_multi_grad_hook(mode="any")`) unshard again
    post-backward  (the last managed param's grad is accumulated, a post-accumulate-grad hook)
                   one reduce-scatter into the sharded grads, then reshard
    end of backward  (root only, `queue_callback`) finish every group whose post-backward did not
                   run: params that got no grad, or modules whose outputs were unused

Prefetch: the root records the order in which groups run forward (first iteration). Afterwards each
group's pre-forward, once its own parameters are in, issues the next group's all-gather in flight,
so it overlaps this group's compute; pre-backward does the same for the group before it (reverse
order), and post-backward issues its reduce-scatter in flight, landed by a later group's
post-backward or at the end of backward. With reshard_after_forward, at most two groups (the
running one and the prefetched one) hold unsharded parameters. `set_modules_to_forward_prefetch`
/ `set_modules_to_backward_prefetch` replace the recorded neighbour with explicit ones.

Autograd runs AccumulateGrad nodes as soon as they are ready, so a post-accumulate-grad hook sees
each unsharded gradient complete, however often the module ran. The first module to run forward
becomes the root (as in torch): it does not reshard after forward by default, since backward would
all-gather its parameters again straight away.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from .group import ParamGroup
from .param import FSDPParam
from .policy import MixedPrecisionPolicy


class FSDPState:
    """Per-module fully_shard state; owned by the module as `_fsdp_state`."""

    def __init__(
        self,
        modules: list[nn.Module],
        group: ParamGroup,
        reshard_after_forward: bool | int | None,
        policy: MixedPrecisionPolicy,
    ) -> None:
        self.modules = modules  # one, or the several a fully_shard([...]) call grouped
        self._forward_pending: set[int] = set()  # ids of grouped modules yet to run this forward
        self.group = group
        self.policy = policy
        self.reshard_after_forward = True if reshard_after_forward is None else reshard_after_forward
        self.auto_reshard = reshard_after_forward is None  # the root then keeps its params after forward
        self.requires_gradient_sync = True
        self.reshard_after_backward = True
        self.is_root: bool | None = None  # decided by the first forward
        self.root: FSDPState = self
        self.tree: list[FSDPState] = []  # root only: every state under it, itself included
        self.forward_order: list[FSDPState] = []  # root only: groups by first forward use
        self._recording = True  # root only: forward_order is being recorded (first forward)
        self._reducing: list[FSDPState] = []  # root only: groups whose reduce-scatter is in flight
        self.forward_prefetch: list[FSDPState] | None = None  # explicit targets (None: implicit)
        self.backward_prefetch: list[FSDPState] | None = None
        self._callback_queued = False
        self._in_backward = False  # between pre- and post-backward: recomputed forwards keep params
        for p in group.params:
            p.on_grad_ready = self._on_grad_ready
        for module in modules:
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward, always_call=False)

    # ------------------------------------------------------------------------------ forward
    def _lazy_init(self) -> None:
        if self.is_root is not None:
            return
        self.is_root = True
        for sub in (s for m in self.modules for s in m.modules()):
            state: FSDPState | None = getattr(sub, "_fsdp_state", None)
            if state is None or state in self.tree:
                continue
            if state is not self:
                state.is_root = False
            state.root = self
            self.tree.append(state)
        if self.auto_reshard:
            self.reshard_after_forward = False

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._lazy_init()
        if not self._forward_pending:  # the group's first module this forward
            self._forward_pending = {id(m) for m in self.modules}
        if torch._C._current_graph_task_id() == -1:  # a real forward, not a recompute in backward
            targets = self._forward_targets()
            for state in (self, *targets):  # kept by a forward no backward consumed: maybe stale
                state.group.drop_partial()
            self.group.unshard()
            self._prefetch(targets)
        else:
            self.group.unshard()
        dtype = self.policy.param_dtype
        if dtype is not None and self.policy.cast_forward_inputs:
            args, kwargs = tree_map(lambda x: _cast_floating(x, dtype), (args, kwargs))
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self._in_backward:  # activation-checkpoint recompute: backward still needs the params
            return output
        self._forward_pending.discard(id(module))
        if self.is_root and not self._forward_pending:
            self._recording = False
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and outputs:
            torch.autograd.graph.register_multi_grad_hook(outputs, self._pre_backward, mode="any")
        if not self._forward_pending:
            if not torch.is_grad_enabled():
                self.group.reshard()  # without grad, nothing will need the unsharded params again
            elif self.reshard_after_forward is True:
                self.group.reshard()
            elif self.reshard_after_forward:  # an int: onto groups of that many ranks
                self.group.reshard_to_partial()
        if self.policy.output_dtype is not None:
            dtype = self.policy.output_dtype
            output = tree_map(lambda x: _cast_floating(x, dtype), output)
        return output

    # ------------------------------------------------------------------------------ backward
    def _pre_backward(self, grad: torch.Tensor) -> None:
        if self.is_root and not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if not self._in_backward:  # this group's first output grad of this backward
            self._in_backward = True
            self.group.unshard()
            self.group.expect_grads()  # also when it stayed unsharded (reshard_after_backward=False)
        self._prefetch(self._backward_targets())

    # ------------------------------------------------------------------------------ prefetch
    def _record(self) -> None:
        root = self.root
        if root._recording and self not in root.forward_order:
            root.forward_order.append(self)

    def _forward_targets(self) -> list[FSDPState]:
        self._record()
        return self.forward_prefetch if self.forward_prefetch is not None else self._recorded_neighbour(+1)

    def _backward_targets(self) -> list[FSDPState]:
        return self.backward_prefetch if self.backward_prefetch is not None else self._recorded_neighbour(-1)

    def _recorded_neighbour(self, offset: int) -> list[FSDPState]:
        """The group `offset` places from this one in the recorded forward order (none while recording)."""
        order = self.root.forward_order
        if self.root._recording or self not in order:
            return []
        j = order.index(self) + offset
        return order[j : j + 1] if 0 <= j < len(order) else []

    @staticmethod
    def _prefetch(targets: list[FSDPState]) -> None:
        for target in targets:
            target.group.unshard(async_op=True)

    # ------------------------------------------------------------------------------ gradients
    def _on_grad_ready(self, param: FSDPParam) -> None:
        if self.group.is_unsharded and self.group.grad_ready(param):
            self.post_backward()

    def post_backward(self) -> None:
        """Reduce (issued in flight; or, without gradient sync, keep) the unsharded grads, then
        reshard. The previous group's reduce-scatter lands now: one in flight at a time."""
        self._in_backward = False
        if self.requires_gradient_sync:
            reducing = self.root._reducing
            while reducing:
                reducing.pop(0).group.finish_reduce()
            self.group.reduce_grads(async_op=True)
            reducing.append(self)
        else:
            self.group.stash_grads()
        if self.reshard_after_backward:
            self.group.reshard()

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        for state in self.tree:
            # post_backward did not run (params without grads, unused outputs, or no params):
            # reduce what there is and reshard; groups kept unsharded on purpose stay so
            unfinished = state._in_backward or state.group.is_gathering
            if unfinished or (state.group.is_unsharded and state.reshard_after_backward):
                state.post_backward()
            state._in_backward = False
        for state in self._reducing:
            state.group.finish_reduce()
        self._reducing.clear()


def _cast_floating(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x
