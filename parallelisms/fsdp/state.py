"""FSDPState: the hooks that run one fully_shard module's group through forward and backward.

    pre-forward    unshard (one all-gather); cast floating inputs to `param_dtype`
    post-forward   register a pre-backward hook on the outputs; reshard if asked; cast outputs
    pre-backward   (first output grad, `register_multi_grad_hook(mode="any")`) unshard again
    post-backward  (the last managed param's grad is accumulated, a post-accumulate-grad hook)
                   one reduce-scatter into the sharded grads, then reshard
    end of backward  (root only, `queue_callback`) finish every group whose post-backward did not
                   run: params that got no grad, or modules whose outputs were unused

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
        reshard_after_forward: bool | None,
        policy: MixedPrecisionPolicy,
    ) -> None:
        self.modules = modules  # one, or the several a fully_shard([...]) call grouped
        self._forward_pending: set[int] = set()  # ids of grouped modules yet to run this forward
        self.group = group
        self.policy = policy
        self.reshard_after_forward = True if reshard_after_forward is None else reshard_after_forward
        self.auto_reshard = reshard_after_forward is None  # the root then keeps its params after forward
        self.requires_gradient_sync = True
        self.is_root: bool | None = None  # decided by the first forward
        self.tree: list[FSDPState] = []  # root only: every state under it, itself included
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
            self.tree.append(state)
        if self.auto_reshard:
            self.reshard_after_forward = False

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._lazy_init()
        if not self._forward_pending:  # the group's first module this forward
            self._forward_pending = {id(m) for m in self.modules}
        self.group.unshard()
        dtype = self.policy.param_dtype
        if dtype is not None and self.policy.cast_forward_inputs:
            args, kwargs = tree_map(lambda x: _cast_floating(x, dtype), (args, kwargs))
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self._in_backward:  # activation-checkpoint recompute: backward still needs the params
            return output
        self._forward_pending.discard(id(module))
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and outputs:
            torch.autograd.graph.register_multi_grad_hook(outputs, self._pre_backward, mode="any")
        if not self._forward_pending and (self.reshard_after_forward or not torch.is_grad_enabled()):
            self.group.reshard()  # without grad, nothing will need the unsharded params again
        if self.policy.output_dtype is not None:
            dtype = self.policy.output_dtype
            output = tree_map(lambda x: _cast_floating(x, dtype), output)
        return output

    # ------------------------------------------------------------------------------ backward
    def _pre_backward(self, grad: torch.Tensor) -> None:
        if self.is_root and not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._in_backward = True
        self.group.unshard()

    def _on_grad_ready(self, param: FSDPParam) -> None:
        if self.group.is_unsharded and self.group.grad_ready(param):
            self.post_backward()

    def post_backward(self) -> None:
        """Reduce (or, without gradient sync, keep) the unsharded grads, then reshard."""
        self._in_backward = False
        if self.requires_gradient_sync:
            self.group.reduce_grads()
        else:
            self.group.stash_grads()
        self.group.reshard()

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        for state in self.tree:
            if state.group.is_unsharded:
                state.post_backward()


def _cast_floating(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x
