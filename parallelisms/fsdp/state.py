"""FSDPState: the training state machine of one fully_shard module, and the hooks that drive it.

    event            hook                                        from                 to
    pre_forward      forward pre-hook: unshard, prefetch         IDLE, FORWARD(1)     FORWARD
    post_forward     forward hook: reshard if asked              FORWARD              IDLE (FORWARD(1))
    pre_backward     first output grad: unshard, prefetch        IDLE, FORWARD(2)     PRE_BACKWARD
    post_backward    last param grad: reduce-scatter or stash    PRE_BACKWARD         POST_BACKWARD
    end_of_backward  root's queued callback, for every state     any(3)               IDLE

    (1) `fully_shard([a, b])`: the group stays in FORWARD until its last module's forward ends.
    (2) a forward that did not finish: a grouped module that did not run, a recompute that stopped early.
        A param grad without an output grad first (outputs unused) enters PRE_BACKWARD the same way.
    (3) PRE_BACKWARD runs post_backward first (params that got no grad); IDLE reduces what it holds
        (stashed grads of earlier micro-batches) when syncing; then groups reshard if asked.

Not transitions: in PRE_BACKWARD a forward is an activation-checkpoint recompute (the params are in);
a forward while the tree's backward runs (the recompute of a region holding this module, ahead of
its backward) gathers without prefetching; a later output grad in PRE_BACKWARD or POST_BACKWARD only
prefetches (or, in POST_BACKWARD, does nothing). Any other order raises a RuntimeError naming the
module, the state it was in and what was expected, before it issues a collective on a wrong
assumption (a second reduce-scatter, a gather into storage autograd is reading).

Gradient sync: a backward with `requires_gradient_sync=False` stashes the unsharded grads; the next
synced backward adds them to its own and reduce-scatters once (gradient accumulation, pipeline
micro-batches), also for a group that this last backward did not reach.

Prefetch: the root records the order in which groups first run forward. Afterwards each group's
pre-forward, once its own parameters are in, issues the next group's all-gather in flight, so it
overlaps this group's compute; pre-backward does the same for the group before it (reverse order),
and post-backward issues its reduce-scatter in flight, landed by a later group's post-backward or at
the end of backward. With reshard_after_forward, at most two groups (the running one and the
prefetched one) hold unsharded parameters. `set_modules_to_forward_prefetch` /
`set_modules_to_backward_prefetch` replace the recorded neighbour with explicit ones.

Autograd runs AccumulateGrad nodes as soon as they are ready, so a post-accumulate-grad hook sees
each unsharded gradient complete, however often the module ran. The first module to run forward
becomes the root (as in torch): it does not reshard after forward by default, since backward would
all-gather its parameters again straight away.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from .group import ParamGroup
from .param import FSDPParam
from .policy import MixedPrecisionPolicy


class TrainingState(Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


IDLE, FORWARD, PRE_BACKWARD, POST_BACKWARD = TrainingState

_HINTS = {
    "pre_forward": "the previous backward did not finish (did it raise?), so its gradients are incomplete; "
    "build the model again (or load a checkpoint)",
    "post_forward": "its pre-forward hook did not run: call the module, not its .forward()",
    "post_backward": "post_backward runs once per backward, after the group's pre-backward; "
    "a second call would reduce-scatter its gradients again",
    "reshard": "the running forward or backward still reads the unsharded parameters; reshard between steps",
    "finish_backward": "call it between backwards, after the weight pass that accumulated the gradients",
}


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
        self.group = group
        self.policy = policy
        self.reshard_after_forward = True if reshard_after_forward is None else reshard_after_forward
        self.auto_reshard = reshard_after_forward is None  # the root then keeps its params after forward
        self.requires_gradient_sync = True
        self.reshard_after_backward = True
        self.training_state = IDLE
        self.root: FSDPState | None = None  # decided by the first forward
        self._classes = [type(m).__name__ for m in modules]  # before fully_shard swaps the classes
        self.label = ", ".join(self._classes)  # with FQNs once the root is known
        self._forward_pending: set[int] = set()  # ids of grouped modules yet to run this forward
        self.forward_prefetch: list[FSDPState] | None = None  # explicit targets (None: implicit)
        self.backward_prefetch: list[FSDPState] | None = None
        # root only
        self.tree: list[FSDPState] = []  # every state under it, itself included
        self.forward_order: tuple[FSDPState, ...] | None = None  # groups by first forward use; None: recording
        self._recording: list[FSDPState] = []
        self._reducing: list[FSDPState] = []  # groups whose reduce-scatter is in flight
        self._end_of_backward_queued = False  # a backward of the tree is running (its callback is queued)
        for p in group.params:
            p.on_grad_ready = self._on_grad_ready
        for module in modules:
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward, always_call=False)

    @property
    def is_root(self) -> bool:
        return self.root is self

    # ------------------------------------------------------------------------------ transitions
    def _expect(self, expected: TrainingState | tuple[TrainingState, ...], event: str) -> None:
        """Raise unless the state is `expected`: a misuse named with the state, not a hang later."""
        allowed = expected if isinstance(expected, tuple) else (expected,)
        if self.training_state not in allowed:
            wanted = " or ".join(s.name for s in allowed)
            raise RuntimeError(
                f"fully_shard module {self.label}: {event} found it in {self.training_state.name}, expected "
                f"{wanted}; {_HINTS.get(event, '')}"
            )

    def _advance(self, event: str, expected: TrainingState | tuple[TrainingState, ...], to: TrainingState) -> None:
        self._expect(expected, event)
        self.training_state = to

    # ------------------------------------------------------------------------------ forward
    def _lazy_init(self) -> None:
        if self.root is not None:
            return
        self.root = self
        fqns = {id(sub): fqn for m in self.modules for fqn, sub in m.named_modules()}
        for sub in (s for m in self.modules for s in m.modules()):
            state: FSDPState | None = getattr(sub, "_fsdp_state", None)
            if state is None or state in self.tree:
                continue
            state.root = self
            state.label = ", ".join(f"{fqns[id(m)] or '<root>'} ({c})" for m, c in zip(state.modules, state._classes))
            self.tree.append(state)
        if self.auto_reshard:
            self.reshard_after_forward = False

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._lazy_init()
        if self.training_state is not PRE_BACKWARD:  # PRE_BACKWARD: a recompute; the params are in
            assert self.root is not None
            recompute = self.root._end_of_backward_queued  # a checkpointed region's, ahead of our backward
            self._advance("pre_forward", (IDLE, FORWARD), FORWARD)
            if not self._forward_pending:  # the group's first module this forward
                self._forward_pending = {id(m) for m in self.modules}
            if recompute:
                self.group.unshard(fresh_scales=False)
            else:
                targets = self._forward_targets()
                self.group.unshard(post_forward_ok=False)
                self._prefetch(targets, in_forward=True)
        dtype = self.policy.param_dtype
        if dtype is not None and self.policy.cast_forward_inputs:
            args, kwargs = tree_map(lambda x: _cast_floating(x, dtype), (args, kwargs))
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self.training_state is not PRE_BACKWARD:  # PRE_BACKWARD: a recompute; backward needs the params
            self._expect(FORWARD, "post_forward")
            self._forward_pending.discard(id(module))
            outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if torch.is_grad_enabled() and outputs:
                torch.autograd.graph.register_multi_grad_hook(outputs, self._pre_backward, mode="any")
            if not self._forward_pending:
                self._end_forward()
        if self.policy.output_dtype is not None:
            dtype = self.policy.output_dtype
            output = tree_map(lambda x: _cast_floating(x, dtype), output)
        return output

    def _end_forward(self) -> None:
        """The group's last module finished forward: reshard as asked, back to IDLE."""
        if not torch.is_grad_enabled() or self.reshard_after_forward is True:
            self.group.reshard()  # without grad, nothing will need the unsharded params again
        elif self.reshard_after_forward:  # an int: onto blocks of that many ranks
            self.group.reshard_post_forward()
        self._advance("post_forward", FORWARD, IDLE)
        if self.is_root and self.forward_order is None:
            self.forward_order = tuple(self._recording)

    # ------------------------------------------------------------------------------ backward
    def _pre_backward(self, grad: torch.Tensor) -> None:
        if self.training_state in (IDLE, FORWARD):  # this group's first output grad of this backward
            self._begin_backward()
            self.group.unshard(fresh_scales=False)  # also when it stayed unsharded (reshard_after_backward=False)
        if self.training_state is PRE_BACKWARD:  # POST_BACKWARD: a late grad of an output without params
            self._prefetch(self._backward_targets(), in_forward=False)

    def _begin_backward(self) -> None:
        self._lazy_init()
        self._advance("pre_backward", (IDLE, FORWARD), PRE_BACKWARD)
        self._forward_pending.clear()
        self.group.expect_grads()
        root = self.root
        assert root is not None
        if not root._end_of_backward_queued:  # the tree's first pre-backward of this backward
            root._end_of_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(root._end_of_backward)

    def _on_grad_ready(self, param: FSDPParam) -> None:
        if self.training_state in (IDLE, FORWARD):  # a grad without this group's pre-backward (outputs unused)
            self._begin_backward()
        if self.training_state is PRE_BACKWARD and self.group.grad_ready(param):
            self.post_backward()

    def post_backward(self) -> None:
        """Reduce (issued in flight; or, without gradient sync, keep) the unsharded grads, then
        reshard. The previous group's reduce-scatter lands now: one in flight at a time."""
        self._advance("post_backward", PRE_BACKWARD, POST_BACKWARD)
        self._reduce_or_stash()
        if self.reshard_after_backward:
            self.group.reshard()

    def _reduce_or_stash(self) -> None:
        if not self.requires_gradient_sync:
            self.group.stash_grads()
            return
        assert self.root is not None
        reducing = self.root._reducing
        while reducing:
            reducing.pop(0).group.finish_reduce()
        self.group.reduce_grads(async_op=True)
        reducing.append(self)

    def _end_of_backward(self) -> None:
        """The root's callback after the whole backward: every state of the tree back to IDLE."""
        for state in self.tree:
            state._finish_backward()
        for state in self._reducing:
            state.group.finish_reduce()
        self._reducing.clear()
        self._end_of_backward_queued = False

    def _finish_backward(self) -> None:
        if self.training_state is PRE_BACKWARD:  # post_backward did not run: params without grads, or none
            self.post_backward()
        elif self.training_state is not POST_BACKWARD and self.group.holds_grads():
            self._reduce_or_stash()  # the backward did not reach it: stashed grads still sync now
        self.group.wait_unshard()  # a prefetch the backward did not use
        if self.reshard_after_backward:  # groups kept unsharded on purpose stay so
            self.group.reshard()
        self._forward_pending.clear()
        self._advance("end_of_backward", tuple(TrainingState), IDLE)

    # ------------------------------------------------------------------------------ prefetch
    def _forward_targets(self) -> list[FSDPState]:
        root = self.root
        assert root is not None
        if root.forward_order is None and self not in root._recording:
            root._recording.append(self)
        return self.forward_prefetch if self.forward_prefetch is not None else self._recorded_neighbour(+1)

    def _backward_targets(self) -> list[FSDPState]:
        return self.backward_prefetch if self.backward_prefetch is not None else self._recorded_neighbour(-1)

    def _recorded_neighbour(self, offset: int) -> list[FSDPState]:
        """The group `offset` places from this one in the recorded forward order (none while recording)."""
        assert self.root is not None
        order = self.root.forward_order
        if order is None or self not in order:
            return []
        j = order.index(self) + offset
        return list(order[j : j + 1]) if 0 <= j < len(order) else []

    @staticmethod
    def _prefetch(targets: list[FSDPState], *, in_forward: bool) -> None:
        """Issue the targets' all-gathers in flight. A forward gathers from the sharded parameters; a
        group whose backward is over is not gathered again."""
        for target in targets:
            if target.training_state is not POST_BACKWARD:
                target.group.unshard(async_op=True, post_forward_ok=not in_forward, fresh_scales=in_forward)


def _cast_floating(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x
